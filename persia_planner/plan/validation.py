"""The plan's checks: that it places exactly the model's tables, and :func:`validate` against its topology."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from persia_planner.cost.analytic import CostModel
from persia_planner.errors import ErrorKind, PlannerError, abbreviate, printable
from persia_planner.kinds import Sharding
from persia_planner.model.specs import DType, ModelSpec, TableSpec
from persia_planner.placement.feasibility import constraint_problems
from persia_planner.placement.memory import PS_LIMIT_REASON, PS_MAX_ROWS, ps_servers_needed
from persia_planner.placement.shards import TablePlacement, server_store_rows
from persia_planner.plan.plan import Plan
from persia_planner.tiers import replica_tier
from persia_planner.topology.graph import Topology
from persia_planner.units import format_bytes

__all__ = [
    "MAX_PROBLEMS",
    "MAX_TABLE_PROBLEMS",
    "model_changed",
    "require_plan_agrees",
    "require_same_tables",
    "require_valid",
    "table_mismatch",
    "validate",
    "wrong_device",
]

MAX_TABLE_PROBLEMS = 5
"""Problems :func:`validate` lists for one table: a plan of 200,000 bad shards is answered in a few lines."""
MAX_PROBLEMS = 50
"""Problems :func:`validate` lists in all, before it stops looking."""


def wrong_device(topology: Topology, device: str, *, gpu: bool) -> str:
    """Why ``device`` cannot hold a shard that needs a GPU (``gpu``) or a parameter server, in a few words: it is
    another kind of device of ``topology``, or none of its devices at all (then a few of those it has are named)."""
    want = "a GPU" if gpu else "a parameter server"
    if topology.has_device(device):
        return f"{abbreviate(device)} is not {want}"
    names = [g.name for g in topology.gpus] if gpu else [s.name for s in topology.servers]
    few = ", ".join(printable(n[:40]) for n in names[:4]) + (f", ... ({len(names)})" if len(names) > 4 else "")
    kind = "GPUs" if gpu else "parameter servers"
    return f"{abbreviate(device)} is not a device of topology {abbreviate(topology.name)} (its {kind}: {few or 'none'})"


def table_mismatch(placed: Iterable[str], tables: Iterable[str]) -> tuple[list[str], list[str]]:
    """The plan-matches-model check: ``(missing, unknown)``, the ``tables`` that ``placed`` lacks (in their order)
    and the names it places that are none of them (sorted). Both empty: the plan places exactly these tables."""
    placed, tables = set(placed), list(tables)
    return [name for name in tables if name not in placed], sorted(placed - set(tables))


def require_same_tables(placed: Iterable[str], tables: Iterable[str], *, holder: str = "the model") -> None:
    """Raise :class:`PlannerError` (kind ``invalid_plan``) unless the plan places exactly ``tables``
    (:func:`table_mismatch`); ``holder`` names what holds the tables in the message.

    Args:
        placed: The names the plan places (a plan's ``tables`` mapping).
        tables: The model's (or collection's) table names.
        holder: What the tables are of, e.g. ``"the collection"``.
    """
    missing, unknown = table_mismatch(placed, tables)
    if missing:
        raise PlannerError(
            f"the plan has no placement for tables {missing[:3]}",
            kind=ErrorKind.INVALID_PLAN,
            fixes=("plan this model (persia plan MODEL TOPOLOGY) and pass that plan",),
        )
    if unknown:
        raise PlannerError(
            f"the plan places tables {unknown[:3]} that are not in {holder}",
            kind=ErrorKind.INVALID_PLAN,
            fixes=("pass the plan made for this model",),
        )


def validate(plan: Plan, model: ModelSpec, topology: Topology) -> list[str]:
    """Re-check a plan against its model and topology.

    Checks: every table is placed exactly once (range shards tile rows x cols; hash buckets each once per column
    range; replicas on every GPU), tiers match devices and sharding types, shard bytes are right, each table keeps
    its ``constraints:`` (sharding types, tiers, devices, cache fraction), no parameter server holds more rows of a
    table than its store can, and no GPU, host or parameter server exceeds its capacity minus the reservation, with
    every shard charged what its runtime allocates (``Shard.storage``).

    Returns:
        Problems found, one line each (at most :data:`MAX_TABLE_PROBLEMS` per table and :data:`MAX_PROBLEMS` in
        all, then a line saying it stopped); empty when the plan is valid.
    """
    problems: list[str] = []
    cost = CostModel(model, topology)
    _, unknown = table_mismatch(plan.tables, (t.name for t in model.tables))
    for extra in unknown:
        problems.append(f"plan places table {extra!r} that the model does not have")
    mem = np.zeros(cost.layout.mem_size)
    for table in model.tables:
        placement = plan.tables.get(table.name)
        if placement is None:
            problems.append(f"table {table.name!r} is not placed")
            continue
        table_problems = _check_table(table, placement, topology, cost)
        broken = constraint_problems(table, placement)
        problems.extend(f"table {table.name!r}: {p}" for p in broken[:MAX_TABLE_PROBLEMS])
        problems.extend(f"table {table.name!r}: {p}" for p in table_problems[:MAX_TABLE_PROBLEMS])
        if len(problems) >= MAX_PROBLEMS:
            return [*problems[:MAX_PROBLEMS], f"stopped after {MAX_PROBLEMS} problems"]
        if not table_problems:
            mem += cost.placement_loads(table, placement)[1]
    caps = cost.capacities()
    slots = [(d.name, m.spec.short_name) for m in cost.layout.memories for d in topology.holders(m.spec.holder)]
    for (name, kind), used, cap in zip(slots, mem, caps, strict=True):
        if used > cap + 0.5:
            problems.append(
                f"{name} {kind} holds {format_bytes(used)}, over its usable {format_bytes(cap)} "
                f"(short by {format_bytes(used - cap)})"
            )
    return problems


def _check_table(table, placement: TablePlacement, topology: Topology, cost: CostModel) -> list[str]:
    problems: list[str] = []
    s = placement.sharding
    if not placement.shards:
        return ["has no shards"]
    if placement.sequence is not table.sequence:  # priced with another output: say why once
        return [model_changed(placement, table, cost.dtype_of(table)) or "its pooling changed: plan again"]
    if not table.allows(s):
        return [f"is a sequence table (pooling: none), which TorchRec's EmbeddingCollection cannot shard {s.value}"]
    gpu_names = {g.name for g in topology.gpus}
    server_names = {p.name for p in topology.servers}
    for i, shard in enumerate(placement.shards):
        spec = shard.tier.spec
        if not spec.local and shard.device not in server_names:
            problems.append(f"shard {i} is on tier {spec.name} but {wrong_device(topology, shard.device, gpu=False)}")
        elif spec.local and shard.device not in gpu_names:
            problems.append(f"shard {i} is on tier {spec.name} but {wrong_device(topology, shard.device, gpu=True)}")
        # A replica on a tier other than hbm is named below, with the replicas' other rules.
        if s not in spec.shardings and not (spec.local and s is Sharding.DATA_PARALLEL):
            if s is Sharding.PS_HASH:
                problems.append(f"shard {i} is on tier {spec.name} but ps_hash shards must be on tier ps")
            else:
                problems.append(f"shard {i} is on tier {spec.name} but the sharding is {s.value}")
        if shard.replica and s is not Sharding.DATA_PARALLEL:
            # A replica is charged its whole table once per GPU and nothing else; the flag must not turn a shard of
            # another sharding into what it is not (a ps_hash bucket would then cost the servers nothing).
            problems.append(f"shard {i} has replica: true but only data_parallel shards are replicas")
        if spec.cached and not (shard.cache_fraction and 0 < shard.cache_fraction <= 1):
            problems.append(f"shard {i} is {spec.name} without a cache_fraction in (0, 1]")
        if not (0 <= shard.cols[0] < shard.cols[1] <= table.dim):
            problems.append(f"shard {i} cols {list(shard.cols)} are outside [0, {table.dim})")
        if shard.rows is not None and not (0 <= shard.rows[0] < shard.rows[1] <= table.rows):
            problems.append(f"shard {i} rows {list(shard.rows)} are outside [0, {table.rows})")
        if shard.hash is not None and not (0 <= shard.hash[0] < shard.hash[1]):
            problems.append(f"shard {i} hash {list(shard.hash)} needs 0 <= bucket < buckets")
        if shard.rows is None and shard.hash is None:
            problems.append(f"shard {i} has neither 'rows' nor 'hash'")
        if shard.rows is not None and shard.hash is not None:
            # Its size would be read from `rows` (a range shard's), while the servers hold a hash bucket's share.
            problems.append(f"shard {i} has both 'rows' and 'hash' (a range shard gives rows, a ps_hash shard hash)")
        if len(problems) >= MAX_TABLE_PROBLEMS:
            return problems  # a plan of thousands of bad shards: the first few say what is wrong
    if problems:
        return problems
    changed = model_changed(placement, table, cost.dtype_of(table))
    if changed is not None:  # every shard's bytes and store differ then: say why once
        return [changed]
    if s is Sharding.PS_HASH:
        problems += _check_hash(table, placement)
        problems += _check_store_rows(table, placement, len(topology.servers))
        problems += _check_store_sizes(table, placement)
    elif s is Sharding.DATA_PARALLEL:
        devices = [sh.device for sh in placement.shards]
        if sorted(devices) != sorted(gpu_names) or not all(sh.replica for sh in placement.shards):
            problems.append("data_parallel needs one replica on every GPU")
        if any(sh.tier is not replica_tier() for sh in placement.shards):
            problems.append(f"data_parallel replicas must be in {replica_tier()}")
        if any(sh.rows != (0, table.rows) or sh.cols != (0, table.dim) for sh in placement.shards):
            problems.append("data_parallel replicas must hold the whole table")
    else:
        problems += _check_tiling(table, placement)
        problems += _check_shape(table, placement, topology)
    for i, shard in enumerate(placement.shards):
        expected = shard.n_rows(table) * table.row_bytes(cost.dtype_of(table), shard.n_cols)
        if shard.bytes != expected:
            problems.append(f"shard {i} bytes {shard.bytes} != {expected} (rows x (cols x dtype + state))")
    return problems


def model_changed(placement: TablePlacement, table: TableSpec, dtype: DType) -> str | None:
    """Why ``placement`` cannot run ``table`` as the model now has it, keeping its rows in ``dtype`` (None: it can):
    it was planned, its bytes and its stores sized, for rows of another dtype; or priced as a sequence table and the
    model pools it, or the other way round (its output and its sharding types differ)."""
    if placement.dtype is not None and placement.dtype is not dtype:
        return (
            f"was planned with {placement.dtype.value} rows, and the model keeps it in {dtype.value} (its dtype or "
            "embedding_dtype changed since): plan again"
        )
    if placement.sequence is not table.sequence:
        planned, now = ("a sequence", "pools it") if placement.sequence else ("a pooled", "makes it a sequence table")
        return f"was planned as {planned} table, and the model {now} (its pooling changed since): plan again"
    return None


def _check_store_sizes(table, placement: TablePlacement) -> list[str]:
    """The stores' sizes plan.json records (``store_rows``, ``backing_rows``) are those the plan charged."""
    problems = []
    for i, shard in enumerate(placement.shards):
        if shard.store_rows is None or shard.hash is None:
            continue  # a plan written before they were recorded: the runtime sizes the stores as the plan charged
        fraction = shard.cache_fraction or 0.0
        expected = server_store_rows(table.rows, shard.hash[1], shard.tier, fraction)
        if (shard.store_rows, shard.backing_rows) != expected:
            problems.append(
                f"shard {i} store_rows {shard.store_rows} / backing_rows {shard.backing_rows} != the {expected[0]} / "
                f"{expected[1]} the plan charges ({shard.hash[1]} servers): plan again, or remove both"
            )
    return problems


