"""HybridEmbeddingBagCollection: same values as TorchRec's EmbeddingBagCollection, K = 0 equals EBC + DDP,
bounded staleness holds, and bad use fails with one clear message."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import PlannerError
from persia_planner.modules.hybrid import HybridEmbeddingBagCollection, SparseOptimizer, StalenessError
from persia_planner.modules.ps.launch import local_cluster
from persia_planner.placement import Shard, Sharding, TablePlacement, Tier
from persia_planner.specs import ModelSpec, Optimizer, TableSpec


def ps_placement(dim: int) -> TablePlacement:
    return TablePlacement(Sharding.PS_HASH, (Shard("ps0", Tier.PS, (0, dim), 0, hash=(0, 1)),))


def local_placement(rows: int, dim: int, tier: Tier = Tier.HBM) -> TablePlacement:
    return TablePlacement(Sharding.TABLE_WISE, (Shard("trainer0/gpu0", tier, (0, dim), 0, rows=(0, rows)),))


CONFIGS = [
    EmbeddingBagConfig(name="t0", feature_names=["a", "b"], num_embeddings=50, embedding_dim=4),
    EmbeddingBagConfig(name="t1", feature_names=["c"], num_embeddings=30, embedding_dim=8),
    EmbeddingBagConfig(name="t2", feature_names=["d"], num_embeddings=20, embedding_dim=4),
]


def random_kjt(gen: torch.Generator, keys: list[str], batch: int, high: int, low: int = 0) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    values = torch.randint(low, high, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def reference_from(hybrid: HybridEmbeddingBagCollection, configs=CONFIGS) -> EmbeddingBagCollection:
    ref = EmbeddingBagCollection(tables=configs, is_weighted=hybrid.is_weighted())
    with torch.no_grad():
        for name, weight in hybrid.local_weights().items():
            ref.embedding_bags[name].weight.copy_(weight)
    return ref


# ---- one process, local tables ----------------------------------------------------------------------------------
def test_local_tables_match_torchrec_ebc_through_sgd_steps():
    hybrid = HybridEmbeddingBagCollection(CONFIGS, optimizer=SparseOptimizer(Optimizer.SGD, learning_rate=0.5))
    ref = reference_from(hybrid)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        # keys in another order than the tables, plus a key no table reads
        kjt = random_kjt(gen, ["d", "x", "c", "a", "b"], batch=6, high=20)
        out, expected = hybrid(kjt), ref(kjt)
        assert out.keys() == expected.keys() == ["a", "b", "c", "d"]
        assert out.length_per_key() == [4, 4, 8, 4]
        torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=0)
        weights = torch.randn(out.values().shape, generator=gen)
        (out.values() * weights).sum().backward()
        (expected.values() * weights).sum().backward()
        opt.step()
        opt.zero_grad()
    for name, weight in hybrid.local_weights().items():
        torch.testing.assert_close(weight, ref.embedding_bags[name].weight.detach(), rtol=0, atol=1e-6)
        assert not torch.equal(
            weight, reference_from(HybridEmbeddingBagCollection(CONFIGS)).embedding_bags[name].weight
        )


def test_local_rowwise_adagrad_matches_torchrec_rowwise_adagrad():
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    configs = [EmbeddingBagConfig(name="t", feature_names=["f"], num_embeddings=40, embedding_dim=8)]
    hybrid = HybridEmbeddingBagCollection(configs, optimizer=SparseOptimizer(learning_rate=0.1, eps=1e-8))
    ref = reference_from(hybrid, configs)
    opt = RowWiseAdagrad(ref.parameters(), lr=0.1, eps=1e-8)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        kjt = random_kjt(gen, ["f"], batch=8, high=40)
        target = torch.randn(8, 8, generator=gen)
        ((hybrid(kjt).values() - target) ** 2).sum().backward()
        ((ref(kjt).values() - target) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(
        hybrid.local_weights()["t"], ref.embedding_bags["t"].weight.detach(), atol=1e-5, rtol=1e-5
    )


def test_local_optimizer_state_of_another_optimizer_is_refused_before_anything_is_copied():
    rowwise = HybridEmbeddingBagCollection(CONFIGS, optimizer=SparseOptimizer(Optimizer.ROWWISE_ADAGRAD))
    adagrad = HybridEmbeddingBagCollection(CONFIGS, optimizer=SparseOptimizer(Optimizer.ADAGRAD))
    saved = rowwise.local_optimizer_states()
    for table in saved:
        for state in table:
            state.fill_(7.0)
    before = adagrad.local_optimizer_states()
    with pytest.raises(PlannerError, match=r"optimizer state of local table 't0' has shapes \[\(50,\)\], this co"):
        adagrad.load_local_optimizer_states(saved)
    after = adagrad.local_optimizer_states()
    assert all(torch.equal(a, b) for x, y in zip(before, after, strict=True) for a, b in zip(x, y, strict=True))
    rowwise.load_local_optimizer_states(saved)  # its own optimizer's state loads
    assert all(bool((s == 7.0).all()) for table in rowwise.local_optimizer_states() for s in table)


def test_raw_ids_map_into_rows_like_a_hashed_ebc():
    hybrid = HybridEmbeddingBagCollection(CONFIGS)
    ref = reference_from(hybrid)
    gen = torch.Generator().manual_seed(2)
    kjt = random_kjt(gen, ["a", "b", "c", "d"], batch=5, high=2**62, low=-(2**62))
    rows = torch.tensor([50, 50, 30, 20])
    per_key = kjt.lengths().view(4, -1).sum(1)
    wrapped = KeyedJaggedTensor(
        keys=kjt.keys(), values=torch.remainder(kjt.values(), rows.repeat_interleave(per_key)), lengths=kjt.lengths()
    )
    torch.testing.assert_close(hybrid(kjt).values(), ref(wrapped).values(), rtol=0, atol=0)
    # uint64 ids (what the PS path accepts) map by their int64 bit patterns; int32 ids as their values.
    as_uint64 = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().view(torch.uint64), lengths=kjt.lengths())
    torch.testing.assert_close(hybrid(as_uint64).values(), ref(wrapped).values(), rtol=0, atol=0)
    narrow = random_kjt(gen, ["a", "b", "c", "d"], batch=5, high=2**31 - 1)
    as_int32 = KeyedJaggedTensor(keys=narrow.keys(), values=narrow.values().int(), lengths=narrow.lengths())
    torch.testing.assert_close(hybrid(as_int32).values(), hybrid(narrow).values(), rtol=0, atol=0)


def test_mean_pooling_matches():
    configs = [
        EmbeddingBagConfig(
            name="t", feature_names=["f", "g"], num_embeddings=30, embedding_dim=4, pooling=PoolingType.MEAN
        )
    ]
    hybrid = HybridEmbeddingBagCollection(configs)
    ref = reference_from(hybrid, configs)
    kjt = random_kjt(torch.Generator().manual_seed(3), ["f", "g"], batch=7, high=30)
    torch.testing.assert_close(hybrid(kjt).values(), ref(kjt).values())


def test_swaps_into_torchrec_dlrm_and_trains():
    from torchrec.models.dlrm import DLRM

    configs = [
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=100, embedding_dim=8) for i in range(3)
    ]
    hybrid = HybridEmbeddingBagCollection(configs, optimizer=SparseOptimizer(learning_rate=0.1))
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


def weighted_kjt(gen: torch.Generator, keys: list[str], batch: int, high: int) -> KeyedJaggedTensor:
    kjt = random_kjt(gen, keys, batch, high)
    weights = torch.rand(kjt.values().numel(), generator=gen) * 4 - 2  # negative ones too
    return KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(), weights=weights)


def test_weighted_local_tables_match_torchrec_weighted_ebc_through_sgd_steps():
    sgd = SparseOptimizer(Optimizer.SGD, learning_rate=0.5)
    hybrid = HybridEmbeddingBagCollection(CONFIGS, optimizer=sgd, is_weighted=True)
    assert hybrid.is_weighted()
    ref = reference_from(hybrid)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(11)
    for step in range(4):
        kjt = weighted_kjt(gen, ["d", "x", "c", "a", "b"], batch=6, high=20)
        if step == 3:  # uint64 ids keep their weights through the bit-pattern view
            kjt = KeyedJaggedTensor(
                keys=kjt.keys(), values=kjt.values().view(torch.uint64), lengths=kjt.lengths(), weights=kjt.weights()
            )
        out = hybrid(kjt)
        expected = ref(KeyedJaggedTensor(kjt.keys(), kjt.values().view(torch.int64), kjt.weights(), kjt.lengths()))
        torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=1e-6)
        grad = torch.randn(out.values().shape, generator=gen)
        (out.values() * grad).sum().backward()
        (expected.values() * grad).sum().backward()
        opt.step()
        opt.zero_grad()
    for name, weight in hybrid.local_weights().items():
        torch.testing.assert_close(weight, ref.embedding_bags[name].weight.detach(), rtol=0, atol=1e-6)
    # The same batch through an unweighted collection: weights ignored, as TorchRec's unweighted EBC ignores them,
    # also bfloat16 ones (fbgemm's permute, which would carry them along, has no bfloat16 kernel).
    plain = HybridEmbeddingBagCollection(CONFIGS)
    kjt = weighted_kjt(gen, ["a", "b", "c", "d"], batch=3, high=20)
    unweighted = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths())
    halves = (kjt.weights() * 4).round() / 4  # exact in bfloat16
    narrow = KeyedJaggedTensor(kjt.keys(), kjt.values(), halves.to(torch.bfloat16), kjt.lengths())
    torch.testing.assert_close(plain(kjt).values(), plain(unweighted).values(), rtol=0, atol=0)
    torch.testing.assert_close(plain(narrow).values(), plain(unweighted).values(), rtol=0, atol=0)
    assert not plain.is_weighted()
    # A weighted collection widens bfloat16 and float64 weights to float32 before pooling.
    wide = KeyedJaggedTensor(kjt.keys(), kjt.values(), halves, kjt.lengths())
    for other in (narrow, KeyedJaggedTensor(kjt.keys(), kjt.values(), halves.double(), kjt.lengths())):
        torch.testing.assert_close(hybrid(other).values(), hybrid(wide).values(), rtol=0, atol=0)


def test_learnable_weights_get_their_gradient_from_a_local_table():
    """Weights that require grad (position weights, say) are learned as with TorchRec's weighted EBC."""
    hybrid = HybridEmbeddingBagCollection(CONFIGS, optimizer=SparseOptimizer(Optimizer.SGD), is_weighted=True)
    ref = reference_from(hybrid)
    kjt = weighted_kjt(torch.Generator().manual_seed(13), ["a", "b", "c", "d"], batch=4, high=20)
    grads = {}
    for key, module in (("hybrid", hybrid), ("ref", ref)):
        weights = kjt.weights().clone().requires_grad_(True)
        out = module(KeyedJaggedTensor(kjt.keys(), kjt.values(), weights, kjt.lengths())).values()
        (out * torch.arange(out.numel()).view(out.shape)).sum().backward()
        grads[key] = weights.grad
    assert grads["hybrid"] is not None and float(grads["hybrid"].abs().max()) > 0
    torch.testing.assert_close(grads["hybrid"], grads["ref"], rtol=0, atol=1e-5)


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
    odd = [EmbeddingBagConfig(name="t", feature_names=["a"], num_embeddings=10, embedding_dim=6)]
    with pytest.raises(PlannerError, match=r"local tables \['t'\] have an embedding_dim that is not a multiple of 4"):
        HybridEmbeddingBagCollection(odd)


