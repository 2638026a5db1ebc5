"""Tier modules: where the registry's tiers (and the memories they bring) come from.

A tier module registers, when imported, the memories of its own (:func:`.memory.register_memory`) and then its
tiers (:func:`.tier.register`). The built-in ones are :data:`BUILT_IN`, in plan.json's order. Others are named by
the ``PERSIA_PLANNER_TIERS`` environment variable (module names, comma-separated) or by an installed package's
``persia_planner.tiers`` entry points, and loaded after the built-ins by every process that imports the planner, so
the servers and trainers a job starts know the same tiers as the command that planned it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import entry_points

from persia_planner.errors import SpecError
from persia_planner.tiers.memory import Memory, unregister_memory
from persia_planner.tiers.tier import Tier, unregister

__all__ = [
    "BUILT_IN",
    "ENTRY_POINT_GROUP",
    "ENVIRONMENT",
    "Loaded",
    "configured",
    "load",
    "load_configured",
    "load_configured_at_import",
    "load_failure",
    "load_missing",
    "plugged",
]

BUILT_IN = (
    "persia_planner.tiers.hbm",
    "persia_planner.tiers.ddr",
    "persia_planner.tiers.hbm_cache",
    "persia_planner.tiers.ps",
    "persia_planner.tiers.ssd",
)
ENVIRONMENT = "PERSIA_PLANNER_TIERS"
ENTRY_POINT_GROUP = "persia_planner.tiers"


@dataclass(frozen=True)
class Loaded:
    """What importing one tier module registered."""

    module: str
    memories: tuple[Memory, ...]
    tiers: tuple[Tier, ...]


def load(module: str) -> Loaded:
    """Import the tier module ``module`` (once) and return what it registered (nothing when it was loaded before).

    Raises:
        ImportError: ``module`` cannot be imported.
    """
    memories, tiers = set(Memory), set(Tier)
    try:
        importlib.import_module(module)
    except BaseException:
        _unregister(tuple(m for m in Memory if m not in memories), tuple(t for t in Tier if t not in tiers))
        sys.modules.pop(module, None)  # a module that failed half-way keeps nothing registered; a retry runs it again
        raise
    return Loaded(module, tuple(m for m in Memory if m not in memories), tuple(t for t in Tier if t not in tiers))


def _unregister(memories: tuple[Memory, ...], tiers: tuple[Tier, ...]) -> None:
    for tier in tiers:
        unregister(tier)
    for memory in memories:
        unregister_memory(memory)


def configured() -> tuple[str, ...]:
    """The tier modules beyond the built-ins: ``PERSIA_PLANNER_TIERS``'s, then the installed entry points'."""
    named = [m.strip() for m in os.environ.get(ENVIRONMENT, "").split(",") if m.strip()]
    named += [ep.module for ep in entry_points(group=ENTRY_POINT_GROUP)]
    return tuple(dict.fromkeys(named))


def load_configured() -> None:
    """Load :func:`configured`'s modules.

    Raises:
        SpecError: One cannot be loaded (it cannot be imported, or its registrations fail), naming it and where it
            was named.
    """
    for module in configured():
        try:
            load(module)
        except Exception as e:  # a plugin's failure of any kind is the user's input, told in one line
            raise SpecError(
                ENVIRONMENT,
                module,
                f"the tier module (named there or by a {ENTRY_POINT_GROUP!r} entry point) cannot be loaded: "
                f"{type(e).__name__}: {e}",
                fixes=("install it or correct the name", f"unset {ENVIRONMENT}"),
            ) from e


_FAILURE: list[SpecError] = []


def load_configured_at_import() -> None:
    """:func:`load_configured`, keeping a failure for :func:`load_failure` rather than failing the import (the
    command line reports it in one line)."""
    try:
        load_configured()
    except SpecError as e:
        _FAILURE[:] = [e]


def load_missing() -> None:
    """Load the configured modules not loaded yet, quietly (what a process does when it meets a name it does not
    know: a fork server imports the package before it has the launcher's ``sys.path``, its children have it)."""
    for module in configured():
        if module not in sys.modules:
            try:
                load(module)
            except Exception:
                continue
    if all(m in sys.modules for m in configured()):
        _FAILURE.clear()


def load_failure() -> SpecError | None:
    """Why loading the configured tier modules failed when the package was imported (None: it did not)."""
    return _FAILURE[0] if _FAILURE else None


@contextmanager
def plugged(module: str) -> Iterator[Loaded]:
    """``module``'s tiers and memories, registered for the ``with`` block and removed after it (a test's tier).
    Processes started inside the block load it too: it is added to ``PERSIA_PLANNER_TIERS`` meanwhile."""
    before = os.environ.get(ENVIRONMENT)
    imported = module in sys.modules
    loaded = load(module)
    os.environ[ENVIRONMENT] = ",".join(filter(None, [before, module]))
    try:
        yield loaded
    finally:
        if before is None:
            os.environ.pop(ENVIRONMENT, None)
        else:
            os.environ[ENVIRONMENT] = before
        if not imported:  # a module loaded before the block stays as it was
            _unregister(loaded.memories, loaded.tiers)
            sys.modules.pop(module, None)  # the next load imports it again, and registers it again
