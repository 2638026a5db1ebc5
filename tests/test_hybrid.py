"""HybridEmbeddingBagCollection: a drop-in for TorchRec's EmbeddingBagCollection (inside TorchRec's DLRM too), whose
local and PS parts together equal EBC + DDP with K = 0, and whose bad use fails with one clear message."""

from __future__ import annotations

import pytest
import torch
from plans import TOPO_1X2, local_placement, ps_placement
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import PlannerError
from persia_planner.model.specs import ModelSpec, Optimizer, TableSpec
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer, StalenessError
from persia_planner.modules.launcher.launch import local_cluster
from persia_planner.topology.graph import Topology

TOPOLOGY = Topology.from_dict(TOPO_1X2)


CONFIGS = [
    EmbeddingBagConfig(name="t0", feature_names=["a", "b"], num_embeddings=50, embedding_dim=4),
    EmbeddingBagConfig(name="t1", feature_names=["c"], num_embeddings=30, embedding_dim=8),
    EmbeddingBagConfig(name="t2", feature_names=["d"], num_embeddings=20, embedding_dim=4),
]


def random_kjt(gen: torch.Generator, keys: list[str], batch: int, high: int, low: int = 0) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    values = torch.randint(low, high, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


# ---- one process, unsharded --------------------------------------------------------------------------------------
def test_swaps_into_torchrec_dlrm_and_trains():
    from torchrec.models.dlrm import DLRM

    configs = [
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=100, embedding_dim=8) for i in range(3)
    ]
    hybrid = HybridEmbeddingBagCollection(configs, optimizer=SparseOptimizer(learning_rate=0.1))
    torch.manual_seed(0)  # the dense layers' initial weights (from the global generator): the same run every time
    model = DLRM(
        embedding_bag_collection=hybrid,
        dense_in_features=4,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    dense = [p for n, p in model.named_parameters() if "embedding_bag_collection" not in n]
    opt = torch.optim.Adagrad(dense, lr=0.05)
    gen = torch.Generator().manual_seed(4)
    kjt = random_kjt(gen, ["f0", "f1", "f2"], batch=64, high=100)
    dense_x = torch.randn(64, 4, generator=gen)
    labels = (torch.rand(64, generator=gen) < 0.3).float()
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense_x, kjt).squeeze(-1), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


def test_weighted_features_need_weights_of_every_id_and_sum_pooling():
    hybrid = HybridEmbeddingBagCollection(CONFIGS, is_weighted=True)
    kjt = random_kjt(torch.Generator().manual_seed(12), ["a", "b", "c", "d"], batch=3, high=20)
    with pytest.raises(PlannerError, match=r"is weighted \(is_weighted=True\) but the KeyedJaggedTensor has no weig"):
        hybrid(kjt)
    short = KeyedJaggedTensor(kjt.keys(), kjt.values(), torch.ones(kjt.values().numel() + 1), kjt.lengths())
    with pytest.raises(PlannerError, match=r"weights are torch.float32 \(\d+,\), expected floating point \[\d+\]"):
        hybrid(short)
    mean = [
        EmbeddingBagConfig(name="m", feature_names=["a"], num_embeddings=10, embedding_dim=4, pooling=PoolingType.MEAN)
    ]
    with pytest.raises(PlannerError, match=r"tables \['m'\] use mean pooling, but weighted features are defined for s"):
        HybridEmbeddingBagCollection(mean, is_weighted=True)


# ---- bad use -----------------------------------------------------------------------------------------------------
def test_plan_must_cover_exactly_the_tables():
    plan = {"t0": local_placement(50, 4), "t1": local_placement(30, 8)}
    with pytest.raises(PlannerError, match=r"no placement for tables \['t2'\]"):
        HybridEmbeddingBagCollection(CONFIGS, plan)
    plan |= {"t2": local_placement(20, 4), "zz": local_placement(1, 4)}
    with pytest.raises(PlannerError, match=r"places tables \['zz'\] that are not in the collection"):
        HybridEmbeddingBagCollection(CONFIGS, plan)


def test_ps_tables_need_a_client():
    plan = {"t0": local_placement(50, 4), "t1": ps_placement(8), "t2": local_placement(20, 4)}
    with pytest.raises(PlannerError, match=r"tables \['t1'\] are on the ps tier but no parameter-server client"):
        HybridEmbeddingBagCollection(CONFIGS, plan)


