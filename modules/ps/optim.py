"""Sparse row optimizers that the embedding parameter server applies to the rows it holds.

Each optimizer is a frozen dataclass of hyper-parameters with a pure, vectorised ``step`` over *gathered* rows:
the store gathers the weights and optimizer state of the ids in a batch, calls ``step`` once, and scatters the
results back. Rows that receive no gradient are never touched ("lazy" sparse semantics), which is what a parameter
server can afford and what Persia and TorchRec/fbgemm do.

Equivalence with the dense definitions (the tests check each to 1e-6):

* :class:`SGD` and :class:`Adagrad` (``weight_decay=0``): a dense step with a zero gradient leaves a row unchanged,
  so the sparse optimizer equals ``torch.optim.SGD`` / ``torch.optim.Adagrad`` on the dense gradient *exactly*.
* :class:`RowWiseAdagrad`: fbgemm's ``EXACT_ROWWISE_ADAGRAD`` (no dense torch counterpart): one accumulator per row,
  ``state += mean_j(g_j^2)``, ``w -= lr * g / (sqrt(state) + eps)``.
* :class:`Adam`: the moments of a row decay only when the row gets a gradient, and the bias correction uses a
  **per-row step counter** (the number of updates this row has received), as Persia's server keeps per-entry
  ``beta^t`` powers. This equals ``torch.optim.Adam`` whenever every row gets a gradient every step; otherwise it is
  the "lazy Adam" of a PS (``torch.optim.SparseAdam`` differs only in using a global step for the bias correction).
* ``weight_decay`` is the L2 form (``g += wd * w`` before the update), as in torch's optimizers and fbgemm's
  ``WeightDecayMode.L2``; on a sparse server it decays only the rows in the batch.
* ``decoupled_weight_decay`` is the decoupled form (AdamW's, fbgemm's ``WeightDecayMode.DECOUPLE``): each row of the
  batch shrinks by :func:`decoupled_decay` before its update, ``w <- w * (1 - lr * wd) - lr * update(g)``, and the
  accumulators see the gradient alone. It is what ``--sparse-weight-decay`` applies to every table: the local tables
  call :func:`decoupled_decay` on the rows a step touches (:mod:`persia_planner.modules.embedding.row_decay`), so the
  formula has this one home.

The step counter of :class:`Adam` is stored as a float32 column of the state (the store keeps one float32 state
tensor per table). float32 counts exactly to 2**24 updates of one row; past that the counter stops growing, which is
harmless because ``beta**(2**24)`` is already 0 in float64, i.e. the bias correction is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["SGD", "Adagrad", "Adam", "RowOptimizer", "RowWiseAdagrad", "decoupled_decay"]


@runtime_checkable
class RowOptimizer(Protocol):
    """A sparse optimizer applied on the server to gathered rows of one table."""

    def state_width(self, dim: int) -> int:
        """Number of float32 state values kept per row of an embedding of width ``dim``."""
        ...

    def init_state(self, n: int, dim: int) -> torch.Tensor:
        """Initial state of ``n`` freshly inserted rows, float32 ``[n, state_width(dim)]``."""
        ...

    def step(
        self, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One update of gathered rows.

        Args:
            weights: float32 ``[n, dim]``, one row per distinct id (duplicates already merged).
            state: float32 ``[n, state_width(dim)]``.
            grads: float32 ``[n, dim]``, the summed gradient of each row.

        Returns:
            ``(new_weights, new_state)`` of the same shapes; the inputs are not modified.
        """
        ...


def _check_hyper(lr: float, eps: float | None = None, weight_decay: float = 0.0, decoupled: float = 0.0) -> None:
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if eps is not None and not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if not decoupled >= 0.0:
        raise ValueError(f"decoupled_weight_decay must be >= 0, got {decoupled}")


def decoupled_decay(weights: torch.Tensor, lr: float, weight_decay: float) -> torch.Tensor:
    """Rows ``weights`` shrunk by decoupled weight decay before their update: ``w * (1 - lr * weight_decay)``.

    The one formula of ``--sparse-weight-decay`` for the servers' rows and the local tables' alike; ``lr`` is the
    step's learning rate (a schedule's current one), so the decay follows the schedule as the update does.
    Returns ``weights`` itself when there is nothing to decay.
    """
    if weight_decay == 0.0:
        return weights
    return weights.mul(1.0 - lr * weight_decay)


