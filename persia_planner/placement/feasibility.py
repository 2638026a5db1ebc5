"""Tables' ``constraints:`` against a topology and a plan: whether the topology can meet them at all (before
searching), and where a plan breaks them (``validate``).

What a placement needs of the devices it may use: ``ps_hash`` hashes a table over every parameter server (the runtime
routes ids to all of them), ``row_wise`` and ``data_parallel`` span every trainer device, ``table_row_wise`` every
device of one host; the others go to any of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from persia_planner.errors import CapacityError, ConstraintError
from persia_planner.kinds import Sharding
from persia_planner.model.access_pattern import MIN_CACHE_FRACTION
from persia_planner.model.constraints import TableConstraints
from persia_planner.model.pooling import sequence_shardings
from persia_planner.model.specs import DType, ModelSpec, TableSpec
from persia_planner.placement.memory import PS_MAX_ROWS, ps_holds
from persia_planner.placement.shards import TablePlacement, even_split, server_bytes, tier_bytes
from persia_planner.tiers import Memory, Tier, server_tiers
from persia_planner.topology.graph import Topology
from persia_planner.topology.hardware import DeviceKind
from persia_planner.units import format_bytes

__all__ = ["check_constraints", "constraint_problems", "placeable"]

# Placements that span every trainer device, or every device of a host.
_EVERY_DEVICE = (Sharding.ROW_WISE, Sharding.DATA_PARALLEL)
_EVERY_CACHE = 1e-9  # relative slack of a plan's cache fraction against the constraint's (a float read back)


def check_constraints(model: ModelSpec, topology: Topology) -> None:
    """Refuse, before any search, a table whose constraints no plan on ``topology`` can keep.

    Raises:
        ConstraintError: A device it names is not in the topology, or no placement it allows can go to the devices
            it allows (a parameter-server table without servers, ``row_wise`` on some devices only, ...).
        CapacityError: No placement it allows fits the devices it allows, even on an empty cluster.
    """
    known = {g.name for g in topology.gpus} | {s.name for s in topology.servers}
    for table in model.tables:
        allowed = table.constraints
        if not allowed.constrained:
            continue
        if allowed.devices is not None:
            unknown = sorted(allowed.devices - known)
            if unknown:
                raise _unknown_device(table, unknown, topology)
        pairs = placeable(table, topology)
        if not pairs:
            raise _no_placement(table, topology)
        _check_room(table, pairs, topology, model.dtype_of(table))


def placeable(table: TableSpec, topology: Topology) -> list[tuple[Sharding, Tier]]:
    """The (sharding type, tier) pairs ``table``'s constraints allow whose devices the topology can give: those of
    its own devices, and for ``ps_hash``, ``row_wise``, ``data_parallel`` and ``table_row_wise`` all of them (every
    server, every trainer device, every device of a host)."""
    allowed = table.constraints
    gpus = [g for g in topology.gpus if allowed.allows_device(g.name)]
    every_gpu = len(gpus) == len(topology.gpus)
    whole_host = any(all(allowed.allows_device(g) for g in host.gpus) for host in topology.trainers)
    every_server = bool(topology.servers) and all(allowed.allows_device(s.name) for s in topology.servers)
    runs = sequence_shardings(topology.device_kind is DeviceKind.CPU) if table.sequence else frozenset(Sharding)
    pairs = []
    for sharding, tier in allowed.combinations():
        if sharding not in runs:  # what the trainers' kernels cannot run for a sequence table
            ok = False
        elif sharding is Sharding.PS_HASH:
            # a server tier needs its memories on every server (a table hashes over all of them)
            ok = every_server and not _lacking(tier, topology)
        elif sharding in _EVERY_DEVICE:
            ok = every_gpu
        elif sharding is Sharding.TABLE_ROW_WISE:
            ok = whole_host
        else:
            ok = bool(gpus)
        if ok:
            pairs.append((sharding, tier))
    return pairs


def _lacking(tier: Tier, topology: Topology) -> tuple[Memory, list[str]] | None:
    """The first memory of server tier ``tier``'s (its rows' or its cache's) that some servers lack, and those
    servers (None: every server has each)."""
    for memory in (tier.spec.rows_in, tier.spec.cache_in):
        if memory is None:
            continue
        without = topology.without(memory)
        if without:
            return memory, without
    return None


def _unknown_device(table: TableSpec, unknown: Sequence[str], topology: Topology) -> ConstraintError:
    hosts = {h.name for h in topology.trainers}
    hint = "name trainer devices (e.g. " + topology.gpus[0].name + ")"
    if topology.servers:
        hint += f" or parameter servers (e.g. {topology.servers[0].name})"
    if unknown[0] in hosts:
        hint = f"name the devices of host {unknown[0]} (e.g. {topology.host(unknown[0]).gpus[0]})"
    return ConstraintError(
        table.name,
        f"table {table.name!r}: constraints.devices names {unknown[0]!r}, which topology {topology.name!r} does not "
        f"have" + (f" (nor {len(unknown) - 1} more of its names)" if len(unknown) > 1 else ""),
        (hint,),
    )


def _no_placement(table: TableSpec, topology: Topology) -> ConstraintError:
    """Why none of the pairs ``table`` allows can go to the devices it allows, sharding type by sharding type."""
    allowed = table.constraints
    shardings = [s for s in Sharding if any(s is pair[0] for pair in allowed.combinations())]
    gpus = sum(allowed.allows_device(g.name) for g in topology.gpus)
    servers = sum(allowed.allows_device(s.name) for s in topology.servers)
    reasons = []
    # ps_hash allowed only on tiers whose memory some servers lack (tiers: [ssd]), on every server
    server_pairs = [t for s, t in allowed.combinations() if s is Sharding.PS_HASH]
    lacking = [_lacking(t, topology) for t in server_pairs]
    no_disk = bool(server_pairs) and all(lacking) and servers == len(topology.servers)
    if Sharding.PS_HASH in shardings:
        if not topology.servers:
            reasons.append(f"ps_hash needs parameter servers, and topology {topology.name!r} has none")
        elif no_disk:
            tier, (memory, without) = server_pairs[0], lacking[0]
            spec = memory.spec
            which = (
                f"no parameter server of topology {topology.name!r} has {spec.entry}"
                if len(without) == len(topology.servers)
                else f"{without[0]}{f' and {len(without) - 1} more' if len(without) > 1 else ''} of the "
                f"{len(topology.servers)} parameter servers {'have' if len(without) > 1 else 'has'} no "
                f"{spec.entry.split(' ', 1)[1] if spec.entry.startswith(('a ', 'an ')) else spec.entry}"
            )
            reasons.append(
                f"the {tier} tier keeps a table's rows on every parameter server's {spec.short_name}, and {which}"
            )
        else:
            reasons.append(
                f"ps_hash hashes a table over every parameter server, and it names {servers} of the "
                f"{len(topology.servers)} servers"
            )
    runs = sequence_shardings(topology.device_kind is DeviceKind.CPU) if table.sequence else frozenset(Sharding)
    if any(s not in runs for s in shardings):
        refused = " and ".join(s.value for s in shardings if s not in runs)
        reasons.append(
            f"{refused} cannot run a sequence table on the CPU trainers of topology {topology.name!r} (fbgemm's CPU "
            "dense kernel pools a replica's rows)"
        )
        shardings = [s for s in shardings if s in runs]
    spanning = [s.value for s in shardings if s in _EVERY_DEVICE]
    if spanning:
        reasons.append(
            f"{' and '.join(spanning)} span{'s' if len(spanning) == 1 else ''} every trainer device, and it names "
            f"{gpus} of the {len(topology.gpus)}"
        )
    if Sharding.TABLE_ROW_WISE in shardings:
        reasons.append("table_row_wise spans every device of a host, and it names every device of none")
    anywhere = [
        s.value for s in shardings if s in (Sharding.TABLE_WISE, Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE)
    ]
    if anywhere:
        reasons.append(
            f"{' and '.join(anywhere)} need{'s' if len(anywhere) == 1 else ''} a trainer device, and it names none"
        )
    local = shardings != [Sharding.PS_HASH]
    fixes = ("name the devices those need", "allow table_wise" if local else "allow a tier of the trainers")
    if not shardings:  # only what the trainers' kernels cannot run
        fixes = ("allow table_wise, row_wise, column_wise or ps_hash", "train on GPUs")
    if not topology.servers and not local:
        fixes = ("add parameter servers (hosts with role: parameter_server)", "allow a tier of the trainers")
    if no_disk and Sharding.PS_HASH in shardings:
        usable = [t.value for t in server_tiers() if not _lacking(t, topology)]
        fixes = (lacking[0][0].spec.how_to_add, f"allow tier {' or '.join(usable)}" if usable else "allow a local tier")
    return ConstraintError(
        table.name,
        f"table {table.name!r}: no placement keeps its constraints ({allowed.describe()}): {'; '.join(reasons)}",
        fixes,
    )


@dataclass(frozen=True)
class _Short:
    """What a placement lacks: ``short`` bytes of ``resource``, as ``text`` says (``need ... have ...``)."""

    pair: tuple[Sharding, Tier]
    resource: str
    short: float
    text: str


def _short(pair: tuple[Sharding, Tier], resource: str, need: float, have: float, text: str) -> _Short:
    """A :class:`_Short` of ``need`` bytes where ``have`` are usable; ``text`` names them ``{need}`` and ``{have}``."""
    shown = text.format(need=format_bytes(need), have=format_bytes(have))
    return _Short(pair, resource, need - have, f"{shown} (short by {format_bytes(need - have)})")


def _check_room(table: TableSpec, pairs: Sequence[tuple[Sharding, Tier]], topology: Topology, dtype: DType) -> None:
    """Raise where no allowed pair fits the allowed devices' usable memory on an empty cluster (a necessary
    condition: the search may still find no room once other tables are placed)."""
    shorts = []
    for pair in pairs:
        short = _short_of(table, pair, topology, dtype)
        if short is None:
            return
        shorts.append(short)
    least = min(shorts, key=lambda s: s.short)
    sharding, tier = least.pair
    raise CapacityError(
        least.resource,
        math.ceil(least.short) if math.isfinite(least.short) else 0,
        f"table {table.name!r} ({format_bytes(table.bytes(dtype))}) fits nowhere its constraints allow "
        f"({table.constraints.describe()}): {sharding.value} on {tier.value}, the nearest to fitting, {least.text}",
        ("allow more tiers, sharding types or devices", "give those devices more memory", "reduce its rows"),
        table=table.name,
    )


def _short_of(table: TableSpec, pair: tuple[Sharding, Tier], topology: Topology, dtype: DType) -> _Short | None:
    """What ``pair`` lacks on the devices ``table`` may use, at the least it could take (None where it fits):
    one device for ``table_wise``, the devices together for the splits, every device for a replica, each server
    for its share of ``ps_hash``."""
    allowed = table.constraints
    sharding, tier = pair
    if sharding is Sharding.PS_HASH:
        n = len(topology.servers)
        if not ps_holds(table.rows, n):
            per_server = -(-table.rows // n)
            return _Short(
                pair,
                "PS rows",
                math.inf,
                f"would give each of the {n} parameter servers {per_server:,} of its rows, over the "
                f"{PS_MAX_ROWS:,} of one table a server's store holds",
            )
        fraction = _least_cache(allowed) if tier.spec.cached else 0.0
        rows = np.array(even_split(table.rows, n))
        for memory, shares in server_bytes(table, tier, rows, table.dim, dtype, fraction).items():
            caps = topology.capacity(memory)
            worst = max(range(n), key=lambda i: shares[i] - caps[i])
            if shares[worst] > caps[worst] + 0.5:
                server, noun = topology.servers[worst].name, memory.spec.short_name
                usable = " usable" if memory is Memory.SERVER else ""  # DDR keeps a reservation back; a disk none
                text = f"needs {{need}} of {server}'s {noun} for its share, which has {{have}}{usable}"
                return _short(pair, f"{server} {noun}", float(shares[worst]), float(caps[worst]), text)
        return None
    gpus = [g for g in topology.gpus if allowed.allows_device(g.name)]
    if sharding is Sharding.DATA_PARALLEL:
        need = float(tier_bytes(table, tier, table.rows, table.dim, dtype, replica=True)[0])
        have = float(min(topology.hbm_capacity(g) for g in gpus))
        text = "needs {need} of HBM on every device, and the smallest has {have} usable"
        return None if need <= have + 0.5 else _short(pair, "GPU HBM", need, have, text)
    fraction = _least_cache(allowed) if tier.spec.cached else 0.0
    hbm, ddr = (float(x) for x in tier_bytes(table, tier, table.rows, table.dim, dtype, fraction))
    if sharding is Sharding.TABLE_WISE:
        for g in gpus:
            if hbm <= topology.hbm_capacity(g) + 0.5 and ddr <= topology.ddr_capacity(topology.host(g.host)) + 0.5:
                return None
        most_hbm = float(max(topology.hbm_capacity(g) for g in gpus))
        if hbm > most_hbm + 0.5:
            text = "needs {need} of HBM on one device, and the largest it may use has {have} usable"
            return _short(pair, "GPU HBM", hbm, most_hbm, text)
        most_ddr = float(max(topology.ddr_capacity(topology.host(g.host)) for g in gpus))
        text = "needs {need} of DDR on one host, and the largest it may use has {have} usable"
        return _short(pair, "trainer DDR", ddr, most_ddr, text)
    # A split: its pieces together take at least the whole table's bytes (column pieces each keep row-wise state).
    hosts = {g.host for g in gpus}
    all_hbm = float(sum(topology.hbm_capacity(g) for g in gpus))
    all_ddr = float(sum(topology.ddr_capacity(topology.host(h)) for h in hosts))
    if hbm > all_hbm + 0.5:
        return _short(pair, "GPU HBM", hbm, all_hbm, "needs {need} of HBM, and the devices it may use have {have}")
    if ddr > all_ddr + 0.5:
        return _short(pair, "trainer DDR", ddr, all_ddr, "needs {need} of DDR, and their hosts have {have}")
    return None


def _least_cache(allowed: TableConstraints) -> float:
    """The smallest cache the search may give the table: its fixed one, else the smallest it sizes."""
    return allowed.cache_fraction if allowed.cache_fraction is not None else MIN_CACHE_FRACTION


def constraint_problems(table: TableSpec, placement: TablePlacement) -> list[str]:
    """Where ``placement`` breaks ``table``'s constraints, one line each (without the table's name): the sharding
    type, the tier, the first shard on a device it does not allow, the first cache of another size."""
    allowed = table.constraints
    if not allowed.constrained or not placement.shards:
        return []
    problems = []
    s, tier = placement.sharding, placement.tier
    if allowed.sharding_types is not None and s not in allowed.sharding_types:
        problems.append(f"the plan shards it {s.value}, but its constraints allow {allowed.describe('sharding_types')}")
    tiers = {shard.tier for shard in placement.shards}
    if allowed.tiers is not None and not tiers <= allowed.tiers:
        outside = sorted(t.value for t in tiers - allowed.tiers)
        problems.append(f"the plan puts it on tier {outside[0]}, but its constraints allow {allowed.describe('tiers')}")
    if allowed.devices is not None:
        off = [(i, shard.device) for i, shard in enumerate(placement.shards) if shard.device not in allowed.devices]
        if off:
            more = f" (and {len(off) - 1} more shards)" if len(off) > 1 else ""
            problems.append(
                f"the plan puts shard {off[0][0]} on {off[0][1]}{more}, but its constraints allow "
                f"{allowed.describe('devices')}"
            )
    if allowed.cache_fraction is not None and tier.spec.cached:
        fixed = allowed.cache_fraction
        for i, shard in enumerate(placement.shards):
            if shard.cache_fraction is None or not math.isclose(shard.cache_fraction, fixed, rel_tol=_EVERY_CACHE):
                shown = "no cache_fraction" if shard.cache_fraction is None else f"{shard.cache_fraction:g}"
                problems.append(
                    f"the plan gives shard {i} cache_fraction {shown}, but its constraints fix cache_fraction {fixed:g}"
                )
                break
    return problems