def test_cpu_adam_is_refused_with_a_fix():
    with pytest.raises(PlannerError, match=r"fbgemm has no CPU adam.*rowwise_adagrad"):
        HybridEmbeddingBagCollection(CONFIGS, optimizer=SparseOptimizer(Optimizer.ADAM), device=torch.device("cpu"))


def test_missing_feature_and_bad_staleness():
    hybrid = HybridEmbeddingBagCollection(CONFIGS)
    kjt = random_kjt(torch.Generator().manual_seed(5), ["a", "b", "c"], batch=2, high=10)
    with pytest.raises(PlannerError, match=r"features \['d'\] of the embedding tables are not keys"):
        hybrid(kjt)
    with pytest.raises(PlannerError, match="staleness must be >= 0"):
        HybridEmbeddingBagCollection(CONFIGS, staleness=-1)


def test_malformed_batches_and_dims_are_refused_with_one_line():
    hybrid = HybridEmbeddingBagCollection(CONFIGS)
    keys = ["a", "b", "c", "d"]
    # lengths promise 8 ids per key but only 2 values: fbgemm would read past the ids (garbage, no error)
    short = KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2]), lengths=torch.full((8,), 1))
    with pytest.raises(PlannerError, match="lengths sum to 8 but it holds 2 values"):
        hybrid(short)
    floats = KeyedJaggedTensor(keys=keys, values=torch.ones(8), lengths=torch.full((8,), 1))
    with pytest.raises(PlannerError, match="values must be integer ids"):
        hybrid(floats)
    negative = KeyedJaggedTensor(keys=keys, values=torch.arange(2), lengths=torch.tensor([2, -1, 1, 0, 0, 0, 0, 0]))
    with pytest.raises(PlannerError, match="lengths must be >= 0"):
        hybrid(negative)


def weighted_kjt(gen: torch.Generator, keys: list[str], batch: int, high: int) -> KeyedJaggedTensor:
    kjt = random_kjt(gen, keys, batch, high)
    weights = torch.rand(kjt.values().numel(), generator=gen) * 4 - 2  # negative ones too
    return KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(), weights=weights)


WEIGHTED = [
    EmbeddingBagConfig(name="near", feature_names=["a", "b"], num_embeddings=40, embedding_dim=4),
    EmbeddingBagConfig(name="far", feature_names=["c"], num_embeddings=30, embedding_dim=4),
]


