"""The measured step-time breakdown of a training run, in the cost model's terms.

``persia train`` profiles a window of steps after warm-up with ``torch.profiler`` (CPU activity, main thread) and
gives every operator's own time to the term of its nearest labelled ancestor: TorchRec's all-to-all ranges, fbgemm's
embedding kernels, the all-reduce, and the PS waits and pushes this package labels itself. What no term claims is the
dense network (MLP, interaction, loss, optimizer, framework overhead). The shares are then applied to the median
step time measured without the profiler, whose own overhead would inflate every small operator.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PS_PUSH", "PS_WAIT", "STEP", "TERMS", "StepProfiler", "Stopwatch", "classify", "shares_of"]

PS_WAIT = "persia:ps_wait"
PS_PUSH = "persia:ps_push"
STEP = "persia:step"
# In the order of the cost model's breakdown (persia_planner.cost.analytic.CostModel.step_parts): emb, a2a, dense,
# allreduce, then the PS tier's parts of "async".
TERMS = ("embedding", "all_to_all", "dense", "all_reduce", "ps_wait", "push")


class Stopwatch:
    """Milliseconds spent inside labelled ranges, summed per label, without a profiler: the parameter-server waits
    and pushes are timed this way in every run (a profiler is not safe with RPCs in flight; decision 0014). The
    range is also a ``record_function``, so a profile that is taken shows it too."""

    def __init__(self) -> None:
        self.totals_ms: dict[str, float] = {}

    @contextlib.contextmanager
    def range(self, label: str) -> Iterator[None]:
        import torch

        start = time.perf_counter()
        try:
            with torch.autograd.profiler.record_function(label):
                yield
        finally:
            self.totals_ms[label] = self.totals_ms.get(label, 0.0) + (time.perf_counter() - start) * 1e3

    def snapshot(self) -> dict[str, float]:
        """The totals so far (a copy: subtract two snapshots for one step's share)."""
        return dict(self.totals_ms)


def classify(name: str) -> str | None:
    """The term a labelled range or an operator belongs to, or None (it takes its parent's)."""
    if name == PS_WAIT:
        return "ps_wait"
    if name == PS_PUSH:
        return "push"
    low = name.lower()
    if low.startswith("[lookup]"):  # TorchRec's EmbeddingEvent ranges: "[event]_[module path]_[sharding]"
        return "embedding"
    if low.startswith(("[splits_dist]", "[tensors_dist]", "[output_dist")):
        return "all_to_all"
    if "all2all" in low or "alltoall" in low or "all_to_all" in low:
        return "all_to_all"
    if "allreduce" in low or "all_reduce" in low:
        return "all_reduce"
    if low.startswith("fbgemm::") or "splitlookupfunction" in low or low == "aten::embedding_bag":
        return "embedding"
    return None


def _is_range(name: str) -> bool:
    """A labelled range (TorchRec's, ours) rather than an operator: its term covers everything inside it."""
    return name.startswith(("[", "##", "persia:"))


@dataclass(frozen=True)
class _Event:
    name: str
    self_us: float
    parent: int | None


def shares_of(events: Iterable[tuple[str, float, int | None]]) -> dict[str, float]:
    """Share of the profiled time per term, from ``(name, self time, parent index)`` triples (parents first).

    Args:
        events: Every event of the thread, each with its own (self) time and the index of its parent event.
    """
    listed = [_Event(n, s, p) for n, s, p in events]
    term: list[str] = []
    totals = dict.fromkeys(TERMS, 0.0)
    for event in listed:
        own = classify(event.name)
        inherited = term[event.parent] if event.parent is not None and event.parent < len(term) else "dense"
        # Inside a labelled range every operator is the range's (fbgemm's permute in TorchRec's input
        # distribution is all-to-all work); outside, an operator names its own term.
        if own is not None and (_is_range(event.name) or inherited == "dense"):
            term.append(own)
        else:
            term.append(inherited)
        totals[term[-1]] += event.self_us
    whole = sum(totals.values())
    return {k: (v / whole if whole > 0 else 0.0) for k, v in totals.items()}


def _thread_events(profile: Any) -> list[tuple[str, float, int | None]]:
    """The main thread's events as (name, self µs, parent index), parents before children."""
    import threading

    main = threading.get_native_id()
    events = [e for e in profile.events() if getattr(e, "thread", None) in (main, threading.get_ident())]
    if not events:  # thread ids are not comparable on every platform: take the thread with the step ranges
        steps = [e for e in profile.events() if e.name == STEP]
        thread = steps[0].thread if steps else None
        events = [e for e in profile.events() if e.thread == thread]
    events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
    index = {id(e): i for i, e in enumerate(events)}
    return [
        (e.name, float(e.self_cpu_time_total), index.get(id(e.cpu_parent)) if e.cpu_parent is not None else None)
        for e in events
    ]


class StepProfiler:
    """Profiles steps ``[start, start + count)`` of a loop and gives the shares of each term.

    Args:
        start: First profiled step (after warm-up: TorchRec's lazy set-up and first allocations are not steps).
        count: Steps profiled.
    """

    def __init__(self, start: int, count: int):
        self.start, self.count = start, count
        self._profile: Any = None
        self.shares: Mapping[str, float] | None = None

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Wrap step ``index`` (0-based) of the loop."""
        import torch

        if index == self.start and self.count > 0:
            # Kineto logs every start and stop ("USDT ... profiler_stop") unless its level is above USDT's (5).
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profile.__enter__()
        try:
            with torch.autograd.profiler.record_function(STEP):
                yield
        except BaseException:
            self._stop()
            raise
        if self._profile is not None and index == self.start + self.count - 1:
            self.shares = shares_of(_thread_events(self._stop()))

    def _stop(self) -> Any:
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.__exit__(None, None, None)
        return profile
