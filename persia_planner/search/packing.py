"""Packing for tight HBM: which tables the GPUs' memory should hold, chosen as a knapsack, and placed largest first.

Where HBM is tight, the hottest-bytes-first greedy fills each GPU with whole small tables and column halves, which
leave every GPU a gap that the next hot table no longer fits: it goes to host memory, and the step pays its lookups
over PCIe. The optimum (the MILP of ``benchmarks/optimality.py``) instead fills HBM to within a few percent, the
large hot tables in even row blocks over every GPU. Here the set is chosen first: each table's lookups in HBM
rather than in host memory save GPU time (the bound's terms of the two tiers), its bytes cost HBM, and the set that
saves the most within the GPUs' free HBM is a 0/1 knapsack (solved exactly on a grid of the capacity). The
construction's knapsack starts (:mod:`.construct`) place that set largest first (first-fit decreasing), each on its
best HBM option or, for the set's largest, in row blocks over every GPU, and the other tables in host memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from persia_planner.bound import TierChoice, table_terms_of
from persia_planner.bound.terms import option_columns
from persia_planner.cost.analytic import CostModel
from persia_planner.tiers import Tier

__all__ = ["KNAPSACK_STEPS", "HbmSet", "hbm_knapsack"]

KNAPSACK_STEPS = 2000
"""The grid the knapsack's capacity is cut into: each table's bytes are rounded up to whole steps (a set that fits
the grid fits the bytes), so the set can leave up to a step per table unused."""


@dataclass(frozen=True)
class HbmSet:
    """The tables chosen for HBM, as a construction takes them.

    Attributes:
        preferred: Each chosen table's tier (HBM), and the others' (host memory, where they may go): the
            construction scores a table's options on its tier only, while one of them fits.
        first: The chosen tables, largest first: placed before every other table.
        spread: The chosen tables of more than half the smallest GPU's free HBM: a second packing start puts them
            in row blocks over every GPU (a split over some GPUs can leave each a gap the next one no longer fits).
    """

    preferred: Mapping[str, TierChoice]
    first: tuple[str, ...]
    spread: frozenset[str]


def hbm_knapsack(cost: CostModel, free_hbm: np.ndarray, steps: int = KNAPSACK_STEPS) -> HbmSet | None:
    """The tables whose lookups in HBM save the most GPU time within ``free_hbm`` (each GPU's free HBM, in bytes): a
    table's saving is its GPU work in host memory (``ddr``) less in HBM, its weight its bytes in HBM. None where every
    table that gains from HBM fits in it (nothing to choose), none gains, or the HBM every table takes anyway leaves
    no room.

    Args:
        cost: The cost model of the model and topology.
        free_hbm: The HBM the set may take, per GPU.
        steps: The grid of the capacity (see :data:`KNAPSACK_STEPS`).
    """
    free_hbm_bytes = float(np.sum(free_hbm))
    columns = option_columns(cost)
    hbm = next(i for i, c in enumerate(columns) if c.tier is Tier.HBM and not c.replicated)
    ddr = next(i for i, c in enumerate(columns) if c.tier is Tier.DDR)
    sync, *_, mem, _ = table_terms_of(cost)
    in_ddr = np.isfinite(sync[:, ddr])
    # Every table takes some HBM wherever it goes: in host memory it keeps its optimizer state there (the tables not
    # chosen go there), and a table with no host-memory option the least of its others. That is reserved for every
    # table, and a chosen table weighs what HBM takes beyond it.
    least = np.where(np.isfinite(sync), mem[0], np.inf).min(axis=1)
    reserved = np.where(in_ddr, mem[0][:, ddr], np.where(np.isfinite(least), least, 0.0))
    room = free_hbm_bytes - float(reserved.sum())
    weight = mem[0][:, hbm] - reserved
    with np.errstate(invalid="ignore"):  # inf - inf: a table with neither option
        saving = sync[:, ddr] - sync[:, hbm]
    # Only a table with both options is weighed (one without a host-memory option takes its best one, unguided).
    candidates = np.flatnonzero(in_ddr & np.isfinite(saving) & (saving > 0) & (weight > 0))
    if not len(candidates) or room <= 0 or float(weight[candidates].sum()) <= room:
        return None
    unit = room / steps
    units = np.ceil(weight[candidates] / unit).astype(int)
    values = saving[candidates]
    best = np.zeros(steps + 1)  # the most saving within each capacity (in steps)
    kept = np.zeros((len(candidates), steps + 1), dtype=bool)
    for k, (w, v) in enumerate(zip(units.tolist(), values.tolist(), strict=True)):
        if w > steps:
            continue
        with_it = best[: steps + 1 - w] + v
        better = with_it > best[w:]
        kept[k, w:] = better
        best[w:] = np.where(better, with_it, best[w:])
    chosen, room = [], steps
    for k in range(len(candidates) - 1, -1, -1):
        if kept[k, room]:
            chosen.append(int(candidates[k]))
            room -= int(units[k])
    if not chosen:
        return None
    tables = cost.model.tables
    by_size = sorted(chosen, key=lambda i: (-float(mem[0][i, hbm]), i))
    # The others go to host memory, where they may: else they would take the HBM reserved for them.
    rest = {tables[i].name: TierChoice(Tier.DDR) for i in np.flatnonzero(in_ddr)}
    half_gpu = float(np.min(free_hbm)) / 2
    return HbmSet(
        rest | {tables[i].name: TierChoice(Tier.HBM) for i in chosen},
        tuple(tables[i].name for i in by_size),
        frozenset(tables[i].name for i in chosen if mem[0][i, hbm] > half_gpu),
    )
