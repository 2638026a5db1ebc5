"""What is being placed: embedding tables and the dense network (model.yaml, or TorchRec configs)."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persia_planner.errors import PlannerError, SpecError, abbreviate
from persia_planner.fields import Fields, load_document
from persia_planner.limits import (
    MAX_BATCH_SIZE,
    MAX_DIM,
    MAX_POOLING_FACTOR,
    MAX_ROWS,
    MAX_STALENESS,
    MAX_TABLE_COUNT,
    MAX_TABLES,
    MAX_ZIPF_ALPHA,
)
from persia_planner.model.constraints import (
    NO_CONSTRAINTS,
    TORCHREC_SOURCE,
    TableConstraints,
    from_parameter_constraints,
    read_constraints,
)
from persia_planner.model.data_schema import DataSchema, read_data_schema
from persia_planner.model.dense import DLRM_BOTTOM, DLRM_NUM_DENSE, DLRM_TOP, DenseArch, DenseSpec, read_dense
from persia_planner.model.dtypes import DType
from persia_planner.model.qcomms import AUTO, QComms
from persia_planner.units import Quantity

if TYPE_CHECKING:
    from persia_planner.topology.graph import Topology

__all__ = [
    "DEFAULT_STALENESS",
    "DLRM_BOTTOM",
    "DLRM_TOP",
    "DType",
    "DenseArch",
    "DenseSpec",
    "ModelSpec",
    "Optimizer",
    "TableConstraints",
    "TableSpec",
    "load_model",
    "with_run_options",
]

DEFAULT_STALENESS = 4
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
        pooling_factor: Mean ids per sample looked up in this table.
        optimizer: Sparse optimizer.
        zipf_alpha: Access skew of ids; 0 means uniform.
        embedding_dtype: The table's own weight dtype; None: the model's (:meth:`ModelSpec.dtype_of`).
        constraints: What the planner may do with it (model.yaml's ``constraints:``; default: anything).
    """

    name: str
    rows: int
    dim: int
    pooling_factor: float = 1.0
    optimizer: Optimizer = Optimizer.ROWWISE_ADAGRAD
    zipf_alpha: float = 0.0
    embedding_dtype: DType | None = None
    constraints: TableConstraints = NO_CONSTRAINTS

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name!r}: rows and dim must be > 0")

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


