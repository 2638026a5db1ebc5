"""LocalEmbeddingBags: the local tables in TorchRec's sharded EmbeddingBagCollection (one trainer here; two trainers
and every sharding type in test_distributed.py) give TorchRec's values, updates and checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plans import TOPO_1X1, local_placement, replicated
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import PlannerError
from persia_planner.model.specs import Optimizer
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
from persia_planner.modules.embedding.local import LocalEmbeddingBags
from persia_planner.modules.embedding.model_parallel import distribute, sparse_torch_optimizer
from persia_planner.tiers import Tier
from persia_planner.topology.graph import Topology

CONFIGS = [
    EmbeddingBagConfig(name="t0", feature_names=["a", "b"], num_embeddings=50, embedding_dim=4),
    EmbeddingBagConfig(name="t1", feature_names=["c"], num_embeddings=30, embedding_dim=8),
    EmbeddingBagConfig(name="t2", feature_names=["d"], num_embeddings=20, embedding_dim=4),
]


def sharded(configs=CONFIGS, optimizer: SparseOptimizer | None = None, *, is_weighted: bool = False, dp=()):
    """A collection of ``configs`` sharded by DMP on one trainer: table-wise, or data-parallel for ``dp``."""
    plan = {
        c.name: replicated(c.num_embeddings, c.embedding_dim, 1)
        if c.name in dp
        else local_placement(c.num_embeddings, c.embedding_dim)
        for c in configs
    }
    hybrid = HybridEmbeddingBagCollection(
        configs, plan, optimizer=optimizer, is_weighted=is_weighted, local_device=torch.device("meta")
    )
    return distribute(hybrid, plan, Topology.from_dict(TOPO_1X1)), hybrid


def random_kjt(gen: torch.Generator, keys: list[str], batch: int, high: int, low: int = 0) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    values = torch.randint(low, high, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def weighted_kjt(gen: torch.Generator, keys: list[str], batch: int, high: int) -> KeyedJaggedTensor:
    kjt = random_kjt(gen, keys, batch, high)
    weights = torch.rand(kjt.values().numel(), generator=gen) * 4 - 2  # negative ones too
    return KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(), weights=weights)


def reference_from(hybrid: HybridEmbeddingBagCollection, configs=CONFIGS) -> EmbeddingBagCollection:
    ref = EmbeddingBagCollection(tables=configs, is_weighted=hybrid.is_weighted())
    ref.load_state_dict({f"embedding_bags.{k}.weight": v for k, v in hybrid.local_weights().items()})
    return ref


@pytest.mark.parametrize("dp", [(), ("t1",)], ids=["fused", "with-data-parallel"])
def test_sharded_tables_match_torchrec_ebc_through_sgd_steps(one_trainer, dp):
    net, hybrid = sharded(optimizer=SparseOptimizer(Optimizer.SGD, learning_rate=0.5), dp=dp)
    replicas = [p for n, p in hybrid.local.named_parameters() if "t1" in n] if dp else []
    dp_opt = sparse_torch_optimizer(Optimizer.SGD, replicas, lr=0.5, eps=1e-8) if replicas else None
    ref = reference_from(hybrid)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        # keys in another order than the tables, plus a key no table reads
        kjt = random_kjt(gen, ["d", "x", "c", "a", "b"], batch=6, high=20)
        out, expected = net(kjt), ref(kjt)
        assert out.keys() == expected.keys() == ["a", "b", "c", "d"]
        assert out.length_per_key() == [4, 4, 8, 4]
        torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=1e-6)
        weights = torch.randn(out.values().shape, generator=gen)
        (out.values() * weights).sum().backward()
        (expected.values() * weights).sum().backward()
        opt.step()
        opt.zero_grad()
        if dp_opt is not None:
            dp_opt.step()
            dp_opt.zero_grad()
    initial = HybridEmbeddingBagCollection(CONFIGS).local_weights()
    for name, weight in hybrid.local_weights().items():
        torch.testing.assert_close(weight, ref.embedding_bags[name].weight.detach(), rtol=0, atol=1e-6)
        assert not torch.equal(weight, initial[name])  # every table trained
    assert hybrid.local.executed()["t1"].sharding == ("data_parallel" if dp else "table_wise")


def test_sharded_rowwise_adagrad_matches_torchrec_rowwise_adagrad(one_trainer):
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    configs = [EmbeddingBagConfig(name="t", feature_names=["f"], num_embeddings=40, embedding_dim=8)]
    net, hybrid = sharded(configs, SparseOptimizer(learning_rate=0.1, eps=1e-8))
    ref = reference_from(hybrid, configs)
    opt = RowWiseAdagrad(ref.parameters(), lr=0.1, eps=1e-8)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        kjt = random_kjt(gen, ["f"], batch=8, high=40)
        target = torch.randn(8, 8, generator=gen)
        ((net(kjt).values() - target) ** 2).sum().backward()
        ((ref(kjt).values() - target) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(
        hybrid.local_weights()["t"], ref.embedding_bags["t"].weight.detach(), atol=1e-5, rtol=1e-5
    )


def test_unsharded_it_is_a_plain_torchrec_collection():
    """Before DMP the local part is TorchRec's own EmbeddingBagCollection, initialised as the sharded one is."""
    hybrid = HybridEmbeddingBagCollection(CONFIGS, seed=3)
    assert type(hybrid.local.ebc) is EmbeddingBagCollection and not hybrid.local.sharded
    assert sorted(hybrid.local.ebc.state_dict()) == [f"embedding_bags.t{i}.weight" for i in range(3)]
    again = HybridEmbeddingBagCollection(CONFIGS, seed=3).local_weights()
    for name, weight in hybrid.local_weights().items():
        assert torch.equal(weight, again[name])
        bound = (1.0 / weight.shape[0]) ** 0.5
        assert float(weight.abs().max()) <= bound


