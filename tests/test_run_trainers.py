"""engine.run_trainers: your own training function in two trainers and a parameter server, one import."""

from __future__ import annotations

import pytest
import torch
from plans import TOPO_1X2, local_placement, ps_placement

from persia_planner.topology.graph import Topology

TOPOLOGY = Topology.from_dict(TOPO_1X2)


def _tower(rank: int, client, steps: int) -> dict:
    """A model of one's own: a local and a parameter-server table under DMP, trained a few SGD steps."""
    import torch.distributed as dist
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from persia_planner.model.specs import Optimizer
    from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
    from persia_planner.modules.embedding.model_parallel import distribute

    ranks = torch.tensor([rank])
    dist.all_reduce(ranks)  # the trainers' group is up
    configs = [EmbeddingBagConfig(num_embeddings=40, embedding_dim=4, name=n, feature_names=[n]) for n in ("a", "b")]
    plan = {"a": local_placement(40, 4), "b": ps_placement(4)}
    sgd = SparseOptimizer(Optimizer.SGD, learning_rate=0.5)
    ebc = HybridEmbeddingBagCollection(configs, plan, ps=client, staleness=0, optimizer=sgd, local_device="meta")
    net = distribute(ebc, plan, TOPOLOGY)
    before = client.lookup("b", torch.arange(10)).clone()
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(10 * step + rank)
        ids = torch.randint(0, 10, (8,), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.cat([ids, ids]), torch.ones(16, dtype=torch.int32))
        loss = net(kjt).values().pow(2).sum()
        loss.backward()
        losses.append(float(loss))
    ebc.flush()
    dist.barrier()
    moved = float((client.lookup("b", torch.arange(10)) - before).abs().max())
    return {"rank": rank, "world": dist.get_world_size(), "ranks_sum": int(ranks), "losses": losses, "moved": moved}


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_run_trainers_runs_a_function_of_ones_own_in_every_trainer_with_the_servers():
    from persia_planner.modules.train import run_trainers

    results = run_trainers(_tower, 3, trainers=2, servers=1)
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    assert all(r["ranks_sum"] == 1 and len(r["losses"]) == 3 for r in results)
    assert all(r["moved"] > 1e-4 for r in results)  # the parameter server's rows trained
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # squared outputs shrink under SGD
