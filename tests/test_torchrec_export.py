"""TorchRec export: plan -> ShardingPlan / ShardingOptions and back, and a real 2-rank DMP training run on CPU."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plans import TOPO_1X2, TOPO_2X2_PS, forced_plan

from persia_planner import (
    CostModel,
    ErrorKind,
    ModelSpec,
    Plan,
    PlannerError,
    Sharding,
    TableSpec,
    Tier,
    Topology,
)
from persia_planner.placement.shards import Shard, TablePlacement, row_blocks
from persia_planner.plan.torchrec_export import ShardBox, TorchRecSharding, gpu_tables, torchrec_shardings
from persia_planner.plan.torchrec_scoring import from_sharding_options

REPO = Path(__file__).resolve().parents[1]


def boxes_tile(entry: TorchRecSharding, rows: int, dim: int) -> bool:
    """The shard rectangles cover rows x dim exactly once."""
    covered = [[0] * dim for _ in range(rows)]
    for b in entry.shards:
        for r in range(b.row_offset, b.row_offset + b.rows):
            for c in range(b.col_offset, b.col_offset + b.cols):
                covered[r][c] += 1
    return all(x == 1 for row in covered for x in row)


# ---- structural: no torch needed ------------------------------------------------------------------------------
STRUCT_MODEL = ModelSpec(
    "struct",
    512,
    (
        TableSpec("tw", 1000, 32),
        TableSpec("cw", 800, 64, pooling_factor=4.0),
        TableSpec("twcw", 600, 64, pooling_factor=4.0),
        TableSpec("rw", 1001, 16),  # 1001 rows on 4 GPUs: the planner splits 251/250/250/250, TorchRec 251/251/251/248
        TableSpec("twrw", 501, 16),
        TableSpec("dp", 50, 8),
        TableSpec("uvm", 700, 16),
        TableSpec("cache", 900, 16),
        TableSpec("remote", 5000, 16),
    ),
)
STRUCT_FORCE = {
    "tw": (Sharding.TABLE_WISE, Tier.HBM),
    "cw": (Sharding.COLUMN_WISE, Tier.HBM),
    "twcw": (Sharding.TABLE_COLUMN_WISE, Tier.HBM),
    "rw": (Sharding.ROW_WISE, Tier.HBM),
    "twrw": (Sharding.TABLE_ROW_WISE, Tier.HBM),
    "dp": (Sharding.DATA_PARALLEL, Tier.HBM),
    "uvm": (Sharding.TABLE_WISE, Tier.DDR),
    "cache": (Sharding.ROW_WISE, Tier.HBM_CACHE),
    "remote": (Sharding.PS_HASH, Tier.PS),
}


@pytest.fixture(scope="module")
def struct_case() -> tuple[ModelSpec, Topology, Plan]:
    topology = Topology.from_dict(TOPO_2X2_PS)
    return STRUCT_MODEL, topology, forced_plan(STRUCT_MODEL, topology, STRUCT_FORCE)


def test_gpu_tables_leave_out_ps(struct_case):
    model, topology, plan = struct_case
    assert gpu_tables(plan) == ["tw", "cw", "twcw", "rw", "twrw", "dp", "uvm", "cache"]
    assert [e.table for e in torchrec_shardings(plan, model, topology)] == gpu_tables(plan)


@pytest.mark.parametrize("name", [n for n in STRUCT_FORCE if n != "remote"])
def test_each_table_exports_its_sharding(struct_case, name):
    model, topology, plan = struct_case
    table = model.table(name)
    entry = {e.table: e for e in torchrec_shardings(plan, model, topology)}[name]
    placement = plan.tables[name]
    sharding, tier = STRUCT_FORCE[name]
    assert entry.sharding_type == sharding.value
    expected_kernel = {Tier.HBM: "fused", Tier.DDR: "fused_uvm", Tier.HBM_CACHE: "fused_uvm_caching"}[tier]
    assert entry.compute_kernel == ("dense" if sharding is Sharding.DATA_PARALLEL else expected_kernel)
    plan_ranks = [topology.gpu_index(s.device) for s in placement.shards]
    if sharding is Sharding.DATA_PARALLEL:
        assert entry.ranks == [0, 1, 2, 3]
        assert all((b.rows, b.cols, b.row_offset, b.col_offset) == (50, 8, 0, 0) for b in entry.shards)
        return
    assert boxes_tile(entry, table.rows, table.dim)
    if sharding in (Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE):
        by_col = sorted(placement.shards, key=lambda s: s.cols)
        assert entry.ranks == [topology.gpu_index(s.device) for s in by_col]
        assert [b.col_offset for b in entry.shards] == [s.cols[0] for s in by_col]  # column order
        assert all(b.rows == table.rows and b.row_offset == 0 for b in entry.shards)
    elif sharding is Sharding.ROW_WISE:
        assert entry.ranks == [0, 1, 2, 3]
        assert [b.rows for b in entry.shards] == row_blocks(table.rows, 4)
        blocks = row_blocks(table.rows, 4)
        assert [b.row_offset for b in entry.shards] == [sum(blocks[:k]) for k in range(4)]
    elif sharding is Sharding.TABLE_ROW_WISE:
        host = topology.gpus[plan_ranks[0]].host
        assert entry.ranks == sorted(plan_ranks)
        assert {topology.gpus[r].host for r in entry.ranks} == {host}
        assert [b.rows for b in entry.shards] == [251, 250]
    else:
        assert entry.ranks == plan_ranks
        assert [(b.rows, b.cols) for b in entry.shards] == [(table.rows, table.dim)]
    if tier is Tier.HBM_CACHE:
        assert entry.cache_load_factor == placement.shards[0].cache_fraction
        assert 0 < entry.cache_load_factor <= 1
    else:
        assert entry.cache_load_factor is None


def test_row_wise_rounding_is_reblocked_to_torchrec_layout():
    """A balanced split (3/3/2/2, what the planner writes today) runs in TorchRec only as its ceil blocks 3/3/3/1."""
    topology = Topology.from_dict(TOPO_2X2_PS)
    model = ModelSpec("m", 64, (TableSpec("t", 10, 8),))
    balanced = [(0, 3), (3, 6), (6, 8), (8, 10)]
    placement = TablePlacement(
        Sharding.ROW_WISE, tuple(_shard(g.name, rows, (0, 8)) for g, rows in zip(topology.gpus, balanced, strict=True))
    )
    (entry,) = torchrec_shardings({"t": placement}, model, topology)
    assert [(b.rank, b.row_offset, b.rows) for b in entry.shards] == [(0, 0, 3), (1, 3, 3), (2, 6, 3), (3, 9, 1)]
    assert row_blocks(5, 4) == [2, 2, 1, 0]


def test_empty_row_blocks_round_trip():
    """TorchRec's 5-rows-on-4-ranks layout (2/2/1/0) becomes three shards of ours and exports back unchanged; an
    empty shard in a plan is ignored."""
    topology = Topology.from_dict(TOPO_2X2_PS)
    model = ModelSpec("m", 64, (TableSpec("t", 5, 8),))
    blocks = [(0, 0, 2), (1, 2, 2), (2, 4, 1), (3, 5, 0)]
    entry = TorchRecSharding("t", "row_wise", "fused", tuple(ShardBox(r, off, 0, n, 8) for r, off, n in blocks))
    ours = from_sharding_options([entry.to_dict()], model, topology)
    assert [(s.device, s.rows) for s in ours["t"].shards] == [
        ("trainer0/gpu0", (0, 2)),
        ("trainer0/gpu1", (2, 4)),
        ("trainer1/gpu0", (4, 5)),
    ]
    assert [s.bytes for s in ours["t"].shards] == [2 * (8 * 4 + 4), 2 * (8 * 4 + 4), 8 * 4 + 4]
    assert torchrec_shardings(ours, model, topology) == [entry]
    with_empty = TablePlacement(Sharding.ROW_WISE, (*ours["t"].shards, _shard("trainer1/gpu1", (5, 5), (0, 8))))
    assert torchrec_shardings({"t": with_empty}, model, topology) == [entry]


def test_unrepresentable_torchrec_choices_raise():
    topology = Topology.from_dict(TOPO_1X2)
    model = ModelSpec("m", 64, (TableSpec("t", 10, 8),))
    grid = TorchRecSharding("t", "grid_shard", "fused", (ShardBox(0, 0, 0, 10, 8),))
    kv = TorchRecSharding("t", "table_wise", "key_value", (ShardBox(0, 0, 0, 10, 8),))
    far = TorchRecSharding("t", "table_wise", "fused", (ShardBox(7, 0, 0, 10, 8),))
    for entry, kind, needle in [
        (grid, ErrorKind.UNSUPPORTED, "grid_shard"),
        (kv, ErrorKind.UNSUPPORTED, "key_value"),
        (far, ErrorKind.INPUT, "rank 7"),
    ]:
        with pytest.raises(PlannerError) as err:
            from_sharding_options([entry], model, topology)
        assert err.value.kind is kind and needle in str(err.value)


def _shard(device: str, rows: tuple[int, int], cols: tuple[int, int], tier: Tier = Tier.HBM, **kw) -> Shard:
    return Shard(device, tier, cols, 0, rows=rows, **kw)


@pytest.mark.parametrize(
    ("placement", "needle"),
    [
        (
            TablePlacement(
                Sharding.COLUMN_WISE,
                (_shard("trainer0/gpu0", (0, 10), (0, 4)), _shard("trainer0/gpu1", (0, 10), (4, 8), Tier.DDR)),
            ),
            "mix tiers",
        ),
        (
            TablePlacement(
                Sharding.ROW_WISE, (_shard("trainer0/gpu0", (0, 5), (0, 8)), _shard("trainer0/gpu1", (5, 10), (0, 8)))
            ),
            "TorchRec splits the rows over every rank",
        ),
        (
            TablePlacement(
                Sharding.ROW_WISE,
                tuple(
                    _shard(f"trainer{i // 2}/gpu{i % 2}", r, (0, 8))
                    for i, r in enumerate([(0, 1), (1, 2), (2, 3), (3, 10)])
                ),
            ),
            "only rounding differences",
        ),
        (
            TablePlacement(
                Sharding.DATA_PARALLEL,
                (_shard("trainer0/gpu0", (0, 10), (0, 8), replica=True),),
            ),
            "every rank",
        ),
        (
            TablePlacement(
                Sharding.TABLE_COLUMN_WISE,
                (_shard("trainer0/gpu0", (0, 10), (0, 4)), _shard("trainer1/gpu0", (0, 10), (4, 8))),
            ),
            "one host",
        ),
    ],
)
def test_inexpressible_placements_raise_unsupported(placement, needle):
    topology = Topology.from_dict(TOPO_2X2_PS)
    model = ModelSpec("m", 64, (TableSpec("t", 10, 8),))
    with pytest.raises(PlannerError) as err:
        torchrec_shardings({"t": placement}, model, topology)
    assert err.value.kind is ErrorKind.UNSUPPORTED
    assert needle in str(err.value) and "'t'" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("device", "line"),
    [
        ("nosuch", "'nosuch' is not a device of topology '1x2' (its GPUs: trainer0/gpu0, trainer0/gpu1)"),
        ("trainer0", "'trainer0' is not a GPU"),
    ],
)
def test_a_shard_on_no_gpu_names_what_the_device_is(device, line):
    topology = Topology.from_dict(TOPO_1X2)
    model = ModelSpec("m", 64, (TableSpec("t", 10, 8),))
    placement = TablePlacement(Sharding.TABLE_WISE, (_shard(device, (0, 10), (0, 8)),))
    with pytest.raises(PlannerError) as err:
        torchrec_shardings({"t": placement}, model, topology)
    assert err.value.kind is ErrorKind.INVALID_PLAN
    assert str(err.value) == f"table 't': shard device {line}; fix: export with the topology the plan was made for"


def test_plan_for_another_model_is_invalid():
    topology = Topology.from_dict(TOPO_1X2)
    model = ModelSpec("m", 64, (TableSpec("t", 10, 8),))
    plan = forced_plan(model, topology, {"t": (Sharding.TABLE_WISE, Tier.HBM)})
    other = ModelSpec("m", 64, (TableSpec("u", 10, 8),))
    with pytest.raises(PlannerError) as err:
        torchrec_shardings(plan, other, topology)
    assert err.value.kind is ErrorKind.INVALID_PLAN


def test_round_trip_through_torchrec_terms_keeps_placements_and_cost(struct_case):
    model, topology, plan = struct_case
    entries = [TorchRecSharding.from_dict(json.loads(json.dumps(e.to_dict()))) for e in torchrec_shardings(
        plan, model, topology)]  # fmt: skip
    back = from_sharding_options(entries, model, topology)
    assert list(back) == gpu_tables(plan)
    for name, placement in back.items():
        if name == "rw":  # re-blocked to TorchRec's rows: same devices, rows moved by < 4
            assert [s.device for s in placement.shards] == [s.device for s in plan.tables[name].shards]
            continue
        if name == "cache":
            assert {s.device for s in placement.shards} == {s.device for s in plan.tables[name].shards}
            continue
        assert sorted(placement.shards, key=lambda s: (s.rows, s.cols, s.device)) == sorted(
            plan.tables[name].shards, key=lambda s: (s.rows, s.cols, s.device)
        ), name
    full = dict(back, remote=plan.tables["remote"])
    cost = CostModel(model, topology)
    step = cost.evaluate(full)[0].step_ms
    assert step == pytest.approx(plan.step_ms, rel=1e-3)


@pytest.mark.processes
def test_export_module_imports_without_torch():
    code = (
        "import sys; import persia_planner, persia_planner.plan.torchrec_export, persia_planner.plan.executability, "
        "persia_planner.plan.torchrec_scoring; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'torchrec'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


# ---- with torchrec --------------------------------------------------------------------------------------------
def test_sharding_plan_objects(struct_case):
    pytest.importorskip("torchrec")
    from torchrec.distributed.types import ShardingPlan

    from persia_planner.plan.torchrec_export import to_embedding_bag_configs, to_sharding_plan

    model, topology, plan = struct_case
    sharding_plan = to_sharding_plan(plan, model, topology, module_path="ebc", device_type="cuda")
    assert isinstance(sharding_plan, ShardingPlan)
    module_plan = sharding_plan.plan["ebc"]
    assert list(module_plan) == gpu_tables(plan)
    assert "remote" not in module_plan
    for entry in torchrec_shardings(plan, model, topology):
        ps = module_plan[entry.table]
        assert ps.sharding_type == entry.sharding_type
        assert ps.compute_kernel == entry.compute_kernel
        assert ps.ranks == entry.ranks
        if entry.sharding_type == "data_parallel":
            assert ps.sharding_spec is None
            continue
        metas = ps.sharding_spec.shards
        assert [(m.shard_offsets, m.shard_sizes) for m in metas] == [
            ([b.row_offset, b.col_offset], [b.rows, b.cols]) for b in entry.shards
        ]
        assert [str(m.placement) for m in metas] == [f"rank:{r}/cuda:{r % 2}" for r in entry.ranks]
    assert module_plan["cache"].cache_params.load_factor == plan.tables["cache"].shards[0].cache_fraction
    assert module_plan["tw"].cache_params is None
    import torch

    default = to_sharding_plan(plan, model, topology).plan[""]["tw"].sharding_spec.shards[0].placement
    assert str(default).endswith(
        "/cuda:" + str(module_plan["tw"].ranks[0] % 2) if torch.cuda.is_available() else "/cpu"
    )
    cpu = to_sharding_plan(plan, model, topology, device_type="cpu").plan[""]
    assert str(cpu["cw"].sharding_spec.shards[1].placement) == f"rank:{cpu['cw'].ranks[1]}/cpu"

    configs = to_embedding_bag_configs(model, gpu_tables(plan))
    assert [(c.name, c.feature_names, c.num_embeddings, c.embedding_dim) for c in configs] == [
        (t.name, [t.name], t.rows, t.dim) for t in model.tables if t.name != "remote"
    ]
    fp16 = ModelSpec("h", 8, (TableSpec("a", 4, 4),), embedding_dtype=model.embedding_dtype.FP16)
    assert to_embedding_bag_configs(fp16)[0].data_type.value == "FP16"


def test_a_model_module_names_its_collection_s_path(struct_case):
    """Given the torch model rather than its spec, the plan's entry sits where DMP will look for it: the one
    collection's path (the outermost, so not a HybridEmbeddingBagCollection's own inner one)."""
    pytest.importorskip("torchrec")
    from torch import nn
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection
    from persia_planner.plan.torchrec_export import to_embedding_bag_configs, to_sharding_plan

    model, topology, plan = struct_case
    configs = to_embedding_bag_configs(model, gpu_tables(plan))
    local = {name: p for name, p in plan.tables.items() if name != "remote"}

    class TwoTower(nn.Module):
        def __init__(self, collection: nn.Module) -> None:
            super().__init__()
            self.towers = nn.ModuleDict({"user": nn.Linear(4, 4)})
            self.ebc = collection

    found = to_sharding_plan(local, TwoTower(EmbeddingBagCollection(configs, device="meta")), topology)
    assert list(found.plan) == ["ebc"] and list(found.plan["ebc"]) == gpu_tables(plan)
    hybrid = HybridEmbeddingBagCollection(configs, local, device="meta")
    assert list(to_sharding_plan(local, TwoTower(hybrid), topology).plan) == ["ebc"]
    two = nn.ModuleDict({"a": EmbeddingBagCollection(configs, device="meta"), "b": hybrid})
    with pytest.raises(PlannerError, match=r"holds 2 embedding collections \(a, b\); fix: pass module_path="):
        to_sharding_plan(local, two, topology)
    assert list(to_sharding_plan(local, two, topology, module_path="b").plan) == ["b"]
    with pytest.raises(PlannerError, match=r"module_path='c' is no embedding collection of the model; it holds"):
        to_sharding_plan(local, two, topology, module_path="c")
    with pytest.raises(PlannerError, match="holds no embedding collection"):
        to_sharding_plan(local, nn.Linear(2, 2), topology)


# ---- the key test: a 2-rank CPU DistributedModelParallel trains with the exported plan ----------------------------
DMP_MODEL = ModelSpec(
    "dmp-tiny",
    32,
    (
        TableSpec("t_tw", 100, 16, pooling_factor=2.0),
        TableSpec("t_cw", 80, 32, pooling_factor=2.0),
        TableSpec("t_twcw", 60, 32, pooling_factor=2.0),
        TableSpec("t_rw", 101, 16, pooling_factor=2.0),
        TableSpec("t_twrw", 31, 8, pooling_factor=2.0),
        TableSpec("t_dp", 50, 8, pooling_factor=2.0),
        TableSpec("t_uvm", 70, 8, pooling_factor=2.0),
        TableSpec("t_cache", 90, 16, pooling_factor=2.0),
    ),
)
DMP_FORCE = {
    "t_tw": (Sharding.TABLE_WISE, Tier.HBM),
    "t_cw": (Sharding.COLUMN_WISE, Tier.HBM),
    "t_twcw": (Sharding.TABLE_COLUMN_WISE, Tier.HBM),
    "t_rw": (Sharding.ROW_WISE, Tier.HBM),
    "t_twrw": (Sharding.TABLE_ROW_WISE, Tier.HBM),
    "t_dp": (Sharding.DATA_PARALLEL, Tier.HBM),
    "t_uvm": (Sharding.TABLE_WISE, Tier.DDR),
    "t_cache": (Sharding.TABLE_WISE, Tier.HBM_CACHE),
}
DMP_STEPS = 20
DMP_LOCAL_BATCH = 16


def _local_weight_sums(dmp) -> dict[str, float]:
    """Sum of this rank's weights per table (its local shards, or its replica), skipping tables it does not hold."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    sums = {}
    for key, value in dmp.state_dict().items():
        if "embedding_bags" not in key:
            continue
        table = key.split(".")[-2]
        if isinstance(value, ShardedTensor):
            if value.local_shards():
                sums[table] = float(sum(s.tensor.double().sum() for s in value.local_shards()))
        else:
            sums[table] = float(getattr(value, "to_local", lambda v=value: v)().double().sum())
    return sums


