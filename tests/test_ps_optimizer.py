"""The PS tables inside TorchRec's optimizer: an LR scheduler on ``dmp.fused_optimizer`` moves a PS table as it moves
a local one, DCP saves and restores the servers' optimizer state exactly, and the keys are TorchRec's. Also the
collection's rules around them: cold ids read alike everywhere, a no-grad forward in train mode, a second collection
on a client that holds the table, and one after the first released it."""

from __future__ import annotations

import pytest
import torch
from plans import TOPO_1X1, local_placement, ps_placement
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.model.specs import Optimizer

CONFIGS = [
    EmbeddingBagConfig(name="near", feature_names=["a"], num_embeddings=10, embedding_dim=4),
    EmbeddingBagConfig(name="far", feature_names=["b"], num_embeddings=10, embedding_dim=4),
]
PLAN = {"near": local_placement(10, 4), "far": ps_placement(4)}


def _batch(ids: list[int]) -> KeyedJaggedTensor:
    """The same ids for the local table's feature and the PS table's: both get the same gradient."""
    values = torch.tensor(ids + ids)
    return KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=torch.ones(2 * len(ids), dtype=torch.int64))


class _Model(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


def _sharded(client, kind: Optimizer, lr: float):
    from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
    from persia_planner.modules.embedding.model_parallel import distribute
    from persia_planner.topology.graph import Topology

    hybrid = HybridEmbeddingBagCollection(
        CONFIGS, PLAN, ps=client, optimizer=SparseOptimizer(kind, learning_rate=lr), local_device=torch.device("meta")
    )
    return distribute(_Model(hybrid), PLAN, Topology.from_dict(TOPO_1X1)), hybrid


def _step(dmp, hybrid, ids: list[int]) -> None:
    dmp(_batch(ids)).sum().backward()
    hybrid.flush()


def _rows(hybrid, client) -> tuple[torch.Tensor, torch.Tensor]:
    every = torch.arange(10)
    return hybrid.local_weights()["near"].clone(), client.read_rows("far", every)


def _schedule(rank: int, client, kind: str) -> list[tuple[float, float]]:
    """Three steps under ``LambdaLR(dmp.fused_optimizer, 1, 0.5, 0)``: each step's largest move of the local table and
    of the PS table."""
    dmp, hybrid = _sharded(client, Optimizer(kind), lr=0.5)
    factors = [1.0, 0.5, 0.0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(dmp.fused_optimizer, lambda s: factors[min(s, 2)])
    moves = []
    for _ in factors:
        near, far = _rows(hybrid, client)
        _step(dmp, hybrid, [1, 2, 2, 5])
        near_after, far_after = _rows(hybrid, client)
        moves.append((float((near_after - near).abs().max()), float((far_after - far).abs().max())))
        scheduler.step()
    return moves


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_an_lr_scheduler_on_the_fused_optimizer_moves_ps_tables_as_local_ones(kind):
    from persia_planner.modules.train import run_trainers

    (moves,) = run_trainers(_schedule, kind, trainers=1, servers=1)
    (full_near, full_far), (half_near, half_far), (frozen_near, frozen_far) = moves
    assert full_near > 1e-2 and abs(full_far - full_near) <= 1e-6, moves
    assert abs(half_near - full_near / 2) <= 1e-6 if kind == "sgd" else half_near > 0, moves
    assert abs(half_far - half_near) <= 1e-6, moves
    assert frozen_near == 0.0 and frozen_far == 0.0, moves


def _checkpoint(rank: int, client, directory: str) -> dict:
    """Keys, then a DCP save, two more steps, a DCP load: the state and the next step are the saved ones'."""
    import torch.distributed.checkpoint as dcp

    dmp, hybrid = _sharded(client, Optimizer.ROWWISE_ADAGRAD, lr=0.3)
    optimizer = dmp.fused_optimizer
    out: dict = {
        "keys": sorted(optimizer.params),
        "groups": [(g["params"][0].shape, g["lr"]) for g in optimizer.param_groups],
    }
    _step(dmp, hybrid, [1, 2, 2, 5])
    saved = optimizer.state_dict()["state"]["ebc.embedding_bags.far.weight"]["far.momentum1"]
    out["state_keys"] = {k: sorted(v) for k, v in optimizer.state_dict()["state"].items()}
    out["trained_rows"] = int((saved != 0).sum())
    dcp.save({"model": dmp.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=directory)
    _step(dmp, hybrid, [0, 1, 7])
    after_save = _rows(hybrid, client)
    _step(dmp, hybrid, [2, 3])
    state = {"model": dmp.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    dmp.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    restored = optimizer.state_dict()["state"]["ebc.embedding_bags.far.weight"]["far.momentum1"]
    out["state_diff"] = float((restored - saved).abs().max())
    _step(dmp, hybrid, [0, 1, 7])  # the step taken right after the save, again: it ends where that one did
    again = _rows(hybrid, client)
    out["replay_diff"] = max(float((a - b).abs().max()) for a, b in zip(again, after_save, strict=True))
    return out


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_dcp_saves_and_restores_the_servers_optimizer_state_under_torchrec_keys(tmp_path):
    from persia_planner.modules.train import run_trainers

    (out,) = run_trainers(_checkpoint, str(tmp_path / "dcp"), trainers=1, servers=1)
    assert out["keys"] == ["ebc.embedding_bags.far.weight", "ebc.embedding_bags.near.weight"], out
    assert out["state_keys"] == {
        "ebc.embedding_bags.far.weight": ["far.momentum1"],
        "ebc.embedding_bags.near.weight": ["near.momentum1"],
    }, out
    assert (torch.Size([10, 4]), 0.3) in out["groups"], out  # the PS table's own group, with its rate
    assert out["trained_rows"] == 3, out  # ids 1, 2, 5 have accumulators; the other rows read as new ones (0)
    assert out["state_diff"] == 0.0 and out["replay_diff"] <= 1e-7, out


def _rules(rank: int, client) -> dict:
    from persia_planner.errors import PlannerError
    from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection

    hybrid = HybridEmbeddingBagCollection(CONFIGS, PLAN, ps=client)
    out: dict = {}
    # A no-grad forward in train mode completes its batch: the next steps go on.
    with torch.no_grad():
        hybrid(_batch([1, 2]))
    for ids in ([1, 3], [4, 2]):
        hybrid(_batch(ids)).values().sum().backward()
    hybrid.flush()
    out["pending"] = hybrid.pending_pushes
    # Cold ids: id 9 was never trained; eval, the state dict and the servers' read agree on it.
    hybrid.eval()
    with torch.no_grad():
        pooled = hybrid(_batch([9])).values()[0, 4:]
    exported = hybrid.state_dict()["embedding_bags.far.weight"][9]
    out["cold_eval_vs_state_dict"] = float((pooled - exported).abs().max())
    out["cold_nonzero"] = float(exported.abs().max())
    try:
        HybridEmbeddingBagCollection(CONFIGS, PLAN, ps=client)
        out["second"] = ""
    except PlannerError as err:
        out["second"] = str(err)
    # Released (a migration, on every trainer), the table takes a new collection while the first is still alive.
    assert hybrid.remote is not None
    hybrid.remote.release()
    try:
        HybridEmbeddingBagCollection(CONFIGS, PLAN, ps=client)
        out["after_release"] = ""
    except PlannerError as err:
        out["after_release"] = str(err)
    return out


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_cold_ids_no_grad_forward_and_a_second_collection_on_the_client():
    from persia_planner.modules.train import run_trainers

    (out,) = run_trainers(_rules, trainers=1, servers=1)
    assert out["pending"] == 0, out
    assert out["cold_eval_vs_state_dict"] == 0.0 and out["cold_nonzero"] > 0, out
    assert "PS table 'far' is already registered on this client" in out["second"], out
    assert "\n" not in out["second"].split(" (fix")[0], out
    assert out["after_release"] == "", out
