"""The pipeline: model + topology -> cost model -> search -> plan (with its lower bound)."""

from __future__ import annotations

from persia_planner.bound import lower_bound
from persia_planner.constraint_checks import check_constraints
from persia_planner.cost import CostModel
from persia_planner.errors import CapacityError
from persia_planner.memory import ps_holds, ps_rows_error
from persia_planner.plans import Plan, usage_of
from persia_planner.search import GreedyLocalSearch, SearchConfig, Searcher
from persia_planner.specs import ModelSpec
from persia_planner.topology import Topology
from persia_planner.units import format_bytes

__all__ = ["Planner", "plan"]


class Planner:
    """Plans models on topologies.

    Args:
        searcher: The search stage (default: greedy construction + local search).
    """

    def __init__(self, searcher: Searcher | None = None):
        self.searcher = searcher or GreedyLocalSearch()

    def plan(self, model: ModelSpec, topology: Topology) -> Plan:
        """Place every table of ``model`` on ``topology``.

        Raises:
            ConstraintError: A table's constraints name a device the topology lacks, or allow no placement its
                devices can hold.
            CapacityError: The model does not fit (or a table fits nowhere its constraints allow); names the short
                capacity, by how much, and what to change.
        """
        check_constraints(model, topology)
        check_capacity(model, topology)
        cost = CostModel(model, topology)
        bound = lower_bound(cost)
        result = self.searcher.search(cost, bound)
        estimate, mem = cost.evaluate(result.placements)
        return Plan(
            model=model.name,
            topology=topology.name,
            tables=result.placements,
            devices=usage_of(cost, estimate, mem, result.placements),
            step_ms=estimate.step_ms,
            lower_bound_ms=bound.value_ms,
            samples_per_s=estimate.samples_per_s,
            alternatives=result.alternatives,
        )


def plan(
    model: ModelSpec,
    topology: Topology,
    *,
    seed: int = 0,
    improve_time_s: float = 5.0,
    explain_top: int = SearchConfig.explain_top,
) -> Plan:
    """Plan ``model`` on ``topology`` with the default search (see :class:`Planner`).

    ``explain_top``: how many of the largest tables get ``Plan.alternatives`` (0: none, which saves re-scoring them;
    the plan is the same).
    """
    config = SearchConfig(seed=seed, improve_time_s=improve_time_s, explain_top=explain_top)
    return Planner(GreedyLocalSearch(config)).plan(model, topology)


def check_capacity(model: ModelSpec, topology: Topology) -> None:
    """Fail fast, before searching, when the tables cannot fit even if perfectly packed."""
    hbm = sum(topology.hbm_capacity(g) for g in topology.gpus)
    ddr = sum(topology.ddr_capacity(h) for h in topology.trainers)
    ps = sum(topology.ddr_capacity(s) for s in topology.servers)
    total = model.total_bytes
    dtype = model.embedding_dtype
    if total > hbm + ddr + ps:
        short = total - (hbm + ddr + ps)
        resource = "PS DDR" if topology.servers else "trainer DDR"
        per_server = topology.servers[0].ddr_bytes if topology.servers else None
        fixes = []
        if per_server:
            need = -(-short // topology.ddr_capacity(topology.servers[0]))
            fixes.append(f"add {need} parameter servers of {format_bytes(per_server)}")
        else:
            fixes.append("add parameter servers (hosts with role: parameter_server)")
        if dtype.n_bytes == 4:
            fixes.append("set embedding_dtype: fp16")
        fixes.append("reduce table rows")
        raise CapacityError(
            resource,
            short,
            f"the tables need {format_bytes(total)} but HBM + DDR + PS hold {format_bytes(hbm + ddr + ps)} after "
            f"reservations: {resource} is short by {format_bytes(short)}",
            tuple(fixes),
        )
    # A table larger than all of HBM and all of DDR can only go to the parameter servers: each must hold its share.
    local = max(hbm, ddr)
    for table in model.tables:
        if table.bytes(dtype) > local and topology.servers and not ps_holds(table.rows, len(topology.servers)):
            raise ps_rows_error(table, len(topology.servers), local)
    largest = max(model.tables, key=lambda t: t.bytes(dtype))
    room = max(hbm, ddr, ps)
    if largest.bytes(dtype) > room:
        short = largest.bytes(dtype) - room
        raise CapacityError(
            "largest tier",
            short,
            f"table {largest.name!r} ({format_bytes(largest.bytes(dtype))}) is larger than any tier "
            f"(largest holds {format_bytes(room)}; short by {format_bytes(short)})",
            ("add parameter servers or DDR", "reduce its rows or dim"),
            table=largest.name,
        )
