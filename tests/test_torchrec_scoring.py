"""TorchRec re-scoring (``persia_planner/plan/torchrec_scoring.py``): TorchRec's planner and ours rated alike by its
estimators, and the TorchRec baseline of ``benchmarks/planner.py`` built on them."""

from __future__ import annotations

from pathlib import Path

import pytest
from plans import gpu_host

from persia_planner import (
    CostModel,
    GreedyLocalSearch,
    ModelSpec,
    Plan,
    Planner,
    SearchConfig,
    Sharding,
    TableSpec,
    Tier,
    Topology,
    validate,
)
from persia_planner.paths import EXAMPLES
from persia_planner.placement.shards import Shard, TablePlacement
from persia_planner.plan.torchrec_scoring import from_sharding_options

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("forced", [False, True], ids=["torchrec-default", "torchrec-forced-mix"])
def test_torchrec_scores_our_plan_and_its_own_consistently(forced):
    """TorchRec's planner plan -> our placements -> back to options keeps TorchRec's objective exactly; our cost
    model scores both plans; TorchRec's perf model ranks a balanced plan above a lopsided one."""
    pytest.importorskip("torchrec")
    import logging

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.perf_models import NoopPerfModel

    from persia_planner.plan.torchrec_scoring import (
        meta_collection,
        score_with_torchrec,
        to_sharding_options,
        to_torchrec_topology,
        torchrec_constraints,
    )

    logging.disable(logging.WARNING)
    topology = Topology.from_dict({"name": "2x2", "hosts": [gpu_host("trainer", 2, 2)]})
    model = ModelSpec(
        "score",
        4096,
        tuple(TableSpec(f"t{i}", 200_001 * (i + 1), 64, pooling_factor=float(2 + 3 * i)) for i in range(6)),
    )
    constraints = torchrec_constraints(model, sharding_types=[s.value for s in Sharding if s.value != "ps_hash"])
    if forced:  # every sharding family and kernel we convert, with uneven row blocks (200_001 rows on 4 ranks)
        constraints["t0"].sharding_types = ["row_wise"]
        constraints["t1"].sharding_types, constraints["t1"].compute_kernels = ["table_wise"], ["fused_uvm"]
        constraints["t2"].sharding_types, constraints["t2"].compute_kernels = ["table_row_wise"], ["fused_uvm_caching"]
        constraints["t3"].sharding_types, constraints["t3"].min_partition = ["column_wise"], 32
        constraints["t4"].sharding_types = ["data_parallel"]
    tr_topology = to_torchrec_topology(topology)
    assert (tr_topology.world_size, tr_topology.local_world_size) == (4, 2)
    per_rank = model.batch_size // 4
    planner = EmbeddingShardingPlanner(
        topology=tr_topology,
        batch_size=per_rank,
        constraints=constraints,
        stats=[],
        debug=False,
    )
    planner.plan(module=meta_collection(model), sharders=[EmbeddingBagCollectionSharder()])
    best = planner._best_plan
    objective = NoopPerfModel(topology=tr_topology).rate(plan=best)
    assert score_with_torchrec(best, tr_topology, model) == pytest.approx(objective, rel=1e-9)

    theirs = from_sharding_options(best, model, topology)
    assert list(theirs) == [t.name for t in model.tables]
    if forced:
        got = {n: (p.sharding.value, p.tier.value, len(p.shards)) for n, p in theirs.items()}
        assert got["t0"] == ("row_wise", "hbm", 4)
        assert got["t1"] == ("table_wise", "ddr", 1)
        assert got["t2"] == ("table_row_wise", "hbm_cache", 2)
        assert theirs["t2"].shards[0].cache_fraction == 0.2
        assert got["t3"] == ("column_wise", "hbm", 2)
        assert got["t4"] == ("data_parallel", "hbm", 4)
        assert [s.rows for s in theirs["t0"].shards] == [
            (0, 50001),
            (50001, 100002),
            (100002, 150003),
            (150003, 200001),
        ]
    for placement in theirs.values():
        assert placement.sharding is not Sharding.PS_HASH
    their_plan = Plan(model.name, topology.name, theirs, {}, 0.0, 0.0, 0.0)
    assert validate(their_plan, model, topology) == []
    again = to_sharding_options(theirs, model, topology, batch_size_per_rank=per_rank, torchrec_topology=tr_topology)
    assert score_with_torchrec(again, tr_topology, model) == pytest.approx(objective, rel=1e-6)

    ours = Planner(GreedyLocalSearch(SearchConfig(improve_time_s=0.5))).plan(model, topology)
    our_options = to_sharding_options(
        ours, model, topology, batch_size_per_rank=per_rank, torchrec_topology=tr_topology
    )
    our_score = score_with_torchrec(our_options, tr_topology, model)
    assert 0 < our_score < float("inf")
    cost = CostModel(model, topology)
    assert cost.evaluate(theirs)[0].step_ms > 0

    # All six tables table-wise on rank 0 must rate worse than spreading them over the ranks.
    lopsided = {
        t.name: TablePlacement(
            Sharding.TABLE_WISE,
            (Shard("trainer0/gpu0", Tier.HBM, (0, t.dim), t.bytes(model.embedding_dtype), rows=(0, t.rows)),),
        )
        for t in model.tables
    }
    spread = {
        t.name: TablePlacement(
            Sharding.TABLE_WISE,
            (Shard(topology.gpus[i % 4].name, Tier.HBM, (0, t.dim), t.bytes(model.embedding_dtype), rows=(0, t.rows)),),
        )
        for i, t in enumerate(model.tables)
    }
    scores = [
        score_with_torchrec(
            to_sharding_options(p, model, topology, batch_size_per_rank=per_rank, torchrec_topology=tr_topology),
            tr_topology,
            model,
        )
        for p in (lopsided, spread)
    ]
    assert scores[0] > 1.5 * scores[1]
    assert cost.evaluate(lopsided)[0].step_ms > cost.evaluate(spread)[0].step_ms


