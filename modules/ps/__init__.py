"""Embedding parameter server (the planner's ``ps`` tier): storage engine and sparse optimizers.

:class:`~persia_planner.modules.ps.store.EmbeddingStore` is one table of one server: a capacity-bounded,
vectorised map from uint64 feature id to a row of weights plus optimizer state (:mod:`.optim`).
"""

from .optim import SGD, Adagrad, Adam, RowOptimizer, RowWiseAdagrad
from .store import EmbeddingStore, Eviction, Normal, Uniform

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
