"""One embedding table of a model: its shape, optimizer, access pattern, pooling and constraints (:class:`TableSpec`),
the optimizer table's torch-free half (:class:`Optimizer`), and how model.yaml's ``tables:`` entries are read."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from persia_planner.errors import abbreviate
from persia_planner.fields import Fields
from persia_planner.kinds import Sharding
from persia_planner.limits import MAX_DIM, MAX_POOLING_FACTOR, MAX_ROWS, MAX_TABLE_COUNT, MAX_ZIPF_ALPHA
from persia_planner.model.constraints import NO_CONSTRAINTS, TableConstraints, read_constraints
from persia_planner.model.dtypes import DType
from persia_planner.model.pooling import SEQUENCE_SHARDINGS, Pooling, SequenceLength
from persia_planner.units import Quantity

__all__ = [
    "OPTIMIZER_STATE_VALUE_BYTES",
    "SEQUENCE_SHARDINGS_FIX",
    "TABLE_NAME_PATTERN",
    "Optimizer",
    "TableSpec",
    "read_tables",
    "sequence_refusal",
]

OPTIMIZER_STATE_VALUE_BYTES = 4  # float32: fbgemm's momentum tensors and the parameter-server store's state


class Optimizer(enum.StrEnum):
    """Sparse optimizer of a table; decides the optimizer state held per row.

    The planner's half of the optimizer table (:data:`_STATE_VALUES`: the state each engine keeps per row); the
    runtime's half, keyed by the same enum, maps it to fbgemm's fused type and the parameter servers' row optimizer
    (``modules/embedding/hybrid.py``) and to a ``torch.optim`` class
    (:func:`persia_planner.plan.torchrec_export.torch_optimizer`).
    """

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    ADAM = "adam"

    @property
    def default_eps(self) -> float | None:
        """The epsilon a run gives the optimizer when none is named (``persia train --sparse-eps``; None: SGD has
        none). Adagrad's and row-wise Adagrad's is 1e-3, not fbgemm's 1e-8: at 1e-8 a row's first step is ``lr`` per
        coordinate whatever its gradient, so an id seen once moves as far as the most frequent and the rare ids
        over-fit within an epoch; 1e-3 keeps a new row's steps in proportion to its gradient until its accumulator
        outgrows it, as Keras's ``initial_accumulator_value`` does (docs/decisions/0030-measured-defaults.md).
        Adam keeps the usual 1e-8."""
        return _DEFAULT_EPS[self]

    @property
    def rowwise(self) -> bool:
        """Whether the state is one value per row (fbgemm then keeps it in HBM even for UVM tables)."""
        return self is Optimizer.ROWWISE_ADAGRAD

    def state_values(self, dim: int) -> int:
        """float32 optimizer state values fbgemm keeps per row of ``dim`` columns (a TorchRec local table)."""
        per_column, per_row = _STATE_VALUES[self][0]
        return per_column * dim + per_row

    def state_bytes_per_row(self, dim: int) -> int:
        """Optimizer state bytes per row of ``dim`` columns (formats.md): sgd 0, rowwise_adagrad 1, adagrad ``dim``,
        adam ``2 * dim`` values, each float32 whatever the weights' dtype (fbgemm's ``momentum1`` / ``momentum2``
        are float32 unless ``optimizer_state_dtypes`` says otherwise, which TorchRec does not set)."""
        return self.state_values(dim) * OPTIMIZER_STATE_VALUE_BYTES

    def ps_state_values(self, dim: int) -> int:
        """float32 optimizer values the parameter-server store keeps per row (``modules/ps/optim.py``'s
        ``state_width``): sgd 0, rowwise_adagrad 1, adagrad ``dim``, adam ``2 * dim + 1`` (both moments and the
        row's step count)."""
        per_column, per_row = _STATE_VALUES[self][1]
        return per_column * dim + per_row


_DEFAULT_EPS: Mapping[Optimizer, float | None] = {
    Optimizer.SGD: None,
    Optimizer.ROWWISE_ADAGRAD: 1e-3,
    Optimizer.ADAGRAD: 1e-3,
    Optimizer.ADAM: 1e-8,
}
_STATE_VALUES: Mapping[Optimizer, tuple[tuple[int, int], tuple[int, int]]] = {
    # optimizer: ((per column, per row) in fbgemm's TBE, (per column, per row) in the parameter-server store)
    Optimizer.SGD: ((0, 0), (0, 0)),
    Optimizer.ROWWISE_ADAGRAD: ((0, 1), (0, 1)),
    Optimizer.ADAGRAD: ((1, 0), (1, 0)),
    Optimizer.ADAM: ((2, 0), (2, 1)),
}
"""The optimizer table's torch-free columns: float32 state values per row of ``dim`` columns, as
``per_column * dim + per_row``."""


@dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    Attributes:
        name: Table name (unique in the model).
        rows: Number of embeddings (``num_embeddings``).
        dim: Embedding dimension.
        pooling_factor: Mean ids per sample looked up in this table (a sequence table: its mean length, plus its
            candidate's one id).
        optimizer: Sparse optimizer.
        zipf_alpha: Access skew of ids; 0 means uniform.
        embedding_dtype: The table's own weight dtype; None: the model's
            (:meth:`persia_planner.model.specs.ModelSpec.dtype_of`).
        constraints: What the planner may do with it (model.yaml's ``constraints:``; default: anything).
        pooling: How a sample's rows leave the table: pooled (``sum``, ``mean``) or one each (``none``: a sequence
            table, TorchRec's ``EmbeddingConfig``).
        max_sequence_length: A sequence table's longest kept sequence (None: pooled, or not known, as a TorchRec
            ``EmbeddingConfig`` does not say).
        candidate: A sequence table's candidate: the pooled table (feature) whose id each sample also looks up in
            this table, so that DIN compares the candidate with the sequence in one embedding space (the sequence
            holds ids of the candidate's kind: a history of items). None: DIN's query is learned from every feature.
    """

    name: str
    rows: int
    dim: int
    pooling_factor: float = 1.0
    optimizer: Optimizer = Optimizer.ROWWISE_ADAGRAD
    zipf_alpha: float = 0.0
    embedding_dtype: DType | None = None
    constraints: TableConstraints = NO_CONSTRAINTS
    pooling: Pooling = Pooling.SUM
    max_sequence_length: int | None = None
    candidate: str | None = None

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name!r}: rows and dim must be > 0")
        if (self.max_sequence_length is not None or self.candidate is not None) and self.pooling.pooled:
            raise ValueError(f"table {self.name!r}: a pooled table has no max_sequence_length or candidate")

    @property
    def sequence(self) -> bool:
        """Whether every id's row is its own output (``pooling: none``), not pooled into its sample's one."""
        return not self.pooling.pooled

    @property
    def outputs_per_sample(self) -> float:
        """Rows of output per sample and feature: one pooled vector, or a sequence's every id (its mean length)."""
        return self.pooling_factor if self.sequence else 1.0

    def allows(self, sharding: Sharding) -> bool:
        """Whether the table's kind can be sharded ``sharding`` (a sequence table: TorchRec's
        ``EmbeddingCollectionSharder``'s types, :data:`~persia_planner.model.pooling.SEQUENCE_SHARDINGS`)."""
        return not self.sequence or sharding in SEQUENCE_SHARDINGS

    @property
    def sequence_mean(self) -> float:
        """The mean ids per sample of the table's own feature: a sequence's mean length (its candidate's id aside)."""
        return self.pooling_factor - (1.0 if self.candidate else 0.0)

    @property
    def features(self) -> tuple[str, ...]:
        """The features looked up in the table: its own (its name), then its candidate's."""
        return (self.name, self.candidate) if self.candidate else (self.name,)

    @property
    def sequence_length(self) -> SequenceLength | None:
        """A sequence table's length (mean and max), where its max is known."""
        if not self.sequence or self.max_sequence_length is None:
            return None
        return SequenceLength(self.sequence_mean, self.max_sequence_length)

    def row_bytes(self, dtype: DType, cols: int | None = None) -> int:
        """Bytes per row (weights in ``dtype`` + float32 optimizer state) for ``cols`` of the table's columns
        (default: all).

        Row-wise state (one float32 per row) is kept whole by every column shard, as fbgemm does.
        """
        cols = self.dim if cols is None else cols
        return cols * dtype.n_bytes + self.optimizer.state_bytes_per_row(cols)

    def bytes(self, dtype: DType) -> int:
        """Bytes of the whole table: rows x (dim x dtype bytes + state bytes)."""
        return self.rows * self.row_bytes(dtype)

    @property
    def parameters(self) -> int:
        return self.rows * self.dim


TABLE_NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}"
"""What a table name may be: it becomes a file name in checkpoints (``persia train --checkpoint``), so letters,
digits, ``_``, ``-`` and ``.``, not starting with ``.`` (a hidden file, or ``..``), at most 200 characters (file
systems allow 255 bytes, and the checkpoint adds a suffix)."""
_TABLE_NAME = re.compile(TABLE_NAME_PATTERN)
_TABLE_NAME_FIX = (
    f"name it to match {TABLE_NAME_PATTERN} (letters, digits, '_', '-', '.'; no leading '.'; at most 200 characters)"
)


def read_tables(item: Fields) -> Iterable[TableSpec]:
    """The tables of one model.yaml ``tables:`` entry (``count: N`` makes ``N`` of them, ``name_0`` ...).

    Raises:
        SpecError: A bad key or value, named by its path.
    """
    name = item.take_str("name")
    rows = item.take_positive("rows", Quantity.COUNT, maximum=MAX_ROWS)
    dim = item.take_positive("dim", Quantity.COUNT, maximum=MAX_DIM)
    kind = item.take_enum("pooling", Pooling, default=Pooling.SUM)
    length = _read_sequence_length(item, kind)
    pooling = (
        length[0] if length else item.take("pooling_factor", Quantity.NUMBER, default=1.0, maximum=MAX_POOLING_FACTOR)
    )
    candidate = item.take_str("candidate", default=None)
    if candidate is not None and kind.pooled:
        raise item.error(
            "candidate", "only a sequence table (pooling: none) has a candidate", fixes=("add pooling: none",)
        )
    if candidate is not None:  # each sample looks its candidate's id up here too
        pooling += 1.0
    optimizer = item.take_enum("optimizer", Optimizer, default=Optimizer.ROWWISE_ADAGRAD)
    alpha = item.take("zipf_alpha", Quantity.NUMBER, default=0.0, maximum=MAX_ZIPF_ALPHA)
    count = item.take_positive("count", Quantity.COUNT, default=1, maximum=MAX_TABLE_COUNT)
    dtype = item.take_enum("embedding_dtype", DType, default=None)
    constraints = read_constraints(item.sub("constraints", default=None), name if isinstance(name, str) else "")
    item.finish()
    if not name:
        raise item.error("name", "table name is empty", fixes=(_TABLE_NAME_FIX,))
    if not _TABLE_NAME.fullmatch(name):
        raise item.error(
            "name", f"table name {abbreviate(name, 60)} cannot be a checkpoint file name", fixes=(_TABLE_NAME_FIX,)
        )
    refused = sequence_refusal(kind, constraints)
    if refused:
        raise item.error("constraints", refused, fixes=(SEQUENCE_SHARDINGS_FIX,))
    names = [name] if count == 1 else [f"{name}_{i}" for i in range(count)]
    longest = length[1] if length else None
    return [
        TableSpec(
            n,
            rows,
            dim,
            pooling,
            optimizer,
            alpha,
            embedding_dtype=dtype,
            constraints=constraints,
            pooling=kind,
            max_sequence_length=longest,
            candidate=candidate,
        )
        for n in names
    ]


SEQUENCE_SHARDINGS_FIX = (
    "allow only "
    + ", ".join(sorted(s.value for s in SEQUENCE_SHARDINGS))
    + " (TorchRec's EmbeddingCollectionSharder's types, and the parameter servers')"
)
"""The fix :func:`sequence_refusal` offers."""


def sequence_refusal(pooling: Pooling, constraints: TableConstraints) -> str | None:
    """Why a table of ``pooling`` cannot take ``constraints`` (a sequence table allowed a sharding type only pooled
    tables have), in a few words; None where it can."""
    allowed = constraints.sharding_types
    if pooling.pooled or allowed is None or allowed <= SEQUENCE_SHARDINGS:
        return None
    refused = " or ".join(sorted(s.value for s in allowed - SEQUENCE_SHARDINGS))
    return f"a sequence table (pooling: none) cannot be sharded {refused}"


def _read_sequence_length(item: Fields, kind: Pooling) -> tuple[float, int | None] | None:
    """model.yaml's ``sequence_length: {mean, max}`` of a ``pooling: none`` table as ``(mean, max)`` (required
    there, refused on a pooled one, where ``pooling_factor`` says the same); ``max`` may be left out (not known: a
    spec read from TorchRec's configs writes none)."""
    if kind.pooled:
        if item.has("sequence_length"):
            raise item.error(
                "sequence_length",
                "only a sequence table (pooling: none) has a sequence_length",
                fixes=("add pooling: none", "give a pooled table's ids per sample as pooling_factor"),
            )
        return None
    if item.has("pooling_factor"):
        raise item.error(
            "pooling_factor",
            "a sequence table (pooling: none) gives its ids per sample as sequence_length",
            fixes=("write sequence_length: {mean: M, max: N}",),
        )
    length = item.sub("sequence_length", default=None)
    if length is None:
        raise item.error(
            "sequence_length",
            "a sequence table (pooling: none) needs its sequence_length",
            fixes=("write sequence_length: {mean: M, max: N} (ids per sample: mean and longest)",),
        )
    mean = length.take_positive("mean", Quantity.NUMBER, maximum=MAX_POOLING_FACTOR)
    longest = length.take_positive("max", Quantity.COUNT, default=None, maximum=MAX_POOLING_FACTOR)
    length.finish()
    if longest is not None and mean > longest:
        raise length.error("mean", f"{mean:g} is over max {longest}", fixes=("give a mean of at most max",))
    return float(mean), None if longest is None else int(longest)
