"""TorchRec re-scoring: TorchRec's plans read back as our placements, and any placement rated by TorchRec.

:func:`from_sharding_options` (and :func:`shardings_from_plan` for a ``ShardingPlan``) turns TorchRec's chosen
shardings into our placements, so our cost model can score TorchRec's plan; :func:`to_sharding_options` and
:func:`score_with_torchrec` rate any placement with TorchRec's own perf and storage estimators. The benchmarks
(``benchmarks/torchrec_baseline.py``) and the tests compare the two planners with them; a run never needs them.

This module imports torch / torchrec only inside functions, as :mod:`persia_planner.plan.torchrec_export` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from persia_planner.errors import ErrorKind, PlannerError, first_line
from persia_planner.kinds import Sharding
from persia_planner.model.specs import ModelSpec, TableSpec
from persia_planner.placement.shards import Shard, TablePlacement
from persia_planner.plan.plan import Plan
from persia_planner.plan.torchrec_collections import require_pooled
from persia_planner.plan.torchrec_export import (
    DATA_PARALLEL_KERNEL,
    DEFAULT_CACHE_LOAD_FACTOR,
    PlanLike,
    ShardBox,
    TorchRecSharding,
    cache_params,
    local_world_size,
    to_embedding_bag_configs,
    torch_optimizer,
    torchrec_shardings,
    uniform_hosts,
)
from persia_planner.tiers import Tier, replica_tier, tier_of_kernel
from persia_planner.topology.graph import DeviceKind, Topology

_TORCHREC_TYPES = frozenset(Sharding) - {Sharding.PS_HASH}

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torchrec.distributed.planner import Topology as TorchRecTopology
    from torchrec.distributed.planner.types import ShardingOption

__all__ = [
    "from_sharding_options",
    "meta_collection",
    "plan_with_torchrec",
    "score_with_torchrec",
    "shardings_from_plan",
    "to_sharding_options",
    "to_torchrec_topology",
    "torchrec_constraints",
    "torchrec_topology_kwargs",
]


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


def torchrec_constraints(
    model: ModelSpec,
    tables: Iterable[str] | None = None,
    *,
    topology: Topology | None = None,
    keep: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """``ParameterConstraints`` per table with its pooling factor and, with ``keep``, what its ``constraints:``
    allow in TorchRec's terms (plus ``extra`` constraint fields, which win).

    Sharding types but ``ps_hash``; tiers as compute kernels (``hbm`` -> ``fused``, and ``dense`` where
    ``data_parallel`` is allowed; ``ddr`` -> ``fused_uvm``; ``hbm_cache`` -> ``fused_uvm_caching``); a fixed cache
    fraction as ``cache_params``; devices as ``ranks`` (rank ``r`` = ``topology.gpus[r]``, so only with
    ``topology``, and only where the installed TorchRec's ``ParameterConstraints`` has ``ranks``). A list that would
    be empty (a table allowed only on the parameter servers) is left out.
    """
    import dataclasses

    from torchrec.distributed.planner.types import ParameterConstraints

    known = {f.name for f in dataclasses.fields(ParameterConstraints)}
    wanted = None if tables is None else set(tables)
    out = {}
    for t in model.tables:
        if wanted is not None and t.name not in wanted:
            continue
        fields: dict[str, Any] = {"pooling_factors": [float(t.pooling_factor)]}
        if keep:
            fields.update((key, value) for key, value in _torchrec_fields(t, topology).items() if key in known)
        out[t.name] = ParameterConstraints(**{**fields, **extra})
    return out


def _torchrec_fields(table: TableSpec, topology: Topology | None) -> dict[str, Any]:
    """The ``ParameterConstraints`` fields of ``table``'s constraints (see :func:`torchrec_constraints`)."""
    allowed = table.constraints
    fields: dict[str, Any] = {}
    if allowed.sharding_types is not None:
        fields["sharding_types"] = [s.value for s in Sharding if s in allowed.sharding_types and s in _TORCHREC_TYPES]
    if allowed.tiers is not None:
        allowed_kernels = (t.spec.torchrec_kernel for t in Tier if t in allowed.tiers and t.spec.torchrec_kernel)
        kernels = list(dict.fromkeys(allowed_kernels))
        if allowed.allows(Sharding.DATA_PARALLEL, replica_tier()):
            kernels.append(DATA_PARALLEL_KERNEL)
        fields["compute_kernels"] = kernels
    if allowed.cache_fraction is not None:
        fields["cache_params"] = cache_params(allowed.cache_fraction)
    if allowed.devices is not None and topology is not None:
        fields["ranks"] = [r for r, g in enumerate(topology.gpus) if g.name in allowed.devices]
    return {key: value for key, value in fields.items() if value != []}


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
                cache_params=cache_params(entry.cache_load_factor),
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
        PlannerError: A placement TorchRec cannot express, a world size mismatch, or sequence tables.
    """
    require_pooled(model, "TorchRec's perf model")
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
    constraints = torchrec_constraints(model, [o.name for o in options], keep=False)
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
    if not uniform_hosts(topology):
        raise PlannerError(
            "TorchRec's Topology needs the same GPU count on every trainer host",
            kind=ErrorKind.UNSUPPORTED,
            fixes=("use hosts with equal GPU counts",),
        )
    local = local_world_size(topology)
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


def plan_with_torchrec(model: ModelSpec, topology: Topology) -> dict[str, TablePlacement]:
    """TorchRec's own ``EmbeddingShardingPlanner``'s plan of ``model`` on ``topology``, as our placements.

    Planned as a TorchRec user would: TorchRec's default enumerator, proposers, partitioner, storage reservation and
    perf model, the tables' pooling factors as ``ParameterConstraints``, a batch of ``batch_size / ranks`` per rank.
    CPU trainer devices are planned with ``compute_device="cpu"``, each rank holding its device's memory budget
    (TorchRec counts CPU tables in DDR); GPUs with ``"cuda"``, HBM and the host DDR split over its GPUs. Runs in this
    process on the meta device (no memory is allocated).

    Raises:
        PlannerError: TorchRec's planner found no plan that fits (kind ``capacity``), the hosts differ in GPU
            count (TorchRec has one local world size), or the model has sequence tables (kind ``unsupported``).
    """
    import logging

    require_pooled(model, "TorchRec's planner")

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner import Topology as TorchRecTopology

    args = torchrec_topology_kwargs(topology)
    cpu = topology.device_kind is DeviceKind.CPU
    if cpu:
        args["ddr_cap"] = min(g.hbm_bytes for g in topology.gpus)
    planner = EmbeddingShardingPlanner(
        topology=TorchRecTopology(compute_device="cpu" if cpu else "cuda", **args),
        batch_size=max(1, model.batch_size // len(topology.gpus)),
        constraints=torchrec_constraints(model),
        debug=False,
    )
    # TorchRec logs its plan at INFO, its failure at ERROR before raising it, and a warning per table on the root
    # logger: the caller gets the plan or one line.
    quiet = [logging.getLogger("torchrec.distributed.planner"), logging.getLogger()]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        sharding_plan = planner.plan(module=meta_collection(model), sharders=[EmbeddingBagCollectionSharder()])
    except Exception as err:  # TorchRec's PlannerError, RuntimeError, ...: one line of ours
        raise PlannerError(
            f"TorchRec's planner found no plan: {first_line(err)}",
            kind=ErrorKind.CAPACITY,
            fixes=("plan with persia plan",),
        ) from None
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return from_sharding_options(shardings_from_plan(sharding_plan, model), model, topology)


# ---- TorchRec -> plan ------------------------------------------------------------------------------------------
def from_sharding_options(options: Iterable[Any], model: ModelSpec, topology: Topology) -> dict[str, TablePlacement]:
    """TorchRec's chosen shardings as our placements, so :class:`~persia_planner.cost.analytic.CostModel` can score
    them.

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
    tier = tier_of_kernel().get(entry.compute_kernel)
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
    dtype = model.dtype_of(table)
    if sharding is Sharding.DATA_PARALLEL:
        ranks = sorted({b.rank for b in entry.shards})
        shards = tuple(
            Shard(
                topology.gpus[r].name,
                replica_tier(),
                (0, table.dim),
                table.bytes(dtype),
                rows=(0, table.rows),
                replica=True,
            )
            for r in ranks
        )
        return TablePlacement(sharding, shards, dtype, table.sequence)
    fraction = None
    if tier.spec.cached:
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
    return TablePlacement(sharding, tuple(shards), dtype, table.sequence)
