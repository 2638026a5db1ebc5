"""benchmarks/cpu_cases.py: each case is a model and a cluster that load and have the budget they claim, and the
cases span the table counts, pooling, skew, trainers and budgets the comparison with TorchRec needs."""

from __future__ import annotations

import pytest
from benchmark_modules import load

from persia_planner import load_model, load_topology
from persia_planner.topology.graph import DeviceKind

cases_module = load("cpu_cases")


@pytest.mark.parametrize("case", cases_module.cases(), ids=lambda c: c.name)
def test_each_case_writes_a_model_and_cluster_that_load_with_the_budget_it_claims(case, tmp_path):
    model_path, topology_path = case.write(tmp_path)
    model, topology = load_model(model_path), load_topology(topology_path)
    assert len(model.tables) == case.tables and {t.dim for t in model.tables} == {case.dim}
    assert model.staleness == 0 and model.batch_size == case.batch
    assert [t.rows for t in model.tables] == case.table_rows()
    assert min(t.rows for t in model.tables) == case.rows[0] and max(t.rows for t in model.tables) == case.rows[1]
    assert {t.zipf_alpha for t in model.tables} == {case.zipf_alpha}
    pooling = [t.pooling_factor for t in model.tables]
    assert min(pooling) == case.pooling[0] and max(pooling) == case.pooling[1]
    assert len(topology.gpus) == case.trainers and len(topology.servers) == case.servers
    assert {g.kind for g in topology.gpus} == {DeviceKind.CPU}
    assert {g.hbm_bytes for g in topology.gpus} == {case.budget_bytes}
    assert cases_module.budget_kind(model, topology) == case.kind
    if case.kind == cases_module.TIGHT and "split" in case.name:  # the largest table must be split
        assert max(cases_module.table_bytes(model)) > topology.hbm_capacity(topology.gpus[0])
    # Small enough for a 2-core machine to train 150 steps in well under a minute.
    assert (
        max(t.rows for t in model.tables) <= 300_000 and sum(cases_module.table_bytes(model)) < 100 * cases_module.MiB
    )


def test_the_cases_span_what_the_issue_asks():
    every = cases_module.cases()
    assert len(every) >= 8 and len({c.name for c in every}) == len(every)
    assert min(c.tables for c in every) == 8 and max(c.tables for c in every) == 100
    assert min(c.pooling[0] for c in every) == 1 and max(c.pooling[1] for c in every) == 20
    assert {c.trainers for c in every} == {2, 4}
    assert {c.kind for c in every} == set(cases_module.KINDS)
    assert sum(c.kind == cases_module.PS_ONLY for c in every) >= 2
    assert len({c.zipf_alpha for c in every}) >= 3 and len({c.dim for c in every}) >= 3
    quick = cases_module.pick(None, quick=True)
    assert len(quick) <= 3 and any(c.kind == cases_module.PS_ONLY for c in quick)
    assert [c.name for c in cases_module.pick("ps-26t-d16-2tr,roomy-8t-d16-2tr", quick=False)] == [
        "ps-26t-d16-2tr",
        "roomy-8t-d16-2tr",
    ]
    with pytest.raises(SystemExit, match="unknown case"):
        cases_module.pick("no-such-case", quick=False)
