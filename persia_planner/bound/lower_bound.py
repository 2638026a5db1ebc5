"""A lower bound on the step time that no plan can beat under the same cost model: the functionals, the search over
their weights, and the bound with what it is made of.

It covers every plan that passes ``plan.validate`` and is built from the search's options: ``hbm_cache`` shards
cache between ``access.MIN_CACHE_FRACTION`` and all of the rows (or the share a table's constraints fix), and a
``table_row_wise`` table spans every GPU of its host (as TorchRec lays it out). Other valid plans may beat it: a
smaller cache, or a table-row-wise table on part of a host (the cost model charges each shard 1/n of the host's
output, as if all n GPUs of the host held one). Every cache size at once: the hit rate is concave in the size, so
the terms of the tangents' envelope (:func:`persia_planner.model.access_pattern.hit_rate_envelope`), linear in the size
between its corners, are at most the true terms there, and least at a corner.

Derivation (Lagrangian relaxation). With the step formula of ``cost.py`` (staleness K), every plan has

- ``S``   = the fixed dense time plus the synchronous embedding time, averaged over GPUs (step >= max_g sync_g >= S),
  also with the GPUs' memory paths replaced by their hosts' DDR time (``max(emb, ddr)`` is at least either);
- ``A_r`` = the time of an asynchronous resource r with its work spread perfectly: the parameter servers' DDR and
  NICs (summed bandwidth), the switch, the busiest host NIC, the slowest PCIe link (max_g async_g >= A_r);
- ``N_w`` = the trainer hosts' NIC time (all-to-all + parameter-server traffic) under a weighting w of the hosts:
  their average and, where hosts differ, the busiest alone (step >= max_h nic_h >= N_w).

At K >= 1, step >= S, A_r and N_w each. At K = 0 a GPU's async time adds to its own sync path: step >= max_g (sync_g
+ async_g) >= S + avg_g async_g. That average is what may join S: for the shared resources (servers, switch, the
same for every GPU) A_r as above, but for the host NICs and PCIe links the GPU average of each GPU's own time, not
the busiest. (S plus the busiest NIC is no bound: where hosts differ, the GPUs behind the slow NIC may carry less
sync work than the average, and the step is then below it.) So step >= S + A_r with those A_r.

For any weights lam on the simplex a convex combination of these functionals is then a bound. Each is a sum over
tables of a term that depends only on the table's *tier* (of those its ``constraints:`` allow), taken at its
smallest over every device and sharding of that tier (lookup bytes at the tier's fastest bandwidth; pooled output
at the cheapest all-to-all owner under the functional's weights); an option whose bytes alone exceed an aggregate
capacity is in no plan. Capacity of the aggregate HBM, trainer DDR and PS DDR is priced into the objective with
multipliers mu >= 0:

    L(lam, mu) = lam_S * fixed + sum_t min_o [ c_t(o; lam) + mu . mem_t(o) ] - mu . capacity

which is a valid lower bound for every (lam, mu) (weak duality). We search lam (a few pairs, then a pattern search)
and maximise over each mu by bisection on the subgradient (L is concave in mu) only where its capacity binds.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from persia_planner.bound.terms import ASYNC_NAMES, N_ASYNC, TierChoice, option_columns, table_terms
from persia_planner.cost.analytic import CostModel
from persia_planner.tiers import Memory

__all__ = ["MAX_WEIGHTINGS", "BoundPart", "LowerBound", "dense_bound", "lower_bound", "lower_bound_ms"]

_CAPACITY_NAMES = ("HBM", "trainer DDR", "PS DDR", "HBM + trainer DDR")
_HINT_TRUST = 1.3
# Weightings the bound's search evaluates by default (see lower_bound). Each is a maximisation over the memory prices.
MAX_WEIGHTINGS = 100


@dataclass(frozen=True)
class BoundPart:
    """One of the step-time functionals the bound combines, and its weight in the combination that gave the bound.

    Attributes:
        name: What it measures, e.g. "GPU work (average)" or "busiest host NIC".
        weight: Its weight (the weights sum to 1).
    """

    name: str
    weight: float


@dataclass(frozen=True)
class LowerBound:
    """The bound, and hints for the search from the relaxation's best solution.

    Attributes:
        value_ms: The bound.
        preferred: Per table, the tier the relaxation gives it (repaired to fit the aggregate capacities).
        prices: Marginal step-time value (ms per byte) of aggregate HBM, trainer DDR and PS DDR.
        hinted_ms: The relaxed step time (largest functional) of the ``preferred`` tiers: how far the hint is from
            balanced. Close to ``value_ms`` means a trustworthy hint.
        weightings: How many weightings of the functionals the search evaluated (at most ``max_weightings``).
        parts: The functionals of the combination that gave the bound, with their weights: what it is made of.
        binding: The memory capacities priced above zero in it (whose room limits the bound).
        complete: False where the search stopped once the bound passed a caller's ``stop_above``
            (:func:`lower_bound`): still a bound, but not the search's best, and its hint is that weighting's.
    """

    value_ms: float
    preferred: Mapping[str, TierChoice]
    prices: tuple[float, float, float] = (0.0, 0.0, 0.0)
    hinted_ms: float = 0.0
    weightings: int = 0
    parts: tuple[BoundPart, ...] = ()
    binding: tuple[str, ...] = ()
    complete: bool = True

    def describe(self) -> str:
        """What the bound is made of, in one line: e.g. "0.85 GPU work (average) + 0.15 busiest host NIC; memory
        priced: HBM"."""
        text = " + ".join(f"{p.weight:.2f} {p.name}" for p in self.parts) or "no functional"
        return text + (f"; memory priced: {', '.join(self.binding)}" if self.binding else "; no memory priced")

    @property
    def trustworthy(self) -> bool:
        """Whether the hinted tiers are nearly balanced (within 30% of the bound) and worth following."""
        return self.hinted_ms <= _HINT_TRUST * self.value_ms


