"""The processes a test starts, read from /proc (imported by the test modules that start jobs)."""

from __future__ import annotations

import time
from pathlib import Path

from persia_planner.modules.ps.progress import process_state


def descendants_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (by the parent pids in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def live(pids: list[int]) -> list[int]:
    """The processes among ``pids`` that still run (not gone, not zombies)."""
    return [pid for pid in pids if process_state(pid) not in (None, "Z")]


def gone_within(pids: list[int], timeout_s: float) -> list[int]:
    """The processes among ``pids`` still alive after ``timeout_s`` (waiting no longer than needed)."""
    deadline = time.monotonic() + timeout_s
    while live(pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # the poll interval, not a synchronisation
    return live(pids)
