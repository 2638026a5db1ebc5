"""``SparseOptimizer``: the embedding tables' optimizer settings, and how they map to fbgemm and to the PS.

One value configures a table wherever the plan put it: :meth:`SparseOptimizer.fbgemm` gives the local tables' fused
optimizer (fbgemm's kernel arguments, which :mod:`.sharder` hands to TorchRec), :meth:`SparseOptimizer.ps` the PS
tables' row optimizer as the servers apply it (:mod:`persia_planner.modules.ps.optim`), so a table trains alike on
either tier. :class:`~.hybrid.HybridEmbeddingBagCollection` takes it, and :mod:`.hybrid` re-exports it: callers import
it with the collection.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from persia_planner.errors import PlannerError
from persia_planner.model.specs import Optimizer
from persia_planner.modules.ps import optim as ps_optim

__all__ = ["SparseOptimizer"]


@dataclass(frozen=True)
class SparseOptimizer:
    """The sparse optimizer of every embedding table, local (fbgemm fused) and remote (PS) alike.

    Attributes:
        kind: ``sgd``, ``adagrad``, ``rowwise_adagrad`` or ``adam`` (adam: PS tables only; fbgemm has no CPU adam).
        learning_rate: Step size.
        eps: Adagrad / Adam epsilon. The default is fbgemm's and TorchRec's (1e-8), as a drop-in's must be;
            ``persia train`` passes its measured one (:attr:`persia_planner.model.specs.Optimizer.default_eps`).
        beta1: Adam first-moment decay.
        beta2: Adam second-moment decay.
        weight_decay: Decoupled weight decay of the rows a step updates, ``w <- w * (1 - lr * weight_decay)`` before
            the update (:func:`persia_planner.modules.ps.optim.decoupled_decay`): the servers apply it to the PS
            tables' rows, :mod:`.row_decay` to the local tables' (fbgemm's CPU kernels ignore their own weight decay
            arguments), so every table decays alike; rows no batch touches keep their values.
    """

    kind: Optimizer = Optimizer.ROWWISE_ADAGRAD
    learning_rate: float = 0.05
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Optimizer(self.kind))
        if not self.learning_rate > 0:
            raise PlannerError(f"sparse optimizer: learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.weight_decay < 1 / self.learning_rate:  # nan fails this too; lr * wd >= 1 flips rows' signs
            raise PlannerError(
                f"sparse optimizer: weight_decay must be in [0, 1 / learning_rate) = [0, {1 / self.learning_rate:g}), "
                f"got {self.weight_decay}",
                fixes=("e.g. weight_decay 1e-4",),
            )

    def fbgemm(self, on_cuda: bool) -> dict[str, Any]:
        """Keyword arguments of ``SplitTableBatchedEmbeddingBagsCodegen`` for this optimizer."""
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        if self.kind is Optimizer.ADAM and not on_cuda:
            raise PlannerError(
                "sparse optimizer adam: fbgemm has no CPU adam for local tables",
                fixes=("use rowwise_adagrad, adagrad or sgd", "place the tables on the ps tier"),
            )
        # No weight decay among them: fbgemm's CPU kernels ignore it, so .row_decay applies the servers' formula to
        # the local tables on every device.
        return {
            "optimizer": EmbOptimType[_RUNTIME[self.kind][0]],
            "learning_rate": self.learning_rate,
            "eps": self.eps,
            "beta1": self.beta1,
            "beta2": self.beta2,
        }

    def ps(self) -> ps_optim.RowOptimizer:
        """The same optimizer as the parameter servers apply it (the weight decay included)."""
        return replace(_RUNTIME[self.kind][1](self), decoupled_weight_decay=self.weight_decay)


# The runtime's half of the optimizer table (the planner's, the state per row, is specs.Optimizer's): fbgemm's fused
# type (an EmbOptimType member's name) for local tables, the parameter servers' row optimizer for PS tables.
# Data-parallel replicas train with its torch.optim class, persia_planner.plan.torchrec_export.torch_optimizer (the
# planner needs that column too, for TorchRec's storage estimator).
_RUNTIME: Mapping[Optimizer, tuple[str, Callable[[SparseOptimizer], ps_optim.RowOptimizer]]] = {
    Optimizer.SGD: ("EXACT_SGD", lambda o: ps_optim.SGD(lr=o.learning_rate)),
    Optimizer.ADAGRAD: ("EXACT_ADAGRAD", lambda o: ps_optim.Adagrad(lr=o.learning_rate, eps=o.eps)),
    Optimizer.ROWWISE_ADAGRAD: (
        "EXACT_ROWWISE_ADAGRAD",
        lambda o: ps_optim.RowWiseAdagrad(lr=o.learning_rate, eps=o.eps),
    ),
    Optimizer.ADAM: ("ADAM", lambda o: ps_optim.Adam(lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=o.eps)),
}
