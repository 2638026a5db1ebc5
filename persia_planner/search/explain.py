"""Explanation: what the largest tables would cost under their other options, and why a table fits nowhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from persia_planner.errors import CapacityError
from persia_planner.kinds import Sharding
from persia_planner.model.specs import TableSpec
from persia_planner.placement.memory import ps_rows_error
from persia_planner.search.base import Alternative
from persia_planner.tiers import Holder, Memory, Tier, server_tiers
from persia_planner.units import format_bytes

if TYPE_CHECKING:
    from persia_planner.search.base import SearchState

__all__ = ["NextBestAlternatives", "capacity_error"]


class NextBestAlternatives:
    """The default :class:`.base.Explainer`: each large table re-placed by every other option, the rest unchanged."""

    def alternatives(self, state: SearchState, top: int) -> dict[str, tuple[Alternative, ...]]:
        """For the ``top`` largest tables: the best step time under each other (sharding, tier), best first."""
        tables = sorted(state.cost.model.tables, key=lambda t: -t.bytes(state.dtype_of(t)))[:top]
        result = {}
        # Explaining reads the state: each table is taken out and put back, which would move it to the end of the
        # choices (the order ruin draws from), round the sums and draw ties from the RNG; all three are put back.
        order, loads, mem = list(state.choices), state.loads.copy(), state.mem.copy()
        rng = state.rng.bit_generator.state
        for table in tables:
            old = state.remove(table.name)
            _, scored = state.best_choice(table)
            state.add(table.name, old)
            seen: dict[tuple[Sharding, Tier], Alternative] = {}
            for choice, _ in scored:
                key = (choice.option.sharding, choice.option.tier)
                step = float(state.cost.step_ms(state.loads - old.loads + choice.loads)[0])
                if key not in seen or step < seen[key].step_ms:
                    seen[key] = Alternative(choice.option, step)
            result[table.name] = tuple(sorted(seen.values(), key=lambda a: a.step_ms))
        placed = [(name, state.choices.pop(name)) for name in order]
        state.choices.update(placed)
        state.loads[:], state.mem[:] = loads, mem
        state.rng.bit_generator.state = rng
        state.changed()
        return result


def capacity_error(state: SearchState, table: TableSpec) -> CapacityError:
    """Why ``table`` fits nowhere in ``state``: the resource that is short, by how much, and the fixes (for a table
    with constraints, that it fits nowhere they allow, and loosening them first)."""
    err = _capacity_error(state, table)
    allowed = table.constraints
    if not allowed.constrained:
        return err
    return CapacityError(
        err.resource,
        err.short_bytes,
        err.message.replace("fits nowhere", f"fits nowhere its constraints allow ({allowed.describe()})", 1),
        ("allow more tiers, sharding types or devices", *err.fixes[:2]),
        table=table.name,
    )


def _capacity_error(state: SearchState, table: TableSpec) -> CapacityError:
    cost, size = state.cost, table.bytes(state.dtype_of(table))
    free_vector = state.cap - state.mem
    # One resource per memory, by its label; a memory behind a server's cache (the ssd tier's disk) counts as the
    # cache's memory, which fills first.
    resource_of = {m: m for m in Memory}
    for tier in Tier:
        if not tier.spec.local and tier.spec.cache_in is not None:
            resource_of[tier.spec.rows_in] = tier.spec.cache_in
    every = {m.spec.label: float(cost.slots_of(free_vector, m).sum()) for m in Memory if resource_of[m] is m}
    # Only the memories of the tiers the search may use count (SearchConfig's tiers and shardings), and of those only
    # what the topology has: a search without the servers' tiers must not blame the servers, nor one of HBM alone
    # the trainers' DDR.
    config = state.config
    allowed = {t.spec.rows_in for t in config.tiers if t.spec.shardings & config.shardings}
    on_servers = {m for m in Memory if m.spec.holder is Holder.SERVER}
    servers_allowed = bool(allowed & on_servers)
    present = {m for m in Memory if m not in on_servers or state.servers_hold(m)}
    server_label = Memory.SERVER.spec.label
    free = {
        label: value
        for label, value in every.items()
        if any(resource_of[m].spec.label == label for m in allowed & present)
    }
    if not free:
        # the memories of their own the allowed server tiers need (a server's DDR goes without saying)
        missing = sorted(f"{m.spec.short_name}s" for m in allowed & on_servers - present if m is not Memory.SERVER)
        return CapacityError(
            server_label if servers_allowed else Memory.DEVICE.spec.label,
            size,
            f"table {table.name!r} ({format_bytes(size)}) fits nowhere: the tiers the search may use "
            f"({', '.join(sorted(t.value for t in config.tiers))}) need parameter servers"
            f"{' with ' + ' and '.join(missing) if missing else ''}, which the topology lacks",
            ("let the search use more tiers or sharding types (SearchConfig)", "add parameter servers"),
            table=table.name,
        )
    n_servers = state.n_servers if server_label in free else 0
    local_labels = (Memory.DEVICE.spec.label, Memory.HOST.spec.label)
    if n_servers and not state.ps_holds(table):
        return ps_rows_error(table, n_servers, max((free.get(k, 0.0) for k in local_labels), default=0.0))
    resource = server_label if n_servers else max(free, key=free.get)
    if resource == server_label:
        # The servers' stores keep a record, an index and float32 optimizer state: more than the table's bytes.
        in_ddr = state.server_bytes(table, server_tiers()[0])[Memory.SERVER]
        size = int(in_ddr.sum())
    short = int(size - free[resource])
    if n_servers and short <= 0:
        # The servers have room in total, but every server holds an equal share of the rows (one hash bucket
        # each, as the parameter servers route ids): the server with the least room is what is short.
        gap = in_ddr - cost.slots_of(free_vector, Memory.SERVER)
        worst = int(np.argmax(gap))
        server = cost.topology.servers[worst].name
        return CapacityError(
            resource,
            int(max(gap[worst], 0)),
            f"table {table.name!r} ({format_bytes(size)} in the servers' stores) fits nowhere: the "
            f"{n_servers} parameter servers hold an equal share of its rows each, and {server} is short "
            f"by {format_bytes(max(gap[worst], 0))} for its share after placing the hotter tables",
            (
                f"give {server} more DDR (parameter servers of equal DDR hold the most)",
                "reduce its rows, or set embedding_dtype: fp16 (the stores keep the rows in it)",
                "lower the reserve fractions under 'constants:' in topology.yaml",
            ),
            table=table.name,
        )
    fixes = (
        "add parameter servers or more DDR per server"
        if n_servers
        else "add parameter servers (hosts with role: parameter_server)"
        if servers_allowed
        else "let the search use more tiers or sharding types (SearchConfig)",
        "reduce its rows" if n_servers else "use embedding_dtype: fp16 or fewer rows",
        "lower the reserve fractions under 'constants:' in topology.yaml",
    )
    held = " in the servers' stores" if resource == "PS DDR" else ""
    return CapacityError(
        resource,
        max(short, 0),
        f"table {table.name!r} ({format_bytes(size)}{held}) fits nowhere: {resource} has "
        f"{format_bytes(max(free[resource], 0))} free after placing the hotter tables "
        f"(short by {format_bytes(max(short, 0))})",
        fixes,
        table=table.name,
    )
