"""The one mapping between a run's options and the model it prices."""

import dataclasses

from persia_planner.model.specs import DType, ModelSpec, TableSpec
from persia_planner.modules.train.config import TrainMode
from persia_planner.modules.train.run_model import run_config, run_model

MODEL = ModelSpec("m", 64, (TableSpec("t", 1_000, 16),))


def test_a_run_of_a_model_trains_with_its_k_mode_and_wire_and_options_override_them():
    at_zero = run_config(dataclasses.replace(MODEL, staleness=0), steps=3)
    assert (at_zero.staleness, at_zero.mode, at_zero.ps_wire, at_zero.steps) == (0, TrainMode.SYNC, DType.FP32, 3)
    stale = run_config(dataclasses.replace(MODEL, staleness=4, ps_wire_dtype=DType.FP16))
    assert (stale.effective_staleness, stale.mode, stale.ps_wire) == (4, TrainMode.HYBRID, DType.FP16)
    forced = run_config(dataclasses.replace(MODEL, staleness=0), mode=TrainMode.HYBRID, ps_wire="bf16")
    assert (forced.mode, forced.effective_staleness, forced.ps_wire) == (TrainMode.HYBRID, 0, DType.BF16)


def test_the_model_a_run_prices_is_the_run_s_and_round_trips():
    cfg = run_config(MODEL, staleness=3, mode="sync", ps_wire="float16")  # both spellings of a dtype
    priced = run_model(MODEL, cfg)
    assert (priced.staleness, priced.ps_wire_dtype) == (0, DType.FP16)  # sync mode trains at K = 0
    again = run_config(priced)
    assert (again.effective_staleness, again.ps_wire) == (cfg.effective_staleness, cfg.ps_wire)
