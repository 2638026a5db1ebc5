"""A run's options and the model it prices, one mapping each way: the staleness K, the mode it implies and the
parameter servers' wire dtype are the model's (what a plan is priced for, ``ModelSpec.staleness`` and
``ps_wire_dtype``) and the run's (``TrainConfig.staleness``, ``mode``, ``ps_wire``). Every caller that turns one
into the other (``persia train``, ``--tune``'s timed runs, calibration's step jobs, the equivalence check) comes
here, so the two can never disagree on what K = 0 or a wire dtype means.
"""

from __future__ import annotations

from typing import Any

from persia_planner.model.specs import ModelSpec, with_run_options
from persia_planner.modules.train.config import TrainConfig, TrainMode

__all__ = ["run_config", "run_model"]


def run_config(model: ModelSpec, **options: Any) -> TrainConfig:
    """The training options of a run of ``model`` as it was priced: its K (``sync`` mode at K = 0, else ``hybrid``)
    and its wire dtype, with ``options`` (any other :class:`TrainConfig` field; one naming K, the mode or the wire
    overrides the model's)."""
    priced = {
        "staleness": model.staleness,
        "mode": TrainMode.SYNC if model.staleness == 0 else TrainMode.HYBRID,
        "ps_wire": model.ps_wire_dtype,
    }
    return TrainConfig(**(priced | options))


def run_model(model: ModelSpec, cfg: TrainConfig) -> ModelSpec:
    """``model`` priced for the run ``cfg`` describes: the K it trains with (0 in sync mode) and its wire dtype."""
    return with_run_options(model, staleness=cfg.effective_staleness, ps_wire=cfg.ps_wire.value)
