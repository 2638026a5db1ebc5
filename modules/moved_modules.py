"""Old import paths of modules that moved: ``import persia_planner.modules.hybrid`` still works, and is the module at
its new home (``persia_planner.modules.embedding.hybrid``), with a ``DeprecationWarning`` naming it.

A finder on ``sys.meta_path`` answers for the old names only, so that a user's code written against an earlier
release keeps running while it moves to the new paths; no file stays behind at the old place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType

__all__ = ["MOVED", "MovedModuleFinder", "install"]

_PACKAGE = "persia_planner.modules"

MOVED: Mapping[str, str] = {
    f"{_PACKAGE}.{old}": f"{_PACKAGE}.{new}"
    for old, new in {
        "allocated": "tools.memory_audit",
        "breakdown": "step_breakdown",
        "calibrate": "tools.calibrate",
        "calibrate_step": "tools.step_calibration",
        "checkpoints": "train.job_checkpoints",
        "config": "train.config",
        "data_source": "data.source",
        "distributed": "embedding.model_parallel",
        "hybrid": "embedding.hybrid",
        "job": "train.job",
        "local": "embedding.local",
        "loop": "train.loop",
        "metrics_log": "train.metrics_log",
        "proclogs": "process_logs",
        "ps.atomic": "atomic",
        "ps.checkpoint": "ps.table_checkpoints",
        "ps.forkserver_hooks": "launcher.forkserver_hooks",
        "ps.launch": "launcher.launch",
        "ps.lifecycle": "launcher.lifecycle",
        "ps.local_job": "launcher.local_job",
        "ps.progress": "launcher.progress",
        "ps.server_report": "ps.server_metrics",
        "ps.trainer": "ps.connection",
        "ps.workers": "launcher.workers",
        "ps_usage": "train.ps_usage",
        "remote": "embedding.remote",
        "resume": "train.trainer_state",
        "roles": "train.roles",
        "rpcenv": "rpc_environment",
        "run_dirs": "train.run_directories",
        "stack": "train_extra",
        "stream": "train.batch_stream",
        "terminal": "train.terminal",
        "tune": "tools.tune",
        "verify": "tools.torchrec_equivalence",
    }.items()
}
"""Each old module path and its new home."""


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module of its new one (the same object: its names, its state)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        """None: the default module, which :meth:`exec_module` replaces in ``sys.modules`` (the moved module itself is
        never handed to the import machinery, so its own spec stays untouched)."""
        return None

    def exec_module(self, module: ModuleType) -> None:
        """Put the moved module in the old path's place: the import returns what ``sys.modules`` holds."""
        warnings.warn(
            f"{module.__name__} moved to {self.new}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[module.__name__] = importlib.import_module(self.new)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED` (and nothing else)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (the package's ``__init__`` calls it)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
