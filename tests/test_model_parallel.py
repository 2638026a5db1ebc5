"""Two trainers run the plan as planned: every sharding type equals TorchRec's EBC + DDP step by step (K = 0), the
collection's KeyedTensor is read by key after mixed sharding, and the run reports what it executed."""

from __future__ import annotations

import datetime
import json

import pytest
import torch
from plans import TOPO_1X2, forced_plan, local_placement, ps_placement

from persia_planner.kinds import Sharding
from persia_planner.model.specs import ModelSpec, TableSpec
from persia_planner.modules.launcher.launch import local_cluster
from persia_planner.plan.executability import planned_execution
from persia_planner.tiers import Tier
from persia_planner.topology.graph import Topology

pytestmark = pytest.mark.processes  # every test here starts processes

TOPOLOGY = Topology.from_dict(TOPO_1X2)
DIM = 32  # column-wise shards of at least 16 columns each on two trainers
TYPES = [
    Sharding.TABLE_WISE,
    Sharding.ROW_WISE,
    Sharding.COLUMN_WISE,
    Sharding.TABLE_ROW_WISE,
    Sharding.TABLE_COLUMN_WISE,
    Sharding.DATA_PARALLEL,
]


def model_with(tested: dict[str, Sharding]) -> tuple[ModelSpec, dict]:
    """The tables under test (each sharded as given), a table-wise one on the other trainer, and a PS table."""
    tables = [TableSpec(name, 101 + 10 * i, DIM, pooling_factor=2.0) for i, name in enumerate(tested)]
    tables += [TableSpec("near", 50, DIM), TableSpec("far", 300, DIM)]
    spec = ModelSpec("dist", 64, tuple(tables))
    sub = ModelSpec("dist", 64, tuple(t for t in tables if t.name in tested))
    placements = dict(forced_plan(sub, TOPOLOGY, {n: (s, Tier.HBM) for n, s in tested.items()}).tables)
    placements["near"] = local_placement(50, DIM, device="trainer0/gpu1")
    placements["far"] = ps_placement(DIM)
    return spec, placements


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", TYPES, ids=[s.value for s in TYPES])
def test_each_sharding_type_equals_torchrec_ebc_plus_ddp_step_by_step(sharding):
    from persia_planner.modules.tools.torchrec_equivalence import compare_with_torchrec

    spec, placements = model_with({"x": sharding})
    assert placements["x"].sharding is sharding
    sync = compare_with_torchrec(
        spec, placements, TOPOLOGY, steps=6, trainers=2, servers=1, batch_size=32, learning_rate=0.5
    )
    assert sync["max_abs_diff"] <= 1e-6, sync
    assert sync["max_weight_diff"] <= 1e-6, sync  # every table's rows, not only the losses
    assert sync["min_weight_moved"] > 1e-4, sync  # and every table trained
    assert sync["hybrid"][0] != sync["hybrid"][1]  # the two trainers saw different batches


@pytest.mark.timeout(300)
def test_row_split_and_replicated_tables_at_once_with_rowwise_adagrad():
    """Row-wise Adagrad keeps one state per row: every sharding that keeps rows whole matches. (Column-wise shards
    keep one per row of each shard in TorchRec, so they match an unsharded table with SGD, tested above.)"""
    from persia_planner.modules.tools.torchrec_equivalence import compare_with_torchrec

    whole_rows = [s for s in TYPES if s not in (Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE)]
    spec, placements = model_with({f"t{i}": s for i, s in enumerate(whole_rows)})
    sync = compare_with_torchrec(
        spec,
        placements,
        TOPOLOGY,
        steps=8,
        trainers=2,
        servers=1,
        batch_size=32,
        learning_rate=0.1,
        sparse_optimizer="rowwise_adagrad",
    )
    assert sync["max_abs_diff"] <= 1e-4 and sync["max_weight_diff"] <= 1e-4, sync
    assert sync["min_weight_moved"] > 1e-4, sync


