"""HybridTrainPipeline: TorchRec's TrainPipelineSparseDist over the drop-in, the PS rows staged with the batches.
With K = 0 it trains exactly as the plain loop does; with K > 0 the rows of staged batches are requested ahead."""

from __future__ import annotations

import pytest
import torch
from plans import TOPO_1X2, ps_placement

from persia_planner.kinds import Sharding
from persia_planner.model.dense import ArchKind, DenseArch, DenseSpec
from persia_planner.model.specs import ModelSpec, TableSpec
from persia_planner.placement.shards import Shard, TablePlacement
from persia_planner.tiers import Tier
from persia_planner.topology.graph import Topology

TOPOLOGY = Topology.from_dict(TOPO_1X2)
DIM, DENSE = 8, 4
SPEC = ModelSpec(
    "pipe",
    64,
    (TableSpec("u", 200, DIM), TableSpec("c", 20, DIM), TableSpec("i", 60, DIM)),
    dense=DenseSpec(arch=DenseArch(ArchKind.DLRM, num_dense=DENSE, bottom=(8,), over=(8, 1))),
)


def _plan() -> dict[str, TablePlacement]:
    gpus = [g.name for g in TOPOLOGY.gpus]
    rows = [(0, 30), (30, 60)]
    return {
        "u": ps_placement(DIM, servers=2),
        "c": TablePlacement(Sharding.TABLE_WISE, (Shard(gpus[1], Tier.HBM, (0, DIM), 0, rows=(0, 20)),)),
        "i": TablePlacement(
            Sharding.ROW_WISE, tuple(Shard(g, Tier.HBM, (0, DIM), 0, rows=r) for g, r in zip(gpus, rows, strict=True))
        ),
    }


def _batches(rank: int, steps: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from persia_planner.modules.data.batch import Batch

    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        ids = [torch.randint(0, n, (32,), generator=gen) for n in (200, 20, 60)]
        kjt = KeyedJaggedTensor.from_lengths_sync(["u", "c", "i"], torch.cat(ids), torch.ones(96, dtype=torch.int32))
        yield Batch(torch.randn(32, DENSE, generator=gen), kjt, ((ids[0] + ids[2]) % 2).float())


def _train(rank: int, client, pipelined: bool, staleness: int, steps: int) -> dict:
    from persia_planner.modules.embedding.hybrid import SparseOptimizer
    from persia_planner.modules.embedding.model_parallel import distribute
    from persia_planner.modules.train.config import TrainConfig
    from persia_planner.modules.train.loop import TrainLoop, build_model, make_optimizer
    from persia_planner.modules.train.pipeline import PipelinedTrainLoop, PipelineStep

    sparse = SparseOptimizer("rowwise_adagrad", learning_rate=0.1)
    plan = _plan()
    model, hybrid = build_model(
        SPEC, plan, ps=client, optimizer=sparse, staleness=staleness, ps_servers=2, local_device=torch.device("meta")
    )
    cfg = TrainConfig(dense_optimizer="adagrad", dense_lr=0.05)
    if pipelined:
        step = PipelineStep(model)
        dmp = distribute(step, plan, TOPOLOGY)
        loop = PipelinedTrainLoop(dmp, hybrid, make_optimizer(step, cfg, sparse))
    else:
        dmp = distribute(model, plan, TOPOLOGY)
        loop = TrainLoop(dmp, hybrid, make_optimizer(model, cfg, sparse))
    stats = list(loop.run(_batches(rank, steps)))
    hybrid.flush()
    pipelined = loop.pipeline.pipelined if pipelined else {}
    return {"losses": [s.loss for s in stats], "staleness": [s.staleness for s in stats], "pipelined": pipelined}


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_the_pipeline_trains_as_the_plain_loop_at_k0_and_stages_ps_rows_ahead_at_k2():
    from persia_planner.modules.train import run_trainers

    plain = run_trainers(_train, False, 0, 8, trainers=2, servers=2)
    piped = run_trainers(_train, True, 0, 8, trainers=2, servers=2)
    for rank in (0, 1):
        assert len(piped[rank]["losses"]) == 8
        torch.testing.assert_close(piped[rank]["losses"], plain[rank]["losses"], rtol=0, atol=1e-6)
        # TorchRec pipelined the local tables' module, and the id mapping ahead of it
        assert piped[rank]["pipelined"] == {"sharded": ["ShardedEmbeddingBagCollection"], "postproc": ["IdsInRange"]}
    ahead = run_trainers(_train, True, 2, 8, trainers=2, servers=2)
    for rank in (0, 1):
        seen = ahead[rank]["staleness"]
        assert len(seen) == 8 and max(seen) >= 1 and max(seen) <= 2  # rows requested ahead, within the bound


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_persia_train_pipelined_evaluates_between_steps_and_equals_the_plain_run_at_k0(tmp_path):
    """The default job (2 PS + 2 trainers) in sync mode with an evaluation and a checkpoint after step 3: the pipeline
    is detached for them and attached again; every loss and the AUC are the plain loop's."""
    from persia_planner import load_model, load_topology, plan
    from persia_planner.modules.train import TrainConfig, train_local
    from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY

    spec, topology = load_model(DEFAULT_MODEL), load_topology(DEFAULT_TOPOLOGY)
    tables = dict(plan(spec, topology).tables)

    def run(pipeline: bool) -> dict:
        cfg = TrainConfig(
            steps=6, mode="sync", eval_every=3, eval_batches=2, checkpoint_every=3, progress=False,
            checkpoint=str(tmp_path / f"ckpt-{pipeline}"), pipeline=pipeline,
        )  # fmt: skip
        return train_local(cfg, spec, tables, servers=len(topology.servers), topology=topology)

    plain, piped = run(False), run(True)
    assert piped["pipelined"] and not plain["pipelined"] and piped["steps"] == 6
    assert [h["loss"] for h in piped["history"]] == pytest.approx([h["loss"] for h in plain["history"]], abs=1e-6)
    assert piped["history"][2]["auc"] == pytest.approx(plain["history"][2]["auc"], abs=1e-6)
    assert piped["auc"] == pytest.approx(plain["auc"], abs=1e-6)
    assert (tmp_path / "ckpt-True" / "step-000000006").is_dir() and piped["executed_matches_plan"]
