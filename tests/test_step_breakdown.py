"""The step-time breakdown: every operator's own time goes to the term of its nearest labelled range."""

from __future__ import annotations

import pytest

from persia_planner.modules.step_breakdown import PS_PUSH, PS_WAIT, STEP, TERMS, Stopwatch, classify, shares_of


def test_terms_follow_labelled_ranges_and_operators():
    assert classify("[lookup]_[model.ebc]_[table_wise]") == "embedding"
    assert classify("[splits_dist]_[model.embedding_bag_collection]_[row_wise]") == "all_to_all"
    assert classify("## All2All_Pooled_bwd ##") == "all_to_all"
    assert classify("c10d::allreduce_") == "all_reduce"
    assert classify("fbgemm::split_embedding_codegen_forward_cpu") == "embedding"
    assert classify(PS_WAIT) == "ps_wait" and classify(PS_PUSH) == "push"
    assert classify("aten::mm") is None and classify(STEP) is None


def test_shares_give_each_operator_to_its_range():
    events = [
        (STEP, 10.0, None),  # 0: Python between operators: the dense network's overhead
        ("aten::mm", 30.0, 0),  # dense
        ("[tensors_dist]_[m.ebc]_[table_wise]", 5.0, 0),  # 2: input all-to-all
        ("fbgemm::permute_2D_sparse_data", 5.0, 2),  # inside it: all-to-all work, not embedding
        ("[lookup]_[m.ebc]_[table_wise]", 2.0, 0),  # 4
        ("aten::cat", 8.0, 4),  # inside the lookup: embedding
        ("c10d::allreduce_", 10.0, 0),
        (PS_WAIT, 20.0, 0),
        ("fbgemm::split_embedding_backward_codegen_sgd_cpu", 10.0, 0),
    ]
    shares = shares_of(events)
    assert set(shares) == set(TERMS)
    assert shares["dense"] == pytest.approx(0.4)
    assert shares["all_to_all"] == pytest.approx(0.1)
    assert shares["embedding"] == pytest.approx(0.2)
    assert shares["all_reduce"] == pytest.approx(0.1) and shares["ps_wait"] == pytest.approx(0.2)
    assert shares["push"] == 0.0
    assert shares_of([]) == dict.fromkeys(TERMS, 0.0)


def test_the_profiled_window_gives_shares_and_an_error_inside_it_reaches_stderr():
    import os

    import torch

    from persia_planner.modules.step_breakdown import StepProfiler

    before = os.fstat(2).st_ino
    profiler = StepProfiler(start=1, count=2)
    for index in range(4):
        with profiler.step(index):
            torch.ones(64, 64) @ torch.ones(64, 64)
    assert profiler.shares is not None and profiler.shares["dense"] == pytest.approx(1.0)
    assert os.fstat(2).st_ino == before and not torch.autograd._profiler_enabled()

    failing = StepProfiler(start=0, count=3)
    with pytest.raises(RuntimeError, match="boom"), failing.step(0):
        raise RuntimeError("boom")
    assert os.fstat(2).st_ino == before and not torch.autograd._profiler_enabled()
    assert failing.shares is None


def test_stopwatch_sums_each_label_and_counts_a_range_that_raises():
    watch = Stopwatch()
    with watch.range(PS_WAIT):
        pass
    before = watch.snapshot()
    with pytest.raises(RuntimeError), watch.range(PS_WAIT):
        raise RuntimeError("a server went away")
    with watch.range(PS_PUSH):
        pass
    after = watch.snapshot()
    assert set(after) == {PS_WAIT, PS_PUSH}
    assert after[PS_WAIT] > before[PS_WAIT] >= 0 and after[PS_PUSH] >= 0
    assert before == {PS_WAIT: before[PS_WAIT]}  # a snapshot is a copy