def test_adam_for_ps_tables_is_the_servers_adam():
    from persia_planner.modules.ps import optim as ps_optim

    adam = SparseOptimizer(Optimizer.ADAM, learning_rate=0.01, eps=1e-6, beta1=0.8, beta2=0.99).ps()
    assert adam == ps_optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6)


def test_gathered_rows_unpack_ids_and_gradients_also_when_empty():
    from persia_planner.modules.hybrid import _unpack_rows

    ids, grads = torch.tensor([-1, 2**62 + 5, 7]), torch.randn(3, 4)
    packed = torch.cat([ids.view(torch.float32).view(-1, 2), grads], dim=1)
    got_ids, got_grads = _unpack_rows(packed)
    assert torch.equal(got_ids, ids) and torch.equal(got_grads, grads)
    # K = 0 with several trainers, a table no trainer has an id of in this step
    got_ids, got_grads = _unpack_rows(torch.empty(0, 6))
    assert got_ids.dtype == torch.int64 and got_ids.shape == (0,) and got_grads.shape == (0, 4)


# ---- with parameter servers (processes) ---------------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self, ebc: HybridEmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc, self.head = ebc, torch.nn.Linear(8, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(sparse).values())


def _k0_int32_ids_two_backwards(j: int, client, _unused) -> list[list[float]]:
    """K = 0, two trainers, the same batch of int32 ids, two backward passes through one forward (multi-task)."""
    import datetime

    import torch.distributed as dist

    from persia_planner.modules.ps.launch import trainers_store

    dist.init_process_group("gloo", store=trainers_store(), rank=j, world_size=2, timeout=datetime.timedelta(60))
    try:
        configs = [EmbeddingBagConfig(name="t", feature_names=["a"], num_embeddings=100, embedding_dim=4)]
        sgd = SparseOptimizer(Optimizer.SGD, learning_rate=1.0)
        hybrid = HybridEmbeddingBagCollection(configs, {"t": ps_placement(4)}, ps=client, staleness=0, optimizer=sgd)
        held = torch.tensor([5, 7])
        before = client.lookup("t", held)  # inserts both rows (either trainer may come first: same rows)
        dist.barrier()
        out = hybrid(
            KeyedJaggedTensor(keys=["a"], values=torch.tensor([5, 7, 5], dtype=torch.int32), lengths=torch.tensor([3]))
        ).values()
        out.sum().backward(retain_graph=True)
        (2 * out).sum().backward()
        hybrid.flush()
        return (before - client.lookup("t", held, train=False)).tolist()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_k0_gathers_int32_ids_and_every_backward_through_a_forward():
    """The gathered K = 0 update packs ids as 8 bytes (int32 ids broke it) and sums every backward pass of a step
    (a second one replaced the first), as the local tables and K > 0 do."""
    moved = local_cluster(1, 2, _k0_int32_ids_two_backwards, None, timeout_s=30.0)
    # Sum pooling: id 5 twice, id 7 once; gradients 1 + 2, averaged over two identical trainers; SGD lr 1.
    torch.testing.assert_close(torch.tensor(moved), torch.tensor([[[6.0] * 4, [3.0] * 4]] * 2), rtol=0, atol=1e-5)


