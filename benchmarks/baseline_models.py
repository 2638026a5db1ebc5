"""The two baselines of ``vs_baselines.py``, fitted on a split's design matrix (``log_features.Design``): an
L2-regularized logistic regression (scikit-learn) and a factorization machine (torch).

Neither sees the validation rows before it scores them: the logistic regression's ``C`` and the machine's L2 strength
and number of epochs are chosen on an inner split of the training rows (``click_logs.inner_split``), then each is
fitted again on every training row with that choice.

The factorization machine (Rendle, 2010) scores a row ``x`` (one-hot ids, standardized dense values) as ``b + w . x
+ sum_{i<j} <v_i, v_j> x_i x_j``, the pairwise term computed as ``0.5 * sum_f ((sum_i v_if x_i)^2 - sum_i v_if^2
x_i^2)``. Its rows train by lazy Adam (torch's ``SparseAdam``: a row moves only in a batch that holds its feature), with
an L2 penalty on the rows of each batch, as libFM's SGD regularizes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from click_logs import Split

__all__ = [
    "C_GRID",
    "FM_L2_GRID",
    "BaselineFit",
    "FactorizationMachine",
    "FmSettings",
    "auc",
    "factorization_machine",
    "logistic_regression",
]

C_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
"""The logistic regression's inverse L2 strengths tried."""
FM_L2_GRID = (0.001, 0.01)
"""The factorization machine's L2 strengths tried (:attr:`FmSettings.l2`)."""


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The ROC AUC of ``scores`` against 0/1 ``labels`` (every row counted; ties count half)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores))


@dataclass(frozen=True)
class BaselineFit:
    """A baseline fitted on a split's training rows and scored on its validation rows.

    Attributes:
        scores: One score per validation row (a probability or a logit: only their order counts).
        chosen: What the inner split chose (``{"C": 0.1}``, ``{"epochs": 4}``).
        inner_auc: The inner split's AUC of each candidate, by its name.
        fit_s: Seconds of the whole fit, the choice included.
    """

    scores: np.ndarray
    chosen: dict[str, float]
    inner_auc: dict[str, float]
    fit_s: float


def logistic_regression(x_train: Any, y_train: np.ndarray, x_valid: Any, inner: Split) -> BaselineFit:
    """L2-regularized logistic regression (lbfgs): ``C`` from :data:`C_GRID` by the AUC on ``inner`` (positions of
    the training rows), then fitted on every training row."""
    from sklearn.linear_model import LogisticRegression

    started = time.perf_counter()
    by_c = {}
    for c in C_GRID:
        model = LogisticRegression(C=c, max_iter=1000).fit(x_train[inner.train], y_train[inner.train])
        by_c[c] = auc(y_train[inner.valid], model.decision_function(x_train[inner.valid]))
    best = max(C_GRID, key=lambda c: by_c[c])
    model = LogisticRegression(C=best, max_iter=1000).fit(x_train, y_train)
    return BaselineFit(
        model.decision_function(x_valid),
        {"C": best},
        {str(c): a for c, a in by_c.items()},
        time.perf_counter() - started,
    )


@dataclass(frozen=True)
class FmSettings:
    """The factorization machine's fixed settings (the epochs are chosen per split).

    Attributes:
        dim: Each feature's vector length.
        lr: Adam's learning rate.
        l2: The penalty on the squared values of each batch's rows (vectors and linear weights), per sample (the
            fit tries each of :data:`FM_L2_GRID`).
        batch_size: Rows per step.
        max_epochs: Passes at most while choosing the epochs.
        patience: Passes without a better inner AUC before the choice stops.
        init_std: The vectors' initial normal standard deviation.
    """

    dim: int = 16
    lr: float = 0.01
    l2: float = 1e-4
    batch_size: int = 512
    max_epochs: int = 20
    patience: int = 2
    init_std: float = 0.01


