"""How far our plans are from optimal: an exact MILP over the search's options on small instances.

For each instance (a model and a cluster small enough to solve exactly), the oracle chooses for every table one
placement among the candidates the search itself would build, and minimises the cost model's step over them with
``scipy.optimize.milp`` (HiGHS). A placement's load and memory vectors come from the cost model; the step's
formula (:class:`persia_planner.cost.step_time.StepModel`: per device the sync time, the async time, their sum at K = 0
or their max at K >= 1, and every host NIC's total) is exact as a MILP, since each ``max`` it takes is minimised (an
epigraph variable per ``max``) and the PS round trip is paid by a binary that any PS table switches on.

The candidates are what the search builds on every tier but the HBM cache (whose sizes the search derives from its
state): each sharding type on ``hbm`` and ``ddr`` with every choice of devices it may make (:func:`candidates`),
a replica on every device, hashed over every server. Our search is run restricted to the same tiers
(``SearchConfig.tiers``), so ``ours / optimum - 1`` (the ``gap``) is the search's own shortfall; ``bound /
optimum`` says how loose the lower bound is (the bound is over every plan, so it is at most the optimum of any
restriction). The MILP lives here and in the tests, never in ``persia plan``'s path (scipy is a dev extra).

    python benchmarks/optimality.py --json out.json          # 60 instances
    python benchmarks/optimality.py --quick --json out.json  # 20 instances (CI)

JSON keys: ``instances`` (``{name, ours_ms, optimum_ms, bound_ms, gap, status}``), ``within_2pct_share``,
``worst_gap``, ``median_bound_over_optimum``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from persia_planner import CapacityError, ModelSpec, Planner, SearchConfig, Topology, validate
from persia_planner.bound import lower_bound
from persia_planner.cost.analytic import CostModel
from persia_planner.cost.terms import Layout
from persia_planner.kinds import Sharding
from persia_planner.model.qcomms import FP32_COMMS
from persia_planner.placement.shards import TablePlacement, row_splittable
from persia_planner.plan.plan import Plan, usage_of
from persia_planner.search import GreedyLocalSearch, Option, build_placement
from persia_planner.synthetic import random_model
from persia_planner.tiers import Tier

console = Console(width=150)
GIB = 1024**3
# Every sharding type and every tier but the HBM cache, whose sizes the search derives from the state.
SHARDINGS = frozenset(Sharding)
TIERS = frozenset({Tier.HBM, Tier.DDR, Tier.PS})
MIN_COLS = 16  # the narrowest column shard the search offers (search/options.py)


@dataclass(frozen=True)
class Candidate:
    """One whole placement of a table, with its load and memory vectors."""

    placement: TablePlacement
    loads: np.ndarray
    mem: np.ndarray


def candidates(cost: CostModel, table: Any) -> list[Candidate]:
    """Every placement of ``table`` the search can build from :data:`SHARDINGS` on :data:`TIERS` that fits on its
    own: whole on each device, column splits (2, 4 and a host's GPU count, as :mod:`.search.options` offers them) on
    every set of that many distinct devices, table-column-wise and table-row-wise on each host (hosts of one size),
    row-wise over every device, a replica on every device, hashed over every server."""
    topo, lay = cost.topology, cost.layout
    G = lay.n_gpus
    host_gpus = [[cost.topology.gpu_index(g) for g in h.gpus] for h in topo.trainers]
    min_host = min(len(g) for g in host_gpus)
    uniform = len({len(g) for g in host_gpus}) == 1
    local_tiers = [t for t in (Tier.HBM, Tier.DDR) if t in TIERS]
    options: list[tuple[Option, list[int]]] = []
    for tier in local_tiers:
        options += [(Option(Sharding.TABLE_WISE, tier), [g]) for g in range(G)]
        for splits in sorted({2, 4, min_host}):
            if splits < 2 or table.dim % splits or table.dim // splits < MIN_COLS:
                continue
            if splits <= 4:
                options += [
                    (Option(Sharding.COLUMN_WISE, tier, splits=splits), list(devices))
                    for devices in itertools.combinations(range(G), splits)
                ]
            if splits == min_host and uniform:
                options += [
                    (Option(Sharding.TABLE_COLUMN_WISE, tier, splits=splits), list(devices))
                    for gpus in host_gpus
                    for devices in itertools.combinations(gpus, splits)
                ]
        if row_splittable(table.rows, G):
            options.append((Option(Sharding.ROW_WISE, tier), list(range(G))))
        if uniform and row_splittable(table.rows, min_host):
            options += [(Option(Sharding.TABLE_ROW_WISE, tier), gpus) for gpus in host_gpus]
    options.append((Option(Sharding.DATA_PARALLEL, Tier.HBM), list(range(G))))
    if lay.n_servers:
        options.append((Option(Sharding.PS_HASH, Tier.PS), []))
    capacity = cost.capacities()
    found = []
    for option, gpus in options:
        if option.sharding not in SHARDINGS:
            continue
        placement = build_placement(cost, table, option, gpus)
        loads, mem = cost.placement_loads(table, placement)
        if np.all(mem <= capacity + 0.5):
            found.append(Candidate(placement, loads, mem))
    return found


# The optimum is proven to this relative gap (a hundredth of a percent, for gaps read to the percent): HiGHS closes
# the last of it slowly (an instance of 28 tables on four alike GPUs stood at 8e-6 after 40 s and 136,000 nodes,
# unproven at 1e-7 after 60 s).
REL_GAP = 1e-4


class Unsolved(TimeoutError):
    """HiGHS proved no optimum in its time: the best plan it found (``incumbent_ms``, None if none) and the least any
    plan can take that it proved (``dual_ms``)."""

    def __init__(self, message: str, incumbent_ms: float | None, dual_ms: float | None):
        super().__init__(message)
        self.incumbent_ms, self.dual_ms = incumbent_ms, dual_ms


def solve(
    cost: CostModel, time_limit_s: float = 60.0, rel_gap: float = REL_GAP
) -> tuple[float, dict[str, TablePlacement]] | None:
    """The optimum of the cost model's step over :func:`candidates` (ms, proven to ``rel_gap``: no plan of those
    candidates is faster than it by more) and a plan that reaches it; None where no choice fits.

    Raises:
        Unsolved: HiGHS proved no optimum within ``time_limit_s`` (a TimeoutError, with what it found).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    lay, step_model = cost.layout, cost.step_model
    G, H, P = lay.n_gpus, lay.n_hosts, lay.n_servers
    tables = cost.model.tables
    cands = [candidates(cost, t) for t in tables]
    if any(not c for c in cands):
        return None
    # Variables: one binary per (table, candidate); then per GPU its emb epigraph, its async epigraph; the step; the
    # PS indicator.
    index = [(i, j) for i, cs in enumerate(cands) for j in range(len(cs))]
    n_x = len(index)
    emb0, asy0 = n_x, n_x + G
    step, has_ps = n_x + 2 * G, n_x + 2 * G + 1
    n = has_ps + 1
    L = np.array([cands[i][j].loads for i, j in index]).T  # resources x candidates
    # Memory in GiB: rows in bytes beside rows in ms leave HiGHS a badly scaled matrix, whose "optimum" it has
    # returned above a feasible plan's step.
    M = np.array([cands[i][j].mem for i, j in index]).T / GIB
    rows: list[np.ndarray] = []
    lo: list[float] = []

    def at_least(row: np.ndarray, bound: float) -> None:
        """``row @ variables >= bound``."""
        rows.append(row)
        lo.append(bound)

    def epigraph(var: int, resources: list[int], extra: dict[int, float] | None = None) -> np.ndarray:
        """The row of ``var - sum of those resources' loads (+ extra)``."""
        row = np.zeros(n)
        row[:n_x] = -L[resources].sum(axis=0)
        row[var] = 1.0
        for k, v in (extra or {}).items():
            row[k] += v
        return row

    hosts, fixed = cost.gpu_host, step_model.fixed_sync_ms
    per_byte = step_model.allreduce_ms_per_byte
    rtt = step_model.rtt_ms / max(step_model.staleness, 1)
    for g in range(G):
        # emb_g >= its memory path, >= its host's DDR
        for r in (lay.emb.start + g, lay.host_ddr.start + hosts[g]):
            at_least(epigraph(emb0 + g, [r]), 0.0)
        # async_g >= each async resource (+ the round trip once any table is on the servers)
        if P:
            resources = [lay.pcie.start + g, lay.nic_async.start + hosts[g], lay.switch]
            resources += list(range(lay.ps_nic.start, lay.ps_nic.stop)) + list(range(lay.ps_ddr.start, lay.ps_ddr.stop))
            for r in resources:
                at_least(epigraph(asy0 + g, [r], {has_ps: -rtt}), 0.0)
        # step >= sync_g = emb_g + nvlink_g + nic_sync_h + fixed_g + dp_bytes * per_byte_g (+ async_g at K = 0)
        sync = epigraph(step, [lay.nvlink.start + g, lay.nic_sync.start + hosts[g]], {emb0 + g: -1.0})
        sync[:n_x] -= L[lay.dp_bytes] * per_byte[g]
        if step_model.staleness == 0 and P:
            sync[asy0 + g] = -1.0
        elif P:
            at_least(epigraph(step, [], {asy0 + g: -1.0}), 0.0)
        at_least(sync, float(fixed[g]))
    # every host NIC's total
    for h in range(H):
        at_least(epigraph(step, [lay.nic_sync.start + h, lay.nic_async.start + h]), 0.0)
    # the PS indicator is on where any table is hashed over the servers
    for k, (i, j) in enumerate(index):
        if cands[i][j].placement.sharding is Sharding.PS_HASH:
            at_least(epigraph(has_ps, [], {k: -1.0}), 0.0)
    # Symmetry: GPUs of one host alike in every figure the cost model has of them are interchangeable (so are alike
    # hosts), and the candidates of one are those of the other, swapped. Every plan has a twin with such GPUs in
    # non-increasing order of the HBM they hold (such hosts, of their GPUs' HBM and their DDR): only those are
    # searched, which leaves HiGHS one of the twins to prove optimal instead of all of them.
    hbm_rows = M[lay.hbm.start : lay.hbm.stop]
    for a, b in _alike_pairs(cost, cands):
        row = np.zeros(n)
        row[:n_x] = hbm_rows[a] - hbm_rows[b]
        at_least(row, 0.0)
    for a, b in _alike_hosts(cost, cands):
        row = np.zeros(n)
        row[:n_x] = M[lay.ddr.start + a] - M[lay.ddr.start + b]
        row[:n_x] += hbm_rows[cost.gpu_host == a].sum(axis=0) - hbm_rows[cost.gpu_host == b].sum(axis=0)
        at_least(row, 0.0)
    # one candidate per table; memory within capacity
    table_of = np.array([i for i, _ in index])
    one = np.zeros((len(cands), n))
    one[:, :n_x] = table_of[None, :] == np.arange(len(cands))[:, None]
    used = M[(M != 0).any(axis=1)]
    memory = np.zeros((len(used), n))
    memory[:, :n_x] = used
    capacity = (cost.capacities()[(M != 0).any(axis=1)] + 0.5) / GIB
    constraints = [
        LinearConstraint(np.array(rows), np.array(lo), np.inf),
        LinearConstraint(one, 1.0, 1.0),
        LinearConstraint(memory, -np.inf, capacity),
    ]
    c = np.zeros(n)
    c[step] = 1.0
    integrality = np.zeros(n)
    integrality[:n_x] = 1
    integrality[has_ps] = 1
    upper = np.full(n, np.inf)
    upper[:n_x] = 1.0
    upper[has_ps] = 1.0
    result = milp(
        c,
        constraints=constraints,
        integrality=integrality,
        bounds=Bounds(np.zeros(n), upper),
        options={"time_limit": time_limit_s, "mip_rel_gap": rel_gap},
    )
    if result.status == 1:  # the time limit, before HiGHS proved an optimum
        incumbent = float(result.fun) if result.x is not None else None
        dual = getattr(result, "mip_dual_bound", None)
        raise Unsolved(f"HiGHS found no proven optimum in {time_limit_s:g} s: {result.message}", incumbent, dual)
    if result.x is None or result.status != 0:
        return None
    chosen = {}
    for k, (i, j) in enumerate(index):
        if result.x[k] > 0.5:
            chosen[tables[i].name] = cands[i][j].placement
    # The plan's step by the cost model itself: the MILP's objective, up to the solver's tolerance, or the
    # formulation above is not the cost model's.
    estimate, mem = cost.evaluate(chosen)
    evaluated = float(estimate.step_ms)
    if abs(evaluated - result.fun) > 1e-6 * max(1.0, evaluated):
        raise AssertionError(f"the MILP's step {result.fun} is not the cost model's {evaluated}")
    # ... and a plan persia validate accepts (capacities, shards, devices), or the candidates are not the search's.
    plan = Plan(cost.model.name, cost.topology.name, chosen, usage_of(cost, estimate, mem, chosen), evaluated, 0, 1)
    problems = validate(plan, cost.model, cost.topology)
    if problems:
        raise AssertionError(f"the MILP's plan is not valid: {problems[0]}")
    return evaluated, chosen


