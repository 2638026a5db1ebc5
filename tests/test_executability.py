"""What a run must execute and what it refuses before training (``persia_planner/plan/executability.py``)."""

from __future__ import annotations

import pytest

from persia_planner import PlannerError, Tier


def test_plans_torchrec_would_not_run_as_written_are_refused():
    from plans import local_placement, replicated

    from persia_planner.model.specs import DType, Optimizer
    from persia_planner.plan.executability import check_executable

    uvm = {"a": local_placement(10, 4), "b": local_placement(10, 4, Tier.DDR)}
    with pytest.raises(PlannerError, match=r"table 'b' is planned on tier ddr \(TorchRec kernel fused_uvm\), which ne"):
        check_executable(uvm, "cpu")
    check_executable(uvm, "cuda")  # UVM is what CUDA trainers run
    with pytest.raises(PlannerError, match=r"table 'a': fbgemm's CPU kernels have no bfloat16 tables"):
        check_executable({"a": local_placement(10, 4)}, "cpu", dtype=DType.BF16)
    dp = {"a": replicated(10, 4, 2)}
    with pytest.raises(PlannerError, match=r"table 'a' is data_parallel in fp16: .* rowwise_adagrad whose state"):
        check_executable(dp, "cpu", dtype=DType.FP16, optimizer=Optimizer.ROWWISE_ADAGRAD)
    check_executable(dp, "cpu", dtype=DType.FP16, optimizer=Optimizer.SGD)  # no state to underflow
    check_executable(dp, "cpu", dtype=DType.FP32, optimizer=Optimizer.ROWWISE_ADAGRAD)
    with pytest.raises(PlannerError, match=r"table 'a' is a local table, and fbgemm's CPU kernels have no fused adam"):
        check_executable({"a": local_placement(10, 4)}, "cpu", optimizer=Optimizer.ADAM)
    check_executable({"a": local_placement(10, 4)}, "cuda", optimizer=Optimizer.ADAM)
