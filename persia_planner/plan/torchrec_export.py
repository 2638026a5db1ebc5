"""Export plans to TorchRec: the ``ShardingPlan`` a run hands to ``DistributedModelParallel``.

The GPU-resident part of a plan (tables on the ``hbm``, ``ddr`` and ``hbm_cache`` tiers, data-parallel ones
included) maps one-to-one onto a TorchRec ``ShardingPlan``: our sharding names are TorchRec's ``ShardingType``
values and each tier is a compute kernel::

    hbm -> "fused"     ddr -> "fused_uvm"     hbm_cache -> "fused_uvm_caching" (+ CacheParams(load_factor))
    data_parallel -> "dense"

Tables on the ``ps`` tier train asynchronously on the parameter servers and are not part of the ShardingPlan;
:func:`gpu_tables` names the tables it covers. TorchRec's row-wise kernels route ids to ranks in blocks of
``ceil(rows / ranks)`` (:func:`~persia_planner.placement.shards.row_blocks`), so row-wise shards are exported in that
layout (see :func:`torchrec_shardings`).

Beside it: :mod:`persia_planner.plan.executability` (how a run must execute a plan, and what TorchRec or fbgemm would
run differently) and :mod:`persia_planner.plan.torchrec_scoring` (TorchRec's plans read back as ours, and any placement
rated by TorchRec's own estimators).

This module imports torch / torchrec only inside functions: ``import persia_planner.plan.torchrec_export`` works without
them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.kinds import Sharding
from persia_planner.model.specs import ModelSpec, Optimizer, TableSpec
from persia_planner.placement.shards import Shard, TablePlacement, row_blocks
from persia_planner.plan.plan import Plan
from persia_planner.plan.torchrec_collections import (
    CollectionPaths,
    collection_paths,
    to_embedding_bag_configs,
    to_embedding_configs,
)
from persia_planner.plan.validation import require_same_tables, wrong_device
from persia_planner.tiers import replica_tier
from persia_planner.topology.graph import Topology

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torchrec.distributed.types import ShardingPlan

__all__ = [
    "DATA_PARALLEL_KERNEL",
    "DEFAULT_CACHE_LOAD_FACTOR",
    "PlanLike",
    "ShardBox",
    "TorchRecSharding",
    "gpu_tables",
    "to_embedding_bag_configs",
    "to_embedding_configs",
    "to_sharding_plan",
    "torch_optimizer",
    "torchrec_shardings",
]

DATA_PARALLEL_KERNEL = "dense"
DEFAULT_CACHE_LOAD_FACTOR = 0.2
"""Cache load factor TorchRec uses for ``fused_uvm_caching`` when none is given (its ``UVM_CACHING_RATIO``)."""

_ROW_SPLIT = (Sharding.ROW_WISE, Sharding.TABLE_ROW_WISE)
_COL_SPLIT = (Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE)

PlanLike = Plan | Mapping[str, TablePlacement]


@dataclass(frozen=True)
class ShardBox:
    """One TorchRec shard: a rectangle of the table on one rank.

    Attributes:
        rank: Global rank (index into ``topology.gpus``).
        row_offset: First row.
        col_offset: First column.
        rows: Number of rows (TorchRec's row-wise layout may hold 0).
        cols: Number of columns.
    """

    rank: int
    row_offset: int
    col_offset: int
    rows: int
    cols: int


@dataclass(frozen=True)
class TorchRecSharding:
    """A table's sharding in TorchRec's terms, without torch objects (JSON-friendly; see :meth:`to_dict`).

    Attributes:
        table: Table name (TorchRec's parameter name in the ``EmbeddingModuleShardingPlan``).
        sharding_type: A TorchRec ``ShardingType`` value.
        compute_kernel: A TorchRec ``EmbeddingComputeKernel`` value.
        shards: The shards in TorchRec's order (data-parallel: one full replica per rank).
        cache_load_factor: ``CacheParams.load_factor`` for ``fused_uvm_caching`` (None: TorchRec's default).
    """

    table: str
    sharding_type: str
    compute_kernel: str
    shards: tuple[ShardBox, ...]
    cache_load_factor: float | None = None

    @property
    def ranks(self) -> list[int]:
        """Ranks in shard order (``ParameterSharding.ranks``)."""
        return [s.rank for s in self.shards]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (read back with :meth:`from_dict`)."""
        return {
            "table": self.table,
            "sharding_type": self.sharding_type,
            "compute_kernel": self.compute_kernel,
            "shards": [[s.rank, s.row_offset, s.col_offset, s.rows, s.cols] for s in self.shards],
            "cache_load_factor": self.cache_load_factor,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TorchRecSharding:
        """Inverse of :meth:`to_dict`."""
        factor = data.get("cache_load_factor")
        return cls(
            table=str(data["table"]),
            sharding_type=str(data["sharding_type"]),
            compute_kernel=str(data["compute_kernel"]),
            shards=tuple(ShardBox(*(int(x) for x in box)) for box in data["shards"]),
            cache_load_factor=None if factor is None else float(factor),
        )

    @classmethod
    def from_option(cls, option: Any) -> TorchRecSharding:
        """From a TorchRec ``ShardingOption`` (its shards must have ranks, as in a planner's chosen plan)."""
        shards = []
        for shard in option.shards:
            if shard.rank is None:
                raise PlannerError(
                    f"TorchRec option for table {option.name!r} has a shard without a rank",
                    kind=ErrorKind.INPUT,
                    fixes=("pass the planner's chosen options (ranks assigned)",),
                )
            (rows, cols), (row_off, col_off) = shard.size, shard.offset
            shards.append(ShardBox(int(shard.rank), int(row_off), int(col_off), int(rows), int(cols)))
        cache = getattr(option, "cache_params", None)
        factor = getattr(cache, "load_factor", None) if cache is not None else None
        return cls(
            option.name,
            str(option.sharding_type),
            str(option.compute_kernel),
            tuple(shards),
            None if factor is None else float(factor),
        )


# ---- plan -> TorchRec (pure) ---------------------------------------------------------------------------------
def tables_of(plan: PlanLike) -> Mapping[str, TablePlacement]:
    return plan.tables if isinstance(plan, Plan) else plan


def gpu_tables(plan: PlanLike) -> list[str]:
    """Names of the tables the TorchRec ShardingPlan covers (every table not on the ``ps`` tier), in plan order.

    Args:
        plan: A plan, or its ``tables`` mapping.
    """
    return [name for name, p in tables_of(plan).items() if p.sharding is not Sharding.PS_HASH]


def _unsupported(table: str, problem: str, fix: str | None = None) -> PlannerError:
    return PlannerError(
        f"cannot export table {table!r} to TorchRec: {problem}", kind=ErrorKind.UNSUPPORTED, fixes=(fix,) if fix else ()
    )


def local_world_size(topology: Topology) -> int:
    return len(topology.trainers[0].gpus)


def uniform_hosts(topology: Topology) -> bool:
    return len({len(h.gpus) for h in topology.trainers}) == 1


def torchrec_shardings(plan: PlanLike, model: ModelSpec, topology: Topology) -> list[TorchRecSharding]:
    """The GPU-resident part of ``plan`` in TorchRec's terms, one entry per table of :func:`gpu_tables`.

    Shard order follows TorchRec: column-wise shards by column, row-wise shards by row (= by rank), and row-wise
    tables use TorchRec's ``ceil(rows / ranks)`` blocks. A row-wise plan split differently only by rounding
    (every boundary within ``ranks - 1`` rows of TorchRec's, as the planner's even split is) is re-blocked to
    TorchRec's layout on the same ranks; anything further off cannot run in TorchRec and raises.

    Args:
        plan: A plan (or its ``tables`` mapping) for ``model`` on ``topology``.
        model: The model the plan places.
        topology: The topology; rank ``r`` is ``topology.gpus[r]``.

    Raises:
        PlannerError: Kind ``unsupported`` when a placement has no TorchRec equivalent (mixed tiers in a table,
            replicas not on every GPU, a row split TorchRec cannot route, ...); kind ``invalid_plan`` when the plan
            names a table or device the model / topology does not have.
    """
    tables = tables_of(plan)
    require_same_tables(tables, (t.name for t in model.tables))
    result = []
    for table in model.tables:  # model order: TorchRec's EBC order
        placement = tables[table.name]
        if placement.sharding is Sharding.PS_HASH:
            continue
        result.append(_table_sharding(table, placement, topology))
    return result


def _table_sharding(table: TableSpec, placement: TablePlacement, topology: Topology) -> TorchRecSharding:
    name, s = table.name, placement.sharding
    if not placement.shards:
        raise PlannerError(f"table {name!r} has no shards", kind=ErrorKind.INVALID_PLAN)
    if not table.allows(s):
        raise _unsupported(
            name, f"is a sequence table, which TorchRec's EmbeddingCollectionSharder cannot shard {s.value}"
        )
    tiers = {shard.tier for shard in placement.shards}
    off = sorted(t for t in tiers if t.spec.torchrec_kernel is None)
    if off:
        raise _unsupported(
            name, f"{s.value} shards on the {off[0]} tier (only ps_hash tables live on parameter servers)"
        )
    if len(tiers) > 1:
        raise _unsupported(
            name,
            f"its shards mix tiers {sorted(t.value for t in tiers)}; TorchRec has one compute kernel per table",
            "put every shard of the table on one tier",
        )
    tier = tiers.pop()
    ranks = []
    gpu_names = {g.name for g in topology.gpus}
    for shard in placement.shards:
        if shard.device not in gpu_names:
            raise PlannerError(
                f"table {name!r}: shard device {wrong_device(topology, shard.device, gpu=True)}",
                kind=ErrorKind.INVALID_PLAN,
                fixes=("export with the topology the plan was made for",),
            )
        ranks.append(topology.gpu_index(shard.device))
    world = len(topology.gpus)

    if s is Sharding.DATA_PARALLEL:
        if sorted(ranks) != list(range(world)) or tier is not replica_tier():
            raise _unsupported(name, "TorchRec data_parallel keeps one HBM replica on every rank", "re-plan the table")
        boxes = tuple(ShardBox(r, 0, 0, table.rows, table.dim) for r in range(world))
        return TorchRecSharding(name, s.value, DATA_PARALLEL_KERNEL, boxes)

    factor = None
    if tier.spec.cached:
        fractions = {shard.cache_fraction for shard in placement.shards}
        if len(fractions) > 1:
            raise _unsupported(name, f"its shards use different cache fractions {sorted(fractions, key=str)}")
        factor = fractions.pop() or DEFAULT_CACHE_LOAD_FACTOR
    kernel = tier.spec.torchrec_kernel

    if any(shard.rows is None for shard in placement.shards):
        raise _unsupported(name, f"{s.value} shards need row ranges")
    # Empty shards (no rows or no columns) hold nothing; TorchRec's own row-wise layout re-creates any it needs.
    pieces = sorted(
        ((shard, rank) for shard, rank in zip(placement.shards, ranks, strict=True) if _area(shard) > 0),
        key=lambda p: (p[0].rows, p[0].cols),
    )
    if not pieces:
        raise PlannerError(f"table {name!r}: every shard is empty", kind=ErrorKind.INVALID_PLAN)

    if s is Sharding.TABLE_WISE:
        shard, rank = pieces[0]
        if len(pieces) != 1 or shard.rows != (0, table.rows) or shard.cols != (0, table.dim):
            raise _unsupported(name, "table_wise needs exactly one shard holding the whole table")
        boxes = (ShardBox(rank, 0, 0, table.rows, table.dim),)
    elif s in _COL_SPLIT:
        if any(shard.rows != (0, table.rows) for shard, _ in pieces):
            raise _unsupported(name, f"{s.value} shards must hold every row")
        pieces.sort(key=lambda p: p[0].cols)
        _require_tiling(name, [shard.cols for shard, _ in pieces], table.dim, "columns")
        if s is Sharding.TABLE_COLUMN_WISE:
            _require_one_host(name, s, ranks, topology)
        boxes = tuple(ShardBox(rank, 0, shard.cols[0], table.rows, shard.n_cols) for shard, rank in pieces)
    elif s in _ROW_SPLIT:
        boxes = _row_boxes(table, s, pieces, topology)
    else:  # pragma: no cover - every Sharding is handled above
        raise _unsupported(name, f"sharding {s.value!r} has no TorchRec equivalent")
    return TorchRecSharding(name, s.value, kernel, boxes, factor)


def _area(shard: Shard) -> int:
    rows = shard.rows[1] - shard.rows[0] if shard.rows is not None else 1
    return max(rows, 0) * max(shard.n_cols, 0)


def _require_tiling(name: str, ranges: Sequence[tuple[int, int]], end: int, what: str) -> None:
    edge = 0
    for a, b in ranges:
        if a != edge or b <= a:
            raise PlannerError(
                f"table {name!r}: {what} ranges {list(ranges)} do not tile [0, {end}) exactly once",
                kind=ErrorKind.INVALID_PLAN,
            )
        edge = b
    if edge != end:
        raise PlannerError(
            f"table {name!r}: {what} ranges {list(ranges)} do not tile [0, {end}) exactly once",
            kind=ErrorKind.INVALID_PLAN,
        )


def _require_one_host(name: str, s: Sharding, ranks: Sequence[int], topology: Topology) -> None:
    hosts = {topology.gpus[r].host for r in ranks}
    if len(hosts) != 1:
        raise _unsupported(name, f"{s.value} shards must stay on one host, found {sorted(hosts)}")
    if not uniform_hosts(topology):
        raise _unsupported(
            name,
            f"{s.value} needs the same GPU count on every host (TorchRec groups ranks by a single local world size)",
            "use row_wise / column_wise on this topology",
        )


def _row_boxes(
    table: TableSpec, s: Sharding, pieces: list[tuple[Shard, int]], topology: Topology
) -> tuple[ShardBox, ...]:
    name = table.name
    if any(shard.cols != (0, table.dim) for shard, _ in pieces):
        raise _unsupported(name, f"{s.value} shards must hold every column")
    _require_tiling(name, [shard.rows for shard, _ in pieces], table.rows, "row")  # type: ignore[misc]
    ranks = [rank for _, rank in pieces]
    if s is Sharding.ROW_WISE:
        group = list(range(len(topology.gpus)))
    else:
        _require_one_host(name, s, ranks, topology)
        local = local_world_size(topology)
        first = ranks[0] // local * local
        group = list(range(first, first + local))
    expected = row_blocks(table.rows, len(group))
    where = "every rank" if s is Sharding.ROW_WISE else f"the ranks {group[0]}..{group[-1]} of one host"
    if ranks != group[: len(ranks)] or any(expected[len(ranks) :]):
        raise _unsupported(
            name,
            f"{s.value} puts its row blocks on ranks {ranks}, but TorchRec splits the rows over {where} in rank "
            f"order ({expected} rows)",
            f"re-plan the table with {s.value} over {where}",
        )
    starts = [shard.rows[0] for shard, _ in pieces]  # type: ignore[index]
    torchrec_starts = [sum(expected[:i]) for i in range(len(pieces))]
    worst = max(abs(a - b) for a, b in zip(starts, torchrec_starts, strict=True))
    if worst >= len(group):
        raise _unsupported(
            name,
            f"its row split starts at {starts}, but TorchRec routes ids in blocks of {expected[0]} rows "
            f"(starts {torchrec_starts}); only rounding differences can be re-blocked",
            f"split the rows as {expected}",
        )
    offsets = [sum(expected[:i]) for i in range(len(group))]
    return tuple(ShardBox(r, off, 0, n, table.dim) for r, off, n in zip(group, offsets, expected, strict=True))


# ---- torch objects ---------------------------------------------------------------------------------------------
def _placement_string(rank: int, device_type: str, topology: Topology) -> str:
    if device_type == "cpu":
        return f"rank:{rank}/cpu"
    gpu = topology.gpus[rank]
    local = topology.host(gpu.host).gpus.index(gpu.name)  # == rank % local_world_size on uniform hosts
    return f"rank:{rank}/{device_type}:{local}"


def cache_params(factor: float | None) -> Any:
    from torchrec.distributed.types import CacheParams

    return CacheParams(load_factor=factor) if factor is not None else None


def to_sharding_plan(
    plan: PlanLike,
    model: ModelSpec | Any,
    topology: Topology,
    *,
    module_path: str | None = None,
    sequence_module_path: str | None = None,
    device_type: str | None = None,
) -> ShardingPlan:
    """The GPU-resident part of ``plan`` as a TorchRec ``ShardingPlan`` (one ``ParameterSharding`` per table, under
    its collection's path: the pooled tables' ``EmbeddingBagCollection``, the sequence tables' ``EmbeddingCollection``).

    Tables on the ``ps`` tier are left out (see :func:`gpu_tables`); build the ``EmbeddingBagCollection`` from
    ``to_embedding_bag_configs(model, gpu_tables(plan))`` (the ``EmbeddingCollection`` from
    :func:`~persia_planner.plan.torchrec_collections.to_embedding_configs`), or hold a persia collection of every
    table and shard it with its sharder (``HybridEmbeddingBagCollectionSharder``).

    Args:
        plan: A plan (or its ``tables`` mapping) for ``model`` on ``topology``.
        model: The model the plan places: its spec, or the ``nn.Module`` to be given to ``DistributedModelParallel``,
            whose embedding collections (a module with ``embedding_bag_configs()``, one with ``embedding_configs()``)
            are found with their paths.
        topology: The topology; rank ``r`` is ``topology.gpus[r]``.
        module_path: Fully qualified name of the pooled tables' collection inside the module given to
            ``DistributedModelParallel`` (``"ebc"`` for ``model.ebc``; ``""`` when the collection is the module);
            default: the path found in ``model``, or ``""`` for a spec.
        sequence_module_path: The same for the sequence tables' collection; default: the path found in ``model``,
            or for a spec ``module_path`` when it has no pooled table (it is required for a spec with both).
        device_type: ``"cuda"`` or ``"cpu"`` shard placements; default ``"cuda"`` when CUDA is available.

    Raises:
        PlannerError: A placement TorchRec cannot express (see :func:`torchrec_shardings`); a module holding no
            collection, several of a kind (naming their paths), or none at a path given; a spec with pooled and
            sequence tables and no ``sequence_module_path``.
    """
    import torch
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        EnumerableShardingSpec,
        ParameterSharding,
        ShardingPlan,
        ShardMetadata,
    )

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(model, ModelSpec):
        paths = _spec_paths(model, module_path, sequence_module_path)
    else:
        paths = collection_paths(model, module_path, sequence_module_path, tables_of(plan))
    model = paths.model
    path_of = {t.name: paths.path_of(t) for t in model.tables}
    module_plans: dict[str, EmbeddingModuleShardingPlan] = {}
    for entry in torchrec_shardings(plan, model, topology):
        spec = None
        if entry.sharding_type != Sharding.DATA_PARALLEL.value:
            spec = EnumerableShardingSpec(
                [
                    ShardMetadata(
                        shard_offsets=[b.row_offset, b.col_offset],
                        shard_sizes=[b.rows, b.cols],
                        placement=_placement_string(b.rank, device_type, topology),
                    )
                    for b in entry.shards
                ]
            )
        module_plan = module_plans.setdefault(path_of[entry.table], EmbeddingModuleShardingPlan())
        module_plan[entry.table] = ParameterSharding(
            sharding_type=entry.sharding_type,
            compute_kernel=entry.compute_kernel,
            ranks=entry.ranks,
            sharding_spec=spec,
            cache_params=cache_params(entry.cache_load_factor),
        )
    if not module_plans:  # every table on the servers: an empty plan of the collection, as before
        module_plans[paths.bags if paths.bags is not None else paths.sequences or ""] = EmbeddingModuleShardingPlan()
    return ShardingPlan(plan=module_plans)


def _spec_paths(model: ModelSpec, module_path: str | None, sequence_module_path: str | None) -> CollectionPaths:
    """A spec's collections' paths: ``module_path`` (default ``""``) for its pooled tables, ``sequence_module_path``
    for its sequence tables (default: ``module_path`` where it has no pooled table).

    Raises:
        PlannerError: Pooled and sequence tables, and no ``sequence_module_path``: TorchRec holds them in two
            collections.
    """
    pooled, sequences = (any(t.sequence is s for t in model.tables) for s in (False, True))
    if pooled and sequences and sequence_module_path is None:
        raise PlannerError(
            "to_sharding_plan: the model has pooled and sequence tables, which TorchRec holds in an "
            "EmbeddingBagCollection and an EmbeddingCollection",
            fixes=("pass sequence_module_path= the EmbeddingCollection's path (module_path= the other's)",),
        )
    bags = module_path or ""
    return CollectionPaths(bags if pooled else None, sequence_module_path or bags if sequences else None, model)


def torch_optimizer(optimizer: Optimizer) -> Any:
    """The ``torch.optim`` class of a sparse optimizer (TorchRec's ``RowWiseAdagrad`` for row-wise Adagrad)."""
    import torch
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    return {
        Optimizer.SGD: torch.optim.SGD,
        Optimizer.ROWWISE_ADAGRAD: RowWiseAdagrad,
        Optimizer.ADAGRAD: torch.optim.Adagrad,
        Optimizer.ADAM: torch.optim.Adam,
    }[optimizer]
