"""Training from a plan: options (:mod:`.config`), the trainer's model and loop (:mod:`.loop`), the job's
checkpoints, metrics and launchers (:mod:`.engine`: ``persia train`` on this machine or under torchrun).

The names users train with are importable from here; each is loaded when first used, so that the torch-free parts
(the options and their checks) load without torch.
"""

from __future__ import annotations

from persia_planner.modules.lazy_exports import lazy_exports

__all__ = [
    "TrainConfig",
    "TrainLoop",
    "build_model",
    "make_optimizer",
    "run_trainers",
    "summary_rows",
    "teacher_for",
    "train_local",
    "train_torchrun",
]

_HOMES = {
    "TrainConfig": "persia_planner.modules.train.config",
    "TrainLoop": "persia_planner.modules.train.loop",
    "build_model": "persia_planner.modules.train.loop",
    "make_optimizer": "persia_planner.modules.train.loop",
    "run_trainers": "persia_planner.modules.train.engine",
    "summary_rows": "persia_planner.modules.train.terminal",
    "teacher_for": "persia_planner.modules.train.batch_stream",
    "train_local": "persia_planner.modules.train.engine",
    "train_torchrun": "persia_planner.modules.train.engine",
}


__getattr__ = lazy_exports(__name__, _HOMES)
