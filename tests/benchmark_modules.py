"""The benchmark scripts (and the other scripts) as modules, for the tests that check them (``benchmarks/`` and
``scripts/`` are no packages)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str, directory: Path = BENCHMARKS) -> ModuleType:
    """``benchmarks/NAME.py`` (or ``directory/NAME.py``) imported as module ``NAME`` (registered first: dataclasses
    look their module up while the file runs)."""
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
