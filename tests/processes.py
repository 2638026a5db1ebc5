"""The processes a test starts, read from /proc, and CLI runs in a fresh interpreter (imported by the test modules
that start jobs or check what the CLI imports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from persia_planner.modules.launcher.progress import process_state


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


ROOT = Path(__file__).resolve().parents[1]
# What makes `persia train` think it runs under torchrun (or names this node's hosts).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
TORCHRUN_ENV += ("PERSIA_HOST",)


def cli_in_fresh_interpreter(cases: list[tuple[list[str], dict[str, str]]]) -> tuple[list[tuple[int, str]], bool]:
    """Each ``(args, env)`` through ``persia`` (typer's runner) in one new Python process, outside any torchrun
    environment: the ``(exit code, output)`` of each, and whether torch was imported along the way."""
    code = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from persia_planner.cli import app\n"
        f"cases = json.loads({json.dumps(json.dumps(cases))})\n"
        "out = [[r.exit_code, r.output] for r in (CliRunner().invoke(app, a, env=e) for a, e in cases)]\n"
        "print(json.dumps({'results': out, 'torch': 'torch' in sys.modules}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return [(code_, output) for code_, output in report["results"]], report["torch"]
