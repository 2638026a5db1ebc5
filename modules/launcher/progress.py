"""The trainers' progress, as their launcher watches it: a trainer that hangs is named within the hang timeout.

Each trainer of :func:`.launch.local_cluster` publishes its step count in its own slot of a shared array
(:func:`publish_progress`, once per step: one integer stored in shared memory, no lock, no round trip), and the
launcher reads the slots while it waits for results (:class:`ProgressWatch`). When no trainer advanced for the hang
timeout, the trainers that are behind the others, and any worker the kernel holds stopped (``SIGSTOP``, state ``T`` in
``/proc/PID/stat``), are named in one line, and the job stops: the others would otherwise wait for them in a
collective until the trainers' group timeout, minutes later, and then blame themselves.

A job where every trainer is at the same step and none is stopped is not stopped by the watch: all of them may be
evaluating or saving a checkpoint, which publish no steps, and nothing says which one to blame. Their own timeouts
(PS requests, the trainers' group) end such a job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["NOT_STARTED", "ProgressWatch", "Stall", "process_state", "publish_progress", "use_progress_slot"]

NOT_STARTED = -1
"""A slot's value before its trainer published its first step."""

_slots: Any = None  # this trainer's view of the shared array (set by use_progress_slot in a trainer process)
_index = 0


def use_progress_slot(slots: Any, index: int) -> None:
    """In a trainer process: publish this trainer's progress in ``slots[index]`` (a shared ``'q'`` array, no lock:
    a lock held by a trainer stopped mid-write would block the launcher too)."""
    global _slots, _index
    _slots, _index = slots, index


def publish_progress(step: int) -> None:
    """Tell the launcher this trainer has done ``step`` steps; call it once per step. A no-op outside a trainer of
    :func:`.launch.local_cluster` (under torchrun, torchrun watches the processes)."""
    if _slots is not None:
        _slots[_index] = step


def process_state(pid: int | None) -> str | None:
    """The state letter of process ``pid`` (``T``: stopped, ``Z``: dead), or None when it is gone or unknown."""
    if pid is None:
        return None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class Stall:
    """Workers the launcher gives up on: one line naming them (``message``) and what to do (``fixes``)."""

    message: str
    fixes: tuple[str, ...]


@dataclass
class ProgressWatch:
    """The launcher's view of the trainers' progress (``slots``, shared with the trainers).

    Attributes:
        slots: The shared array, one slot per trainer, :data:`NOT_STARTED` at first.
        timeout_s: How long no trainer may advance before the ones behind (or stopped) are named.
        clock: The time source (seconds, monotonic).
    """

    slots: Any
    timeout_s: float
    clock: Any = time.monotonic
    _seen: list[int] = field(default_factory=list)
    _since: float = 0.0

    def check(
        self, trainers: list[tuple[str, int | None]], servers: list[tuple[str, int | None]], done: set[int]
    ) -> Stall | None:
        """The stall to stop the job for, if any: call it whenever waiting for the trainers' results timed out.

        Args:
            trainers: ``(name, pid)`` of every trainer, in trainer order.
            servers: ``(name, pid)`` of every server.
            done: The trainers that already reported (their progress no longer matters).
        """
        now = self.clock()
        steps = list(self.slots)
        if steps != self._seen:
            self._seen, self._since = steps, now
            return None
        if max(steps) == NOT_STARTED or now - self._since < self.timeout_s:
            return None  # not training yet (start-up has its own timeouts), or advanced recently
        waiting = [j for j in range(len(trainers)) if j not in done]
        stopped = {name for name, pid in [*trainers, *servers] if process_state(pid) in ("T", "t")}
        top = max(steps)
        behind = [j for j in waiting if steps[j] < top or trainers[j][0] in stopped]
        stopped_servers = [name for name, _pid in servers if name in stopped]
        if not behind and not stopped_servers:
            return None
        idle = f"{now - self._since:.0f}"
        stopped_pids = [str(pid) for name, pid in [*trainers, *servers] if name in stopped and pid is not None]
        if behind:
            named = [trainers[j][0] for j in behind]
            parts = [
                f"{trainers[j][0] + ' ' if len(behind) > 1 else ''}{_at(steps[j])}"
                + (", stopped (SIGSTOP)" if trainers[j][0] in stopped else "")
                for j in behind
            ]
            others = sorted({steps[j] for j in range(len(trainers)) if j not in behind})
            if others:
                parts.append(f"the others {' / '.join(_at(s) for s in others)}")
            parts += [f"{name} stopped (SIGSTOP)" for name in stopped_servers]
            message = f"{', '.join(named)} made no progress for {idle} s ({'; '.join(parts)})"
            pid = trainers[behind[0]][1]
        else:
            message = (
                f"{', '.join(stopped_servers)} stopped (SIGSTOP): no trainer made progress for {idle} s ({_at(top)})"
            )
            pid = None
        if stopped_pids:
            fixes: tuple[str, ...] = (f"resume it (kill -CONT {' '.join(stopped_pids)}) or find what stopped it",)
        else:
            fixes = (f"see where it waits (py-spy dump --pid {pid})",) if pid is not None else ()
        return Stall(message, fixes)


def _at(step: int) -> str:
    return "before its first step" if step == NOT_STARTED else f"at step {step}"