def _read_by_key(j: int, client, job: tuple) -> dict:
    """Forward of a mixed-sharded collection: keys in config order, each key's values TorchRec's."""
    import torch.distributed as dist
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from persia_planner.modules.data import SyntheticClicks, Teacher
    from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection
    from persia_planner.modules.embedding.model_parallel import distribute, executed_plan
    from persia_planner.modules.launcher.launch import trainers_store
    from persia_planner.plan.torchrec_export import to_embedding_bag_configs

    spec, placements = job
    dist.init_process_group("gloo", store=trainers_store(), rank=j, world_size=2, timeout=datetime.timedelta(60))
    try:
        configs = to_embedding_bag_configs(spec)
        hybrid = HybridEmbeddingBagCollection(configs, placements, ps=client, local_device=torch.device("meta"))
        net = distribute(hybrid, placements, TOPOLOGY)
        weights = hybrid.local_weights()
        for turn in range(2):  # one trainer at a time: the first admits and initialises the PS rows
            if turn == j:
                weights["far"] = client.lookup("far", torch.arange(300))
            dist.barrier()
        ref = EmbeddingBagCollection(tables=configs)
        ref.load_state_dict({f"embedding_bags.{k}.weight": v for k, v in weights.items()})
        teacher = Teacher(features=tuple(t.name for t in spec.tables), rows={t.name: t.rows for t in spec.tables})
        kjt = SyntheticClicks(teacher, batch_size=16, num_batches=2, seed=5).batch(j).sparse
        per_key = torch.tensor(kjt.length_per_key())
        rows = torch.tensor([spec.table(k).rows for k in kjt.keys()]).repeat_interleave(per_key)  # noqa: SIM118
        kjt = KeyedJaggedTensor(keys=kjt.keys(), values=torch.remainder(kjt.values(), rows), lengths=kjt.lengths())
        net.eval()
        with torch.no_grad():
            out, expected = net(kjt), ref(kjt)
            hybrid.keep_order = False
            loose = net(kjt)
        return {
            "keys": out.keys(),
            "loose_keys": loose.keys(),
            "diff": max(float((out[k] - expected[k]).abs().max()) for k in expected.keys()),  # noqa: SIM118
            "loose_diff": max(float((loose[k] - expected[k]).abs().max()) for k in expected.keys()),  # noqa: SIM118
            "executed": executed_plan(hybrid),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_keyed_tensor_is_read_by_key_after_mixed_sharding_and_the_run_reports_what_it_executed():
    spec, placements = model_with({f"t{i}": s for i, s in enumerate(TYPES)})
    results = local_cluster(1, 2, _read_by_key, (spec, placements), timeout_s=30.0)
    planned = planned_execution(placements, spec, TOPOLOGY)
    assert planned["t2"]["sharding"] == "column_wise" and planned["far"] == {"servers": ["ps0"]}
    for result in results:
        assert result["keys"] == [t.name for t in spec.tables]  # config order, whatever TorchRec's rank grouping
        assert result["diff"] <= 1e-6, result
        # keep_order=False: the keys as TorchRec's sharded collection groups them, then the PS tables; same values
        assert result["loose_keys"] != result["keys"] and result["loose_keys"][-1] == "far"
        assert sorted(result["loose_keys"]) == sorted(result["keys"]) and result["loose_diff"] <= 1e-6, result
        assert result["executed"] == planned


@pytest.mark.timeout(600)
def test_a_plans_quantized_collectives_run_through_torchrecs_codecs_and_a_ddp_hook(tmp_path):
    """persia train on a plan whose collectives are fp16: every local table's all-to-all runs TorchRec's fp16 codecs
    (data-parallel replicas move none), the dense all-reduce runs torch's fp16 hook, and synchronous training (K = 0:
    no arrival order) ends near the float32 plan's losses, not bit for bit (the codecs do round what travels)."""
    from typer.testing import CliRunner

    from persia_planner.cli import app
    from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY

    results = {}
    for qcomms in ("fp32", "fp16"):
        out = tmp_path / f"{qcomms}.json"
        planned = CliRunner().invoke(
            app,
            ["plan", str(DEFAULT_MODEL), str(DEFAULT_TOPOLOGY), "--qcomms", qcomms, "--staleness", "0", "-o", str(out)],
        )
        assert planned.exit_code == 0, planned.output
        ran = CliRunner().invoke(
            app, ["train", "--plan", str(out), "--mode", "sync", "--steps", "12", "--batch-size", "512", "--json"]
        )
        assert ran.exit_code == 0, ran.output
        results[qcomms] = json.loads(ran.stdout)
    quantized = results["fp16"]
    assert quantized["plan_qcomms"] == {"forward": "fp16", "backward": "fp16"} and quantized["executed_matches_plan"]
    comms = [e.get("comms") for e in quantized["executed_plan"].values() if "sharding" in e]
    travelling = [e for e in quantized["executed_plan"].values() if e.get("sharding") not in (None, "data_parallel")]
    assert travelling and all(e["comms"] == {"forward": "float16", "backward": "float16"} for e in travelling), comms
    assert quantized["dense_all_reduce"] == "float16" and results["fp32"]["dense_all_reduce"] == "float32"
    assert all(
        "comms" not in e or e["comms"]["forward"] == "float32" for e in results["fp32"]["executed_plan"].values()
    )
    for key in ("loss", "eval_loss"):  # the last step's training loss, the evaluation's
        diff = abs(results["fp32"][key] - quantized[key])
        assert 0 < diff < 0.01, (key, results["fp32"][key], quantized[key])