def bound_at(cost: CostModel, at: LowerBound) -> float | None:
    """A lower bound (ms) on the step of any plan of ``cost``'s model, from one weighting of its functionals: the one
    that gave ``at`` (another cost model's bound of the same tables, e.g. with other collectives), about one
    maximisation instead of up to :data:`MAX_WEIGHTINGS`. None where ``at`` weighs a functional this model lacks."""
    if not at.parts or at.parts[0].name == "dense step alone":
        return None
    return _bound(cost, MAX_WEIGHTINGS, at)


def dense_bound(cost: CostModel) -> LowerBound:
    """The bound of the dense step alone: every plan's step is at least the GPUs' average time of an empty plan (the
    dense part, its all-reduce and the fixed costs). Trivial, and free: what a quick re-plan reports beside its plan
    where the full bound (:func:`lower_bound`) would cost more than the re-plan itself."""
    return LowerBound(float(np.mean(cost.fixed_sync_ms)), {}, parts=(BoundPart("dense step alone", 1.0),))


def lower_bound(
    cost: CostModel, *, max_weightings: int = MAX_WEIGHTINGS, stop_above: float = float("inf")
) -> LowerBound:
    """A lower bound (ms) on the step time of any plan of ``cost.model`` on ``cost.topology``, with the tier
    assignment of the relaxation's best solution (a Lagrangian hint the search starts from).

    Args:
        cost: The cost model of the model and topology.
        max_weightings: Weightings of the functionals the search over weights evaluates at most (each one a
            maximisation over the memory prices). The bound holds for any value; more can only tighten it.
        stop_above: Stop the search as soon as a weighting's bound exceeds this (ms): for a caller that only asks
            whether the bound does (the result then has ``complete`` false: a valid bound, not the search's best).
    """
    if max_weightings < 1:
        raise ValueError(f"max_weightings must be at least 1, got {max_weightings}")
    bound = _bound(cost, max_weightings, None, stop_above)
    assert isinstance(bound, LowerBound)
    return bound


_TERMS: weakref.WeakKeyDictionary[CostModel, tuple] = weakref.WeakKeyDictionary()
"""Each cost model's table terms (the most of a bound's cost): a probe (:func:`bound_at`) and a full bound of one
cost model, as the planner's choice of the collectives' precisions takes them, compute them once."""


def table_terms_of(cost: CostModel) -> tuple:
    """:func:`persia_planner.bound.terms.table_terms` of ``cost``, computed once per cost model (read-only arrays)."""
    found = _TERMS.get(cost)
    if found is None:
        found = table_terms(cost)
        for array in (*found[:4], *found[4], *found[5:]):
            array.setflags(write=False)  # shared by every bound of this cost model
        _TERMS[cost] = found
    return found