# ---- the TorchRec baseline used by benchmarks/planner.py ---------------------------------------------------------
def _baseline():
    import importlib.util

    spec = importlib.util.spec_from_file_location("torchrec_baseline", REPO / "benchmarks" / "torchrec_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.processes
def test_torchrec_baseline_plan_converts_and_scores():
    pytest.importorskip("torchrec")
    baseline = _baseline()
    topology = Topology.from_dict({"name": "2x2", "hosts": [gpu_host("trainer", 2, 2)]})
    model = ModelSpec(
        "baseline", 4096, tuple(TableSpec(f"t{i}", 100_000 * (i + 1), 32, pooling_factor=2.0 + i) for i in range(5))
    )
    ours = Planner(GreedyLocalSearch(SearchConfig(improve_time_s=0.2))).plan(model, topology)
    result = baseline.compare_plans(model, topology, ours, timeout_s=60.0)
    assert result["status"] == "ok", result["error"]
    assert result["error"] is None and result["torchrec_seconds"] > 0
    assert result["torchrec_problems"] == []  # TorchRec's plan, converted, passes our validity and capacity checks
    assert sum(result["torchrec_choices"].values()) == 5
    assert result["ours_ms_ours"] == pytest.approx(ours.step_ms)
    assert result["torchrec_ms_torchrec"] == pytest.approx(result["torchrec_objective_ms"], rel=1e-6)
    for key in ("torchrec_ms_ours", "ours_ms_torchrec"):
        assert 0 < result[key] < float("inf")


@pytest.mark.processes
def test_torchrec_baseline_reports_failure_and_timeout():
    pytest.importorskip("torchrec")
    from persia_planner.synthetic import random_model

    baseline = _baseline()
    model = ModelSpec("tiny", 1024, (TableSpec("t", 10_000_000, 128),))
    failed = baseline.time_torchrec_planner(
        model, world_size=2, local_world_size=2, hbm_bytes=1 << 20, ddr_bytes=1 << 20, timeout_s=60.0
    )
    assert failed["status"] == "failed" and failed["options"] is None
    assert "storage" in failed["error"].lower() and "\n" not in failed["error"]

    big = random_model(100, seed=1)  # TorchRec needs well over a second to enumerate 100 tables on 64 ranks
    slow = baseline.time_torchrec_planner(
        big, world_size=64, local_world_size=8, hbm_bytes=80 << 30, ddr_bytes=256 << 30, timeout_s=0.5
    )
    assert slow["status"] == "timeout" and slow["options"] is None
    assert slow["seconds"] == 0.5
    assert slow["wall_s"] < slow["startup_s"] + 5.0  # killed promptly, not waited for


def test_our_constraints_are_passed_on_to_torchrecs_planner():
    """Tables held by model.yaml's constraints: TorchRec's planner, given them as ParameterConstraints, plans each
    as they ask (read back, the placements keep every constraint)."""
    pytest.importorskip("torchrec")
    import logging

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    from persia_planner.placement.feasibility import constraint_problems
    from persia_planner.plan.torchrec_scoring import meta_collection, to_torchrec_topology, torchrec_constraints

    logging.disable(logging.WARNING)
    topology = Topology.from_dict({"name": "2x2", "hosts": [gpu_host("trainer", 2, 2)]})
    held = {
        "t0": {"sharding_types": ["row_wise"], "tiers": ["hbm"]},
        "t1": {"sharding_types": ["table_wise"], "tiers": ["hbm_cache"], "cache_fraction": 0.3},
        "t2": {"sharding_types": ["column_wise", "table_wise"], "tiers": ["ddr"]},
        "t3": {"sharding_types": ["data_parallel", "ps_hash"]},
    }
    model = ModelSpec.from_dict(
        {
            "batch_size": 4096,
            "tables": [
                {"name": f"t{i}", "rows": 100_000, "dim": 64, "pooling_factor": 2.0 + i, "constraints": held[f"t{i}"]}
                for i in range(4)
            ],
        }
    )
    constraints = torchrec_constraints(model, topology=topology)
    assert constraints["t1"].compute_kernels == ["fused_uvm_caching"]
    assert constraints["t1"].cache_params.load_factor == 0.3
    assert constraints["t3"].sharding_types == ["data_parallel"] and constraints["t3"].compute_kernels is None
    assert constraints["t0"].pooling_factors == [2.0]
    planner = EmbeddingShardingPlanner(
        topology=to_torchrec_topology(topology), batch_size=1024, constraints=constraints, stats=[], debug=False
    )
    planner.plan(module=meta_collection(model), sharders=[EmbeddingBagCollectionSharder()])
    theirs = from_sharding_options(planner._best_plan, model, topology)
    for table in model.tables:
        assert constraint_problems(table, theirs[table.name]) == [], table.name
    assert theirs["t1"].shards[0].cache_fraction == 0.3


@pytest.mark.processes
def test_torchrec_baseline_plans_for_cpu_trainers_in_their_memory_budget():
    """compute_device="cpu": TorchRec's CPU sharder's types and kernels only, every table in the ranks' DDR budget,
    and the plan converts onto a CPU topology (ranks = its trainer processes) within their memory."""
    pytest.importorskip("torchrec")
    from persia_planner.plan.torchrec_export import TorchRecSharding

    baseline = _baseline()
    host = {
        "name": "trainer",
        "ddr": "8GiB",
        "profile": "profiles/cpu-2core.yaml",
        "cpus": {"count": 2, "memory": "64MiB"},
    }
    topology = Topology.from_dict({"name": "cpu2", "hosts": [host]}, base_dir=EXAMPLES)
    model = ModelSpec(
        "cpu", 2048, tuple(TableSpec(f"t{i}", 20_000 * (i + 1), 16, pooling_factor=1.0 + i) for i in range(4))
    )
    result = baseline.time_torchrec_planner(
        model, world_size=2, local_world_size=2, hbm_bytes=0, ddr_bytes=64 << 20, timeout_s=60.0, compute_device="cpu"
    )
    assert result["status"] == "ok", result["error"]
    entries = [TorchRecSharding.from_dict(d) for d in result["options"]]
    assert {e.sharding_type for e in entries} <= {"table_wise", "column_wise", "table_column_wise", "data_parallel"}
    assert {e.compute_kernel for e in entries} <= {"fused", "dense"}
    theirs = from_sharding_options(entries, model, topology)
    assert list(theirs) == [t.name for t in model.tables]
    assert {s.tier for p in theirs.values() for s in p.shards} == {Tier.HBM}  # a CPU trainer's budget
    assert validate(Plan(model.name, topology.name, theirs, {}, 0.0, 0.0, 0.0), model, topology) == []

    too_small = baseline.time_torchrec_planner(
        model, world_size=2, local_world_size=2, hbm_bytes=0, ddr_bytes=1 << 20, timeout_s=60.0, compute_device="cpu"
    )
    assert too_small["status"] == "failed" and "storage" in too_small["error"].lower()
    with pytest.raises(ValueError, match="compute_device"):
        baseline.time_torchrec_planner(
            model, world_size=2, hbm_bytes=0, ddr_bytes=1 << 20, timeout_s=1.0, compute_device="tpu"
        )
