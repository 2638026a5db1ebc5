"""--sparse-weight-decay: the local tables' rows (fused fbgemm tables and data-parallel replicas) decay with the
parameter servers' formula, ``w * (1 - lr * wd) - lr * update(g)``, on the rows a step touches only."""

from __future__ import annotations

import pytest
import torch
from local_and_ps import near_and_far
from plans import TOPO_1X1, local_placement, replicated
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import PlannerError
from persia_planner.model.specs import Optimizer
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
from persia_planner.modules.embedding.model_parallel import data_parallel_tables, distribute, sparse_torch_optimizer
from persia_planner.modules.embedding.row_decay import touched_rows
from persia_planner.modules.launcher.launch import local_cluster
from persia_planner.modules.ps import optim as ps_optim
from persia_planner.topology.graph import Topology

LR, WD, EPS = 0.1, 0.5, 1e-8
ROWS, DIM = 20, 4
# The same ids in each feature: "a" reads the fused table, "b" the replica (or the PS table), "c" the other one.
IDS = [[3, 5], [5], [], [11, 3, 3]]


def kjt(keys: list[str]) -> KeyedJaggedTensor:
    lengths = [len(bag) for _ in keys for bag in IDS]
    values = [i for _ in keys for bag in IDS for i in bag]
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(values), lengths=torch.tensor(lengths))


def expected_rows(before: torch.Tensor, grad: torch.Tensor, kind: Optimizer) -> torch.Tensor:
    """The table after one step, by the formula written out: touched rows decay, then take the update."""
    touched = grad.ne(0).any(dim=1)
    if kind is Optimizer.SGD:
        update = grad
    elif kind is Optimizer.ADAGRAD:  # from a zero accumulator
        update = grad / (grad.abs() + EPS)
    else:  # row-wise Adagrad from a zero accumulator
        update = grad / (grad.square().mean(dim=1, keepdim=True).sqrt() + EPS)
    after = before * (1 - LR * WD) - LR * update
    return torch.where(touched.unsqueeze(1), after, before)


def row_grad(upstream: torch.Tensor) -> torch.Tensor:
    """The gradient of each row of a sum-pooled table read by :data:`IDS` with output gradient ``upstream``."""
    grad = torch.zeros(ROWS, DIM)
    for bag, ids in enumerate(IDS):
        for i in ids:
            grad[i] += upstream[bag]
    return grad


def test_touched_rows_are_the_ids_each_table_reads():
    # features 0 and 2 read table 0, feature 1 table 1; 2 bags each
    indices = torch.tensor([4, 4, 1, 7, 2, 4, 9], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 3, 4, 4, 6, 7])
    rows = touched_rows(indices, offsets, [0, 1, 0])
    assert rows[0].tolist() == [4, 4, 1, 2, 4, 9] and rows[1].tolist() == [7]
    # variable batch: feature 0 has 1 bag, feature 1 has 3 (over two ranks)
    rows = touched_rows(indices[:5], torch.tensor([0, 2, 3, 4, 5]), [0, 1], [[1], [1, 2]])
    assert rows[0].tolist() == [4, 4] and rows[1].tolist() == [1, 7, 2]


@pytest.mark.parametrize("kind", [Optimizer.ROWWISE_ADAGRAD, Optimizer.SGD, Optimizer.ADAGRAD])
def test_fused_and_replicated_rows_decay_with_the_servers_formula(one_trainer, kind):
    configs = [
        EmbeddingBagConfig(name="fused", feature_names=["a"], num_embeddings=ROWS, embedding_dim=DIM),
        EmbeddingBagConfig(name="rep", feature_names=["b"], num_embeddings=ROWS, embedding_dim=DIM),
    ]
    plan = {"fused": local_placement(ROWS, DIM), "rep": replicated(ROWS, DIM, 1)}
    sparse = SparseOptimizer(kind, learning_rate=LR, eps=EPS, weight_decay=WD)
    hybrid = HybridEmbeddingBagCollection(configs, plan, optimizer=sparse, local_device=torch.device("meta"))
    net = distribute(hybrid, plan, Topology.from_dict(TOPO_1X1))
    replica_opt = sparse_torch_optimizer(
        kind, list(data_parallel_tables(hybrid).values()), lr=LR, eps=EPS, weight_decay=WD
    )
    before = hybrid.local_weights()
    upstream = torch.randn(len(IDS), 2 * DIM, generator=torch.Generator().manual_seed(0))
    out = net(kjt(["a", "b"]))
    (out.values() * upstream).sum().backward()
    replica_opt.step()
    after = hybrid.local_weights()
    for name, columns in (("fused", slice(0, DIM)), ("rep", slice(DIM, 2 * DIM))):
        grad = row_grad(upstream[:, columns])
        torch.testing.assert_close(after[name], expected_rows(before[name], grad, kind), rtol=0, atol=1e-6)
        # the servers' row optimizer on the same rows gives the same values
        ids = grad.ne(0).any(dim=1).nonzero().squeeze(1)
        ps = sparse.ps()
        stepped, _ = ps.step(before[name][ids], ps.init_state(len(ids), DIM), grad[ids])
        torch.testing.assert_close(after[name][ids], stepped, rtol=0, atol=1e-6)
    untouched = [i for i in range(ROWS) if i not in {3, 5, 11}]
    assert torch.equal(after["fused"][untouched], before["fused"][untouched])
    assert torch.equal(after["rep"][untouched], before["rep"][untouched])
    # an evaluation touches nothing
    net.eval()
    with torch.no_grad():
        net(kjt(["a", "b"]))
    net.train()
    out = net(kjt(["a", "b"]))
    assert torch.equal(hybrid.local_weights()["fused"], after["fused"])