def _weighted_two_trainers(j: int, client, steps: int) -> dict[str, float]:
    """K = 0, two trainers, a local and a PS table with weighted features, against TorchRec's weighted EBC trained on
    both trainers' batches (the mean of their losses, as the hybrid averages over trainers)."""
    import datetime

    import torch.distributed as dist

    from persia_planner.modules.embedding.model_parallel import distribute
    from persia_planner.modules.launcher.launch import trainers_store

    dist.init_process_group("gloo", store=trainers_store(), rank=j, world_size=2, timeout=datetime.timedelta(60))
    try:
        sgd = SparseOptimizer(Optimizer.SGD, learning_rate=0.5)
        plan = {"near": local_placement(40, 4), "far": ps_placement(4)}
        hybrid = HybridEmbeddingBagCollection(
            WEIGHTED, plan, ps=client, staleness=0, optimizer=sgd, is_weighted=True, local_device=torch.device("meta")
        )
        net = distribute(hybrid, plan, TOPOLOGY)
        every_id = torch.arange(30)
        far_before = client.lookup("far", every_id)  # inserts every row: per-id init, whichever trainer comes first
        near_before = hybrid.local_weights()["near"].clone()
        dist.barrier()
        ref = EmbeddingBagCollection(tables=WEIGHTED, is_weighted=True)
        with torch.no_grad():
            ref.embedding_bags["near"].weight.copy_(near_before)
            ref.embedding_bags["far"].weight.copy_(far_before)
        opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        forward = 0.0
        for step in range(steps):
            gens = [torch.Generator().manual_seed(100 * step + r) for r in range(2)]
            batches = [weighted_kjt(g, ["c", "a", "b"], batch=5, high=30) for g in gens]
            grads = [torch.randn(5, 12, generator=g) for g in gens]
            out = net(batches[j]).values()
            (out * grads[j]).sum().backward()
            expected = [ref(b).values() for b in batches]
            forward = max(forward, float((out - expected[j]).abs().max()))
            (sum((e * g).sum() for e, g in zip(expected, grads, strict=True)) / 2).backward()
            opt.step()
            opt.zero_grad()
        # Learnable weights cannot go through TorchRec's input all-to-all (it has no backward for them): refused.
        learnable = weighted_kjt(torch.Generator().manual_seed(99), ["c", "a", "b"], batch=5, high=30)
        learnable = KeyedJaggedTensor(
            learnable.keys(), learnable.values(), learnable.weights().requires_grad_(True), learnable.lengths()
        )
        refused = False
        try:
            net(learnable)
        except PlannerError as err:
            refused = "learnable per-id weights" in str(err)
        # The last step's PS update waits for a collective that flush() runs: evaluating before it is refused.
        net.eval()
        unsent = ""
        try:
            with torch.no_grad():
                net(batches[j])
        except StalenessError as err:
            unsent = str(err)
        net.train()
        hybrid.flush()
        # Eval: each trainer pools its own batch with its weights (no gather), local and PS tables alike.
        net.eval()
        scored = weighted_kjt(torch.Generator().manual_seed(1000 + j), ["c", "a", "b"], batch=5, high=30)
        with torch.no_grad():
            evaluated = float((net(scored).values() - ref(scored).values()).abs().max())
        far_after = client.lookup("far", every_id, train=False)
        near_after = hybrid.local_weights()["near"]
        return {
            "refused": refused,
            "unsent": unsent,
            "eval": evaluated,
            "forward": forward,
            "near": float((near_after - ref.embedding_bags["near"].weight).abs().max()),
            "far": float((far_after - ref.embedding_bags["far"].weight).abs().max()),
            "near_moved": float((near_after - near_before).abs().max()),
            "far_moved": float((far_after - far_before).abs().max()),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_weighted_features_match_torchrec_weighted_ebc_across_trainers_and_servers():
    """Weights reach fbgemm through TorchRec's input all-to-all and scale the PS rows (and so the pushed gradients):
    every output and every row after training equals TorchRec's weighted EBC."""
    for result in local_cluster(1, 2, _weighted_two_trainers, 4, timeout_s=30.0):
        assert result["forward"] <= 1e-6 and result["near"] <= 1e-6 and result["far"] <= 1e-6, result
        assert result["eval"] <= 1e-6 and result["refused"], result
        assert "call flush() on every trainer before eval()" in result["unsent"], result
        assert result["near_moved"] > 1e-3 and result["far_moved"] > 1e-3, result


SMALL = ModelSpec(
    "small",
    512,
    tuple(
        TableSpec(name, rows, 8) for name, rows in (("c1", 3000), ("c2", 500), ("c3", 2000), ("c4", 50), ("c5", 100))
    ),
)
SMALL_PLAN = {
    "c1": ps_placement(8),
    "c2": local_placement(500, 8),
    "c3": ps_placement(8),
    "c4": local_placement(50, 8, device="trainer0/gpu1"),
    "c5": local_placement(100, 8),
}


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_k0_equals_torchrec_ebc_plus_ddp_step_by_step():
    from persia_planner.modules.tools.torchrec_equivalence import compare_with_torchrec

    sync = compare_with_torchrec(
        SMALL, SMALL_PLAN, TOPOLOGY, steps=8, trainers=2, servers=2, batch_size=64, learning_rate=3.0
    )
    assert len(sync["hybrid"]) == 2 and all(len(h) == 8 for h in sync["hybrid"])
    assert sync["max_abs_diff"] <= 1e-6, sync
    # the two trainers saw different batches, and training moved: the match is not two copies of one constant
    assert sync["hybrid"][0] != sync["hybrid"][1]
    assert sync["hybrid"][0][-1] < sync["hybrid"][0][0] - 0.05


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_k0_with_rowwise_adagrad_is_one_synchronous_update_per_step():
    # The trainers gather their PS gradients and push each id once: Adagrad's accumulator sees the step's averaged
    # gradient, as TorchRec's RowWiseAdagrad under DDP does (separate pushes per trainer would not match).
    from persia_planner.modules.tools.torchrec_equivalence import compare_with_torchrec

    sync = compare_with_torchrec(
        SMALL,
        SMALL_PLAN,
        TOPOLOGY,
        steps=8,
        trainers=2,
        servers=2,
        batch_size=64,
        learning_rate=0.5,
        sparse_optimizer="rowwise_adagrad",
    )
    assert sync["max_abs_diff"] <= 1e-5, sync
    assert sync["hybrid"][0] != sync["hybrid"][1]
    assert sync["hybrid"][0][-1] < sync["hybrid"][0][0] - 0.02
