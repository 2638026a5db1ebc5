"""Synthetic click data from a hidden teacher model, so that tests and the default run need no download.

The teacher is a small DLRM-like model whose parameters are never materialised as tables:

* ids: per feature, a Zipf(``alpha``) distribution over ``rows`` ranks (rank ``r`` has probability proportional to
  ``(r + 1) ** -alpha``, drawn exactly by inverse CDF); rank ``r`` is published as the id ``splitmix64(r ^ salt) >>
  1``, so ids spread over the non-negative 63-bit space like real hashed ids and nothing hints at popularity.
* embeddings: the ``dim``-vector of an id is a pure function of (seed, feature, id): splitmix64 hashes of the id feed
  a Box-Muller transform, vectorised over ids, so a 10**8-row feature costs no memory.
* dense: 13 log-normal counts (written to Criteo files as integers), seen through ``log1p`` like the reader.
* head: ``p = sigmoid(scale * (sum_f w_f . mean_bag(e) + v . dense_std + interests) + bias)``. ``scale`` sets the
  logit spread (``logit_std``) and ``bias`` is bisected so the mean click probability is ``target_ctr``; both are
  calibrated on a fixed sample with one id per feature (a sequence: its mean length).
* interests (:class:`Interest`): a behaviour sequence (a user's history) holds ids of another feature (the items a
  candidate is one of); its term is the candidate's similarity to the history, pooled by attention
  (``sum_i softmax(sharpness d_i) d_i`` over the dots ``d_i`` of their embeddings), not a mean: a model that pools the
  history loses it, and the teacher's AUC without it (``Teacher.prob(..., without=...)``) says by how much.

Labels are ``Bernoulli(p)``, so no model can beat the teacher's own ranking: :func:`teacher_auc` (the AUC of
``teacher_prob`` against the labels) is the best achievable AUC of a dataset.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import SpecError
from persia_planner.modules.data.criteo import FEATURE_NAMES, Batch
from persia_planner.modules.data.criteo_format import NUM_CATEGORICAL, NUM_INTEGER, write_criteo
from persia_planner.modules.hashing import GOLDEN_GAMMA, splitmix64

__all__ = ["ZIPF_ALPHA", "Interest", "SyntheticClicks", "Teacher", "teacher_auc", "to_criteo"]

ZIPF_ALPHA = 1.05  # the default skew of every feature's ids (a model.yaml table's zipf_alpha describes the same)

_GOLDEN = np.uint64(GOLDEN_GAMMA)
_DENSE_LOG_MEAN = 1.5  # log-normal counts: log1p(count) is roughly N(1.5, 1.2); max count stays ~1e4, exact in f32
_DENSE_LOG_STD = 1.2
_CALIBRATION_SAMPLES = 1 << 15


def _unit(h: np.ndarray) -> np.ndarray:
    """uint64 hash -> float64 uniform in (0, 1) (53 bits, never 0 so that log() is safe)."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


@dataclass(frozen=True)
class Interest:
    """A behaviour sequence of the teacher: feature ``sequence`` holds ids of feature ``of`` (its ids and their
    embeddings), and a click's logit gains ``weight`` times the sample's candidate (its first ``of`` id) attending
    over them (see the module docstring).

    Attributes:
        sequence: The sequence feature (a history).
        of: The feature whose ids it holds (the candidate's).
        mean_length: Its mean length, for the calibration's sample.
        weight: How much the term weighs against one pooled feature's (each about ``N(0, 1)``).
        sharpness: The attention's inverse temperature (large: the most similar id alone).
    """

    sequence: str
    of: str
    mean_length: float = 20.0
    weight: float = 1.0
    sharpness: float = 4.0


