"""HybridEmbeddingCollection (modules/embedding/sequence_hybrid.py): TorchRec's EmbeddingCollection interface and
output with every table local, and with a PS table beside a local one (K = 0) equal to TorchRec's EmbeddingCollection
under DistributedModelParallel, loss for loss.

The unsharded cases restate those of TorchRec's ``EmbeddingCollectionTest``
(torchrec/modules/tests/test_embedding_modules.py, Meta Platforms, BSD-3-Clause licence): the same inputs and the
same expected shapes, keys and indices, with dims a multiple of 4 (fbgemm's) where TorchRec's use 3 and 5."""

from __future__ import annotations

import pytest
import torch
from plans import TOPO_1X2, local_placement, ps_placement
from torchrec.fx import symbolic_trace
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import PlannerError
from persia_planner.kinds import Sharding
from persia_planner.model.specs import Optimizer
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection
from persia_planner.modules.embedding.sequence_hybrid import HybridEmbeddingCollection
from persia_planner.modules.embedding.sparse_optimizer import SparseOptimizer
from persia_planner.modules.launcher.launch import local_cluster
from persia_planner.placement.shards import Shard, TablePlacement
from persia_planner.tiers import Tier
from persia_planner.topology.graph import Topology


def _shared():
    return [
        EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=10, feature_names=["f1", "f2"]),
        EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=10, feature_names=["f2"]),
    ]


# f1: [0, 1] [2]; f2: [] [3]
FEATURES = KeyedJaggedTensor.from_offsets_sync(
    keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3]), offsets=torch.tensor([0, 2, 3, 3, 4])
)


# ---- TorchRec's EmbeddingCollectionTest cases, every table local ---------------------------------------------


def test_forward_gives_a_row_per_id_under_torchrecs_keys():
    ec = HybridEmbeddingCollection(_shared())
    out = ec(FEATURES)
    assert list(out) == ["f1", "f2@t1", "f2@t2"]
    assert out["f1"].values().shape == (3, 8) and out["f2@t1"].values().shape == (1, 8)
    assert out["f2@t2"].values().shape == (1, 8) and out["f1"].lengths().tolist() == [2, 1]
    # the rows are the tables' own: the same as TorchRec's collection holding the same weights
    ref = EmbeddingCollection(_shared())
    ref.load_state_dict(ec.state_dict())
    expected = ref(FEATURES)
    assert all(torch.equal(out[k].values(), expected[k].values()) for k in expected)
    assert list(ec.state_dict()) == ["embeddings.t1.weight", "embeddings.t2.weight"]


def test_indices_are_the_features_ids_eager_and_scripted():
    ec = HybridEmbeddingCollection(_shared(), need_indices=True)
    for run in (ec, torch.jit.script(ec)):
        out = run(FEATURES)
        assert torch.equal(out["f1"].weights(), torch.tensor([0, 1, 2]))
        assert torch.equal(out["f2@t1"].weights(), torch.tensor([3]))
        assert torch.equal(out["f2@t2"].weights(), torch.tensor([3]))


def test_fx_traces_and_the_trace_scripts():
    gm = symbolic_trace(HybridEmbeddingCollection(_shared()))
    torch.jit.script(gm)
    out = gm(FEATURES)
    assert out["f1"].values().shape == (3, 8) and out["f2@t2"].values().shape == (1, 8)


def test_scripting_and_the_device():
    config = EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"])
    torch.jit.script(HybridEmbeddingCollection([config]))
    ec = HybridEmbeddingCollection([config], device=torch.device("meta"))
    assert ec.embeddings["t1"].weight.device == torch.device("meta")


def test_duplicate_names_and_mixed_dims_fail_as_torchrecs_do():
    one = EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"])
    with pytest.raises(ValueError, match="table name 't1' is used twice"):
        HybridEmbeddingCollection([one, EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10)])
    with pytest.raises(ValueError, match="one embedding_dim"):
        HybridEmbeddingCollection([one, EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=10)])


# ---- the wrong kind of table or wrapper: one line ------------------------------------------------------------


def test_the_wrong_kind_of_table_and_managed_collisions_are_one_line():
    bag = EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    seq = EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    with pytest.raises(PlannerError, match=r"tables \['b'\] are EmbeddingBagConfig.*use HybridEmbeddingBagCollection"):
        HybridEmbeddingCollection([bag])
    with pytest.raises(PlannerError, match=r"tables \['s'\] are EmbeddingConfig.*HybridEmbeddingCollection"):
        HybridEmbeddingBagCollection([seq])
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    mch = MCHManagedCollisionModule(
        zch_size=10, device=torch.device("cpu"), eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1
    )
    mcc = ManagedCollisionCollection({"b": mch}, [bag])
    with pytest.raises(PlannerError) as err:
        ManagedCollisionEmbeddingBagCollection(HybridEmbeddingBagCollection([bag]), mcc)
    line = str(err.value)
    assert "\n" not in line and "does not run under TorchRec's managed-collision (MCH) wrappers" in line
    assert "zch_size becomes the table's rows" in line