def _check_hash(table, placement: TablePlacement) -> list[str]:
    by_cols: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for shard in placement.shards:
        if shard.hash is None:
            return ["ps_hash shards need 'hash': [bucket, buckets]"]
        by_cols.setdefault(shard.cols, []).append(shard.hash)
    problems = _cols_tile(table, list(by_cols))
    for cols, buckets in by_cols.items():
        n = {b[1] for b in buckets}
        # The count first: `buckets` may claim 10**18 of them, which range() must not be listed for.
        if len(n) != 1 or next(iter(n)) != len(buckets) or sorted(b[0] for b in buckets) != list(range(len(buckets))):
            problems.append(
                f"cols {list(cols)}: hash buckets {abbreviate(sorted(buckets))} are not each of 0..n-1 once"
            )
    return problems


def _check_store_rows(table, placement: TablePlacement, n_servers: int) -> list[str]:
    """One line if a server would hold more rows of the table than its store can (``memory.PS_MAX_ROWS``)."""
    fullest = max(placement.shards, key=lambda shard: shard.n_rows(table))
    rows = fullest.n_rows(table)
    if rows <= PS_MAX_ROWS:
        return []
    need = ps_servers_needed(table.rows)
    fix = f"plan it with at least {need} parameter servers" if need > n_servers else "spread it over more hash buckets"
    return [
        f"{fullest.device} would hold {rows:,} of its rows, over the {PS_MAX_ROWS:,} rows of one table that a "
        f"parameter server's store holds ({PS_LIMIT_REASON}); fix: {fix}"
    ]