def _gpu_figures(cost: CostModel, g: int) -> tuple[float, ...]:
    """Every per-GPU figure of the cost model: GPUs with the same are interchangeable in it."""
    scales = tuple(float(cost.sharding_scale[s][g]) for s in sorted(cost.sharding_scale, key=lambda s: s.value))
    sm = cost.step_model
    return (
        float(cost.hbm_bw[g]),
        float(cost.uvm_bw[g]),
        float(cost.nvlink_bw[g]),
        float(cost.pcie_bw[g]),
        float(cost.capacities()[cost.layout.hbm.start + g]),
        float(sm.fixed_sync_ms[g]),
        float(sm.allreduce_ms_per_byte[g]),
        *scales,
    )


def _alike_pairs(cost: CostModel, cands: list[list[Candidate]]) -> list[tuple[int, int]]:
    """Consecutive pairs (a, b) of interchangeable GPUs of one host, whose swap maps every candidate to a
    candidate."""
    lay = cost.layout
    pairs = []
    for h in range(lay.n_hosts):
        gpus = [int(g) for g in np.flatnonzero(cost.gpu_host == h)]
        for a, b in itertools.pairwise(gpus):
            if _gpu_figures(cost, a) == _gpu_figures(cost, b) and _closed(cands, *_swap(lay, [(a, b)], [])):
                pairs.append((a, b))
    return pairs


