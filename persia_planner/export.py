"""Export plans to TorchRec, and read TorchRec's plans back.

The GPU-resident part of a plan (tables on the ``hbm``, ``ddr`` and ``hbm_cache`` tiers, data-parallel ones
included) maps one-to-one onto a TorchRec ``ShardingPlan``: our sharding names are TorchRec's ``ShardingType``
values and each tier is a compute kernel::

    hbm -> "fused"     ddr -> "fused_uvm"     hbm_cache -> "fused_uvm_caching" (+ CacheParams(load_factor))
    data_parallel -> "dense"

Tables on the ``ps`` tier train asynchronously on the parameter servers and are not part of the ShardingPlan;
:func:`gpu_tables` names the tables it covers. TorchRec's row-wise kernels route ids to ranks in blocks of
``ceil(rows / ranks)``, so row-wise shards are exported in that layout (see :func:`torchrec_shardings`).

The other direction (:func:`from_sharding_options`) turns TorchRec's chosen ``ShardingOption`` list into our
placements, so our cost model can score TorchRec's plan, and :func:`score_with_torchrec` scores any placement with
TorchRec's own perf model.

This module imports torch / torchrec only inside functions: ``import persia_planner.export`` works without them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.placement import Shard, Sharding, TablePlacement, Tier, row_blocks
from persia_planner.plans import Plan, require_same_tables
from persia_planner.specs import DType, ModelSpec, Optimizer, TableSpec
from persia_planner.topology import Topology

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torchrec.distributed.planner import Topology as TorchRecTopology
    from torchrec.distributed.planner.types import ShardingOption
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

__all__ = [
    "DEFAULT_CACHE_LOAD_FACTOR",
    "KERNEL_OF_TIER",
    "ShardBox",
    "TorchRecSharding",
    "check_executable",
    "from_sharding_options",
    "gpu_tables",
    "meta_collection",
    "planned_execution",
    "score_with_torchrec",
    "shardings_from_plan",
    "to_embedding_bag_configs",
    "to_sharding_options",
    "to_sharding_plan",
    "to_torchrec_topology",
    "torch_optimizer",
    "torchrec_constraints",
    "torchrec_shardings",
    "torchrec_topology_kwargs",
]

KERNEL_OF_TIER: Mapping[Tier, str] = {Tier.HBM: "fused", Tier.DDR: "fused_uvm", Tier.HBM_CACHE: "fused_uvm_caching"}
"""TorchRec compute kernel of each GPU-side tier (data-parallel tables use ``"dense"``)."""

DATA_PARALLEL_KERNEL = "dense"
DEFAULT_CACHE_LOAD_FACTOR = 0.2
"""Cache load factor TorchRec uses for ``fused_uvm_caching`` when none is given (its ``UVM_CACHING_RATIO``)."""

_TIER_OF_KERNEL: Mapping[str, Tier] = {
    "fused": Tier.HBM,
    "dense": Tier.HBM,
    "fused_uvm": Tier.DDR,
    "fused_uvm_caching": Tier.HBM_CACHE,
}
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


def shardings_from_plan(sharding_plan: Any, model: ModelSpec) -> list[TorchRecSharding]:
    """The entries of a TorchRec ``ShardingPlan`` (every module in it) as :class:`TorchRecSharding`, model order.

    Args:
        sharding_plan: A TorchRec ``ShardingPlan`` (e.g. returned by ``EmbeddingShardingPlanner.plan``).
        model: The model; gives the shape of data-parallel tables, whose entries carry no shard metadata.

    Raises:
        PlannerError: The plan names a table the model does not have.
    """
    entries: dict[str, TorchRecSharding] = {}
    for module_plan in sharding_plan.plan.values():
        for table, sharding in module_plan.items():
            try:
                spec = model.table(table)
            except KeyError:
                raise PlannerError(
                    f"TorchRec plan has table {table!r} that model {model.name!r} lacks", kind=ErrorKind.INPUT
                ) from None
            if sharding.sharding_spec is None:  # data_parallel: a full replica on each rank
                boxes = tuple(ShardBox(int(r), 0, 0, spec.rows, spec.dim) for r in sharding.ranks or ())
            else:
                boxes = tuple(
                    ShardBox(
                        _rank_of(m.placement),
                        int(m.shard_offsets[0]),
                        int(m.shard_offsets[1]),
                        int(m.shard_sizes[0]),
                        int(m.shard_sizes[1]),
                    )
                    for m in sharding.sharding_spec.shards
                )
            cache = sharding.cache_params
            factor = cache.load_factor if cache is not None else None
            entries[table] = TorchRecSharding(
                table,
                str(sharding.sharding_type),
                str(sharding.compute_kernel),
                boxes,
                None if factor is None else float(factor),
            )
    return [entries[t.name] for t in model.tables if t.name in entries]


def _rank_of(placement: Any) -> int:
    rank = placement.rank() if hasattr(placement, "rank") else None
    if rank is None:  # a placement string "rank:3/cuda:3"
        rank = int(str(placement).split("/")[0].split(":")[1])
    return int(rank)


# ---- plan -> TorchRec (pure) ---------------------------------------------------------------------------------
def _tables_of(plan: PlanLike) -> Mapping[str, TablePlacement]:
    return plan.tables if isinstance(plan, Plan) else plan


def gpu_tables(plan: PlanLike) -> list[str]:
    """Names of the tables the TorchRec ShardingPlan covers (every table not on the ``ps`` tier), in plan order.

    Args:
        plan: A plan, or its ``tables`` mapping.
    """
    return [name for name, p in _tables_of(plan).items() if p.sharding is not Sharding.PS_HASH]


def _unsupported(table: str, problem: str, fix: str | None = None) -> PlannerError:
    return PlannerError(
        f"cannot export table {table!r} to TorchRec: {problem}", kind=ErrorKind.UNSUPPORTED, fixes=(fix,) if fix else ()
    )


def _local_world_size(topology: Topology) -> int:
    return len(topology.trainers[0].gpus)


def _uniform_hosts(topology: Topology) -> bool:
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
    tables = _tables_of(plan)
    require_same_tables(tables, (t.name for t in model.tables))
    result = []
    for table in model.tables:  # model order: TorchRec's EBC order
        placement = tables[table.name]
        if placement.sharding is Sharding.PS_HASH:
            continue
        result.append(_table_sharding(table, placement, topology))
    return result


def planned_execution(plan: PlanLike, model: ModelSpec, topology: Topology) -> dict[str, dict[str, Any]]:
    """How a run must execute ``plan``, table by table, in the terms a run reports what it executed.

    Returns:
        ``{table: {"sharding", "kernel", "ranks"}}`` (TorchRec's sharding type, compute kernel and ranks in shard
        order) for local tables, ``{table: {"servers": [...]}}`` for parameter-server tables, in model order.
    """
    local = {
        e.table: {"sharding": e.sharding_type, "kernel": e.compute_kernel, "ranks": e.ranks}
        for e in torchrec_shardings(plan, model, topology)
    }
    tables = _tables_of(plan)
    out = {}
    for t in model.tables:
        if t.name in local:
            out[t.name] = local[t.name]
        else:
            out[t.name] = {"servers": sorted({s.device for s in tables[t.name].shards})}
    return out


def check_executable(
    plan: PlanLike, device_type: str, *, dtype: DType = DType.FP32, optimizer: Optimizer = Optimizer.SGD
) -> None:
    """Refuse a plan that TorchRec and fbgemm would not run as written on trainers of ``device_type``.

    - On CPU TorchRec runs the ``fused_uvm`` and ``fused_uvm_caching`` kernels (tiers ``ddr``, ``hbm_cache``) as
      plain host memory with the ``fused`` kernel: the plan would be silently changed.
    - fbgemm's CPU kernels have no bfloat16 tables.
    - Data-parallel tables are not fused: TorchRec leaves them to a ``torch.optim`` optimizer, whose state has the
      weights' dtype; an Adagrad-type or Adam state in fp16/bf16 underflows and the run diverges.

    Args:
        plan: The plan (or its ``tables``).
        device_type: ``cpu`` or ``cuda``.
        dtype: The model's ``embedding_dtype``.
        optimizer: The sparse optimizer of the local tables.

    Raises:
        PlannerError: Kind ``unsupported``, naming the first such table and the fix.
    """
    local = {name: p for name, p in _tables_of(plan).items() if p.sharding is not Sharding.PS_HASH}
    for name, p in local.items():
        tiers = {s.tier for s in p.shards}
        bad = tiers & {Tier.DDR, Tier.HBM_CACHE}
        if device_type != "cuda" and bad:
            tier = sorted(bad)[0]
            raise PlannerError(
                f"table {name!r} is planned on tier {tier.value} (TorchRec kernel {KERNEL_OF_TIER[tier]}), which "
                "needs CUDA unified memory; these trainers have no GPU",
                kind=ErrorKind.UNSUPPORTED,
                fixes=(
                    "plan for CPU trainers without ddr/hbm_cache tiers (a topology whose devices hold the local "
                    "tables in hbm)",
                    "train on GPUs",
                ),
            )
        if device_type != "cuda" and dtype is DType.BF16:
            raise PlannerError(
                f"table {name!r}: fbgemm's CPU kernels have no bfloat16 tables (embedding_dtype: bf16)",
                kind=ErrorKind.UNSUPPORTED,
                fixes=("use embedding_dtype: fp16 or fp32", "train on GPUs"),
            )
        if p.sharding is Sharding.DATA_PARALLEL and dtype is not DType.FP32 and optimizer is not Optimizer.SGD:
            raise PlannerError(
                f"table {name!r} is data_parallel in {dtype.value}: TorchRec updates replicas with a torch.optim "
                f"{optimizer.value} whose state would be {dtype.value} too, and it underflows",
                kind=ErrorKind.UNSUPPORTED,
                fixes=(
                    "use embedding_dtype: fp32",
                    "plan the table with a fused sharding (table_wise, row_wise, ...)",
                    "use the sgd sparse optimizer",
                ),
            )


def _table_sharding(table: TableSpec, placement: TablePlacement, topology: Topology) -> TorchRecSharding:
    name, s = table.name, placement.sharding
    if not placement.shards:
        raise PlannerError(f"table {name!r} has no shards", kind=ErrorKind.INVALID_PLAN)
    tiers = {shard.tier for shard in placement.shards}
    if Tier.PS in tiers:
        raise _unsupported(name, f"{s.value} shards on the ps tier (only ps_hash tables live on parameter servers)")
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
                f"table {name!r}: shard device {shard.device!r} is not a GPU of topology {topology.name!r}",
                kind=ErrorKind.INVALID_PLAN,
                fixes=("export with the topology the plan was made for",),
            )
        ranks.append(topology.gpu_index(shard.device))
    world = len(topology.gpus)

    if s is Sharding.DATA_PARALLEL:
        if sorted(ranks) != list(range(world)) or tier is not Tier.HBM:
            raise _unsupported(name, "TorchRec data_parallel keeps one HBM replica on every rank", "re-plan the table")
        boxes = tuple(ShardBox(r, 0, 0, table.rows, table.dim) for r in range(world))
        return TorchRecSharding(name, s.value, DATA_PARALLEL_KERNEL, boxes)

    factor = None
    if tier is Tier.HBM_CACHE:
        fractions = {shard.cache_fraction for shard in placement.shards}
        if len(fractions) > 1:
            raise _unsupported(name, f"its shards use different cache fractions {sorted(fractions, key=str)}")
        factor = fractions.pop() or DEFAULT_CACHE_LOAD_FACTOR
    kernel = KERNEL_OF_TIER[tier]

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
    if not _uniform_hosts(topology):
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
        local = _local_world_size(topology)
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
def _data_type(model: ModelSpec) -> Any:
    from torchrec.modules.embedding_configs import DataType

    return DataType[model.embedding_dtype.value.upper()]


def to_embedding_bag_configs(model: ModelSpec, tables: Iterable[str] | None = None) -> list[EmbeddingBagConfig]:
    """TorchRec ``EmbeddingBagConfig`` per table (feature name = table name, sum pooling, the model's dtype).

    Args:
        model: The model.
        tables: Only these tables (e.g. ``gpu_tables(plan)``), in model order; default every table.

    Raises:
        KeyError: A name in ``tables`` is not a table of the model.
    """
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    wanted = None if tables is None else set(tables)
    if wanted is not None:
        unknown = wanted - {t.name for t in model.tables}
        if unknown:
            raise KeyError(f"model {model.name!r} has no table {sorted(unknown)[0]!r}")
    data_type = _data_type(model)
    return [
        EmbeddingBagConfig(
            name=t.name,
            feature_names=[t.name],
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            pooling=PoolingType.SUM,
            data_type=data_type,
        )
        for t in model.tables
        if wanted is None or t.name in wanted
    ]


def _placement_string(rank: int, device_type: str, topology: Topology) -> str:
    if device_type == "cpu":
        return f"rank:{rank}/cpu"
    gpu = topology.gpus[rank]
    local = topology.host(gpu.host).gpus.index(gpu.name)  # == rank % local_world_size on uniform hosts
    return f"rank:{rank}/{device_type}:{local}"


def _cache_params(factor: float | None) -> Any:
    from torchrec.distributed.types import CacheParams

    return CacheParams(load_factor=factor) if factor is not None else None


def to_sharding_plan(
    plan: PlanLike,
    model: ModelSpec,
    topology: Topology,
    *,
    module_path: str = "",
    device_type: str | None = None,
) -> ShardingPlan:
    """The GPU-resident part of ``plan`` as a TorchRec ``ShardingPlan`` (one ``ParameterSharding`` per table).

    Tables on the ``ps`` tier are left out (see :func:`gpu_tables`); build the ``EmbeddingBagCollection`` from
    ``to_embedding_bag_configs(model, gpu_tables(plan))``.

    Args:
        plan: A plan (or its ``tables`` mapping) for ``model`` on ``topology``.
        model: The model the plan places.
        topology: The topology; rank ``r`` is ``topology.gpus[r]``.
        module_path: Fully qualified name of the ``EmbeddingBagCollection`` inside the module given to
            ``DistributedModelParallel`` (``"ebc"`` for ``model.ebc``; ``""`` when the collection is the module).
        device_type: ``"cuda"`` or ``"cpu"`` shard placements; default ``"cuda"`` when CUDA is available.

    Raises:
        PlannerError: A placement TorchRec cannot express (see :func:`torchrec_shardings`).
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
    module_plan = EmbeddingModuleShardingPlan()
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
        module_plan[entry.table] = ParameterSharding(
            sharding_type=entry.sharding_type,
            compute_kernel=entry.compute_kernel,
            ranks=entry.ranks,
            sharding_spec=spec,
            cache_params=_cache_params(entry.cache_load_factor),
        )
    return ShardingPlan(plan={module_path: module_plan})


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


def meta_collection(model: ModelSpec, tables: Iterable[str] | None = None) -> Any:
    """An ``EmbeddingBagCollection`` of ``model`` on the meta device (no memory), for planning and scoring.

    Each table's parameter carries its optimizer class (``apply_optimizer_in_backward``), so TorchRec's storage
    estimator counts the optimizer state as our model does.
    """
    import torch
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    ebc = EmbeddingBagCollection(tables=to_embedding_bag_configs(model, tables), device=torch.device("meta"))
    for config in ebc.embedding_bag_configs():
        spec = model.table(config.name)
        apply_optimizer_in_backward(torch_optimizer(spec.optimizer), [ebc.embedding_bags[config.name].weight], {})
    return ebc


def torchrec_constraints(model: ModelSpec, tables: Iterable[str] | None = None, **extra: Any) -> dict[str, Any]:
    """``ParameterConstraints`` per table with its pooling factor (plus ``extra`` constraint fields)."""
    from torchrec.distributed.planner.types import ParameterConstraints

    wanted = None if tables is None else set(tables)
    return {
        t.name: ParameterConstraints(pooling_factors=[float(t.pooling_factor)], **extra)
        for t in model.tables
        if wanted is None or t.name in wanted
    }


def _options_from_shardings(
    entries: Sequence[TorchRecSharding], model: ModelSpec, batch_size_per_rank: int, module_path: str
) -> list[ShardingOption]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.enumerators import get_partition_by_type
    from torchrec.distributed.planner.types import Shard as TorchRecShard
    from torchrec.distributed.planner.types import ShardingOption

    ebc = meta_collection(model, [e.table for e in entries])
    params = EmbeddingBagCollectionSharder().shardable_parameters(ebc)
    options = []
    for entry in entries:
        table = model.table(entry.table)
        shards = [
            TorchRecShard(
                size=[b.rows, b.cols],
                offset=[b.row_offset, b.col_offset],
                rank=b.rank,
            )
            for b in entry.shards
        ]
        options.append(
            ShardingOption(
                name=entry.table,
                tensor=params[entry.table],
                module=(module_path, ebc),
                input_lengths=[float(table.pooling_factor)],
                batch_size=int(batch_size_per_rank),
                sharding_type=entry.sharding_type,
                partition_by=get_partition_by_type(entry.sharding_type),
                compute_kernel=entry.compute_kernel,
                shards=shards,
                cache_params=_cache_params(entry.cache_load_factor),
                is_pooled=True,
            )
        )
    return options


def to_sharding_options(
    plan: PlanLike | Sequence[TorchRecSharding],
    model: ModelSpec,
    topology: Topology | None,
    *,
    batch_size_per_rank: int,
    torchrec_topology: TorchRecTopology,
    module_path: str = "",
) -> list[ShardingOption]:
    """The GPU-resident part of a placement as TorchRec ``ShardingOption`` objects with ranks, perf and storage.

    Perf and storage are filled by TorchRec's ``EmbeddingPerfEstimator`` / ``EmbeddingStorageEstimator`` for
    ``torchrec_topology`` (as its planner's enumerator does), so the list can be rated by its perf model
    (:func:`score_with_torchrec`) or turned into a plan by ``torchrec.distributed.planner.planners.to_sharding_plan``.

    Args:
        plan: A plan / placements mapping for ``model`` on ``topology``, or already-translated
            :class:`TorchRecSharding` entries (then ``topology`` is not used).
        model: The model.
        topology: Our topology (rank ``r`` = ``topology.gpus[r]``).
        batch_size_per_rank: Samples per rank per step (TorchRec's planner ``batch_size``).
        torchrec_topology: TorchRec's ``Topology`` to estimate for (its world size must match).
        module_path: FQN of the collection in the module (``ShardingOption.path``).

    Raises:
        PlannerError: A placement TorchRec cannot express, or a world size mismatch.
    """
    if isinstance(plan, Plan | Mapping):
        if topology is None:
            raise PlannerError("to_sharding_options needs the topology to translate a plan", kind=ErrorKind.INPUT)
        entries = torchrec_shardings(plan, model, topology)
    else:
        entries = list(plan)
    top_rank = max((b.rank for e in entries for b in e.shards), default=-1)
    if top_rank >= torchrec_topology.world_size:
        raise PlannerError(
            f"the placement uses rank {top_rank} but the TorchRec topology has world_size "
            f"{torchrec_topology.world_size}",
            kind=ErrorKind.INPUT,
            fixes=("build the TorchRec topology with one rank per GPU of the plan's topology",),
        )
    options = _options_from_shardings(entries, model, batch_size_per_rank, module_path)
    _estimate(options, torchrec_topology, model)
    return options


def _estimate(options: list[ShardingOption], torchrec_topology: TorchRecTopology, model: ModelSpec) -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
    from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name

    sharder = EmbeddingBagCollectionSharder()
    data_map = build_sharder_data_map({sharder_name(sharder.module_type): sharder})
    constraints = torchrec_constraints(model, [o.name for o in options])
    EmbeddingPerfEstimator(topology=torchrec_topology, constraints=constraints).estimate(options, data_map)
    EmbeddingStorageEstimator(topology=torchrec_topology, constraints=constraints).estimate(options, data_map)


def score_with_torchrec(
    options: Sequence[ShardingOption], torchrec_topology: TorchRecTopology, model: ModelSpec
) -> float:
    """TorchRec's planner objective for ``options``: max over ranks of the summed shard perf, in ms.

    This is ``NoopPerfModel(topology).rate(options)``, the quantity ``EmbeddingShardingPlanner`` minimises, after
    re-estimating every shard with ``EmbeddingPerfEstimator`` (pooling factors from ``model``), so options from
    anywhere (ours, or TorchRec's planner) are rated alike.

    Args:
        options: ShardingOptions with ranks (e.g. from :func:`to_sharding_options` or a planner's ``_best_plan``).
        torchrec_topology: TorchRec's ``Topology`` to rate for.
        model: The model (pooling factors).
    """
    from torchrec.distributed.planner.perf_models import NoopPerfModel

    options = list(options)
    _estimate(options, torchrec_topology, model)
    return float(NoopPerfModel(topology=torchrec_topology).rate(plan=options))


def torchrec_topology_kwargs(topology: Topology) -> dict[str, Any]:
    """Keyword arguments of TorchRec's planner ``Topology`` for ``topology`` (no torch needed; JSON-safe).

    Capacities per rank: the GPU's HBM, and the host's DDR split evenly over its GPUs. Bandwidths, in TorchRec's
    bytes/ms: HBM, host DDR, PCIe (HBM<->DDR), NVLink (intra-host) and the host NIC shared by its GPUs
    (inter-host, per rank). ``compute_device`` is left to the caller.

    Raises:
        PlannerError: Hosts with different GPU counts (TorchRec has a single local world size).
    """
    if not _uniform_hosts(topology):
        raise PlannerError(
            "TorchRec's Topology needs the same GPU count on every trainer host",
            kind=ErrorKind.UNSUPPORTED,
            fixes=("use hosts with equal GPU counts",),
        )
    local = _local_world_size(topology)
    per_ms = 1e-3
    return {
        "world_size": len(topology.gpus),
        "local_world_size": local,
        "hbm_cap": min(g.hbm_bytes for g in topology.gpus),
        "ddr_cap": min(h.ddr_bytes for h in topology.trainers) // local,
        "hbm_mem_bw": min(g.hbm_bandwidth for g in topology.gpus) * per_ms,
        "ddr_mem_bw": min(h.ddr_bandwidth for h in topology.trainers) * per_ms,
        "hbm_to_ddr_mem_bw": min(g.pcie_bandwidth for g in topology.gpus) * per_ms,
        "intra_host_bw": min(g.nvlink_bandwidth for g in topology.gpus) * per_ms,
        "inter_host_bw": min(h.nic_bandwidth for h in topology.trainers) / local * per_ms,
    }


def to_torchrec_topology(topology: Topology, *, compute_device: str = "cuda") -> TorchRecTopology:
    """TorchRec's planner ``Topology`` for ``topology`` (see :func:`torchrec_topology_kwargs`).

    Raises:
        PlannerError: Hosts with different GPU counts.
    """
    from torchrec.distributed.planner import Topology as TorchRecTopology

    return TorchRecTopology(compute_device=compute_device, **torchrec_topology_kwargs(topology))


# ---- TorchRec -> plan ------------------------------------------------------------------------------------------
def from_sharding_options(options: Iterable[Any], model: ModelSpec, topology: Topology) -> dict[str, TablePlacement]:
    """TorchRec's chosen shardings as our placements, so :class:`~persia_planner.cost.CostModel` can score them.

    Kernels map to tiers: ``fused`` -> hbm, ``fused_uvm`` -> ddr, ``fused_uvm_caching`` -> hbm_cache (its cache
    load factor, or TorchRec's default 0.2), ``dense`` -> hbm (data-parallel replicas on every GPU). Empty shards
    of TorchRec's row-wise layout are dropped.

    Args:
        options: TorchRec ``ShardingOption`` objects (with ranks), :class:`TorchRecSharding` entries or their
            :meth:`~TorchRecSharding.to_dict` forms.
        model: The model the options place.
        topology: Our topology; rank ``r`` becomes ``topology.gpus[r]``.

    Returns:
        Placement per table name, in model order; tables with no option are absent.

    Raises:
        PlannerError: Kind ``unsupported`` for a sharding type or kernel we cannot represent (e.g. ``grid_shard``,
            ``key_value``); kind ``input`` for unknown tables or ranks beyond the topology.
    """
    entries = {}
    for item in options:
        if isinstance(item, TorchRecSharding):
            entry = item
        elif isinstance(item, Mapping):
            entry = TorchRecSharding.from_dict(item)
        else:
            entry = TorchRecSharding.from_option(item)
        entries[entry.table] = entry
    names = {t.name for t in model.tables}
    unknown = sorted(set(entries) - names)
    if unknown:
        raise PlannerError(
            f"TorchRec plan has table {unknown[0]!r} that model {model.name!r} lacks", kind=ErrorKind.INPUT
        )
    return {t.name: _placement_of(t, entries[t.name], model, topology) for t in model.tables if t.name in entries}


def _placement_of(table: TableSpec, entry: TorchRecSharding, model: ModelSpec, topology: Topology) -> TablePlacement:
    name = table.name
    try:
        sharding = Sharding(entry.sharding_type)
    except ValueError:
        sharding = None
    if sharding is None or sharding is Sharding.PS_HASH:
        raise PlannerError(
            f"table {name!r}: TorchRec sharding type {entry.sharding_type!r} has no persia equivalent",
            kind=ErrorKind.UNSUPPORTED,
            fixes=(
                "constrain TorchRec's planner to table_wise/row_wise/column_wise/table_row_wise/"
                "table_column_wise/data_parallel",
            ),
        )
    tier = _TIER_OF_KERNEL.get(entry.compute_kernel)
    if tier is None or (entry.compute_kernel == DATA_PARALLEL_KERNEL) != (sharding is Sharding.DATA_PARALLEL):
        if tier is None:
            problem = f"TorchRec compute kernel {entry.compute_kernel!r} has no persia tier"
        else:
            problem = f"kernel {entry.compute_kernel!r} with sharding {entry.sharding_type!r} is not supported"
        raise PlannerError(
            f"table {name!r}: {problem}",
            kind=ErrorKind.UNSUPPORTED,
            fixes=("constrain TorchRec's planner to the fused, fused_uvm, fused_uvm_caching and dense kernels",),
        )
    world = len(topology.gpus)
    bad = [b.rank for b in entry.shards if not 0 <= b.rank < world]
    if bad:
        raise PlannerError(
            f"table {name!r}: TorchRec rank {bad[0]} is beyond the topology's {world} GPUs",
            kind=ErrorKind.INPUT,
            fixes=("pass the topology TorchRec planned for",),
        )
    dtype = model.embedding_dtype
    if sharding is Sharding.DATA_PARALLEL:
        ranks = sorted({b.rank for b in entry.shards})
        shards = tuple(
            Shard(
                topology.gpus[r].name, Tier.HBM, (0, table.dim), table.bytes(dtype), rows=(0, table.rows), replica=True
            )
            for r in ranks
        )
        return TablePlacement(sharding, shards)
    fraction = None
    if tier is Tier.HBM_CACHE:
        fraction = entry.cache_load_factor if entry.cache_load_factor is not None else DEFAULT_CACHE_LOAD_FACTOR
    shards = []
    for b in entry.shards:
        if b.rows == 0 or b.cols == 0:
            continue
        shards.append(
            Shard(
                device=topology.gpus[b.rank].name,
                tier=tier,
                cols=(b.col_offset, b.col_offset + b.cols),
                bytes=b.rows * table.row_bytes(dtype, b.cols),
                rows=(b.row_offset, b.row_offset + b.rows),
                cache_fraction=fraction,
            )
        )
    return TablePlacement(sharding, tuple(shards))