def _bound(
    cost: CostModel, max_weightings: int, at: LowerBound | None, stop_above: float = float("inf")
) -> LowerBound | float | None:
    lay = cost.layout
    sync, sync_ddr, asyn, nic, (host, host_fixed), mem, fractions = table_terms_of(cost)
    feasible = np.isfinite(sync)
    sync_avg = np.where(feasible, sync / lay.n_gpus, 0.0)
    ddr_avg = np.where(feasible, sync_ddr / lay.n_gpus, 0.0)
    fixed = float(np.mean(cost.fixed_sync_ms))
    columns = option_columns(cost)
    relaxation = _Relaxation.of(cost, feasible, mem, columns)
    functionals, names = _functionals(cost, (sync_avg, ddr_avg, fixed), asyn, nic, (host, host_fixed))
    # A functional that stays below the trivial bound even at its largest cannot lift a combination much: drop it.
    all_functionals = list(functionals)
    kept = [
        k
        for k, f in enumerate(functionals)
        if f[1] > 0 or float(np.where(relaxation.feasible, f[0], -np.inf).max(axis=1).sum()) > fixed
    ]
    functionals, names = [functionals[k] for k in kept], [names[k] for k in kept]
    search = _WeightSearch(relaxation, functionals, np.zeros_like(sync_avg), max_weightings, stop_above=stop_above)
    if at is not None:  # one weighting only: another bound's, by its functionals' names
        if not {p.name for p in at.parts} <= set(names):
            return None
        weights = np.array([sum(p.weight for p in at.parts if p.name == name) for name in names])
        return max(search.combined(weights)[0], fixed)
    best, best_w, best_pick, best_mu = search.run()
    best_pick = relaxation.repair(best_pick, search.combination(best_w)[0])
    preferred = {
        t.name: TierChoice(columns[p].tier, float(fractions[i, p]), columns[p].replicated)
        for i, (t, p) in enumerate(zip(cost.model.tables, best_pick.tolist(), strict=True))
    }
    prices = (float(best_mu[0] + best_mu[3]), float(best_mu[1] + best_mu[3]), float(best_mu[2]))
    # The relaxed step of the hinted tiers: the largest functional there. A Lagrangian pick is only optimal for its
    # weights; when it overloads a resource the weights ignored, the search should not follow it.
    rows = relaxation.rows
    hinted_ms = max(
        float(np.where(relaxation.feasible, f, 0.0)[rows, best_pick].sum()) + constant
        for f, constant in all_functionals
    )
    parts = tuple(BoundPart(name, float(w)) for name, w in zip(names, best_w.tolist(), strict=True) if w > 0)
    binding_names = tuple(_CAPACITY_NAMES[k] for k in range(len(best_mu)) if best_mu[k] > 0)
    if fixed >= best:
        parts, binding_names = (BoundPart("dense step alone", 1.0),), ()
    complete = not search.stopped
    return LowerBound(max(best, fixed), preferred, prices, hinted_ms, search.calls, parts, binding_names, complete)


