"""What is being placed: a whole model, its embedding tables (:mod:`.tables`) and dense network (model.yaml, or
TorchRec's collections: :mod:`.torchrec_configs`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persia_planner.errors import PlannerError
from persia_planner.fields import Fields, load_document
from persia_planner.limits import MAX_BATCH_SIZE, MAX_STALENESS, MAX_TABLES
from persia_planner.model.constraints import TableConstraints
from persia_planner.model.data_schema import DataSchema, read_data_schema
from persia_planner.model.dense import DLRM_BOTTOM, DLRM_NUM_DENSE, DLRM_TOP, DenseArch, DenseSpec, read_dense
from persia_planner.model.dtypes import DType
from persia_planner.model.pooling import Pooling, SequenceLength
from persia_planner.model.qcomms import AUTO, QComms
from persia_planner.model.tables import (
    OPTIMIZER_STATE_VALUE_BYTES,
    TABLE_NAME_PATTERN,
    Optimizer,
    TableSpec,
    read_tables,
)
from persia_planner.model.torchrec_configs import torchrec_configs, torchrec_tables
from persia_planner.units import Quantity

if TYPE_CHECKING:
    from persia_planner.topology.graph import Topology

__all__ = [
    "DEFAULT_STALENESS",
    "DLRM_BOTTOM",
    "DLRM_TOP",
    "OPTIMIZER_STATE_VALUE_BYTES",
    "TABLE_NAME_PATTERN",
    "DType",
    "DenseArch",
    "DenseSpec",
    "ModelSpec",
    "Optimizer",
    "Pooling",
    "SequenceLength",
    "TableConstraints",
    "TableSpec",
    "load_model",
    "with_run_options",
]

DEFAULT_STALENESS = 4


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
            if t.sequence:
                length = {"mean": t.sequence_mean} | ({"max": t.max_sequence_length} if t.max_sequence_length else {})
                table |= {"pooling": t.pooling.value, "sequence_length": length}
                if t.candidate:
                    table["candidate"] = t.candidate
            else:
                table |= {"pooling_factor": t.pooling_factor} | (
                    {"pooling": "mean"} if t.pooling is Pooling.MEAN else {}
                )
            table["optimizer"] = t.optimizer.value
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
            for table in read_tables(item):
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
        pooled_names = {t.name for t in tables if not t.sequence}
        odd = next((t for t in tables if t.candidate and t.candidate not in pooled_names), None)
        if odd is not None:
            raise top.error(
                "tables",
                f"table {odd.name!r}: candidate {odd.candidate!r} is not a pooled table of the model",
                fixes=("name the pooled table whose ids the sequence holds (an item table for a history of items)",),
            )
        dims = sorted({t.dim for t in tables if t.sequence})
        if len(dims) > 1:  # persia train holds them in one EmbeddingCollection, whose tables TorchRec makes share it
            raise top.error(
                "tables",
                f"the sequence tables (pooling: none) have dims {', '.join(map(str, dims))}: TorchRec's "
                "EmbeddingCollection needs one dim for all of them",
                fixes=("give every sequence table the same dim",),
            )
        data = read_data_schema(top.sub("data", default=None))
        # A tabular model's dense inputs are its data's dense columns: the arch (and its price) reads them.
        inputs = data.num_inputs if data is not None else DLRM_NUM_DENSE
        pooled = sum(not t.sequence for t in tables)
        sequences = tuple(t.sequence_mean for t in tables if t.sequence)
        candidates = sum(t.candidate is not None for t in tables)
        dense = read_dense(
            top.sub("dense", default=None), {t.dim for t in tables}, pooled, inputs, sequences, candidates
        )
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
        max_sequence_lengths: Mapping[str, int] | None = None,
        optimizer: Optimizer = Optimizer.ROWWISE_ADAGRAD,
        constraints: Mapping[str, Any] | None = None,
        topology: Topology | None = None,
    ) -> ModelSpec:
        """Build from TorchRec's embedding collections or their configs.

        Works with modules on the meta device: only the configs are read, never the weights.

        Args:
            tables: An ``EmbeddingBagCollection`` (anything with ``embedding_bag_configs()``: pooled tables), an
                ``EmbeddingCollection`` (anything with ``embedding_configs()``: sequence tables, ``pooling: none``),
                a model holding either or both (every collection's tables, in module order), or a list of
                ``EmbeddingBagConfig`` / ``EmbeddingConfig``.
            batch_size: Global batch size.
            name: Model name for the plan.
            dense: The dense part, if known.
            pooling_factors: Mean ids per sample per table name, a sequence table's mean length (default: the
                constraints' ``pooling_factors``, else 1.0).
            max_sequence_lengths: The longest sequence a sample keeps, per sequence table name (default: not known;
                TorchRec's configs do not say).
            optimizer: Sparse optimizer of every table.
            constraints: TorchRec's ``ParameterConstraints`` per table name, as its planner takes them: their
                sharding types, compute kernels, cache load factor, ranks and pooling factors become each table's
                :class:`~persia_planner.model.constraints.TableConstraints` (see
                :func:`~persia_planner.model.constraints.from_parameter_constraints`).
            topology: The topology the ranks of ``constraints`` number (rank ``r`` is ``topology.gpus[r]``);
                needed only where a constraint gives ``ranks``.

        Raises:
            SpecError: ``constraints`` names a table the collection lacks, a sharding type a sequence table cannot
                take, or one that cannot be read as ours; a module that holds no collection.
        """
        gpu_names = None if topology is None else [g.name for g in topology.gpus]
        specs = torchrec_tables(
            torchrec_configs(tables),
            pooling_factors=dict(pooling_factors or {}),
            max_sequence_lengths=dict(max_sequence_lengths or {}),
            optimizer=optimizer,
            constraints=dict(constraints or {}),
            gpu_names=gpu_names,
        )
        # The model's default is the most common dtype; every table keeps its own.
        dtypes = [t.embedding_dtype for t in specs if t.embedding_dtype is not None]
        dtype = max(DType, key=dtypes.count) if dtypes else DType.FP32
        return cls(name, int(batch_size), tuple(specs), dense or DenseSpec(), dtype)


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
