"""Eviction in a full store: which rows go (:func:`choose_victims`), and the log of the ids that went
(:class:`EvictionLog`), which the next incremental dump lists as removals (:mod:`.deltas`)."""

from __future__ import annotations

import torch

from persia_planner.modules.ps.index import HashIndex, as_ids
from persia_planner.modules.ps.policies import Eviction

__all__ = ["EvictionLog", "choose_victims"]


def _lowest(score: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` smallest values of ``score`` (ties: lowest positions first), in no particular order.

    ``kthvalue`` and two comparisons: faster than ``topk`` on large tables, and exact.
    """
    if k >= score.numel():
        return torch.arange(score.numel())
    threshold = torch.kthvalue(score, k).values
    below = (score < threshold).nonzero().squeeze(1)
    at = (score == threshold).nonzero().squeeze(1)[: k - below.numel()]
    return torch.cat([below, at])


def choose_victims(
    eviction: Eviction, last: torch.Tensor, count: torch.Tensor, protected: torch.Tensor, n_victims: int
) -> torch.Tensor:
    """Slots of the ``n_victims`` rows ``eviction`` gives up first, never the ``protected`` slots.

    Args:
        eviction: The table's policy.
        last: Per occupied slot, the training lookup batch of its last access (int32).
        count: Per occupied slot, its access count (int32).
        protected: Slots of the current batch's hits. Under LRU they must carry the newest ``last`` and
            ``n_victims`` must leave them room (at most the other rows): then they are never chosen.
        n_victims: How many rows go.

    Returns:
        The victims' slots, in no particular order.
    """
    if eviction is Eviction.LRU:
        # The batch's hits carry the newest step, and at most live - len(protected) rows are chosen: never them.
        score = last
    else:
        # count, then recency: one int64 key; the batch's hits are pushed to the top so they are never chosen.
        score = (count.long() << 32) | last.long()
        score[protected] = torch.iinfo(torch.int64).max
    return _lowest(score, n_victims)


class EvictionLog:
    """The ids a store evicted since its last incremental dump, for that dump's removals.

    The log runs from the store's first dump, checkpoint or load on (:meth:`start`): before that no replica can hold
    the store's rows, so nothing is kept. It holds 8 B per eviction between two dumps, compacted to the distinct ids
    no longer held when it outgrows twice the capacity; if even those exceed the capacity, it is dropped
    (:meth:`drop`) and the next dump says its removals are incomplete: a replica then keeps those evicted ids until
    it reloads a full checkpoint.

    Args:
        capacity: The store's capacity.
        index: The store's hash index: ids held again (re-admitted since their eviction) are no removals.
    """

    def __init__(self, capacity: int, index: HashIndex) -> None:
        self.capacity = capacity
        self.index = index
        self.running = False
        self.complete = True  # False: dropped since the last take()
        self._ids: list[torch.Tensor] = []
        self._n = 0  # ids in the log

    def start(self) -> None:
        """Run the log from here on, if it is not running yet."""
        if not self.running:
            self.restart()

    def restart(self) -> None:
        """Run the log afresh: empty and complete."""
        self.running, self.complete, self._ids, self._n = True, True, [], 0

    def add(self, ids: torch.Tensor) -> None:
        """Log evicted ``ids`` (nothing while the log is not running, or once it was dropped)."""
        if not self.running or not self.complete:
            return
        self._ids.append(ids)
        self._n += ids.numel()
        # Compact past twice the capacity: amortised O(1) per id, and the log never holds more than 16 B per row.
        if self._n > 2 * self.capacity:
            compacted = self._removed()
            if compacted.numel() > self.capacity:
                self.drop()
            else:
                self._ids, self._n = [compacted], compacted.numel()

    def drop(self) -> None:
        """Give up the log until the next :meth:`take`, which then says its removals are incomplete."""
        self.running, self.complete, self._ids, self._n = True, False, [], 0

    def take(self) -> tuple[torch.Tensor, bool]:
        """The removals since the previous take (the logged ids, distinct and sorted, less those held again) and
        whether they are all of them; restarts the log."""
        complete = self.complete
        removed = self._removed() if self.running and complete else torch.empty(0, dtype=torch.int64)
        self.restart()
        return removed, complete

    def put_back(self, removed: torch.Tensor | None, *, complete: bool = True) -> None:
        """Log what a :meth:`take` returned again (the dump that carried it failed): ``removed`` as evicted, and
        the log dropped if that take said it was incomplete."""
        if removed is not None and removed.numel():
            self.start()
            self.add(as_ids(removed))
        if not complete:
            self.drop()

    def _removed(self) -> torch.Tensor:
        if not self._ids:
            return torch.empty(0, dtype=torch.int64)
        ids = torch.unique(torch.cat(self._ids))
        slots, _ = self.index.find(ids)
        return ids[slots < 0]
