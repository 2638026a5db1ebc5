"""HybridEmbeddingBagCollectionSharder: a user's own model goes through ``DistributedModelParallel`` as TorchRec
users write it, the plan found by ``to_sharding_plan(plan, model, topology)``, the PS tables on the servers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plans import TOPO_1X2, local_placement, ps_placement
from torch import nn

from persia_planner.kinds import Sharding
from persia_planner.placement.shards import Shard, TablePlacement
from persia_planner.tiers import Tier
from persia_planner.topology.graph import Topology

TOPOLOGY = Topology.from_dict(TOPO_1X2)
DIM = 8


def _plan() -> dict[str, TablePlacement]:
    """The user tower's ids on the servers, its country table local (table-wise), the items row-wise over both."""
    gpus = [g.name for g in TOPOLOGY.gpus]
    items = TablePlacement(
        Sharding.ROW_WISE,
        tuple(Shard(g, Tier.HBM, (0, DIM), 30 * DIM * 4, rows=(30 * k, 30 * (k + 1))) for k, g in enumerate(gpus)),
    )
    return {"user": ps_placement(DIM, servers=2), "country": local_placement(10, DIM), "item": items}


class TwoTower(nn.Module):
    """A retrieval model of one's own: one collection for both towers' features, a dot product of the towers."""

    def __init__(self, collection: nn.Module) -> None:
        super().__init__()
        self.ebc = collection
        self.user_tower = nn.Linear(2 * DIM, DIM)
        self.item_tower = nn.Linear(DIM, DIM)

    def forward(self, features, labels: torch.Tensor) -> torch.Tensor:
        pooled = self.ebc(features)
        user = self.user_tower(torch.cat([pooled["user"], pooled["country"]], dim=1))
        item = self.item_tower(pooled["item"])
        logits = (user * item).sum(dim=1)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _batch(step: int, rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1000 * step + rank)
    users, countries, items = (torch.randint(0, n, (16,), generator=gen) for n in (50, 10, 60))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["user", "country", "item"], torch.cat([users, countries, items]), torch.ones(48, dtype=torch.int32)
    )
    return kjt, ((users + items) % 2).float()


def _train(rank: int, client, steps: range, checkpoint: str, resume: bool) -> list[float]:
    """Train ``steps`` of the two-tower model; resume from ``checkpoint`` first, or save into it at the end."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from persia_planner.model.specs import Optimizer
    from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
    from persia_planner.modules.embedding.sharder import HybridEmbeddingBagCollectionSharder
    from persia_planner.plan.torchrec_export import to_sharding_plan

    configs = [
        EmbeddingBagConfig(num_embeddings=rows, embedding_dim=DIM, name=name, feature_names=[name])
        for name, rows in (("user", 50), ("country", 10), ("item", 60))
    ]
    plan = _plan()
    sgd = SparseOptimizer(Optimizer.SGD, learning_rate=0.3)
    collection = HybridEmbeddingBagCollection(configs, plan, ps=client, optimizer=sgd, local_device="meta")
    torch.manual_seed(0)
    model = TwoTower(collection)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"),
        plan=to_sharding_plan(plan, model, TOPOLOGY),
        sharders=[HybridEmbeddingBagCollectionSharder()],
    )
    dense = [p for n, p in dmp.named_parameters() if "ebc." not in n]
    opt = torch.optim.SGD(dense, lr=0.3)
    path = Path(checkpoint)
    if resume:
        state = torch.load(path / "model.pt", weights_only=True)
        model.user_tower.load_state_dict(state["user_tower"])
        model.item_tower.load_state_dict(state["item_tower"])
        collection.load_local_weights(state["tables"])
        if rank == 0:
            client.load(path / "ps")
        dist.barrier()
    losses = []
    for step in steps:
        kjt, labels = _batch(step, rank)
        loss = dmp(kjt, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    collection.flush()  # K = 0: the last step's gathered PS update is sent and applied on every server
    tables = collection.local_weights(dst=0)
    if not resume and rank == 0:
        towers = {"user_tower": model.user_tower.state_dict(), "item_tower": model.item_tower.state_dict()}
        torch.save({**towers, "tables": tables}, path / "model.pt")
        client.save(path / "ps")
    dist.barrier()
    return losses


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_two_tower_model_shards_with_the_sharder_and_resumes_exactly(tmp_path):
    """2 trainers and 2 servers, K = 0: 6 steps straight equal 3 steps, a checkpoint, fresh processes and servers
    loading it, and 3 more, loss for loss."""
    from persia_planner.modules.train import run_trainers

    (tmp_path / "whole").mkdir()
    (tmp_path / "half").mkdir()
    whole = run_trainers(_train, range(6), str(tmp_path / "whole"), False, trainers=2, servers=2)
    first = run_trainers(_train, range(3), str(tmp_path / "half"), False, trainers=2, servers=2)
    rest = run_trainers(_train, range(3, 6), str(tmp_path / "half"), True, trainers=2, servers=2)
    for rank in (0, 1):
        assert first[rank] == whole[rank][:3]
        assert rest[rank] == whole[rank][3:]  # bit for bit
    assert whole[0][-1] != whole[0][0]