def _functionals(
    cost: CostModel,
    sync: tuple[np.ndarray, np.ndarray, float],
    asyn: np.ndarray,
    nic: np.ndarray,
    host: tuple[np.ndarray, np.ndarray],
) -> tuple[list[tuple[np.ndarray, float]], list[str]]:
    """The linear functionals F_j (per-table terms, a constant in ms) with step >= F_j for every plan, and their
    names: the GPU work (``sync``: its average, via host DDR, and the fixed dense time), the asynchronous resources
    (at K = 0 joined to the GPU work), the host NICs and each host's sync path."""
    sync_avg, ddr_avg, fixed = sync
    synchronous = cost.model.staleness == 0
    used = [r for r in range(N_ASYNC) if asyn[r].max(initial=0.0) > 0]
    functionals: list[tuple[np.ndarray, float]] = []
    names: list[str] = []
    shared = [r for r in used if r < 3]  # the servers' DDR and NICs and the switch: the same for every GPU
    if synchronous and used:
        strongest = max(used, key=lambda r: float(asyn[r].max(axis=1).sum()))
        functionals.append((sync_avg + asyn[strongest], fixed))
        functionals.append((ddr_avg + asyn[strongest], fixed))
        names += [f"GPU work + {ASYNC_NAMES[strongest]} (K = 0)", f"GPU work via host DDR + {ASYNC_NAMES[strongest]}"]
    else:
        functionals.append((sync_avg, fixed))
        functionals.append((ddr_avg, fixed))
        names += ["GPU work (average)", "GPU work via host DDR (average)"]
        # The two strongest asynchronous resources carry the bound; more only slow the weight search down.
        strongest_two = sorted(used, key=lambda r: -float(asyn[r].max(axis=1).sum()))[:2]
        functionals.extend((asyn[r], 0.0) for r in strongest_two)
        names += [ASYNC_NAMES[r] for r in strongest_two]
    functionals.extend((f, 0.0) for f in nic)
    names += ["host NICs (average)", "busiest host NIC"][: len(nic)]
    # A host's sync path. At K = 0 the servers' time joins it: only a resource every GPU waits on alike.
    joined = max(shared, key=lambda r: float(asyn[r].max(axis=1).sum())) if synchronous and shared else None
    paths, path_fixed = host
    host_names = ["hosts' sync path (average)"]
    if len(paths) == 2:
        host_names.append("busiest host's sync path")
    elif len(paths) > 2:
        host_names += [f"host {h.name}'s sync path" for h in cost.topology.trainers]
    for which, f, constant in zip(host_names, paths, path_fixed, strict=True):
        if joined is None:
            functionals.append((f, float(constant)))
            names.append(which)
        else:
            functionals.append((f + asyn[joined], float(constant)))
            names.append(f"{which} + {ASYNC_NAMES[joined]} (K = 0)")
    return functionals, names


