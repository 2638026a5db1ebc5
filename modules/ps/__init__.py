"""Embedding parameter server (the planner's ``ps`` tier), on torch.distributed.rpc.

:class:`~persia_planner.modules.ps.store.EmbeddingStore` is one table of one server: a capacity-bounded,
vectorised map from uint64 feature id to a row of weights plus optimizer state (:mod:`.optim`).
:mod:`.server` serves the tables of one process (``persia ps --rank R --world-size W``);
:class:`~persia_planner.modules.ps.client.PsClient` shards requests over the servers by
:func:`~persia_planner.modules.ps.sharding.server_of`; the two speak :mod:`.protocol` and never import each other.
:mod:`persia_planner.modules.ps.table_checkpoints` saves and re-shards the tables, :mod:`.deltas` dumps their changes
for serving replicas; :mod:`persia_planner.modules.ps.connection` joins a trainer to the group. Starting the
servers and the trainers is the job's (:mod:`persia_planner.modules.launcher`), which this package never imports."""

from __future__ import annotations

from persia_planner.modules.lazy_exports import lazy_exports

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

_HOMES = {
    "Adagrad": "persia_planner.modules.ps.optim",
    "Adam": "persia_planner.modules.ps.optim",
    "EmbeddingStore": "persia_planner.modules.ps.store",
    "Eviction": "persia_planner.modules.ps.policies",
    "Normal": "persia_planner.modules.ps.policies",
    "RowOptimizer": "persia_planner.modules.ps.optim",
    "RowWiseAdagrad": "persia_planner.modules.ps.optim",
    "SGD": "persia_planner.modules.ps.optim",
    "Uniform": "persia_planner.modules.ps.policies",
}


__getattr__ = lazy_exports(__name__, _HOMES)
