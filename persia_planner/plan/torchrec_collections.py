"""Which TorchRec collection holds each table of a plan: the configs a spec's tables become (an
``EmbeddingBagCollection`` of its pooled tables, an ``EmbeddingCollection`` of its sequence tables) and where a
user's module holds them, so that :func:`persia_planner.plan.torchrec_export.to_sharding_plan` keys every table's
``ParameterSharding`` by its own collection's path.

Torch and TorchRec are imported inside functions only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.model.specs import DType, ModelSpec, TableSpec
from persia_planner.model.torchrec_configs import BAGS, collections_of, kind_of

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig

__all__ = [
    "CollectionPaths",
    "collection_paths",
    "require_pooled",
    "to_embedding_bag_configs",
    "to_embedding_configs",
]


def _data_type(dtype: DType) -> Any:
    from torchrec.modules.embedding_configs import DataType

    return DataType[dtype.value.upper()]


def _chosen(model: ModelSpec, tables: Iterable[str] | None, sequence: bool) -> list[TableSpec]:
    """The model's tables of one kind, in model order: every one, or those ``tables`` names.

    Raises:
        KeyError: A name in ``tables`` is not a table of the model.
        PlannerError: It names a table of the other kind.
    """
    wanted = None if tables is None else set(tables)
    if wanted is not None:
        unknown = wanted - {t.name for t in model.tables}
        if unknown:
            raise KeyError(f"model {model.name!r} has no table {sorted(unknown)[0]!r}")
        other = sorted(t.name for t in model.tables if t.name in wanted and t.sequence is not sequence)
        if other:
            kind, builder = ("a pooled", "bag_") if sequence else ("a sequence", "")
            fix = f"build its config with to_embedding_{builder}configs"
            raise PlannerError(f"table {other[0]!r} is {kind} table", fixes=(fix,))
    return [t for t in model.tables if t.sequence is sequence and (wanted is None or t.name in wanted)]


def to_embedding_bag_configs(model: ModelSpec, tables: Iterable[str] | None = None) -> list[EmbeddingBagConfig]:
    """TorchRec ``EmbeddingBagConfig`` per pooled table (feature name = table name, its pooling, its dtype).

    Args:
        model: The model.
        tables: Only these tables (e.g. ``gpu_tables(plan)``), in model order; default every pooled table (a sequence
            table's config is :func:`to_embedding_configs`').

    Raises:
        KeyError: A name in ``tables`` is not a table of the model.
        PlannerError: A name in ``tables`` is a sequence table.
    """
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(
            name=t.name,
            feature_names=[t.name],
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            pooling=PoolingType[t.pooling.name],
            data_type=_data_type(model.dtype_of(t)),
        )
        for t in _chosen(model, tables, sequence=False)
    ]


def to_embedding_configs(model: ModelSpec, tables: Iterable[str] | None = None) -> list[EmbeddingConfig]:
    """TorchRec ``EmbeddingConfig`` per sequence table (``pooling: none``; feature name = table name, then its
    candidate's feature where it has one; its dtype), for an ``EmbeddingCollection``.

    Args:
        model: The model.
        tables: Only these tables, in model order; default every sequence table.

    Raises:
        KeyError: A name in ``tables`` is not a table of the model.
        PlannerError: A name in ``tables`` is a pooled table.
    """
    from torchrec.modules.embedding_configs import EmbeddingConfig

    return [
        EmbeddingConfig(
            name=t.name,
            feature_names=list(t.features),  # its own feature, then its candidate's
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            data_type=_data_type(model.dtype_of(t)),
        )
        for t in _chosen(model, tables, sequence=True)
    ]


@dataclass(frozen=True)
class CollectionPaths:
    """Where a module given to ``DistributedModelParallel`` holds a plan's tables.

    Attributes:
        bags: The path of the collection of pooled tables (None: the module has none).
        sequences: The path of the collection of sequence tables (None: none).
        model: The tables of both, as the planner reads them (bags first).
    """

    bags: str | None
    sequences: str | None
    model: ModelSpec

    def path_of(self, table: TableSpec) -> str:
        """The path of the collection that holds ``table``."""
        path = self.sequences if table.sequence else self.bags
        assert path is not None  # the model holds only the collections' tables
        return path


def collection_paths(
    module: Any, module_path: str | None, sequence_module_path: str | None, planned: Iterable[str] = ()
) -> CollectionPaths:
    """The collections of ``module`` a plan's tables are in: its one collection of bags (``embedding_bag_configs()``,
    TorchRec's or persia's) and its one collection of sequences (``embedding_configs()``), each the outermost one
    (not a persia collection's own inner TorchRec one), or those at the paths given. A collection that holds none of
    the ``planned`` tables is left out unless its path was given (an unplanned one beside the planned one).

    Raises:
        PlannerError: A path that is no collection of the module (of that kind), several collections of a kind and
            no path, or no collection at all.
    """
    found = collections_of(module)
    paths = [p or "(the module itself)" for p, _ in found]
    if module_path is not None and sequence_module_path is None:
        named = [m for p, m in found if p == module_path]
        if named and kind_of(named[0]) != BAGS:  # the one collection the plan is for is a sequence collection
            module_path, sequence_module_path = None, module_path
    bags = [(p, m) for p, m in found if kind_of(m) == BAGS]
    sequences = [(p, m) for p, m in found if kind_of(m) != BAGS]
    chosen_bags = _pick(bags, module_path, "module_path", paths, "EmbeddingBagCollection")
    chosen_sequences = _pick(sequences, sequence_module_path, "sequence_module_path", paths, "EmbeddingCollection")
    wanted = set(planned)

    def unplanned(found: tuple[str, Any] | None, given: str | None) -> bool:
        if found is None or given is not None or not wanted:
            return False
        return not any(c.name in wanted for c in getattr(found[1], kind_of(found[1]) or BAGS)())

    if unplanned(chosen_bags, module_path):
        chosen_bags = None
    if unplanned(chosen_sequences, sequence_module_path):
        chosen_sequences = None
    chosen = [c for c in (chosen_bags, chosen_sequences) if c is not None]
    if not chosen:
        raise PlannerError(
            "to_sharding_plan: the model holds no embedding collection", fixes=("pass the model spec instead",)
        )
    model = ModelSpec.from_torchrec([c for _, m in chosen for c in getattr(m, kind_of(m) or BAGS)()], batch_size=1)
    return CollectionPaths(
        chosen_bags[0] if chosen_bags else None, chosen_sequences[0] if chosen_sequences else None, model
    )


def _pick(
    found: Sequence[tuple[str, Any]], path: str | None, option: str, paths: list[str], kind: str
) -> tuple[str, Any] | None:
    """The collection of one kind at ``path`` (``option`` names it), else the one there is (None if none)."""
    if path is not None:
        chosen = [(p, m) for p, m in found if p == path]
        if not chosen:
            raise PlannerError(
                f"to_sharding_plan: {option}={path!r} is no embedding collection of the model; it holds "
                f"{paths or 'none'}",
                fixes=(f"pass the path of the model's {kind}",),
            )
        return chosen[0]
    if len(found) > 1:
        where = ", ".join(p or "(the module itself)" for p, _ in found)
        raise PlannerError(
            f"to_sharding_plan: the model holds {len(found)} embedding collections ({where})",
            fixes=(f"pass {option}= the one the plan is for",),
        )
    return found[0] if found else None


def require_pooled(model: ModelSpec, what: str) -> None:
    """Refuse a model with sequence tables where only an ``EmbeddingBagCollection`` is built (TorchRec's planner and
    perf model, :mod:`persia_planner.plan.torchrec_scoring`).

    Raises:
        PlannerError: Kind ``unsupported``, naming the tables and ``what`` refused them.
    """
    sequences = [t.name for t in model.tables if t.sequence]
    if sequences:
        raise PlannerError(
            f"{what} is compared on pooled tables only, and model {model.name!r} has sequence tables "
            f"({', '.join(sequences[:3])})",
            kind=ErrorKind.UNSUPPORTED,
            fixes=("compare a model of pooled tables",),
        )