@dataclass(frozen=True)
class Teacher:
    """The hidden click model (see the module docstring).

    Args:
        features: Sparse feature names (KJT keys); 26 names make Criteo-compatible data.
        rows: Number of distinct ids per feature (one count for all, or per feature).
        alpha: Zipf exponent of the id distribution (larger = more skewed).
        dim: Embedding dimension of the teacher.
        num_dense: Number of dense features (13 for Criteo).
        target_ctr: Mean click probability the bias is calibrated to.
        logit_std: Standard deviation of the logit around the bias (sets how predictable clicks are).
        seed: Seed of everything hidden (ids, embeddings, head).
        interests: Its behaviour sequences (a sequence feature's linear term is replaced by its interest term).
    """

    features: tuple[str, ...] = FEATURE_NAMES
    rows: int | Mapping[str, int] = 100_000
    alpha: float = ZIPF_ALPHA
    dim: int = 8
    num_dense: int = NUM_INTEGER
    target_ctr: float = 0.25
    logit_std: float = 2.0
    seed: int = 0
    interests: tuple[Interest, ...] = ()
    scale: float = field(init=False)
    bias: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        if not self.features or len(set(self.features)) != len(self.features):
            raise SpecError("Teacher", "features", "must be distinct, non-empty names")
        if not 0.0 < self.target_ctr < 1.0:
            raise SpecError("Teacher", "target_ctr", f"must be in (0, 1), got {self.target_ctr}")
        if self.alpha <= 0 or self.dim < 1 or self.num_dense < 0:
            raise SpecError("Teacher", "", "alpha must be > 0, dim >= 1, num_dense >= 0")
        for name in self.features:
            if self.num_rows(name) < 1:
                raise SpecError("Teacher", f"rows.{name}", f"must be >= 1, got {self.num_rows(name)}")
        object.__setattr__(self, "interests", tuple(self.interests))
        sequences = {i.sequence for i in self.interests}
        for i in self.interests:
            if i.sequence not in self.features or i.of not in self.features or i.of in sequences or i.sequence == i.of:
                raise SpecError(
                    "Teacher", f"interests.{i.sequence}", "must name a feature holding ids of another, pooled feature"
                )
            if not (i.mean_length >= 1 and i.weight >= 0 and i.sharpness >= 0):
                raise SpecError(
                    "Teacher", f"interests.{i.sequence}", "needs mean_length >= 1, weight and sharpness >= 0"
                )
        rng = np.random.default_rng([self.seed, 0x7EAC])
        # Head weights: N(0, 1/dim) per feature makes each feature's per-id score ~N(0, 1) before scaling.
        object.__setattr__(self, "_w", rng.normal(0.0, 1.0 / math.sqrt(self.dim), (len(self.features), self.dim)))
        object.__setattr__(self, "_v", rng.normal(0.0, 1.0, self.num_dense))
        salts = splitmix64(np.arange(2 * len(self.features), dtype=np.uint64) + np.uint64(self.seed * 1_000_003))
        object.__setattr__(self, "_id_salt", salts[: len(self.features)])
        object.__setattr__(self, "_emb_salt", salts[len(self.features) :])
        object.__setattr__(self, "_cdfs", {})
        object.__setattr__(self, "scale", 1.0)
        object.__setattr__(self, "bias", 0.0)
        self._calibrate()

    # --- ids -------------------------------------------------------------------------------------------------------
    def num_rows(self, feature: str) -> int:
        """Number of distinct ids of ``feature``."""
        return int(self.rows[feature] if isinstance(self.rows, Mapping) else self.rows)

    def _cdf(self, feature: str) -> np.ndarray:
        rows = self.num_rows(feature)
        cdf = self._cdfs.get(rows)
        if cdf is None:
            cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -self.alpha)
            cdf /= cdf[-1]
            self._cdfs[rows] = cdf
        return cdf

    def ids_of_rank(self, feature: str, ranks: np.ndarray | Sequence[int]) -> np.ndarray:
        """The int64 ids (non-negative, 63-bit) of popularity ranks (0 = most frequent) of ``feature``."""
        f = self.features.index(feature)
        ranks = np.asarray(ranks, dtype=np.uint64)
        return (splitmix64(ranks ^ self._id_salt[f]) >> np.uint64(1)).astype(np.int64)

    def expected_share(self, feature: str, top_k: int) -> float:
        """Expected fraction of ``feature``'s lookups that hit its ``top_k`` most frequent ids."""
        cdf = self._cdf(feature)
        return float(cdf[min(top_k, cdf.shape[0]) - 1]) if top_k > 0 else 0.0

    def sample_ids(self, feature: str, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` Zipf-distributed int64 ids of ``feature`` (a sequence's: of the feature it holds ids of)."""
        feature = self.ids_of(feature)
        ranks = np.searchsorted(self._cdf(feature), rng.random(n), side="right")
        return self.ids_of_rank(feature, np.minimum(ranks, self.num_rows(feature) - 1))

    def ids_of(self, feature: str) -> str:
        """The feature whose ids ``feature`` holds: itself, or the one a sequence is of (:class:`Interest`)."""
        return next((i.of for i in self.interests if i.sequence == feature), feature)

    # --- model -----------------------------------------------------------------------------------------------------
    def embeddings(self, feature: str, ids: np.ndarray) -> np.ndarray:
        """``[len(ids), dim]`` float64 teacher embeddings (a pure function of seed, feature and id)."""
        f = self.features.index(feature)
        h = splitmix64(np.asarray(ids, dtype=np.int64).view(np.uint64)[:, None] ^ self._emb_salt[f])
        h = splitmix64(h + np.arange(self.dim, dtype=np.uint64)[None, :] * _GOLDEN)
        u1, u2 = _unit(h), _unit(splitmix64(h))
        return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)  # Box-Muller: standard normal

    def _raw_score(
        self,
        dense: np.ndarray,
        lengths: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
        without: frozenset[str] = frozenset(),
    ) -> np.ndarray:
        """Unscaled logit: dense part plus, per feature, ``w_f`` dotted with the mean embedding of the bag; per
        interest (but those of ``without``), its attention term."""
        n = dense.shape[0]
        dense_std = (dense.astype(np.float64) - _DENSE_LOG_MEAN) / _DENSE_LOG_STD
        score = dense_std @ self._v / math.sqrt(max(self.num_dense, 1))
        for interest in self.interests:
            if interest.sequence not in without:
                score += interest.weight * self._interest(interest, n, lengths, values)
        sequences = {i.sequence for i in self.interests}
        for f, name in enumerate(self.features):
            if name in sequences:
                continue
            # Zipf batches repeat their hot ids: score each distinct id once (the same numbers, several x faster).
            uniq, inverse = np.unique(values[f], return_inverse=True)
            per_id = (self.embeddings(name, uniq) @ self._w[f])[inverse]
            bag = np.repeat(np.arange(n), lengths[f])
            sums = np.bincount(bag, weights=per_id, minlength=n)
            score += sums / np.maximum(lengths[f], 1)  # mean pooling; an empty bag contributes 0
        return score

    def _interest(
        self, interest: Interest, n: int, lengths: Sequence[np.ndarray], values: Sequence[np.ndarray]
    ) -> np.ndarray:
        """Each sample's candidate (its first ``of`` id) attending over its sequence: ``sum_i softmax(s d_i) d_i``
        with ``d_i`` the dots of their embeddings over ``sqrt(dim)``; 0 without a candidate or a sequence."""
        c, h = self.features.index(interest.of), self.features.index(interest.sequence)
        first = np.concatenate([[0], np.cumsum(lengths[c])[:-1]]).astype(np.int64)
        has = lengths[c] > 0
        candidates = np.zeros((n, self.dim))
        candidates[has] = self.embeddings(interest.of, values[c][first[has]])
        bag = np.repeat(np.arange(n), lengths[h])
        if bag.size == 0:
            return np.zeros(n)
        uniq, inverse = np.unique(values[h], return_inverse=True)
        history = self.embeddings(interest.of, uniq)[inverse]
        dots = (history * candidates[bag]).sum(axis=1) / math.sqrt(self.dim)
        top = np.full(n, -np.inf)
        np.maximum.at(top, bag, interest.sharpness * dots)
        weights = np.exp(interest.sharpness * dots - top[bag])
        total = np.bincount(bag, weights=weights, minlength=n)
        pooled = np.bincount(bag, weights=weights * dots, minlength=n)
        return np.where(has & (total > 0), pooled / np.maximum(total, 1e-300), 0.0)

    def _calibrate(self) -> None:
        rng = np.random.default_rng([self.seed, 0xCA11])
        n = _CALIBRATION_SAMPLES
        dense = _sample_dense(rng, n, self.num_dense)
        means = {i.sequence: i.mean_length for i in self.interests}
        # one id per feature, a sequence its mean length (drawn only then: a teacher without one calibrates as ever)
        lengths = [
            1 + rng.poisson(means[f] - 1.0, n) if f in means else np.ones(n, dtype=np.int64) for f in self.features
        ]
        values = [self.sample_ids(f, int(length.sum()), rng) for f, length in zip(self.features, lengths, strict=True)]
        raw = self._raw_score(dense, lengths, values)
        scale = self.logit_std / max(float(raw.std()), 1e-12)
        lo, hi = -30.0, 30.0
        for _ in range(100):  # mean(sigmoid(x + b)) is increasing in b: bisect
            mid = 0.5 * (lo + hi)
            if _sigmoid(scale * raw + mid).mean() < self.target_ctr:
                lo = mid
            else:
                hi = mid
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "bias", 0.5 * (lo + hi))

    def prob(self, batch: Batch, without: Iterable[str] = ()) -> torch.Tensor:
        """The teacher's click probability ``[B]`` (float32) for a batch of its own features (e.g. read back);
        ``without`` leaves those sequences' interest terms out: the best a model that cannot read them may do."""
        sparse = batch.sparse
        if list(sparse.keys()) != list(self.features):
            raise SpecError("Teacher.prob", "sparse.keys", f"expected {list(self.features)}, got {sparse.keys()}")
        jt = sparse.to_dict()
        lengths = [jt[f].lengths().numpy().astype(np.int64) for f in self.features]
        values = [jt[f].values().numpy() for f in self.features]
        return torch.from_numpy(self._prob(batch.dense.numpy(), lengths, values, frozenset(without)))

    def _prob(
        self,
        dense: np.ndarray,
        lengths: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
        without: frozenset[str] = frozenset(),
    ) -> np.ndarray:
        raw = self._raw_score(dense, lengths, values, without)
        return _sigmoid(self.scale * raw + self.bias).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free form


def _sample_counts(rng: np.random.Generator, n: int, num_dense: int) -> np.ndarray:
    """Log-normal integer counts ``[n, num_dense]`` (Criteo's integer columns are counts)."""
    z = rng.standard_normal((n, num_dense))
    return np.floor(np.expm1(_DENSE_LOG_MEAN + _DENSE_LOG_STD * z)).clip(0).astype(np.int64)


def _sample_dense(rng: np.random.Generator, n: int, num_dense: int) -> np.ndarray:
    return _dense_of(_sample_counts(rng, n, num_dense))


def _dense_of(counts: np.ndarray) -> np.ndarray:
    return np.log1p(np.maximum(counts, 0)).astype(np.float32)  # the reader's transform, bit for bit


@dataclass(frozen=True)
class _Rows:
    """One synthetic batch before tensors: what :func:`to_criteo` writes and :class:`Batch` wraps."""

    counts: np.ndarray  # [B, num_dense] int64
    lengths: list[np.ndarray]  # per feature [B] int64
    values: list[np.ndarray]  # per feature [sum(lengths)] int64
    labels: np.ndarray  # [B] float32
    prob: np.ndarray  # [B] float32


class SyntheticClicks:
    """An iterable of ``num_batches`` synthetic :class:`Batch` es drawn from a :class:`Teacher`.

    Batch ``b`` depends only on ``(seed, b)`` (not on the other batches), so iteration is repeatable and batches
    can be generated in any order or in parallel.

    Args:
        teacher: The hidden model.
        batch_size: Samples per batch.
        num_batches: Batches per pass.
        pooling: Mean ids per sample per feature (default 1.0). ``m <= 1``: a bag holds one id with probability
            ``m`` (else it is empty, like a missing Criteo value); ``m > 1``: ``1 + Poisson(m - 1)`` ids.
        seed: Seed of the samples (the teacher has its own).
    """

    def __init__(
        self,
        teacher: Teacher,
        *,
        batch_size: int,
        num_batches: int,
        pooling: Mapping[str, float] | None = None,
        seed: int = 0,
    ):
        if batch_size < 1 or num_batches < 0:
            raise SpecError("SyntheticClicks", "", "batch_size must be >= 1 and num_batches >= 0")
        pooling = dict(pooling or {})
        for name, mean in pooling.items():
            if name not in teacher.features:
                raise SpecError("SyntheticClicks", f"pooling.{name}", "not a feature of the teacher")
            if not mean >= 0:
                raise SpecError("SyntheticClicks", f"pooling.{name}", f"must be >= 0, got {mean}")
        self.teacher = teacher
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.pooling = {name: float(pooling.get(name, 1.0)) for name in teacher.features}
        self.seed = seed

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        for b in range(self.num_batches):
            yield self.batch(b)

    def _rows(self, index: int) -> _Rows:
        t, n = self.teacher, self.batch_size
        rng = np.random.default_rng([self.seed, index])
        counts = _sample_counts(rng, n, t.num_dense)
        lengths, values = [], []
        for name in t.features:
            mean = self.pooling[name]
            if mean <= 1.0:
                length = (rng.random(n) < mean).astype(np.int64)
            else:
                length = 1 + rng.poisson(mean - 1.0, n).astype(np.int64)
            lengths.append(length)
            values.append(t.sample_ids(name, int(length.sum()), rng))
        prob = t._prob(_dense_of(counts), lengths, values)
        labels = (rng.random(n) < prob).astype(np.float32)
        return _Rows(counts, lengths, values, labels, prob)

    def batch(self, index: int) -> Batch:
        """Batch number ``index`` (deterministic for the seed)."""
        rows = self._rows(index)
        sparse = KeyedJaggedTensor(
            keys=list(self.teacher.features),
            values=torch.from_numpy(np.concatenate(rows.values)),
            lengths=torch.from_numpy(np.concatenate(rows.lengths).astype(np.int32)),
        )
        return Batch(
            dense=torch.from_numpy(_dense_of(rows.counts)),
            sparse=sparse,
            labels=torch.from_numpy(rows.labels),
            teacher_prob=torch.from_numpy(rows.prob),
        )


def teacher_auc(batches: Iterable[Batch]) -> float:
    """AUC of ``teacher_prob`` against the labels (torchmetrics): the best AUC any model can reach on the data.

    Raises:
        SpecError: If a batch has no ``teacher_prob`` (real data) or there are no batches.
    """
    probs, labels = [], []
    for batch in batches:
        if batch.teacher_prob is None:
            raise SpecError("teacher_auc", "teacher_prob", "batch has no teacher probability (not synthetic data)")
        probs.append(batch.teacher_prob)
        labels.append(batch.labels)
    if not probs:
        raise SpecError("teacher_auc", "", "no batches")
    return float(binary_auroc(torch.cat(probs), torch.cat(labels).long()))


def to_criteo(dataset: SyntheticClicks, path: str | os.PathLike[str]) -> Path:
    """Write every sample of ``dataset`` as a Criteo-format file (``.gz`` compresses).

    Dense features are written as their integer counts (the reader's ``log1p`` gives back ``Batch.dense`` exactly),
    ids as hex, empty bags as missing values.

    Raises:
        SpecError: If the teacher is not Criteo-shaped (13 dense, 26 sparse features) or a bag holds several ids.
    """
    t = dataset.teacher
    if t.num_dense != NUM_INTEGER or len(t.features) != NUM_CATEGORICAL:
        raise SpecError(
            "to_criteo", "teacher", f"needs {NUM_INTEGER} dense and {NUM_CATEGORICAL} sparse features", fixes=()
        )
    labels, counts, cats, missing = [], [], [], []
    for b in range(dataset.num_batches):
        rows = dataset._rows(b)
        n = rows.labels.shape[0]
        ids = np.zeros((n, NUM_CATEGORICAL), dtype=np.int64)
        present = np.zeros((n, NUM_CATEGORICAL), dtype=bool)
        for f, (length, values) in enumerate(zip(rows.lengths, rows.values, strict=True)):
            if length.max(initial=0) > 1:
                raise SpecError(
                    "to_criteo",
                    f"pooling.{t.features[f]}",
                    "Criteo rows hold at most one id per feature",
                    fixes=("use pooling <= 1.0",),
                )
            present[:, f] = length == 1
            ids[present[:, f], f] = values
        labels.append(rows.labels.astype(np.int64))
        counts.append(rows.counts)
        cats.append(ids)
        missing.append(~present)
    return write_criteo(
        path,
        np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64),
        np.concatenate(counts) if counts else np.zeros((0, NUM_INTEGER), dtype=np.int64),
        np.concatenate(cats) if cats else np.zeros((0, NUM_CATEGORICAL), dtype=np.int64),
        cat_missing=np.concatenate(missing) if missing else None,
    )
