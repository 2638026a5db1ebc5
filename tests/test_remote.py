"""RemoteEmbeddingBags (the PS tables of a HybridEmbeddingBagCollection): the K = 0 gathered update, bounded
staleness and its gauge, and misuse of the step protocol."""

from __future__ import annotations

import weakref

import pytest
import torch
from plans import local_placement, ps_placement
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import PlannerError
from persia_planner.model.specs import Optimizer
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer, StalenessError
from persia_planner.modules.launcher.launch import local_cluster


def test_adam_for_ps_tables_is_the_servers_adam():
    from persia_planner.modules.ps import optim as ps_optim

    adam = SparseOptimizer(Optimizer.ADAM, learning_rate=0.01, eps=1e-6, beta1=0.8, beta2=0.99).ps()
    assert adam == ps_optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6)


def test_gathered_rows_unpack_ids_and_gradients_also_when_empty():
    from persia_planner.modules.embedding.remote import unpack_rows

    ids, grads = torch.tensor([-1, 2**62 + 5, 7]), torch.randn(3, 4)
    packed = torch.cat([ids.view(torch.float32).view(-1, 2), grads], dim=1)
    got_ids, got_grads = unpack_rows(packed)
    assert torch.equal(got_ids, ids) and torch.equal(got_grads, grads)
    # K = 0 with several trainers, a table no trainer has an id of in this step
    got_ids, got_grads = unpack_rows(torch.empty(0, 6))
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

    from persia_planner.modules.launcher.launch import trainers_store

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


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_k0_gathers_int32_ids_and_every_backward_through_a_forward():
    """The gathered K = 0 update packs ids as 8 bytes (int32 ids broke it) and sums every backward pass of a step
    (a second one replaced the first), as the local tables and K > 0 do."""
    moved = local_cluster(1, 2, _k0_int32_ids_two_backwards, None, timeout_s=30.0)
    # Sum pooling: id 5 twice, id 7 once; gradients 1 + 2, averaged over two identical trainers; SGD lr 1.
    torch.testing.assert_close(torch.tensor(moved), torch.tensor([[[6.0] * 4, [3.0] * 4]] * 2), rtol=0, atol=1e-5)


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
        client.drop("remote")  # the next collection starts from fresh rows (it would be refused on trained ones)
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
    return out


@pytest.mark.processes
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
    assert result["prefetch_missing"].startswith("features ['e'] of the embedding tables are not keys")


# ---- without servers: a client answering in this process ----------------------------------------------------------
class _InProcessPs:
    """The part of a ``PsClient`` the PS tables use, answering at once: rows of ones, pushes acknowledged.
    ``answered`` holds a weak reference to every answer."""

    def __init__(self) -> None:
        self.answered: list[weakref.ref] = []

    def register(self, config) -> None:
        self.dim = config.dim

    def lookup_async(self, table: str, ids: torch.Tensor, train: bool = True) -> torch.futures.Future:
        rows = torch.ones(ids.numel(), self.dim)
        self.answered.append(weakref.ref(rows))
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(rows)
        return fut

    def push_gradients_async(
        self, table: str, ids: torch.Tensor, grads: torch.Tensor, *, optimizer=None
    ) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def flush(self) -> None:
        pass


def test_a_trained_batch_leaves_nothing_behind():
    """Once a step's pushes are acknowledged its rows and batch are freed by reference counting alone: a gradient
    hook that held the batch made a cycle through its row futures that Python's collector cannot see, and a soak
    run's trainers grew by every step's rows (about 2 MB a step, benchmarks/soak.py)."""
    import gc

    from persia_planner.modules.embedding.remote import RemoteEmbeddingBags
    from persia_planner.modules.ps import optim as ps_optim

    ps = _InProcessPs()
    configs = [EmbeddingBagConfig(name="t", feature_names=["a"], num_embeddings=100, embedding_dim=4)]
    remote = RemoteEmbeddingBags(configs, ps, optimizer=ps_optim.SGD(lr=0.1), staleness=1)
    gc.collect()
    gc.disable()  # what a cycle would keep alive must show: nothing here may wait for the collector
    try:
        for step in range(3):
            batch = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 2, step]), lengths=torch.tensor([2, 1]))
            remote(batch)["a"].sum().backward()
        remote.flush()
        assert remote.pending_pushes == 0
        assert len(ps.answered) == 3 and [r() is None for r in ps.answered] == [True] * 3
    finally:
        gc.enable()
