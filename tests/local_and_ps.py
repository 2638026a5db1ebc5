"""A local table ("near", feature "a") and a PS table ("far", feature "b") of the same shape on one trainer, the PS
rows starting where the local ones do: what the tests of the tables' optimizers (schedules, decay) compare."""

from __future__ import annotations

import torch
from plans import TOPO_1X1, local_placement, ps_placement
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
from persia_planner.modules.embedding.model_parallel import distribute
from persia_planner.topology.graph import Topology


def near_and_far(
    client, sparse: SparseOptimizer, rows: int, dim: int
) -> tuple[HybridEmbeddingBagCollection, nn.Module, torch.Tensor]:
    """The collection (K = 0), its DMP-sharded module and the rows both tables start from. Needs the trainer's
    process group."""
    configs = [
        EmbeddingBagConfig(name="near", feature_names=["a"], num_embeddings=rows, embedding_dim=dim),
        EmbeddingBagConfig(name="far", feature_names=["b"], num_embeddings=rows, embedding_dim=dim),
    ]
    plan = {"near": local_placement(rows, dim), "far": ps_placement(dim)}
    hybrid = HybridEmbeddingBagCollection(
        configs, plan, ps=client, staleness=0, optimizer=sparse, local_device=torch.device("meta")
    )
    net = distribute(hybrid, plan, Topology.from_dict(TOPO_1X1))
    start = hybrid.local_weights()["near"].clone()
    client.assign_rows("far", torch.arange(rows), start)
    return hybrid, net, start