@dataclass(frozen=True)
class ModelSpec:
    """A whole model: tables, dense part, batch.

    Attributes:
        name: Model name, copied into plan.json.
        batch_size: Global samples per training step.
        tables: The embedding tables, in file order.
        dense: The dense network.
        embedding_dtype: Weight dtype of the tables that do not name their own.
        staleness: Persia's embedding staleness K: how many steps async (PS) work may lag; 0 = synchronous.
        data: How the columns of a Parquet / CSV click log feed the model (model.yaml's ``data:``), if given.
        ps_wire_dtype: The dtype parameter-server rows and gradients travel in (``persia train --ps-wire``); the
            plan prices PS traffic in it.
        qcomms: The precisions of the trainers' collectives (:class:`~persia_planner.model.qcomms.QComms`); None
            (model.yaml's ``auto``): the planner chooses.
    """

    name: str
    batch_size: int
    tables: tuple[TableSpec, ...]
    dense: DenseSpec = field(default_factory=DenseSpec)
    embedding_dtype: DType = DType.FP32
    staleness: int = DEFAULT_STALENESS
    data: DataSchema | None = None
    ps_wire_dtype: DType = DType.FP32
    qcomms: QComms | None = None

    def __post_init__(self) -> None:
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"table name {dup!r} appears twice")

    def dtype_of(self, table: TableSpec) -> DType:
        """``table``'s weight dtype: its own, else the model's ``embedding_dtype``."""
        return table.embedding_dtype or self.embedding_dtype

    @property
    def table_dtypes(self) -> dict[str, DType]:
        """Each table's weight dtype, by table name."""
        return {t.name: self.dtype_of(t) for t in self.tables}

    @property
    def dtypes(self) -> frozenset[DType]:
        """The weight dtypes of the tables."""
        return frozenset(self.dtype_of(t) for t in self.tables)

    def table(self, name: str) -> TableSpec:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(name)

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes(self.dtype_of(t)) for t in self.tables)

    @property
    def embedding_parameters(self) -> int:
        return sum(t.parameters for t in self.tables)

    def to_dict(self) -> dict[str, Any]:
        """As model.yaml writes it: :meth:`from_dict` reads back an equal spec."""
        tables = []
        for t in self.tables:
            table: dict[str, Any] = {"name": t.name, "rows": t.rows, "dim": t.dim}
            table |= {"pooling_factor": t.pooling_factor, "optimizer": t.optimizer.value}
            if t.zipf_alpha:
                table["zipf_alpha"] = t.zipf_alpha
            if t.embedding_dtype is not None:
                table["embedding_dtype"] = t.embedding_dtype.value
            if t.constraints.to_dict():
                table["constraints"] = t.constraints.to_dict()
            tables.append(table)
        out: dict[str, Any] = {
            "name": self.name,
            "batch_size": self.batch_size,
            "embedding_dtype": self.embedding_dtype.value,
            "staleness": self.staleness,
            "ps_wire_dtype": self.ps_wire_dtype.value,
            "qcomms": AUTO if self.qcomms is None else self.qcomms.to_dict(),
            "tables": tables,
        }
        arch = self.dense.arch
        if arch is not None:
            out["dense"] = arch.to_dict()
            if arch.inputs_from_data:  # the data's dense columns, as when model.yaml left it out
                del out["dense"]["num_dense"]
        elif self.dense != DenseSpec():
            out["dense"] = {"parameters": self.dense.parameters, "flops_per_sample": self.dense.flops_per_sample}
        if self.data is not None:
            out["data"] = self.data.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "model.yaml") -> ModelSpec:
        """Build from parsed model.yaml content; errors name ``source`` and the key path."""
        top = Fields(data, source, "")
        name = top.take_str("name", default="model")
        batch_size = top.take_positive("batch_size", Quantity.COUNT, maximum=MAX_BATCH_SIZE)
        dtype = top.take_enum("embedding_dtype", DType, default=DType.FP32)
        staleness = top.take("staleness", Quantity.COUNT, default=DEFAULT_STALENESS, maximum=MAX_STALENESS)
        wire = top.take_enum("ps_wire_dtype", DType, default=DType.FP32)
        qcomms = _read_qcomms(top)
        tables: list[TableSpec] = []
        seen: dict[str, str] = {}
        for _, item in top.take_list("tables", max_items=MAX_TABLES):
            for table in _read_tables(item):
                if table.name in seen:
                    raise item.error(
                        "name", f"table name {table.name!r} is already used by {seen[table.name]}", ("rename it",)
                    )
                seen[table.name] = item.path
                tables.append(table)
            if len(tables) > MAX_TABLES:  # every table is held, and searched over, in memory
                raise top.error(
                    "tables",
                    f"the model has over {MAX_TABLES:,} tables (by {item.path})",
                    fixes=("check the tables' counts",),
                )
        if not tables:
            raise top.error("tables", "the model has no tables", fixes=("add at least one table",))
        data = read_data_schema(top.sub("data", default=None))
        # A tabular model's dense inputs are its data's dense columns: the arch (and its price) reads them.
        inputs = data.num_inputs if data is not None else DLRM_NUM_DENSE
        dense = read_dense(top.sub("dense", default=None), {t.dim for t in tables}, len(tables), inputs)
        top.finish()
        return cls(
            name, batch_size, tuple(tables), dense, dtype, staleness, data=data, ps_wire_dtype=wire, qcomms=qcomms
        )

    @classmethod
    def from_torchrec(
        cls,
        tables: Any,
        batch_size: int,
        *,
        name: str = "torchrec-model",
        dense: DenseSpec | None = None,
        pooling_factors: Mapping[str, float] | None = None,
        optimizer: Optimizer = Optimizer.ROWWISE_ADAGRAD,
        constraints: Mapping[str, Any] | None = None,
        topology: Topology | None = None,
    ) -> ModelSpec:
        """Build from a TorchRec ``EmbeddingBagCollection`` or a list of ``EmbeddingBagConfig``.

        Works with modules on the meta device: only the configs are read, never the weights.

        Args:
            tables: An ``EmbeddingBagCollection`` (anything with ``embedding_bag_configs()``) or configs.
            batch_size: Global batch size.
            name: Model name for the plan.
            dense: The dense part, if known.
            pooling_factors: Mean ids per sample per table name (default: the constraints' ``pooling_factors``,
                else 1.0).
            optimizer: Sparse optimizer of every table.
            constraints: TorchRec's ``ParameterConstraints`` per table name, as its planner takes them: their
                sharding types, compute kernels, cache load factor, ranks and pooling factors become each table's
                :class:`~persia_planner.model.constraints.TableConstraints` (see
                :func:`~persia_planner.model.constraints.from_parameter_constraints`).
            topology: The topology the ranks of ``constraints`` number (rank ``r`` is ``topology.gpus[r]``);
                needed only where a constraint gives ``ranks``.

        Raises:
            SpecError: ``constraints`` names a table the collection lacks, or one that cannot be read as ours.
        """
        configs = tables.embedding_bag_configs() if hasattr(tables, "embedding_bag_configs") else list(tables)
        pooling_factors = dict(pooling_factors or {})
        constraints = dict(constraints or {})
        unknown = sorted(set(constraints) - {c.name for c in configs})
        if unknown:
            raise SpecError(
                TORCHREC_SOURCE,
                str(unknown[0]),
                f"constrains table {unknown[0]!r}, which the collection lacks",
                fixes=("key the constraints by table name",),
            )
        gpu_names = None if topology is None else [g.name for g in topology.gpus]
        specs = []
        for config in configs:
            allowed, pooling = NO_CONSTRAINTS, None
            if config.name in constraints:
                allowed, pooling = from_parameter_constraints(config.name, constraints[config.name], gpu_names)
            specs.append(
                TableSpec(
                    name=config.name,
                    rows=int(config.num_embeddings),
                    dim=int(config.embedding_dim),
                    pooling_factor=float(pooling_factors.get(config.name, pooling or 1.0)),
                    optimizer=optimizer,
                    embedding_dtype=_torchrec_dtype(config),
                    constraints=allowed,
                )
            )
        # The model's default is the most common dtype; every table keeps its own.
        dtypes = [t.embedding_dtype for t in specs if t.embedding_dtype is not None]
        dtype = max(DType, key=dtypes.count) if dtypes else DType.FP32
        return cls(name, int(batch_size), tuple(specs), dense or DenseSpec(), dtype)


