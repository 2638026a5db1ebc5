"""Sequence tables through the planner and its TorchRec export (persia_planner/plan/torchrec_collections.py and
to_sharding_plan): priced by their output, planned with an EmbeddingCollection's sharding types, recorded in plan.json,
exported under their own collection's path, and refused in one line where they cannot run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from plans import TOPO_2X2_PS, forced_plan

from persia_planner import CostModel, ModelSpec, Planner, PlannerError, Sharding, TableSpec, Tier, Topology, validate
from persia_planner.model.pooling import SEQUENCE_SHARDINGS, Pooling
from persia_planner.plan.plan import Plan

SEQ = dict(pooling=Pooling.NONE, max_sequence_length=40)
MODEL = ModelSpec(
    "seq",
    512,
    (
        TableSpec("user", 1000, 16, pooling_factor=2.0),
        TableSpec("hist_tw", 1000, 32, pooling_factor=20.0, **SEQ),
        TableSpec("hist_rw", 1001, 32, pooling_factor=20.0, **SEQ),
        TableSpec("hist_cw", 800, 32, pooling_factor=20.0, **SEQ),
        TableSpec("hist_dp", 50, 32, pooling_factor=20.0, **SEQ),
        TableSpec("hist_ps", 5000, 32, pooling_factor=20.0, **SEQ),
    ),
)
FORCE = {
    "user": (Sharding.TABLE_ROW_WISE, Tier.HBM),
    "hist_tw": (Sharding.TABLE_WISE, Tier.HBM),
    "hist_rw": (Sharding.ROW_WISE, Tier.HBM_CACHE),
    "hist_cw": (Sharding.COLUMN_WISE, Tier.DDR),
    "hist_dp": (Sharding.DATA_PARALLEL, Tier.HBM),
    "hist_ps": (Sharding.PS_HASH, Tier.PS),
}


@pytest.fixture(scope="module")
def case() -> tuple[Topology, Plan]:
    topology = Topology.from_dict(TOPO_2X2_PS)
    return topology, forced_plan(MODEL, topology, FORCE)


def test_a_sequence_tables_output_is_a_row_per_id():
    topology = Topology.from_dict(TOPO_2X2_PS)
    pooled = dataclasses.replace(MODEL.table("hist_tw"), pooling=Pooling.SUM, max_sequence_length=None)
    cost = CostModel(
        dataclasses.replace(MODEL, tables=(*MODEL.tables, dataclasses.replace(pooled, name="b"))), topology
    )
    seq_bytes, seq_values = cost.output_exchange(MODEL.table("hist_tw"), 16)
    bag_bytes, bag_values = cost.output_exchange(pooled, 16)
    assert seq_bytes == pytest.approx(20.0 * bag_bytes) and bag_bytes == 512 * 16 * 4  # fp32 both ways, averaged
    assert seq_values == bag_values == 0  # float32 collectives convert nothing
    # row-wise: each shard returns its own ids' rows (TorchRec's sequence all-to-all), a bag shard every sample's
    halves = np.array([0.5, 0.5])
    gpus = np.arange(2)
    seq_out = cost.range_shard_terms(MODEL.table("hist_tw"), halves, 16, Tier.HBM, gpus)[0]
    bag_out = cost.range_shard_terms(pooled, halves, 16, Tier.HBM, gpus)[0]
    assert np.allclose(seq_out, 0.5 * seq_bytes) and bag_out == bag_bytes


def test_the_planner_gives_sequence_tables_only_the_embedding_collections_types(case):
    topology, _ = case
    for sharding in (Sharding.TABLE_ROW_WISE, Sharding.TABLE_COLUMN_WISE):
        from persia_planner import GreedyLocalSearch, SearchConfig

        config = SearchConfig(shardings=frozenset({sharding, Sharding.TABLE_WISE}), improve_time_s=0.1)
        plan = Planner(GreedyLocalSearch(config)).plan(MODEL, topology)
        for table in MODEL.tables:
            if table.sequence:
                assert plan.tables[table.name].sharding in SEQUENCE_SHARDINGS and plan.tables[table.name].sequence
        assert validate(plan, MODEL, topology) == []


def test_plan_json_records_sequence_tables_and_a_changed_pooling_is_one_line(case):
    topology, plan = case
    data = plan.to_dict()
    assert data["tables"]["hist_tw"]["pooling"] == "none" and "pooling" not in data["tables"]["user"]
    back = Plan.from_dict(data)
    assert back.tables["hist_tw"].sequence and not back.tables["user"].sequence
    assert back.tables["hist_tw"].same_as(plan.tables["hist_tw"])
    pooled = dataclasses.replace(
        MODEL,
        tables=tuple(
            dataclasses.replace(t, pooling=Pooling.SUM, max_sequence_length=None) if t.name == "hist_tw" else t
            for t in MODEL.tables
        ),
    )
    assert validate(plan, pooled, topology) == [
        "table 'hist_tw': was planned as a sequence table, and the model pools it (its pooling changed since): "
        "plan again"
    ]
    twrw = dataclasses.replace(plan.tables["user"], sequence=True)
    as_sequence = dataclasses.replace(
        MODEL, tables=tuple(dataclasses.replace(t, **SEQ) if t.name == "user" else t for t in MODEL.tables)
    )
    bad = dataclasses.replace(plan, tables={**plan.tables, "user": twrw})
    assert validate(bad, as_sequence, topology) == [
        "table 'user': is a sequence table (pooling: none), which TorchRec's EmbeddingCollection cannot shard "
        "table_row_wise"
    ]


def test_each_table_is_exported_under_its_own_collections_path(case):
    pytest.importorskip("torchrec")
    from persia_planner.plan.torchrec_export import to_sharding_plan

    topology, plan = case
    sharding_plan = to_sharding_plan(
        plan, MODEL, topology, module_path="ebc", sequence_module_path="ec", device_type="cpu"
    )
    assert {path: sorted(p) for path, p in sharding_plan.plan.items()} == {
        "ebc": ["user"],
        "ec": ["hist_cw", "hist_dp", "hist_rw", "hist_tw"],
    }
    ec = sharding_plan.plan["ec"]
    assert (ec["hist_rw"].sharding_type, ec["hist_rw"].compute_kernel) == ("row_wise", "fused_uvm_caching")
    assert (ec["hist_cw"].sharding_type, ec["hist_cw"].compute_kernel) == ("column_wise", "fused_uvm")
    with pytest.raises(PlannerError, match="pass sequence_module_path= the EmbeddingCollection's path"):
        to_sharding_plan(plan, MODEL, topology, device_type="cpu")
    only_sequences = ModelSpec("s", 64, tuple(t for t in MODEL.tables if t.sequence))
    local = {n: p for n, p in plan.tables.items() if n != "user"}
    assert list(to_sharding_plan(local, only_sequences, topology, module_path="ec", device_type="cpu").plan) == ["ec"]


def test_a_module_holding_bags_and_sequences_is_found_by_kind(case):
    pytest.importorskip("torchrec")
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    from persia_planner.plan.torchrec_export import to_embedding_bag_configs, to_embedding_configs, to_sharding_plan

    topology, plan = case
    model = torch.nn.Module()
    model.towers = torch.nn.ModuleDict(
        {
            "sparse": EmbeddingBagCollection(to_embedding_bag_configs(MODEL), device="meta"),
            "history": EmbeddingCollection(to_embedding_configs(MODEL), device="meta"),
        }
    )
    found = to_sharding_plan(plan, model, topology, device_type="cpu")
    assert {p: sorted(v) for p, v in found.plan.items()} == {
        "towers.sparse": ["user"],
        "towers.history": ["hist_cw", "hist_dp", "hist_rw", "hist_tw"],
    }
    with pytest.raises(PlannerError, match=r"sequence_module_path='x' is no embedding collection of the model"):
        to_sharding_plan(plan, model, topology, sequence_module_path="x", device_type="cpu")


def test_configs_of_each_kind_and_one_line_for_the_other_kind():
    pytest.importorskip("torchrec")
    from torchrec.modules.embedding_configs import EmbeddingConfig, PoolingType

    from persia_planner.plan.torchrec_export import to_embedding_bag_configs, to_embedding_configs

    bags = to_embedding_bag_configs(MODEL)
    sequences = to_embedding_configs(MODEL)
    assert [c.name for c in bags] == ["user"] and bags[0].pooling == PoolingType.SUM
    assert [c.name for c in sequences] == ["hist_tw", "hist_rw", "hist_cw", "hist_dp", "hist_ps"]
    assert all(type(c) is EmbeddingConfig and c.feature_names == [c.name] for c in sequences)
    mean = ModelSpec("m", 8, (TableSpec("t", 10, 8, pooling=Pooling.MEAN),))
    assert to_embedding_bag_configs(mean)[0].pooling == PoolingType.MEAN
    with pytest.raises(PlannerError, match="table 'hist_tw' is a sequence table; fix: build its config with "):
        to_embedding_bag_configs(MODEL, ["user", "hist_tw"])
    with pytest.raises(PlannerError, match="table 'user' is a pooled table"):
        to_embedding_configs(MODEL, ["user"])


def test_an_unplanned_collection_beside_the_planned_one_is_left_out(case):
    pytest.importorskip("torchrec")
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.embedding_configs import EmbeddingConfig

    from persia_planner.plan.torchrec_export import to_embedding_bag_configs, to_sharding_plan

    topology, plan = case
    model = torch.nn.Module()
    model.ebc = EmbeddingBagCollection(to_embedding_bag_configs(MODEL), device="meta")
    model.side = EmbeddingCollection([EmbeddingConfig(name="h", embedding_dim=8, num_embeddings=10)], device="meta")
    only_user = {"user": plan.tables["user"]}
    for path in (None, "ebc"):
        found = to_sharding_plan(only_user, model, topology, module_path=path, device_type="cpu")
        assert {p: sorted(v) for p, v in found.plan.items()} == {"ebc": ["user"]}


def test_a_sequence_tables_config_reads_its_candidates_feature_too():
    pytest.importorskip("torchrec")
    from persia_planner.plan.torchrec_export import to_embedding_configs

    model = ModelSpec("m", 8, (TableSpec("item", 10, 8), TableSpec("history", 10, 8, 3.0, candidate="item", **SEQ)))
    assert [c.feature_names for c in to_embedding_configs(model)] == [["history", "item"]]


def test_torchrecs_planner_and_perf_model_refuse_a_sequence_model_in_one_line(case):
    pytest.importorskip("torchrec")
    from persia_planner.plan.torchrec_scoring import plan_with_torchrec

    topology, _ = case
    with pytest.raises(PlannerError) as err:
        plan_with_torchrec(MODEL, topology)
    assert str(err.value).startswith(
        "TorchRec's planner is compared on pooled tables only, and model 'seq' has sequence tables (hist_tw, hist_rw, "
    )


def test_a_sequence_table_held_to_data_parallel_on_cpu_trainers_is_one_line():
    from persia_planner.errors import ConstraintError
    from persia_planner.model.constraints import TableConstraints
    from persia_planner.paths import EXAMPLES
    from persia_planner.placement.feasibility import check_constraints
    from persia_planner.topology.graph import load_topology

    cpu = load_topology(EXAMPLES / "local_2x1.yaml")
    only_dp = TableConstraints(sharding_types=frozenset({Sharding.DATA_PARALLEL}))
    model = ModelSpec("m", 64, (TableSpec("hist", 100, 8, 20.0, constraints=only_dp, **SEQ),))
    with pytest.raises(ConstraintError) as err:
        check_constraints(model, cpu)
    assert "data_parallel cannot run a sequence table on the CPU trainers" in str(err.value)
    assert "fix: allow table_wise, row_wise, column_wise or ps_hash" in str(err.value)
    check_constraints(model, Topology.from_dict(TOPO_2X2_PS))  # GPUs run it