@dataclass
class _Relaxation:
    """The Lagrangian of the memory capacities: for a combination of the functionals, the best value over the
    prices ``mu >= 0`` of the aggregate HBM, trainer DDR, PS DDR and HBM + trainer DDR, and the picks there."""

    feasible: np.ndarray  # T x O: the options in some plan
    mem: np.ndarray  # 4 x T x O: each option's bytes of each capacity
    capacity: np.ndarray  # 4
    binding: list[int]  # the capacities that can bind, in the order their prices are searched
    mem_scale: float  # the smallest bytes of any option
    warm: np.ndarray = field(default_factory=lambda: np.zeros(4))  # the previous weights' prices

    def __post_init__(self) -> None:
        # The maximisation evaluates the Lagrangian thousands of times on 1,000 tables: flat views and the
        # infeasible options' inf added once per functional keep each evaluation to a few whole-array operations.
        self.rows = np.arange(self.mem.shape[1])
        n_options = self.mem.shape[2]
        self.mem_flat = self.mem.reshape(len(self.mem), -1)
        self.row_starts = self.rows * n_options
        # The picks' bytes are gathered from a copy with the options' memory rows side by side: np.take of its rows
        # is what mem_flat[:, flat] gives (the same layout, so sum() adds in the same order: the same bits), without
        # the fancy index's strided copy, twice as slow.
        self.mem_rows = np.ascontiguousarray(self.mem_flat.T)

    @classmethod
    def of(cls, cost: CostModel, feasible: np.ndarray, mem: np.ndarray, columns: list[TierChoice]) -> _Relaxation:
        """The relaxation of the tables' options (``feasible`` is narrowed to the options that fit)."""
        lay = cost.layout
        caps = cost.capacities() + 0.5  # validate() allows half a byte over each device's capacity
        # A fourth, implied constraint: HBM + trainer DDR together. Its price moves both local tiers at once, which
        # the per-tier prices alone cannot do without oscillating (a table priced out of HBM lands in DDR and back).
        mem = np.concatenate([mem, (mem[0] + mem[1])[None]], axis=0)
        capacity = np.array(
            [
                caps[lay.hbm].sum(),
                caps[lay.ddr].sum(),
                caps[lay.slots(Memory.SERVER)].sum(),
                caps[lay.hbm].sum() + caps[lay.ddr].sum(),
            ]
        )
        # An option whose bytes alone exceed an aggregate capacity is in no valid plan. A table's cached shards may
        # mix the cache fractions, so those options go together, where even the smallest cache does not fit. (Where
        # a table fits nowhere no plan exists: its options stay, so that the bound stays finite.)
        fits = np.all(mem <= capacity[:, None, None], axis=0)
        cached = np.array([c.tier.spec.cached for c in columns])
        fits[:, cached] = fits[:, cached].any(axis=1, keepdims=True)
        feasible = feasible & (fits | ~np.any(feasible & fits, axis=1, keepdims=True))
        # A capacity that even the most memory-hungry option of every table cannot exceed never binds: price 0.
        binding = [k for k in (3, 0, 1, 2) if capacity[k] < float(mem[k].max(axis=1).sum())]
        positive = mem[mem > 0]
        return cls(feasible, mem, capacity, binding, float(positive.min()) if positive.size else 1.0)

    def evaluate(self, masked: np.ndarray, constant: float, mu: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """The Lagrangian at prices ``mu``, its subgradient and the picks (``masked``: the terms with inf where an
        option is infeasible)."""
        c = masked + np.dot(mu[None, :], self.mem_flat).reshape(masked.shape)  # what np.tensordot(mu, mem, 1) does
        pick = c.argmin(axis=1)
        flat = self.row_starts + pick
        value = constant + float(c.ravel()[flat].sum()) - float(mu @ self.capacity)
        used = self.mem_rows.take(flat, axis=0).sum(axis=0)
        return value, used - self.capacity, pick

    def maximise(self, terms: np.ndarray, constant: float, settle: bool = False) -> tuple[float, np.ndarray]:
        """max over mu >= 0 by bisection on the subgradient (L is concave, piecewise linear in each price), warm-started
        from the previous call's prices: one round over the binding capacities from there, two from none or where
        ``settle`` asks (a second round settles each price again against the others' new ones: the weight search
        asks it of its best weighting only, every other weighting's prices start where a near one's ended).

        Returns the best bound seen and the tables' cheapest options at the final prices, each price on the side
        where its capacity holds (so the picks make a near-feasible start for the search)."""
        evaluate, binding, feasible = self.evaluate, self.binding, self.feasible
        mu = self.warm.copy()
        terms = np.where(feasible, terms, np.inf)
        value, slope, pick = evaluate(terms, constant, mu)
        # No price above (largest term / smallest memory) changes a pick: the search range ends there.
        log_top = np.log10(max(float(np.abs(terms[feasible]).max(initial=0.0)), 1e-12) / self.mem_scale) + 1
        full_range = (log_top - 17, log_top)
        for _ in range(2 if len(binding) > 1 and (settle or not mu.any()) else 1):
            for k in binding:
                if slope[k] <= 0 and mu[k] == 0:
                    continue
                if mu[k] > 0:
                    lo, hi = np.log10(mu[k]) - 2, np.log10(mu[k]) + 2
                    mu[k] = 10**lo
                    v_lo, sl_lo, _ = evaluate(terms, constant, mu)
                    mu[k] = 10**hi
                    v_hi, sl_hi, _ = evaluate(terms, constant, mu)
                    value = max(value, v_lo, v_hi)
                    if not (sl_lo[k] > 0 >= sl_hi[k]):
                        lo, hi = full_range
                else:
                    lo, hi = full_range
                for _ in range(13):
                    mid = (lo + hi) / 2
                    mu[k] = 10**mid
                    v, sl, _ = evaluate(terms, constant, mu)
                    value = max(value, v)
                    lo, hi = (mid, hi) if sl[k] > 0 else (lo, mid)
                mu[k] = 10**hi
                v, slope, pick = evaluate(terms, constant, mu)
                value = max(value, v)
        self.warm[:] = mu
        return value, pick

    def repair(self, pick: np.ndarray, terms: np.ndarray) -> np.ndarray:
        """Make the relaxation's picks fit: while a capacity is over, move the tables that free its bytes at the
        least extra cost per byte to their cheapest option that uses less of it."""
        mem, rows, capacity = self.mem, self.rows, self.capacity
        pick = pick.copy()
        cost_now = np.where(self.feasible, terms, np.inf)
        for _ in range(4):
            over = mem[:, rows, pick].sum(axis=1) - capacity
            if np.all(over <= 0):
                break
            full = over >= 0
            for k in np.flatnonzero(over > 0):
                held = mem[k, rows, pick]
                # Never push bytes into another capacity that is already full.
                grows_full = np.any(full[:, None, None] & (mem > mem[:, rows, pick][:, :, None]), axis=0)
                alternative = np.where((mem[k] < held[:, None]) & ~grows_full, cost_now, np.inf)
                alt = np.argmin(alternative, axis=1)
                extra = alternative[rows, alt] - cost_now[rows, pick]
                freed = held - mem[k, rows, alt]
                ratio = np.where((freed > 0) & np.isfinite(extra), extra / np.maximum(freed, 1e-300), np.inf)
                order = np.argsort(ratio, kind="stable")
                enough = int(np.searchsorted(np.cumsum(freed[order]), over[k])) + 1
                moved = order[:enough][np.isfinite(ratio[order[:enough]])]
                pick[moved] = alt[moved]
        return pick


@dataclass
class _WeightSearch:
    """The search over the simplex of the functionals' weights: the best pair (the GPU work, one other), then a
    local pattern search over all, each weighting one maximisation over the memory prices."""

    relaxation: _Relaxation
    functionals: list[tuple[np.ndarray, float]]
    zeros: np.ndarray  # T x O, so that a combination of no term has the terms' shape
    max_weightings: int
    calls: int = 0
    stop_above: float = float("inf")  # a bound above this is all the caller needs: the search stops there
    best: float = float("-inf")  # the best bound so far

    def combination(self, weights: np.ndarray) -> tuple[np.ndarray, float]:
        terms = sum(w * f[0] for w, f in zip(weights, self.functionals, strict=True) if w > 0)
        constant = sum(w * f[1] for w, f in zip(weights, self.functionals, strict=True))
        return np.asarray(terms) + self.zeros, constant

    def combined(self, weights: np.ndarray, settle: bool = False) -> tuple[float, np.ndarray, np.ndarray]:
        self.calls += 1
        value, pick = self.relaxation.maximise(*self.combination(weights), settle=settle)
        return value, pick, self.relaxation.warm.copy()

    @property
    def stopped(self) -> bool:
        """Whether the best bound so far passed ``stop_above`` (the search stops there)."""
        return self.best > self.stop_above

    @property
    def done(self) -> bool:
        """No more weightings: the budget is spent, or the best bound passed ``stop_above``."""
        return self.stopped or self.calls >= self.max_weightings

    def run(self) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        """The best bound found, its weights, the picks and the prices there."""
        n = len(self.functionals)
        best_w = np.eye(n)[0]
        best, best_pick, best_mu = self.combined(best_w)
        self.best = best
        for j in range(1, n):
            for w in (0.3, 0.6, 0.85):
                if self.done:
                    break
                weights = np.zeros(n)
                weights[0], weights[j] = w, 1 - w
                value, pick, mu = self.combined(weights)
                if value > best:
                    best, best_w, best_pick, best_mu = value, weights, pick, mu
                    self.best = best
        step = 0.1
        # Bounded by a count of weightings, not rounds: any weights give a valid bound, so stopping early only
        # loosens it. Where the relaxation is infeasible (more bytes than the cluster holds) the Lagrangian grows
        # without limit and every move "improves" it. Where every tier is nearly full, the prices warm-started from
        # the previous weighting gain a little in every call (they climb a ridge of coupled capacities one price at
        # a time), so the same weights kept "improving" for seconds, for a bound under 1% tighter (decision 0004).
        while step > 0.03 and not self.done:
            improved = False
            for i in range(n):
                for j in range(n):
                    if i == j or best_w[j] < step / 2 or self.done:
                        continue
                    weights = best_w.copy()
                    moved = min(step, weights[j])
                    weights[i] += moved
                    weights[j] -= moved
                    value, pick, mu = self.combined(weights)
                    if value > best * (1 + 1e-9):
                        best, best_w, best_pick, best_mu, improved = value, weights, pick, mu, True
                        self.best = best
            if not improved:
                step /= 2
        if not self.done:
            # Each weighting's prices had one round from a near weighting's: the best one's are settled (from its own),
            # where the budget leaves a weighting for it. The search ran whole: so it stays (``stopped`` is not set).
            self.relaxation.warm[:] = best_mu
            value, pick, mu = self.combined(best_w, settle=True)
            if value > best:
                best, best_pick, best_mu = value, pick, mu
        return best, best_w, best_pick, best_mu


def lower_bound_ms(cost: CostModel) -> float:
    """The bound alone (see :func:`lower_bound`)."""
    return lower_bound(cost).value_ms