def _l2(grads: torch.Tensor, weights: torch.Tensor, weight_decay: float) -> torch.Tensor:
    # Same expression as torch.optim (grad.add(param, alpha=wd)) so results match bit for bit.
    return grads.add(weights, alpha=weight_decay) if weight_decay != 0.0 else grads


@dataclass(frozen=True)
class SGD:
    """Plain SGD: ``w -= lr * (g + wd * w)``. No state."""

    lr: float = 0.01
    weight_decay: float = 0.0
    decoupled_weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_hyper(self.lr, weight_decay=self.weight_decay, decoupled=self.decoupled_weight_decay)

    def state_width(self, dim: int) -> int:
        return 0

    def init_state(self, n: int, dim: int) -> torch.Tensor:
        return torch.zeros(n, 0, dtype=torch.float32)

    def step(
        self, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = _l2(grads, weights, self.weight_decay)
        return decoupled_decay(weights, self.lr, self.decoupled_weight_decay).add(g, alpha=-self.lr), state


@dataclass(frozen=True)
class Adagrad:
    """Element-wise Adagrad as ``torch.optim.Adagrad`` with ``lr_decay=0``: ``s += g^2; w -= lr * g/(sqrt(s)+eps)``."""

    lr: float = 0.01
    eps: float = 1e-10
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    decoupled_weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_hyper(self.lr, self.eps, self.weight_decay, self.decoupled_weight_decay)

    def state_width(self, dim: int) -> int:
        return dim

    def init_state(self, n: int, dim: int) -> torch.Tensor:
        return torch.full((n, dim), self.initial_accumulator_value, dtype=torch.float32)

    def step(
        self, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = _l2(grads, weights, self.weight_decay)
        new_state = state.addcmul(g, g, value=1)
        std = new_state.sqrt().add_(self.eps)
        decayed = decoupled_decay(weights, self.lr, self.decoupled_weight_decay)
        return decayed.addcdiv(g, std, value=-self.lr), new_state


@dataclass(frozen=True)
class RowWiseAdagrad:
    """fbgemm ``EXACT_ROWWISE_ADAGRAD``: one accumulator per row, ``s += mean(g^2)``, ``w -= lr*g/(sqrt(s)+eps)``.

    The row-wise variant is what large sparse tables use: 4 bytes of state per row instead of ``4 * dim``.
    """

    lr: float = 0.01
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_hyper(self.lr, self.eps, self.weight_decay, self.decoupled_weight_decay)

    def state_width(self, dim: int) -> int:
        return 1

    def init_state(self, n: int, dim: int) -> torch.Tensor:
        return torch.zeros(n, 1, dtype=torch.float32)

    def step(
        self, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = _l2(grads, weights, self.weight_decay)
        new_state = state + g.square().mean(dim=1, keepdim=True)
        multiplier = self.lr / (new_state.sqrt() + self.eps)
        return decoupled_decay(weights, self.lr, self.decoupled_weight_decay) - multiplier * g, new_state


@dataclass(frozen=True)
class Adam:
    """Lazy Adam with a per-row step counter (see the module docstring); state ``[m | v | t]``, width ``2*dim+1``.

    Per row with ``t`` its own update count: ``m = lerp(m, g, 1-b1)``, ``v = b2*v + (1-b2)*g^2``,
    ``w -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``, operation for operation as torch's single-tensor Adam.
    """

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_hyper(self.lr, self.eps, self.weight_decay, self.decoupled_weight_decay)
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas must be two values in [0, 1), got {self.betas}")

    def state_width(self, dim: int) -> int:
        return 2 * dim + 1

    def init_state(self, n: int, dim: int) -> torch.Tensor:
        return torch.zeros(n, 2 * dim + 1, dtype=torch.float32)

    def step(
        self, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dim = weights.shape[1]
        beta1, beta2 = self.betas
        g = _l2(grads, weights, self.weight_decay)
        m = state[:, :dim].lerp(g, 1 - beta1)
        v = state[:, dim : 2 * dim].mul(beta2).addcmul_(g, g, value=1 - beta2)
        t = state[:, 2 * dim :] + 1
        # Bias corrections in float64 like torch (where they are Python floats), then rounded once to float32.
        t64 = t.double()
        step_size = (self.lr / (1 - beta1**t64)).float()
        bias_correction2_sqrt = (1 - beta2**t64).sqrt().float()
        denom = (v.sqrt() / bias_correction2_sqrt).add_(self.eps)
        new_weights = decoupled_decay(weights, self.lr, self.decoupled_weight_decay) - step_size * (m / denom)
        return new_weights, torch.cat([m, v, t], dim=1)
