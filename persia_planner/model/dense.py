"""The dense network of a model: its architecture (model.yaml's ``dense:``) and what it costs the planner.

:class:`DenseArch` names one of TorchRec's own models, ``DLRM`` or ``DLRM_DCN`` (DCN-v2 with low-rank cross layers),
or DIN (target attention over sequence features), and its layer sizes; ``persia train`` builds exactly that model,
and :class:`DenseSpec` derives the parameter count and FLOPs the cost model prices from the same numbers, so the plan
and the run describe one network.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Any

from persia_planner.errors import abbreviate
from persia_planner.fields import Fields
from persia_planner.limits import (
    MAX_DENSE_FEATURES,
    MAX_DENSE_FLOPS_PER_SAMPLE,
    MAX_DENSE_PARAMETERS,
    MAX_LAYER_WIDTH,
    MAX_LAYERS,
)
from persia_planner.units import Quantity

__all__ = [
    "DIN_ATTENTION",
    "DLRM_BOTTOM",
    "DLRM_NUM_DENSE",
    "DLRM_TOP",
    "ArchError",
    "ArchKind",
    "DenseArch",
    "DenseSpec",
    "read_dense",
]

# The default dense network of ``persia train`` (TorchRec's ``DLRM``): 13 dense inputs (Criteo's integer columns),
# bottom MLP (the embedding dim is appended as its last layer), then the over arch to one logit.
DLRM_NUM_DENSE = 13
DLRM_BOTTOM = (64,)
DLRM_TOP = (64, 32, 1)
DCN_LAYERS = 3
DCN_LOW_RANK = 16


DIN_ATTENTION = (36,)


class ArchKind(enum.StrEnum):
    """Which model the dense part is: ``dlrm`` (TorchRec's ``DLRM``: pairwise dot interaction), ``dcn``
    (``DLRM_DCN``: DCN-v2 low-rank cross layers over the concatenated embeddings), or ``din`` (DIN's target attention
    over the sequence tables' rows, the model's only arch that reads sequences)."""

    DLRM = "dlrm"
    DCN = "dcn"
    DIN = "din"

    @property
    def reads_sequences(self) -> bool:
        """Whether the arch attends over sequence tables (``pooling: none``); the others pool every feature."""
        return self is ArchKind.DIN


@dataclass(frozen=True)
class DenseArch:
    """The dense and over arch ``persia train`` builds around the embedding collection.

    Attributes:
        kind: ``dlrm`` or ``dcn``.
        num_dense: Dense input features (the bottom MLP's input width).
        inputs_from_data: ``num_dense`` was not written in model.yaml: a run takes the data's dense columns instead
            (the plan prices ``num_dense``, the model's ``data:`` count or Criteo's 13).
        bottom: Hidden sizes of the bottom MLP; the embedding dim is appended as its output layer.
        over: Sizes of the over (top) arch, at least two, the last one 1 (the logit).
        dcn_layers: DCN-v2 cross layers (``dcn`` only).
        dcn_low_rank: Rank of each cross layer's ``W V`` factorisation (``dcn`` only).
        dropout: Dropout probability on the output of every hidden layer of the bottom MLP (all but its last, the
            dense embedding the interaction reads) and of the over arch (all but the logit), in training only; 0:
            none. It adds no parameter, so the plan's counts do not change.
        attention: Hidden sizes of DIN's activation unit (``din`` only), which scores each sequence id's row
            against the sample's query; its output layer (one score) is appended.

    Raises:
        ArchError: A size out of range (a ``ValueError`` naming the field).
    """

    kind: ArchKind = ArchKind.DLRM
    num_dense: int = DLRM_NUM_DENSE
    bottom: tuple[int, ...] = DLRM_BOTTOM
    over: tuple[int, ...] = DLRM_TOP
    dcn_layers: int = DCN_LAYERS
    dcn_low_rank: int = DCN_LOW_RANK
    inputs_from_data: bool = False
    dropout: float = 0.0
    attention: tuple[int, ...] = DIN_ATTENTION

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ArchKind(self.kind))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ArchError("dropout", f"must be a probability in [0, 1), got {self.dropout!r}", "e.g. dropout: 0.1")
        object.__setattr__(self, "dropout", float(self.dropout))
        object.__setattr__(self, "bottom", tuple(self.bottom))
        object.__setattr__(self, "over", tuple(self.over))
        object.__setattr__(self, "attention", tuple(self.attention))
        _check_counts((("num_dense", self.num_dense, MAX_DENSE_FEATURES), ("dcn_layers", self.dcn_layers, MAX_LAYERS)))
        _check_counts((("dcn_low_rank", self.dcn_low_rank, MAX_LAYER_WIDTH),))
        for name, sizes in (("bottom", self.bottom), ("over", self.over), ("attention", self.attention)):
            if len(sizes) > MAX_LAYERS:
                raise ArchError(name, f"has {len(sizes)} layers, more than {MAX_LAYERS}", f"give at most {MAX_LAYERS}")
            bad = next((s for s in sizes if not 1 <= s <= MAX_LAYER_WIDTH), None)
            if bad is not None:
                raise ArchError(name, f"layer size {bad} is not in [1, {MAX_LAYER_WIDTH:,}]", "give positive sizes")
        if len(self.over) < 2 or self.over[-1] != 1:
            example = ", ".join(str(s) for s in (*(self.over[:-1] or (64,)), 1))
            got = list(self.over)
            raise ArchError(
                "over", f"must have at least two layers and end in 1 (the logit), got {got}", f"e.g. [{example}]"
            )

    def counts(
        self, dim: int, features: int, sequences: tuple[float, ...] = (), candidates: int = 0
    ) -> tuple[int, int]:
        """``(parameters, multiply-adds per sample)`` of the network over ``features`` pooled embeddings of ``dim``
        (and, for ``din``, the sequence tables of mean lengths ``sequences``, ``candidates`` of them with a
        candidate).

        ``dlrm`` (TorchRec ``DLRM``): bottom MLP ``num_dense -> bottom -> dim``, the pairwise dot interaction of the
        ``F = features + 1`` vectors (one batched ``F x dim`` by ``dim x F`` product) and the over arch over ``dim``
        plus the ``F (F - 1) / 2`` dot products. ``dcn`` (TorchRec ``DLRM_DCN``): the same bottom MLP, then
        ``dcn_layers`` low-rank cross layers on the concatenation of width ``N = F dim`` (``x0 * (W (V x) + b) + x``:
        ``W`` is ``N x r``, ``V`` is ``r x N``, ``b`` is ``N``; ``2 N r + N`` multiply-adds each), and the over arch
        over ``N``. ``din``: the same bottom MLP, a query ``F dim -> dim`` from the dense and pooled embeddings (where
        a sequence table has no candidate, whose row is its query otherwise), per sequence table an activation unit
        ``4 dim -> attention -> 1`` on ``[q, k, q - k, q * k]`` for each of its ids (``L`` of them: its mean length)
        and their weighted sum, and the over arch over the ``F + S`` vectors.
        """
        params, macs = _mlp((self.num_dense, *self.bottom, dim))
        f = features + 1
        if self.kind is ArchKind.DIN:
            query_params, query_macs = _mlp((f * dim, dim)) if candidates < len(sequences) else (0, 0)
            unit_params, unit_macs = _mlp((4 * dim, *self.attention, 1))
            params += query_params + len(sequences) * unit_params
            # per id: its unit's input (two products), the unit, and its share of the weighted sum
            macs += query_macs + round(sum(sequences) * (unit_macs + 3 * dim))
            over_params, over_macs = _mlp(((f + len(sequences)) * dim, *self.over))
            return params + over_params, macs + over_macs
        if self.kind is ArchKind.DLRM:
            macs += f * f * dim
            over_in = dim + f * (f - 1) // 2
        else:
            width = f * dim
            params += self.dcn_layers * (2 * width * self.dcn_low_rank + width)
            macs += self.dcn_layers * (2 * width * self.dcn_low_rank + width)
            over_in = width
        over_params, over_macs = _mlp((over_in, *self.over))
        return params + over_params, macs + over_macs

    def to_dict(self) -> dict[str, Any]:
        """model.yaml's ``dense:`` keys of this arch (the DCN ones only for ``dcn``)."""
        out: dict[str, Any] = {
            "arch": self.kind.value,
            "num_dense": self.num_dense,
            "bottom": list(self.bottom),
            "over": list(self.over),
        }
        if self.kind is ArchKind.DCN:
            out |= {"dcn_layers": self.dcn_layers, "dcn_low_rank": self.dcn_low_rank}
        if self.kind is ArchKind.DIN:
            out["attention"] = list(self.attention)
        if self.dropout:  # written only when set: an arch without it records as it did before the option
            out["dropout"] = self.dropout
        return out


class ArchError(ValueError):
    """A :class:`DenseArch` field out of range: ``field``, ``problem`` and a ``fix``."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        super().__init__(f"dense.{field}: {problem}")
        self.field, self.problem, self.fix = field, problem, fix


def _check_counts(values: tuple[tuple[str, int, int], ...]) -> None:
    for name, value, maximum in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
            raise ArchError(name, f"must be an integer in [1, {maximum:,}], got {value!r}")


def _mlp(widths: tuple[int, ...]) -> tuple[int, int]:
    """Parameters (weights and biases) and multiply-adds per sample of a chain of linear layers."""
    params = macs = 0
    for fan_in, fan_out in itertools.pairwise(widths):
        params += fan_in * fan_out + fan_out
        macs += fan_in * fan_out
    return params, macs


@dataclass(frozen=True)
class DenseSpec:
    """The dense network, trained data-parallel.

    Attributes:
        parameters: Dense parameter count (its gradients are all-reduced every step in fp32).
        flops_per_sample: Forward FLOPs per sample; backward counts as 2x.
        arch: The architecture ``persia train`` builds, when model.yaml names one (the two counts are then derived
            from it); None: TorchRec's ``DLRM`` with the default sizes, and the counts as given.
    """

    parameters: int = 0
    flops_per_sample: float = 0.0
    arch: DenseArch | None = None

    @classmethod
    def of_arch(
        cls, arch: DenseArch, dim: int, features: int, sequences: tuple[float, ...] = (), candidates: int = 0
    ) -> DenseSpec:
        """The counts of ``arch`` over ``features`` pooled embeddings of ``dim`` and sequences of mean lengths
        ``sequences``, ``candidates`` of them with a candidate (:meth:`DenseArch.counts`; FLOPs are 2 per
        multiply-add)."""
        params, macs = arch.counts(dim, features, sequences, candidates)
        return cls(params, 2.0 * macs, arch)

    @classmethod
    def dlrm(
        cls,
        num_dense: int,
        dim: int,
        features: int,
        bottom: tuple[int, ...] = DLRM_BOTTOM,
        top: tuple[int, ...] = DLRM_TOP,
    ) -> DenseSpec:
        """TorchRec's ``DLRM`` dense part as ``persia train`` builds it (:meth:`DenseArch.counts`), without
        recording the arch (the calibration's and benchmarks' networks)."""
        params, macs = DenseArch(ArchKind.DLRM, num_dense, bottom, top).counts(dim, features)
        return cls(params, 2.0 * macs)

    @property
    def built_arch(self) -> DenseArch:
        """The arch ``persia train`` builds: the one given, else the default ``DLRM``."""
        return self.arch or DenseArch()


_ARCH_KEYS = ("num_dense", "bottom", "over", "dcn_layers", "dcn_low_rank", "dropout", "attention")


def read_dense(
    fields: Fields | None,
    dims: set[int],
    features: int,
    num_dense: int = DLRM_NUM_DENSE,
    sequences: tuple[float, ...] = (),
    candidates: int = 0,
) -> DenseSpec:
    """model.yaml's ``dense:`` section (``fields``; None when absent) for tables of ``dims``: ``features`` pooled
    ones and sequence ones of mean lengths ``sequences`` (``candidates`` of them with a candidate).

    Either the counts (``parameters``, ``flops_per_sample``) or an arch (``arch:`` and its sizes, from which the
    counts are derived); both at once is refused, so that the plan never prices another network than the one
    trained.

    Raises:
        SpecError: An unknown key, a size out of range, counts beside an arch, or an arch over tables of several
            dims (one line naming the key).
    """
    if fields is None:
        return DenseSpec()
    if not fields.has("arch"):
        stray = next((k for k in _ARCH_KEYS if fields.has(k)), None)
        if stray is not None:
            raise fields.error(stray, "describes a dense arch, but 'arch' is not given", ("add 'arch: dlrm' or dcn",))
        spec = DenseSpec(
            parameters=fields.take("parameters", Quantity.COUNT, default=0, maximum=MAX_DENSE_PARAMETERS),
            flops_per_sample=fields.take(
                "flops_per_sample", Quantity.NUMBER, default=0.0, maximum=MAX_DENSE_FLOPS_PER_SAMPLE
            ),
        )
        fields.finish()
        return spec
    kind = fields.take_enum("arch", ArchKind)
    given = next((k for k in ("parameters", "flops_per_sample") if fields.has(k)), None)
    if given is not None:
        raise fields.error(
            given, f"is derived from 'arch: {kind.value}' and cannot be given beside it", (f"remove '{given}'",)
        )
    if kind is not ArchKind.DCN:
        dcn_key = next((k for k in ("dcn_layers", "dcn_low_rank") if fields.has(k)), None)
        if dcn_key is not None:
            raise fields.error(dcn_key, "is for 'arch: dcn' only", (f"remove '{dcn_key}'", "set 'arch: dcn'"))
    if kind is not ArchKind.DIN and fields.has("attention"):
        raise fields.error("attention", "is for 'arch: din' only", ("remove 'attention'", "set 'arch: din'"))
    if kind.reads_sequences != bool(sequences):
        problem = (
            f"'{kind.value}' pools every feature, and the model has sequence tables (pooling: none)"
            if sequences
            else f"'{kind.value}' attends over sequence tables, and the model has none (pooling: none)"
        )
        fix = "set 'arch: din'" if sequences else "add a sequence table, or use 'arch: dlrm' or dcn"
        raise fields.error("arch", problem, (fix,))
    values: dict[str, Any] = {"kind": kind, "num_dense": num_dense, "inputs_from_data": not fields.has("num_dense")}
    for key, ceiling in (
        ("num_dense", MAX_DENSE_FEATURES),
        ("dcn_layers", MAX_LAYERS),
        ("dcn_low_rank", MAX_LAYER_WIDTH),
    ):
        if fields.has(key):
            values[key] = fields.take_positive(key, Quantity.COUNT, maximum=ceiling)
    for key in ("bottom", "over", "attention"):
        if fields.has(key):
            values[key] = _take_sizes(fields, key)
    if fields.has("dropout"):
        values["dropout"] = fields.take("dropout", Quantity.NUMBER, maximum=1.0)
    fields.finish()
    try:
        arch = DenseArch(**values)
    except ArchError as err:
        raise fields.error(err.field, err.problem, (err.fix,) if err.fix else ()) from None
    if len(dims) != 1:
        raise fields.error(
            "arch",
            f"'{kind.value}' needs one embedding dim for all tables (its interaction), got {sorted(dims)}",
            ("give every table the same dim",),
        )
    spec = DenseSpec.of_arch(arch, next(iter(dims)), features, sequences, candidates)
    if spec.parameters > MAX_DENSE_PARAMETERS or spec.flops_per_sample > MAX_DENSE_FLOPS_PER_SAMPLE:
        raise fields.error(
            "arch",
            f"the network has {spec.parameters:,} parameters and {spec.flops_per_sample:g} FLOPs per sample, over "
            f"the ceilings ({MAX_DENSE_PARAMETERS:,} and {MAX_DENSE_FLOPS_PER_SAMPLE:g})",
            ("give smaller layers",),
        )
    return spec


def _take_sizes(fields: Fields, key: str) -> tuple[int, ...]:
    """A list of layer sizes: positive integers."""
    value = fields.take(key)
    if not isinstance(value, list):
        raise fields.error(key, f"expected a list of layer sizes, got {abbreviate(value)}", (f"e.g. {key}: [64, 32]",))
    if len(value) > MAX_LAYERS:
        raise fields.error(key, f"has {len(value):,} layers, more than {MAX_LAYERS}", (f"give at most {MAX_LAYERS}",))
    for i, size in enumerate(value):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise fields.error(key, f"layer {i} is {abbreviate(size)}, not a positive integer")
    return tuple(value)