def _torchrec_dtype(config: Any) -> DType:
    """An ``EmbeddingBagConfig``'s ``data_type`` (TorchRec's ``DataType``, e.g. ``DataType.FP16``) as a :class:`DType`.

    Raises:
        SpecError: A dtype the planner cannot price or the runtime cannot train (e.g. INT8 weights): a silent float32
            would price and allocate the table at the wrong size.
    """
    value = getattr(config, "data_type", None)
    if value is None:
        return DType.FP32
    name = str(getattr(value, "name", value)).rsplit(".", 1)[-1].lower()
    try:
        return DType(name)
    except ValueError:
        raise SpecError(
            "EmbeddingBagConfig",
            f"{config.name}.data_type",
            f"{abbreviate(name, 20)} is not a trainable embedding dtype ({', '.join(d.value for d in DType)})",
            fixes=("train the table in fp32, fp16 or bf16 and quantize it for inference",),
        ) from None


TABLE_NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}"
"""What a table name may be: it becomes a file name in checkpoints (``persia train --checkpoint``), so letters,
digits, ``_``, ``-`` and ``.``, not starting with ``.`` (a hidden file, or ``..``), at most 200 characters (file
systems allow 255 bytes, and the checkpoint adds a suffix)."""
_TABLE_NAME = re.compile(TABLE_NAME_PATTERN)
_TABLE_NAME_FIX = (
    f"name it to match {TABLE_NAME_PATTERN} (letters, digits, '_', '-', '.'; no leading '.'; at most 200 characters)"
)


def _read_tables(item: Fields) -> Iterable[TableSpec]:
    name = item.take_str("name")
    rows = item.take_positive("rows", Quantity.COUNT, maximum=MAX_ROWS)
    dim = item.take_positive("dim", Quantity.COUNT, maximum=MAX_DIM)
    pooling = item.take("pooling_factor", Quantity.NUMBER, default=1.0, maximum=MAX_POOLING_FACTOR)
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
    names = [name] if count == 1 else [f"{name}_{i}" for i in range(count)]
    return [
        TableSpec(n, rows, dim, pooling, optimizer, alpha, embedding_dtype=dtype, constraints=constraints)
        for n in names
    ]


def with_run_options(
    model: ModelSpec, *, staleness: int | None = None, ps_wire: str | None = None, qcomms: str | None = None
) -> ModelSpec:
    """``model`` with the staleness K, the PS wire dtype and the collectives' precisions a run will use
    (``--staleness``, ``--ps-wire``, ``--qcomms``; None keeps the model's): the plan is priced for them and records
    them.

    Raises:
        PlannerError: ``ps_wire`` names no dtype, or ``qcomms`` is not ``auto``, a dtype or two.
    """
    wire = model.ps_wire_dtype if ps_wire is None else DType.parse(ps_wire, "--ps-wire")
    comms = model.qcomms if qcomms is None else QComms.from_value(qcomms, "--qcomms")
    staleness = model.staleness if staleness is None else int(staleness)
    return replace(model, staleness=staleness, ps_wire_dtype=wire, qcomms=comms)


def _read_qcomms(top: Fields) -> QComms | None:
    """model.yaml's ``qcomms``: ``auto`` (default), a dtype for both directions, or ``{forward, backward}``."""
    value = top.take("qcomms", default=AUTO)
    try:
        return QComms.from_value(value, "qcomms")
    except PlannerError as err:
        raise top.error("qcomms", str(err).removeprefix("qcomms "), fixes=("see formats.md, qcomms",)) from None


def load_model(path: str | Path) -> ModelSpec:
    """Load and validate a model.yaml.

    Raises:
        SpecError: Malformed YAML, unknown key, bad unit or value; the message names the file and key path.
    """
    data, source = load_document(path, "see formats.md for the model.yaml keys")
    return ModelSpec.from_dict(data, Path(source).name)