def _dmp_worker(rank: int, world_size: int, port: int, tables: dict, out_dir: str) -> None:
    """One rank: build the model on meta, shard it with the exported plan, train, write what it saw as JSON."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch import nn
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from persia_planner.modules.launcher.launch import use_hosted_store
    from persia_planner.modules.launcher.lifecycle import exit_now
    from persia_planner.plan.torchrec_export import to_embedding_bag_configs, to_sharding_plan

    use_hosted_store(port)  # rendezvous in the test's store, listening before either rank starts
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        topology = Topology.from_dict(TOPO_1X2)
        model_spec = DMP_MODEL
        names = gpu_tables(tables)
        sharding_plan = to_sharding_plan(tables, model_spec, topology, module_path="ebc", device_type="cpu")

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                configs = to_embedding_bag_configs(model_spec, names)
                self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
                self.head = nn.Sequential(
                    nn.Linear(sum(c.embedding_dim for c in configs), 8), nn.ReLU(), nn.Linear(8, 1)
                )
                self.seen: dict[str, list[int]] = {}

            def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
                kt = self.ebc(kjt)
                outputs = [kt[name] for name in names]  # by key, never by position
                self.seen = {name: list(out.shape) for name, out in zip(names, outputs, strict=True)}
                return self.head(torch.cat(outputs, dim=1)).squeeze(1)

        torch.manual_seed(0)
        net = Net()
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8}
        )
        dmp = DistributedModelParallel(
            module=net,
            env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
            device=torch.device("cpu"),
            plan=sharding_plan,
            sharders=[sharder],
        )
        dense_opt = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=0.05)
        )
        gen = torch.Generator().manual_seed(100 + rank)
        lengths = torch.randint(1, 4, (len(names), DMP_LOCAL_BATCH), generator=gen)
        values = torch.cat(
            [
                torch.randint(0, model_spec.table(n).rows, (int(lengths[i].sum()),), generator=gen)
                for i, n in enumerate(names)
            ]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=values, lengths=lengths.flatten())
        labels = torch.randint(0, 2, (DMP_LOCAL_BATCH,), generator=gen).float()
        before = _local_weight_sums(dmp)
        losses = []
        for _ in range(DMP_STEPS):
            dense_opt.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(dmp(kjt), labels)
            loss.backward()
            dense_opt.step()
            losses.append(float(loss.detach()))
        after = _local_weight_sums(dmp)
        local_shards = {}
        for key, value in dmp.state_dict().items():
            if isinstance(value, ShardedTensor):
                table = key.split(".")[-2]
                local_shards[table] = sorted(
                    [list(s.metadata.shard_offsets), list(s.metadata.shard_sizes)] for s in value.local_shards()
                )
        result = {
            "losses": losses,
            "seen": dmp.module.seen,
            "local_shards": local_shards,
            "changed": sorted(t for t in before if abs(after[t] - before[t]) > 1e-6),
            "local_tables": sorted(before),
            "fused_tables": sorted({k.split(".")[-2] for k in dmp.fused_optimizer.state_dict()["state"]}),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_now()  # the last barrier's work may still be freed by a gloo thread: do not finalize under it


@pytest.mark.processes
def test_dmp_trains_with_exported_plan(tmp_path):
    pytest.importorskip("torchrec")
    import torch.multiprocessing as mp

    topology = Topology.from_dict(TOPO_1X2)
    plan = forced_plan(DMP_MODEL, topology, DMP_FORCE)
    shardings = {p.sharding for p in plan.tables.values()}
    assert {Sharding.TABLE_WISE, Sharding.COLUMN_WISE, Sharding.ROW_WISE, Sharding.DATA_PARALLEL} <= shardings
    tables = dict(plan.tables)
    from persia_planner.modules.launcher.launch import hosted_store

    with hosted_store() as port:
        mp.spawn(_dmp_worker, args=(2, port, tables, str(tmp_path)), nprocs=2, join=True)

    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        losses = result["losses"]
        assert len(losses) == DMP_STEPS
        assert losses[-1] < 0.8 * losses[0], losses
        assert result["seen"] == {t.name: [DMP_LOCAL_BATCH, t.dim] for t in DMP_MODEL.tables}
        # Each rank holds exactly the shards our plan put on its GPU (straight from plan.tables, not the exporter).
        held = set()
        for name, placement in plan.tables.items():
            mine = sorted(
                [[s.rows[0], s.cols[0]], [s.rows[1] - s.rows[0], s.n_cols]]
                for s in placement.shards
                if topology.gpu_index(s.device) == rank
            )
            if placement.sharding is Sharding.DATA_PARALLEL:
                assert name not in result["local_shards"]
                continue
            assert result["local_shards"].get(name, []) == mine, (rank, name)
            held |= {name} if mine else set()
        assert set(result["fused_tables"]) == held
        assert set(result["local_tables"]) == held | {"t_dp"}
        assert result["changed"] == result["local_tables"]  # every local shard and the replica trained