def test_a_torchrec_checkpoint_loads_into_the_sharded_tables_and_back(one_trainer):
    torch.manual_seed(7)
    theirs = EmbeddingBagCollection(tables=CONFIGS)
    net, hybrid = sharded(dp=("t2",))
    hybrid.local.load_torchrec_state_dict(theirs.state_dict())
    kjt = random_kjt(torch.Generator().manual_seed(8), ["a", "b", "c", "d"], batch=5, high=20)
    torch.testing.assert_close(net(kjt).values(), theirs(kjt).values(), rtol=0, atol=1e-6)
    back = EmbeddingBagCollection(tables=CONFIGS)
    back.load_state_dict(hybrid.local.torchrec_state_dict())  # TorchRec's keys, strict
    for key, value in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    with pytest.raises(PlannerError, match=r"local table 't1' has shape \(30, 8\), the state dict's is \(30, 4\)"):
        hybrid.local.load_torchrec_state_dict({"embedding_bags.t1.weight": torch.zeros(30, 4)}, strict=False)


def test_optimizer_state_of_another_optimizer_is_refused_before_anything_is_copied(one_trainer):
    _, rowwise = sharded(optimizer=SparseOptimizer(Optimizer.ROWWISE_ADAGRAD))
    saved = rowwise.local.optimizer_pieces()
    assert sorted({key[1] for key in saved}) == ["t0.momentum1", "t1.momentum1", "t2.momentum1"]
    for state in saved.values():
        state.fill_(7.0)
    rowwise.local.load_optimizer_pieces(saved)  # its own optimizer's state loads
    assert all(bool((s == 7.0).all()) for s in rowwise.local.optimizer_pieces().values())
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _, adagrad = sharded(optimizer=SparseOptimizer(Optimizer.ADAGRAD))
    before = adagrad.local.optimizer_pieces()
    with pytest.raises(PlannerError, match=r"no optimizer state 't0.momentum1' of shape \(50, 4\) at offset \[0, 0\]"):
        adagrad.local.load_optimizer_pieces({k: v.view(-1, 1).expand(-1, 4) for k, v in saved.items()})
    after = adagrad.local.optimizer_pieces()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_raw_ids_map_into_rows_like_a_hashed_ebc(one_trainer):
    net, hybrid = sharded()
    ref = reference_from(hybrid)
    gen = torch.Generator().manual_seed(2)
    kjt = random_kjt(gen, ["a", "b", "c", "d"], batch=5, high=2**62, low=-(2**62))
    rows = torch.tensor([50, 50, 30, 20])
    per_key = kjt.lengths().view(4, -1).sum(1)
    wrapped = KeyedJaggedTensor(
        keys=kjt.keys(), values=torch.remainder(kjt.values(), rows.repeat_interleave(per_key)), lengths=kjt.lengths()
    )
    torch.testing.assert_close(net(kjt).values(), ref(wrapped).values(), rtol=0, atol=1e-6)
    # uint64 ids (what the PS path accepts) map by their int64 bit patterns; int32 ids as their values.
    as_uint64 = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().view(torch.uint64), lengths=kjt.lengths())
    torch.testing.assert_close(net(as_uint64).values(), ref(wrapped).values(), rtol=0, atol=1e-6)
    narrow = random_kjt(gen, ["a", "b", "c", "d"], batch=5, high=2**31 - 1)
    as_int32 = KeyedJaggedTensor(keys=narrow.keys(), values=narrow.values().int(), lengths=narrow.lengths())
    torch.testing.assert_close(net(as_int32).values(), net(narrow).values(), rtol=0, atol=0)