# ---- a PS table and a local one, K = 0, two trainers: TorchRec's EC + DMP loss for loss ------------------------

TOPOLOGY = Topology.from_dict(TOPO_1X2)
NEAR_FAR = [
    EmbeddingConfig(name="near", feature_names=["a"], num_embeddings=40, embedding_dim=8),
    EmbeddingConfig(name="far", feature_names=["b", "c"], num_embeddings=30, embedding_dim=8),
]


def _batch(gen: torch.Generator, batch: int) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 5, (3 * batch,), generator=gen)  # empty sequences too
    return KeyedJaggedTensor(keys=["c", "a", "b"], values=torch.randint(0, 30, (int(lengths.sum()),), generator=gen),
                             lengths=lengths)  # fmt: skip


def _loss(out, gen: torch.Generator) -> torch.Tensor:
    """A readout every id's row reaches, different per id position (the sequences' order matters)."""
    total = torch.zeros(())
    for key in ("a", "b", "c"):
        values = out[key].values()
        total = total + (values * torch.randn(values.shape, generator=gen)).sum()
    return total


def _k0_two_trainers(j: int, client, steps: int) -> dict[str, float]:
    import datetime

    import torch.distributed as dist

    from persia_planner.modules.embedding.model_parallel import distribute, executed_plan
    from persia_planner.modules.launcher.launch import trainers_store

    dist.init_process_group("gloo", store=trainers_store(), rank=j, world_size=2, timeout=datetime.timedelta(60))
    try:
        sgd = SparseOptimizer(Optimizer.SGD, learning_rate=0.3)
        near = TablePlacement(  # row-wise over both trainers: TorchRec's sequence all-to-all of ids and rows
            Sharding.ROW_WISE,
            tuple(Shard(f"trainer0/gpu{g}", Tier.HBM, (0, 8), 0, rows=(20 * g, 20 * g + 20)) for g in range(2)),
        )
        both_local = {"near": near, "far": local_placement(30, 8, device="trainer0/gpu1")}
        plan = {"near": near, "far": ps_placement(8)}
        # TorchRec's EmbeddingCollection under DMP (its EmbeddingCollectionSharder, fbgemm's fused SGD): the reference
        ref = HybridEmbeddingCollection(NEAR_FAR, both_local, optimizer=sgd, local_device=torch.device("meta"))
        ref_net = distribute(ref, both_local, TOPOLOGY)
        hybrid = HybridEmbeddingCollection(
            NEAR_FAR, plan, ps=client, staleness=0, optimizer=sgd, local_device=torch.device("meta")
        )
        net = distribute(hybrid, plan, TOPOLOGY)
        start = ref.local_weights()
        if j == 0:
            client.assign_rows("far", torch.arange(30), start["far"])
        dist.barrier()
        worst, losses = 0.0, []
        for step in range(steps):
            batch = _batch(torch.Generator().manual_seed(100 * step + j), batch=6)
            readout = 1000 * step + j
            loss = _loss(net(batch), torch.Generator().manual_seed(readout))
            expected = _loss(ref_net(batch), torch.Generator().manual_seed(readout))
            loss.backward()
            expected.backward()
            worst = max(worst, abs(float(loss) - float(expected)))
            losses.append(float(loss))
        hybrid.flush()
        far = client.lookup("far", torch.arange(30), train=False)
        after = ref.local_weights()
        ran = executed_plan(net, TOPOLOGY)
        return {
            "loss": worst,
            "moved": losses[0] != losses[-1],
            "near": float((hybrid.local_weights()["near"] - after["near"]).abs().max()),
            "far": float((far - after["far"]).abs().max()),
            "far_moved": float((far - start["far"]).abs().max()),
            "ran": ran,
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_k0_with_a_ps_table_equals_torchrecs_embedding_collection_under_dmp():
    for result in local_cluster(1, 2, _k0_two_trainers, 6, timeout_s=30.0):
        assert result["loss"] <= 1e-6 and result["near"] <= 1e-6 and result["far"] <= 1e-6, result
        assert result["far_moved"] > 1e-3 and result["moved"], result
        assert result["ran"]["near"]["sharding"] == "row_wise" and result["ran"]["near"]["ranks"] == [0, 1], result
        assert result["ran"]["far"] == {"servers": ["ps0"]}, result