def _cols_tile(table, ranges: list[tuple[int, int]]) -> list[str]:
    ranges = sorted(ranges)
    edge = 0
    for a, b in ranges:
        if a != edge:
            return [f"column ranges {abbreviate(ranges)} do not tile [0, {table.dim}) exactly once"]
        edge = b
    return (
        [] if edge == table.dim else [f"column ranges {abbreviate(ranges)} do not tile [0, {table.dim}) exactly once"]
    )


def _check_tiling(table, placement: TablePlacement) -> list[str]:
    """Rectangles tile rows x cols exactly once: per column cut, the row ranges chain from 0 to rows."""
    shards = placement.shards
    if any(s.rows is None for s in shards):
        return ["range shardings need 'rows' on every shard"]
    cuts = sorted({c for s in shards for c in s.cols})
    if cuts[0] != 0 or cuts[-1] != table.dim:
        return [f"columns do not cover [0, {table.dim})"]
    for lo, hi in itertools.pairwise(cuts):
        covering = sorted(s.rows for s in shards if s.cols[0] <= lo and hi <= s.cols[1])  # type: ignore[type-var]
        edge = 0
        for a, b in covering:
            if a != edge:
                return [f"rows x cols [{lo}, {hi}) are covered {'twice' if a < edge else 'with a gap'} near row {a}"]
            edge = b
        if edge != table.rows:
            return [f"rows of cols [{lo}, {hi}) end at {edge}, not {table.rows}"]
    return []


