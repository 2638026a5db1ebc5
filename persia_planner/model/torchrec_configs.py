"""A TorchRec model's tables as the planner's :class:`~persia_planner.model.tables.TableSpec`: its
``EmbeddingBagCollection`` (pooled bags) and ``EmbeddingCollection`` (sequences), their configs, or a whole model
holding either or both. Read duck-typed, without importing torch: a collection has ``embedding_bag_configs()`` or
``embedding_configs()``, a config ``pooling`` (a bag's) or not (a sequence's ``EmbeddingConfig``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from persia_planner.errors import SpecError, abbreviate
from persia_planner.model.constraints import NO_CONSTRAINTS, TORCHREC_SOURCE, from_parameter_constraints
from persia_planner.model.dtypes import DType
from persia_planner.model.pooling import Pooling
from persia_planner.model.tables import SEQUENCE_SHARDINGS_FIX, Optimizer, TableSpec, sequence_refusal

__all__ = ["BAGS", "SEQUENCES", "collections_of", "kind_of", "torchrec_configs", "torchrec_tables"]

BAGS = "embedding_bag_configs"
"""The method a collection of pooled tables gives its configs by (:func:`kind_of`)."""
SEQUENCES = "embedding_configs"
"""The method a collection of sequence tables gives its configs by."""


def collections_of(module: Any) -> list[tuple[str, Any]]:
    """The embedding collections of ``module`` (itself included) by path, outermost first: each module with
    ``embedding_bag_configs()`` (a bag collection, TorchRec's or persia's) or ``embedding_configs()`` (a sequence
    collection) that no other one holds."""
    if kind_of(module) is not None:
        return [("", module)]
    found: list[tuple[str, Any]] = []
    named = getattr(module, "named_modules", None)
    for path, m in named() if callable(named) else ():
        if kind_of(m) is not None and not any(path.startswith(f"{p}.") for p, _ in found):
            found.append((path, m))
    return found


def kind_of(module: Any) -> str | None:
    """The method ``module`` gives its table configs by: a bag collection's :data:`BAGS` (checked first: persia's
    bag collection refuses ``embedding_configs()``, which TorchRec's managed-collision wrapper asks of it), a
    sequence collection's :data:`SEQUENCES`, or None."""
    for kind in (BAGS, SEQUENCES):
        if callable(getattr(module, kind, None)):
            return kind
    return None


def torchrec_configs(source: Any) -> list[Any]:
    """The table configs of ``source``: a collection, a model holding collections (every one's, in module order), or
    configs already.

    Raises:
        SpecError: A module that holds no embedding collection.
    """
    if isinstance(source, Sequence) and not isinstance(source, str):
        return list(source)
    found = collections_of(source)
    if not found:
        if not callable(getattr(source, "named_modules", None)):
            return list(source)  # any other iterable of configs
        raise SpecError(
            TORCHREC_SOURCE,
            type(source).__name__,
            "holds no EmbeddingBagCollection or EmbeddingCollection",
            fixes=("pass the model that holds its embedding collections, or their configs",),
        )
    return [c for _, m in found for c in getattr(m, kind_of(m) or BAGS)()]


def torchrec_tables(
    configs: Sequence[Any],
    *,
    pooling_factors: Mapping[str, float],
    max_sequence_lengths: Mapping[str, int],
    optimizer: Optimizer,
    constraints: Mapping[str, Any],
    gpu_names: Sequence[str] | None,
) -> list[TableSpec]:
    """One :class:`TableSpec` per config (see :meth:`persia_planner.model.specs.ModelSpec.from_torchrec`).

    Raises:
        SpecError: ``constraints`` name a table the configs lack, a sharding type a sequence table cannot take, or
            something that cannot be read as ours; a dtype the planner cannot train.
    """
    names = {c.name for c in configs}
    for what, keyed in (("constrains", constraints), ("gives the max sequence length of", max_sequence_lengths)):
        unknown = sorted(set(keyed) - names)
        if unknown:
            raise SpecError(
                TORCHREC_SOURCE,
                str(unknown[0]),
                f"{what} table {unknown[0]!r}, which the collection lacks",
                fixes=("key them by table name",),
            )
    tables = []
    for config in configs:
        allowed, pooling = NO_CONSTRAINTS, None
        if config.name in constraints:
            allowed, pooling = from_parameter_constraints(config.name, constraints[config.name], gpu_names)
        kind = _pooling(config)
        refused = sequence_refusal(kind, allowed)
        if refused:
            raise SpecError(TORCHREC_SOURCE, f"{config.name}.sharding_types", refused, fixes=(SEQUENCE_SHARDINGS_FIX,))
        longest = max_sequence_lengths.get(config.name) if not kind.pooled else None
        mean = float(pooling_factors.get(config.name, pooling or 1.0))
        if longest is not None and not 0 < mean <= longest:
            raise SpecError(
                TORCHREC_SOURCE,
                f"{config.name}.max_sequence_length",
                f"{longest} is under the table's mean sequence length {mean:g}",
                fixes=("give the longest sequence a sample keeps",),
            )
        tables.append(
            TableSpec(
                name=config.name,
                rows=int(config.num_embeddings),
                dim=int(config.embedding_dim),
                pooling_factor=mean,
                optimizer=optimizer,
                embedding_dtype=_dtype(config),
                constraints=allowed,
                pooling=kind,
                max_sequence_length=None if longest is None else int(longest),
            )
        )
    return tables


def _pooling(config: Any) -> Pooling:
    """A config's pooling: an ``EmbeddingBagConfig``'s ``PoolingType`` (sum or mean), ``none`` for an
    ``EmbeddingConfig``, which has none.

    Raises:
        SpecError: A pooling the planner does not know.
    """
    if not hasattr(config, "pooling"):
        return Pooling.NONE
    name = str(getattr(config.pooling, "name", config.pooling)).rsplit(".", 1)[-1].lower()
    try:
        return Pooling(name)
    except ValueError:
        raise SpecError(
            "EmbeddingBagConfig",
            f"{config.name}.pooling",
            f"{abbreviate(name, 20)} is not a pooling the planner knows (sum, mean)",
            fixes=("use PoolingType.SUM or PoolingType.MEAN",),
        ) from None


def _dtype(config: Any) -> DType:
    """A config's ``data_type`` (TorchRec's ``DataType``, e.g. ``DataType.FP16``) as a :class:`DType`.

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
            type(config).__name__,
            f"{config.name}.data_type",
            f"{abbreviate(name, 20)} is not a trainable embedding dtype ({', '.join(d.value for d in DType)})",
            fixes=("train the table in fp32, fp16 or bf16 and quantize it for inference",),
        ) from None