def test_the_decay_follows_the_rate_fbgemm_holds(one_trainer):
    """A scheduled rate (the fused optimizer's param group, set in fbgemm at its step) is the decay's rate too."""
    configs = [EmbeddingBagConfig(name="fused", feature_names=["a"], num_embeddings=ROWS, embedding_dim=DIM)]
    plan = {"fused": local_placement(ROWS, DIM)}
    sparse = SparseOptimizer(Optimizer.SGD, learning_rate=LR, weight_decay=WD)
    hybrid = HybridEmbeddingBagCollection(configs, plan, optimizer=sparse, local_device=torch.device("meta"))
    net = distribute(hybrid, plan, Topology.from_dict(TOPO_1X1))
    for group in net.fused_optimizer.param_groups:
        group["lr"] = LR / 4
    net.fused_optimizer.step()  # TorchRec's fused optimizer hands its rate to fbgemm here
    before = hybrid.local_weights()["fused"]
    upstream = torch.randn(len(IDS), DIM, generator=torch.Generator().manual_seed(1))
    (net(kjt(["a"])).values() * upstream).sum().backward()
    grad = row_grad(upstream)
    expected = torch.where(grad.ne(0).any(dim=1, keepdim=True), before * (1 - LR / 4 * WD) - LR / 4 * grad, before)
    torch.testing.assert_close(hybrid.local_weights()["fused"], expected, rtol=0, atol=1e-6)


def test_weight_decay_out_of_range_is_one_line():
    with pytest.raises(PlannerError, match=r"weight_decay must be in \[0, 1 / learning_rate\)"):
        SparseOptimizer(learning_rate=0.1, weight_decay=10.0)
    with pytest.raises(PlannerError, match="weight_decay"):
        SparseOptimizer(weight_decay=float("nan"))
    assert SparseOptimizer(learning_rate=0.1, weight_decay=0.5).ps().decoupled_weight_decay == 0.5


def test_the_row_optimizers_decay_before_their_update():
    weights = torch.tensor([[2.0, -1.0]])
    grads = torch.tensor([[1.0, 1.0]])
    for opt in (
        ps_optim.SGD(lr=0.05, decoupled_weight_decay=0.1),
        ps_optim.Adagrad(lr=0.05, eps=0.0, decoupled_weight_decay=0.1),
        ps_optim.RowWiseAdagrad(lr=0.05, eps=0.0, decoupled_weight_decay=0.1),
    ):
        new, state = opt.step(weights, opt.init_state(1, 2), grads)
        # the update of a unit gradient from a zero accumulator is 1 for each: 2 * 0.995 - 0.05, -1 * 0.995 - 0.05
        torch.testing.assert_close(new, torch.tensor([[1.94, -1.045]]), rtol=0, atol=1e-6)
        if state.numel():  # the accumulator sees the gradient alone (decision 0023's L2 grew it)
            assert torch.allclose(state, torch.ones_like(state))
    adam = ps_optim.Adam(lr=0.05, decoupled_weight_decay=0.1)
    plain = ps_optim.Adam(lr=0.05)
    new, _ = adam.step(weights, adam.init_state(1, 2), grads)
    ref, _ = plain.step(weights, plain.init_state(1, 2), grads)
    torch.testing.assert_close(new, ref - 0.05 * 0.1 * weights, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        ps_optim.SGD(decoupled_weight_decay=-1.0)


# ---- a local and a PS table, side by side -----------------------------------------------------------------------


def _local_and_ps(j: int, client, kind: str) -> dict[str, float]:
    import datetime

    import torch.distributed as dist

    from persia_planner.modules.launcher.launch import trainers_store

    dist.init_process_group("gloo", store=trainers_store(), rank=j, world_size=1, timeout=datetime.timedelta(60))
    try:
        sparse = SparseOptimizer(Optimizer(kind), learning_rate=LR, eps=EPS, weight_decay=WD)
        hybrid, net, start = near_and_far(client, sparse, ROWS, DIM)  # the PS table starts where the local one does
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            upstream = torch.randn(len(IDS), DIM, generator=gen)
            out = net(kjt(["a", "b"])).values()
            (out * upstream.repeat(1, 2)).sum().backward()  # both tables get the same gradients
        hybrid.flush()
        near = hybrid.local_weights()["near"]
        far = client.read_rows("far", torch.arange(ROWS))
        return {
            "diff": float((near - far).abs().max()),
            "moved": float((near - start).abs().max()),
            "untouched_moved": float((near[[0, 1, 2]] - start[[0, 1, 2]]).abs().max()),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "sgd"])
def test_a_local_and_a_ps_table_decay_alike(kind):
    (result,) = local_cluster(1, 1, _local_and_ps, kind, timeout_s=30.0)
    assert result["diff"] <= 1e-6 and result["moved"] > 1e-2 and result["untouched_moved"] == 0.0, result