def test_mean_pooling_matches(one_trainer):
    configs = [
        EmbeddingBagConfig(
            name="t", feature_names=["f", "g"], num_embeddings=30, embedding_dim=4, pooling=PoolingType.MEAN
        )
    ]
    net, hybrid = sharded(configs)
    ref = reference_from(hybrid, configs)
    kjt = random_kjt(torch.Generator().manual_seed(3), ["f", "g"], batch=7, high=30)
    torch.testing.assert_close(net(kjt).values(), ref(kjt).values())


def test_weighted_tables_match_torchrec_weighted_ebc_through_sgd_steps(one_trainer):
    net, hybrid = sharded(optimizer=SparseOptimizer(Optimizer.SGD, learning_rate=0.5), is_weighted=True)
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
        out = net(kjt)
        expected = ref(KeyedJaggedTensor(kjt.keys(), kjt.values().view(torch.int64), kjt.weights(), kjt.lengths()))
        torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=1e-6)
        grad = torch.randn(out.values().shape, generator=gen)
        (out.values() * grad).sum().backward()
        (expected.values() * grad).sum().backward()
        opt.step()
        opt.zero_grad()
    for name, weight in hybrid.local_weights().items():
        torch.testing.assert_close(weight, ref.embedding_bags[name].weight.detach(), rtol=0, atol=1e-6)
    # A weighted collection widens bfloat16 and float64 weights to float32 before pooling.
    kjt = weighted_kjt(gen, ["a", "b", "c", "d"], batch=3, high=20)
    halves = (kjt.weights() * 4).round() / 4  # exact in bfloat16
    wide = KeyedJaggedTensor(kjt.keys(), kjt.values(), halves, kjt.lengths())
    for dtype in (torch.bfloat16, torch.float64):
        other = KeyedJaggedTensor(kjt.keys(), kjt.values(), halves.to(dtype), kjt.lengths())
        torch.testing.assert_close(net(other).values(), net(wide).values(), rtol=0, atol=0)


def test_unweighted_tables_ignore_the_weights_a_batch_carries(one_trainer):
    net, _ = sharded()
    kjt = weighted_kjt(torch.Generator().manual_seed(12), ["a", "b", "c", "d"], batch=3, high=20)
    unweighted = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths())
    narrow = KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.weights().to(torch.bfloat16), kjt.lengths())
    torch.testing.assert_close(net(kjt).values(), net(unweighted).values(), rtol=0, atol=0)
    torch.testing.assert_close(net(narrow).values(), net(unweighted).values(), rtol=0, atol=0)


def test_dims_fbgemm_cannot_run_are_refused_before_sharding():
    """Unsharded, the collection is TorchRec's (torch's EmbeddingBag takes any dim); DMP's fbgemm kernels do not."""
    odd = [EmbeddingBagConfig(name="t", feature_names=["a"], num_embeddings=10, embedding_dim=6)]
    local = LocalEmbeddingBags(odd)
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([3, 12]), lengths=torch.tensor([1, 1]))
    assert local(kjt).values().shape == (2, 6)
    with pytest.raises(PlannerError, match=r"local tables \['t'\] have an embedding_dim that is not a multiple of 4"):
        local.check_shardable()


def test_unexecutable_tiers_are_refused_before_sharding(one_trainer):
    plan = {c.name: local_placement(c.num_embeddings, c.embedding_dim) for c in CONFIGS}
    plan["t1"] = local_placement(30, 8, Tier.HBM_CACHE)
    hybrid = HybridEmbeddingBagCollection(CONFIGS, plan, local_device=torch.device("meta"))
    with pytest.raises(PlannerError, match=r"table 't1' is planned on tier hbm_cache \(TorchRec kernel fused_uvm_c"):
        distribute(hybrid, plan, Topology.from_dict(TOPO_1X1))


def test_fp16_tables_keep_fp16_weights_in_fbgemm(one_trainer):
    from torchrec.modules.embedding_configs import DataType

    configs = [
        EmbeddingBagConfig(name=c.name, feature_names=c.feature_names, num_embeddings=c.num_embeddings,
                           embedding_dim=c.embedding_dim, data_type=DataType.FP16)
        for c in CONFIGS
    ]  # fmt: skip
    net, hybrid = sharded(configs, SparseOptimizer(Optimizer.SGD, learning_rate=0.5))
    assert {piece.dtype for _, _, piece, _ in hybrid.local.pieces()} == {torch.float16}
    ref = reference_from(hybrid)  # float32 copies of the fp16 weights
    kjt = random_kjt(torch.Generator().manual_seed(21), ["a", "b", "c", "d"], batch=6, high=20)
    out = net(kjt)
    torch.testing.assert_close(out.values(), ref(kjt).values(), rtol=0, atol=1e-3)
    before = hybrid.local_weights()
    out.values().sum().backward()
    after = hybrid.local_weights()
    assert all(not torch.equal(before[n], after[n]) for n in before)  # the fused fp16 update ran