class FactorizationMachine(torch.nn.Module):
    """A second-order factorization machine over ``features`` sparse-or-dense inputs (see the module docstring).

    Args:
        features: The design matrix's columns.
        dim: Each feature's vector length.
        init_std: The vectors' initial normal standard deviation (the linear weights start at 0).
    """

    def __init__(self, features: int, dim: int, init_std: float):
        super().__init__()
        self.vectors = torch.nn.Embedding(features, dim, sparse=True)
        self.weights = torch.nn.Embedding(features, 1, sparse=True)
        self.bias = torch.nn.Parameter(torch.zeros(1))
        torch.nn.init.normal_(self.vectors.weight, std=init_std)
        torch.nn.init.zeros_(self.weights.weight)

    def forward(self, rows: Any, columns: Any, values: Any, batch: int) -> tuple[Any, Any]:
        """Logits of ``batch`` rows given as COO entries ``(rows, columns, values)``, and the L2 penalty of the rows
        they used (summed)."""
        scaled = self.vectors(columns) * values[:, None]
        dim = scaled.shape[1]
        sums = torch.zeros(batch, dim).index_add(0, rows, scaled)
        squares = torch.zeros(batch, dim).index_add(0, rows, scaled * scaled)
        linear = self.weights(columns)[:, 0] * values
        logits = self.bias + torch.zeros(batch).index_add(0, rows, linear) + 0.5 * (sums * sums - squares).sum(1)
        return logits, (scaled * scaled).sum() + (linear * linear).sum()


@dataclass
class _Trainer:
    """Epochs of one factorization machine over a CSR matrix."""

    x: Any
    y: np.ndarray
    settings: FmSettings
    seed: int
    model: Any = field(init=False)
    optimizers: list[Any] = field(init=False)

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        s = self.settings
        self.model = FactorizationMachine(self.x.shape[1], s.dim, s.init_std)
        tables = [self.model.vectors.weight, self.model.weights.weight]
        self.optimizers = [torch.optim.SparseAdam(tables, lr=s.lr), torch.optim.Adam([self.model.bias], lr=s.lr)]

    def _batch(self, x: Any) -> tuple[Any, Any, Any, int]:
        coo = x.tocoo()
        return (
            torch.from_numpy(coo.row.astype(np.int64)),
            torch.from_numpy(coo.col.astype(np.int64)),
            torch.from_numpy(coo.data.astype(np.float32)),
            x.shape[0],
        )

    def epoch(self, number: int) -> None:
        order = np.random.default_rng([self.seed, number]).permutation(self.x.shape[0])
        step = self.settings.batch_size
        for start in range(0, len(order), step):
            rows = order[start : start + step]
            logits, penalty = self.model(*self._batch(self.x[rows]))
            target = torch.from_numpy(self.y[rows].astype(np.float32))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
            loss = loss + self.settings.l2 * penalty / len(rows)
            for o in self.optimizers:
                o.zero_grad()
            loss.backward()
            for o in self.optimizers:
                o.step()

    def scores(self, x: Any) -> np.ndarray:
        out = []
        with torch.no_grad():
            for start in range(0, x.shape[0], 8192):
                out.append(self.model(*self._batch(x[start : start + 8192]))[0].numpy())
        return np.concatenate(out)


def factorization_machine(
    x_train: Any, y_train: np.ndarray, x_valid: Any, inner: Split, seed: int, settings: FmSettings | None = None
) -> BaselineFit:
    """A factorization machine: per L2 strength of :data:`FM_L2_GRID`, passes over ``inner``'s training positions
    (up to ``max_epochs``, stopping after ``patience`` without a better AUC on its validation positions); the best
    strength and epochs then train on every training row."""
    base = settings or FmSettings()
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # its steps are small: on shared cores a second thread spins, 10x slower
    try:
        return _fit_fm(x_train, y_train, x_valid, inner, seed, base, started)
    finally:
        torch.set_num_threads(threads)


def _fit_fm(
    x_train: Any, y_train: np.ndarray, x_valid: Any, inner: Split, seed: int, base: FmSettings, started: float
) -> BaselineFit:
    tried: dict[tuple[float, int], float] = {}
    for l2 in FM_L2_GRID:
        trial = _Trainer(x_train[inner.train], y_train[inner.train], replace(base, l2=l2), seed)
        for epoch in range(1, base.max_epochs + 1):
            trial.epoch(epoch)
            tried[l2, epoch] = auc(y_train[inner.valid], trial.scores(x_train[inner.valid]))
            if epoch - max((e for strength, e in tried if strength == l2), key=lambda e: tried[l2, e]) >= base.patience:
                break
    l2, epochs = max(tried, key=lambda k: tried[k])
    final = _Trainer(x_train, y_train, replace(base, l2=l2), seed)
    for epoch in range(1, epochs + 1):
        final.epoch(epoch)
    return BaselineFit(
        final.scores(x_valid),
        {"epochs": epochs, "l2": l2, "dim": base.dim, "lr": base.lr},
        {f"l2 {strength:g}, {e} epochs": a for (strength, e), a in tried.items()},
        time.perf_counter() - started,
    )
