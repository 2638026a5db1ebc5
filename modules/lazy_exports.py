"""A package's names loaded when first used: its ``__init__`` lists where each lives, and the package imports a
module only when one of its names is asked for, so that the torch-free parts of the package load without torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` that finds each name of ``homes`` (name -> module) in its module."""

    def getattr_(name: str) -> Any:
        module = homes.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return getattr_
