"""Embedding parameter server (the planner's ``ps`` tier), on torch.distributed.rpc.

:class:`~persia_planner.modules.ps.store.EmbeddingStore` is one table of one server: a capacity-bounded,
vectorised map from uint64 feature id to a row of weights plus optimizer state (:mod:`.optim`).
:mod:`.server` serves the tables of one process (``persia ps --rank R --world-size W``);
:class:`~persia_planner.modules.ps.client.PsClient` shards requests over the servers by
:func:`~persia_planner.modules.ps.sharding.server_of`; the two speak :mod:`.protocol` and never import each other.
:mod:`.checkpoint` saves and re-shards the tables, :mod:`.deltas` dumps their changes for serving replicas;
:mod:`.trainer` joins a trainer to the group;
:func:`~persia_planner.modules.ps.launch.local_cluster` runs servers and trainers on one machine."""

from .optim import SGD, Adagrad, Adam, RowOptimizer, RowWiseAdagrad
from .policies import Eviction, Normal, Uniform
from .store import EmbeddingStore

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "EmbeddingStore",
    "Eviction",
    "Normal",
    "RowOptimizer",
    "RowWiseAdagrad",
    "Uniform",
]