WEIGHTED = [
    EmbeddingBagConfig(name="near", feature_names=["a", "b"], num_embeddings=40, embedding_dim=4),
    EmbeddingBagConfig(name="far", feature_names=["c"], num_embeddings=30, embedding_dim=4),
]


def _weighted_two_trainers(j: int, client, steps: int) -> dict[str, float]:
    """K = 0, two trainers, a local and a PS table with weighted features, against TorchRec's weighted EBC trained on
    both trainers' batches (the mean of their losses, as the hybrid averages over trainers)."""
    import datetime

    import torch.distributed as dist

    from persia_planner.modules.ps.launch import trainers_store

    dist.init_process_group("gloo", store=trainers_store(), rank=j, world_size=2, timeout=datetime.timedelta(60))
    try:
        sgd = SparseOptimizer(Optimizer.SGD, learning_rate=0.5)
        plan = {"near": local_placement(40, 4), "far": ps_placement(4)}
        hybrid = HybridEmbeddingBagCollection(WEIGHTED, plan, ps=client, staleness=0, optimizer=sgd, is_weighted=True)
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
            out = hybrid(batches[j]).values()
            (out * grads[j]).sum().backward()
            expected = [ref(b).values() for b in batches]
            forward = max(forward, float((out - expected[j]).abs().max()))
            (sum((e * g).sum() for e, g in zip(expected, grads, strict=True)) / 2).backward()
            opt.step()
            opt.zero_grad()
        # Learnable weights cannot go through the trainers' gather of local ids (it has no backward): refused.
        learnable = weighted_kjt(torch.Generator().manual_seed(99), ["c", "a", "b"], batch=5, high=30)
        learnable = KeyedJaggedTensor(
            learnable.keys(), learnable.values(), learnable.weights().requires_grad_(True), learnable.lengths()
        )
        refused = False
        try:
            hybrid(learnable)
        except PlannerError as err:
            refused = "learnable per-id weights" in str(err)
        hybrid.flush()
        # Eval: each trainer pools its own batch with its weights (no gather), local and PS tables alike.
        hybrid.eval()
        scored = weighted_kjt(torch.Generator().manual_seed(1000 + j), ["c", "a", "b"], batch=5, high=30)
        with torch.no_grad():
            evaluated = float((hybrid(scored).values() - ref(scored).values()).abs().max())
        far_after = client.lookup("far", every_id, train=False)
        near_after = hybrid.local_weights()["near"]
        return {
            "refused": refused,
            "eval": evaluated,
            "forward": forward,
            "near": float((near_after - ref.embedding_bags["near"].weight).abs().max()),
            "far": float((far_after - ref.embedding_bags["far"].weight).abs().max()),
            "near_moved": float((near_after - near_before).abs().max()),
            "far_moved": float((far_after - far_before).abs().max()),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_weighted_features_match_torchrec_weighted_ebc_across_trainers_and_servers():
    """Weights reach fbgemm after the trainers' gather of local ids and scale the PS rows (and so the pushed
    gradients): every output and every row after training equals TorchRec's weighted EBC."""
    for result in local_cluster(1, 2, _weighted_two_trainers, 4, timeout_s=30.0):
        assert result["forward"] <= 1e-6 and result["near"] <= 1e-6 and result["far"] <= 1e-6, result
        assert result["eval"] <= 1e-6 and result["refused"], result
        assert result["near_moved"] > 1e-3 and result["far_moved"] > 1e-3, result


def _staleness_scenarios(j: int, client, _unused) -> dict:
    """K = 2 with pushes slowed down: the gauge reaches K and never exceeds it; prefetching too far raises."""
    from persia_planner.modules.data import SyntheticClicks, Teacher
    from persia_planner.modules.train import TrainLoop

    configs = [
        EmbeddingBagConfig(name="remote", feature_names=["r"], num_embeddings=1000, embedding_dim=4),
        EmbeddingBagConfig(name="near", feature_names=["n"], num_embeddings=100, embedding_dim=4),
    ]
    plan = {"remote": ps_placement(4), "near": local_placement(100, 4)}
    out = {}
    for k in (0, 2):
        hybrid = HybridEmbeddingBagCollection(configs, plan, ps=client, staleness=k)
        model = _Net(hybrid)
        head = model.head
        data = SyntheticClicks(Teacher(features=("r", "n"), rows=500, seed=k), batch_size=64, num_batches=30)
        loop = TrainLoop(model, hybrid, torch.optim.SGD(head.parameters(), lr=0.1))
        gauges = [s.staleness for s in loop.run(iter(data))]
        hybrid.flush()
        out[k] = {"gauges": gauges, "max": hybrid.staleness_max_seen, "pending": hybrid.pending_pushes}
    # Prefetching K + 1 batches before any backward pass would break the bound.
    hybrid = HybridEmbeddingBagCollection(configs, plan, ps=client, staleness=1)
    batches = [
        SyntheticClicks(Teacher(features=("r", "n"), rows=50), batch_size=4, num_batches=3).batch(i) for i in range(3)
    ]
    hybrid.prefetch(batches[0].sparse)
    hybrid.prefetch(batches[1].sparse)
    try:
        hybrid.prefetch(batches[2].sparse)
        out["too_far"] = None
    except StalenessError as err:
        out["too_far"] = str(err)
    try:
        hybrid(batches[1].sparse)
        out["out_of_order"] = None
    except StalenessError as err:
        out["out_of_order"] = str(err)
    # K = 0: an eval forward right after a step reads that step's update (pushes are slowed down by 30 ms here).
    sgd = SparseOptimizer(Optimizer.SGD, learning_rate=0.5)
    fresh = [EmbeddingBagConfig(name="evaluated", feature_names=["e"], num_embeddings=1000, embedding_dim=4)]
    hybrid = HybridEmbeddingBagCollection(fresh, {"evaluated": ps_placement(4)}, ps=client, staleness=0, optimizer=sgd)
    one = KeyedJaggedTensor(keys=["e"], values=torch.tensor([123]), lengths=torch.tensor([1]))
    trained = hybrid(one).values()
    trained.sum().backward()  # gradient 1 for each of the row's values: SGD moves them by -0.5
    hybrid.eval()
    out["eval_after_step"] = (trained.detach(), hybrid(one).values())
    # A batch without a table's feature is refused by prefetch (TrainLoop's first call on a batch) in one line.
    hybrid.train()
    try:
        hybrid.prefetch(KeyedJaggedTensor(keys=["x"], values=torch.tensor([1]), lengths=torch.tensor([1])))
        out["prefetch_missing"] = None
    except PlannerError as err:
        out["prefetch_missing"] = str(err)
    hybrid.eval()
    # With several trainers the last step's update waits for a collective: evaluating before flush() is refused.
    hybrid._stashed[hybrid._backward_through] = {}
    try:
        hybrid(one)
        out["eval_unsent"] = None
    except StalenessError as err:
        out["eval_unsent"] = str(err)
    return out


@pytest.mark.timeout(300)
def test_bounded_staleness_gauge_and_misuse():
    (result,) = local_cluster(1, 1, _staleness_scenarios, None, delay_ms=30.0, timeout_s=30.0)
    assert set(result[0]["gauges"]) == {0} and result[0]["max"] == 0
    # With 30 ms per PS call and compute far below that, the prefetcher runs up to the bound: K = 2 is reached.
    assert max(result[2]["gauges"]) == 2 == result[2]["max"], result[2]["gauges"]
    assert result[0]["pending"] == result[2]["pending"] == 0
    assert "cannot prefetch batch 2" in result["too_far"] and "needs the gradients of batch 0" in result["too_far"]
    assert "every PS table's pooled output must reach the loss" in result["too_far"]  # the other way to get here
    assert "different batch than the next prefetched one" in result["out_of_order"]
    trained, evaluated = result["eval_after_step"]
    assert torch.equal(evaluated, trained - 0.5)
    assert "call flush() on every trainer before eval()" in result["eval_unsent"]
    assert result["prefetch_missing"].startswith("features ['e'] of the embedding tables are not keys")


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
    "c4": local_placement(50, 8, Tier.DDR),
    "c5": local_placement(100, 8, Tier.HBM_CACHE),
}


@pytest.mark.timeout(600)
def test_k0_equals_torchrec_ebc_plus_ddp_step_by_step():
    from persia_planner.modules.verify import compare_with_torchrec

    sync = compare_with_torchrec(SMALL, SMALL_PLAN, steps=8, trainers=2, servers=2, batch_size=64, learning_rate=3.0)
    assert len(sync["hybrid"]) == 2 and all(len(h) == 8 for h in sync["hybrid"])
    assert sync["max_abs_diff"] <= 1e-6, sync
    # the two trainers saw different batches, and training moved: the match is not two copies of one constant
    assert sync["hybrid"][0] != sync["hybrid"][1]
    assert sync["hybrid"][0][-1] < sync["hybrid"][0][0] - 0.05


@pytest.mark.timeout(600)
def test_k0_with_rowwise_adagrad_is_one_synchronous_update_per_step():
    # The trainers gather their PS gradients and push each id once: Adagrad's accumulator sees the step's averaged
    # gradient, as TorchRec's RowWiseAdagrad under DDP does (separate pushes per trainer would not match).
    from persia_planner.modules.verify import compare_with_torchrec

    sync = compare_with_torchrec(
        SMALL,
        SMALL_PLAN,
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