def _alike_hosts(cost: CostModel, cands: list[list[Candidate]]) -> list[tuple[int, int]]:
    """Consecutive pairs (a, b) of interchangeable hosts: the same bandwidths, DDR and GPUs alike one for one, and
    their swap maps every candidate to a candidate."""

    def figures(h: int) -> tuple:
        gpus = np.flatnonzero(cost.gpu_host == h)
        ddr = float(cost.capacities()[cost.layout.ddr.start + h])
        return (float(cost.nic_bw[h]), float(cost.host_ddr_bw[h]), ddr, tuple(_gpu_figures(cost, g) for g in gpus))

    alike = []
    for a in range(cost.layout.n_hosts - 1):
        if figures(a) != figures(a + 1):
            continue
        gpus = zip(np.flatnonzero(cost.gpu_host == a), np.flatnonzero(cost.gpu_host == a + 1), strict=True)
        if _closed(cands, *_swap(cost.layout, list(gpus), [(a, a + 1)])):
            alike.append((a, a + 1))
    return alike


def _swap(lay: Layout, gpus: list[tuple[int, int]], hosts: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The index permutations of the load and the memory vector that swap those GPUs and hosts."""
    load, mem = np.arange(lay.size), np.arange(lay.mem_size)
    for pairs, load_slices, mem_slices in (
        (gpus, (lay.emb, lay.nvlink, lay.pcie), (lay.hbm,)),
        (hosts, (lay.host_ddr, lay.nic_sync, lay.nic_async), (lay.ddr,)),
    ):
        for a, b in pairs:
            for perm, slices in ((load, load_slices), (mem, mem_slices)):
                for s in slices:
                    perm[[s.start + a, s.start + b]] = perm[[s.start + b, s.start + a]]
    return load, mem


def _closed(cands: list[list[Candidate]], load: np.ndarray, mem: np.ndarray) -> bool:
    """Whether the swap maps each table's every candidate to one of its candidates. A row split that is not even
    gives its first devices a row more, so its twin with those devices swapped is no candidate; a symmetry cut
    there would drop plans that have no twin left (HiGHS then reports an "optimum" above the search's plan)."""
    for cs in cands:
        vectors = np.array([np.concatenate([c.loads, c.mem]) for c in cs])
        twins = np.array([np.concatenate([c.loads[load], c.mem[mem]]) for c in cs])
        scale = np.maximum(np.abs(vectors).max(axis=0), 1e-12)
        close = np.abs(twins[:, None, :] - vectors[None, :, :]) <= 1e-9 * scale
        if not close.all(axis=2).any(axis=1).all():
            return False
    return True


@dataclass(frozen=True)
class Instance:
    """A small model on a small cluster."""

    name: str
    tables: int
    hosts: tuple[tuple[int, float], ...]  # (GPUs, NIC GB/s) per trainer host
    servers: int
    staleness: int
    hbm_gib: float
    seed: int

    def model(self) -> ModelSpec:
        model = random_model(
            self.tables,
            seed=self.seed,
            rows_range=(1e3, 2e6),
            dims=(16, 64, 128),
            batch_size=16384,
            staleness=self.staleness,
        )
        # The oracle places tables for given collectives: float32 ones, which the planner then keeps.
        return dataclasses.replace(model, qcomms=FP32_COMMS)

    def topology(self) -> Topology:
        hosts: list[dict[str, Any]] = [
            {
                "name": f"h{i}_",
                "ddr": 64 * GIB,
                "ddr_bandwidth": "200GB/s",
                "nic_bandwidth": f"{nic:g}GB/s",
                "gpus": {
                    "count": gpus,
                    "hbm": int(self.hbm_gib * GIB),
                    "hbm_bandwidth": "2TB/s",
                    "tflops": 300,
                    "pcie_bandwidth": "32GB/s",
                    "nvlink_bandwidth": "300GB/s",
                },
            }
            for i, (gpus, nic) in enumerate(self.hosts)
        ]
        hosts += [
            {
                "name": f"ps{p}_",
                "role": "parameter_server",
                "ddr": 2048 * GIB,
                "ddr_bandwidth": "100GB/s",
                "nic_bandwidth": "25GB/s",
            }
            for p in range(self.servers)
        ]
        return Topology.from_dict({"name": self.name, "hosts": hosts})


def instances(quick: bool) -> list[Instance]:
    """Homogeneous and heterogeneous hosts, K = 0 and K = 4, with and without servers, memory-tight and roomy."""
    clusters = [
        ((4, 50.0),),
        ((2, 50.0), (2, 50.0)),
        ((2, 12.5), (4, 100.0)),
        ((1, 25.0), (3, 50.0), (4, 100.0)),
    ]
    out = []
    count = 20 if quick else 60
    rng = np.random.default_rng(0)
    for k in range(count):
        hosts = clusters[k % len(clusters)]
        servers = (0, 2)[(k // len(clusters)) % 2]
        staleness = (0, 4)[(k // (2 * len(clusters))) % 2]
        hbm = float(rng.choice([0.25, 1.0, 16.0]))  # tight to roomy for these tables
        tables = int(rng.integers(6, 25 if quick else 41))
        name = f"i{k:02d}-{tables}t-{'x'.join(str(g) for g, _ in hosts)}-ps{servers}-k{staleness}-{hbm:g}g"
        out.append(Instance(name, tables, hosts, servers, staleness, hbm, seed=k))
    return out


def run_instance(inst: Instance, time_limit_s: float) -> dict[str, Any]:
    """Ours (restricted to the oracle's options), the optimum and the bound of one instance."""
    model, topology = inst.model(), inst.topology()
    cost = CostModel(model, topology)
    record: dict[str, Any] = {"name": inst.name, "ours_ms": None, "optimum_ms": None, "bound_ms": None, "gap": None}
    config = SearchConfig(seed=0, improve_time_s=1.0, shardings=SHARDINGS, tiers=TIERS)
    started = time.perf_counter()
    try:
        solved = solve(cost, time_limit_s)
    except Unsolved as err:
        # What it did prove still brackets the optimum.
        record.update(
            status="unsolved",
            solve_s=time.perf_counter() - started,
            incumbent_ms=err.incumbent_ms,
            dual_ms=err.dual_ms,
        )
        return record
    record["solve_s"] = time.perf_counter() - started
    try:
        ours = Planner(GreedyLocalSearch(config)).plan(model, topology)
    except CapacityError:
        ours = None
    if solved is None:
        # No choice among the oracle's options fits: the search, on the same options, finds none either.
        record["status"] = "no_plan" if ours is None else "ours_without_optimum"
        return record
    optimum, _ = solved
    record["optimum_ms"] = optimum
    record["bound_ms"] = float(lower_bound(cost).value_ms)
    if ours is None:
        record["status"] = "ours_failed"
        return record
    record["ours_ms"] = ours.step_ms
    record["gap"] = ours.step_ms / optimum - 1
    record["status"] = "ok"
    return record


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    solved = [r for r in records if r["status"] == "ok"]
    gaps = [r["gap"] for r in solved]
    ratios = [r["bound_ms"] / r["optimum_ms"] for r in solved]
    return {
        "instances": records,
        "solved": len(solved),
        "within_2pct_share": sum(g <= 0.02 for g in gaps) / len(gaps) if gaps else None,
        "worst_gap": max(gaps, default=None),
        "median_gap": statistics.median(gaps) if gaps else None,
        "median_bound_over_optimum": statistics.median(ratios) if ratios else None,
        "min_bound_over_optimum": min(ratios, default=None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 instances of up to 24 tables (CI)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--time-limit", type=float, default=60.0, help="HiGHS's time per instance (s)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    records = []
    for inst in instances(args.quick):
        records.append(run_instance(inst, args.time_limit))
        r = records[-1]
        console.print(f"{inst.name}: {r['status']} ours {r['ours_ms']} optimum {r['optimum_ms']} bound {r['bound_ms']}")
    out = summarize(records) | {"quick": args.quick, "wall_s": time.perf_counter() - started}
    table = Table(title="ours (the search on the oracle's options) vs the MILP optimum vs the lower bound (ms)")
    for col in ("instance", "ours", "optimum", "bound", "gap", "bound / optimum", "solve s"):
        table.add_column(col, justify="left" if col == "instance" else "right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    for r in records:
        ratio = None if r["optimum_ms"] is None or r["bound_ms"] is None else r["bound_ms"] / r["optimum_ms"]
        table.add_row(
            r["name"],
            ms(r["ours_ms"]),
            ms(r["optimum_ms"]),
            ms(r["bound_ms"]),
            "-" if r["gap"] is None else f"{r['gap']:+.2%}",
            "-" if ratio is None else f"{ratio:.3f}",
            f"{r['solve_s']:.1f}",
        )
    console.print(table)
    console.print(
        f"solved {out['solved']}/{len(records)}; within 2%: {out['within_2pct_share']}; worst gap {out['worst_gap']};"
        f" median bound / optimum {out['median_bound_over_optimum']}"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