def _check_shape(table, placement: TablePlacement, topology: Topology) -> list[str]:
    s, shards = placement.sharding, placement.shards
    full_rows = all(sh.rows == (0, table.rows) for sh in shards)
    full_cols = all(sh.cols == (0, table.dim) for sh in shards)
    hosts = {topology.host(topology.gpus[topology.gpu_index(sh.device)].host).name for sh in shards}
    tiers = {sh.tier for sh in shards}
    problems = []
    if len(tiers) > 1:
        problems.append(f"shards mix tiers {sorted(t.value for t in tiers)}")
    if s is Sharding.TABLE_WISE and len(shards) != 1:
        problems.append("table_wise has exactly one shard")
    if s in (Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE) and not full_rows:
        problems.append(f"{s.value} shards must hold every row")
    if s in (Sharding.ROW_WISE, Sharding.TABLE_ROW_WISE) and not full_cols:
        problems.append(f"{s.value} shards must hold every column")
    if s in (Sharding.TABLE_ROW_WISE, Sharding.TABLE_COLUMN_WISE) and len(hosts) != 1:
        problems.append(f"{s.value} shards must stay on one host, found {abbreviate(sorted(hosts))}")
    return problems


def require_valid(plan: Plan, model: ModelSpec, topology: Topology) -> None:
    """Raise :class:`PlannerError` (kind ``invalid_plan``) naming the first problem and how many there are."""
    problems = validate(plan, model, topology)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PlannerError(
            f"invalid plan: {problems[0]}{more}",
            kind=ErrorKind.INVALID_PLAN,
            fixes=("re-run 'persia plan' for this model and topology",),
        )


def require_plan_agrees(plan: Plan, model: ModelSpec, source: str = "plan.json") -> None:
    """Refuse to run ``plan`` with another staleness K or PS wire dtype than it was priced for.

    ``model`` carries the run's K and wire (:func:`persia_planner.model.specs.with_run_options`). Only parameter-server
    tables depend on them (K decides how much of their traffic hides behind the step; the wire, its bytes), and a plan
    that does not record them (an older writer, another planner) is taken as it is.

    Raises:
        PlannerError: Kind ``input``, naming the plan's value, the run's and both ways to agree.
    """
    if not plan.remote_tables():
        return
    if plan.staleness is not None and plan.staleness != model.staleness:
        raise PlannerError(
            f"{source} was priced for staleness K = {plan.staleness}, but this run trains its parameter-server tables "
            f"with K = {model.staleness}",
            kind=ErrorKind.INPUT,
            fixes=(
                f"re-plan with 'persia plan --staleness {model.staleness}'",
                f"train with --staleness {plan.staleness} --mode hybrid"
                if plan.staleness
                else "train with --mode sync",
            ),
        )
    if plan.ps_wire_dtype is not None and plan.ps_wire_dtype is not model.ps_wire_dtype:
        raise PlannerError(
            f"{source} was priced for parameter-server traffic in {plan.ps_wire_dtype.torch_name}, but this run sends "
            f"{model.ps_wire_dtype.torch_name}",
            kind=ErrorKind.INPUT,
            fixes=(
                f"re-plan with 'persia plan --ps-wire {model.ps_wire_dtype.value}'",
                f"train with --ps-wire {plan.ps_wire_dtype.torch_name}",
            ),
        )
