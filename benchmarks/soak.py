"""Soak benchmark: the default hybrid job trained for minutes, its throughput and every process's memory over time.

The job is the one ``persia train`` runs with no options (the bundled DLRM, the default topology's parameter servers
and 2 trainers, synthetic data, hybrid mode), on this machine (``train_local``), for a wall-clock budget
(``--minutes``, start-up included). A short probe job first measures the step time, from which the soak job's step
count is set to fill the rest of the budget (a job's trainers must agree on their step count before they start).

While the soak job runs, a thread samples every process of the job every few seconds: the launcher (this process),
the fork server the workers are forked from, each parameter server and each trainer; from ``/proc/PID/status``
(``VmRSS``, and ``RssAnon``: the heap, where a leak would show) and ``/proc/PID/stat`` (CPU time).

The training loop's span is cut into equal windows (``--windows``, 10). **Warm-up is its first 20%** (the first 2
windows): allocators, the servers' stores and the fork server's pages settle there. The first window after warm-up
is the baseline every later one is compared to, as a ratio:

* ``throughput_ratio_last_vs_first``: the last window's samples/s over the baseline's (target >= 0.9);
  ``throughput_decay`` is 1 minus it. On a machine shared with other work the samples/s of a window also follow the
  neighbours, so each window's samples per CPU-second of the job's processes is reported beside it
  (``cpu_ratio_last_vs_first``, ``cpu_trend_ratio``): a real decay lowers both, a busy neighbour only the first;
  and the share of the machine's CPU the processes outside the job took (``others_cpu_windows``, ``/proc/stat``).
* ``rss_growth_max``: the largest ``(RSS at the end - RSS after warm-up) / RSS after warm-up`` over the processes
  (target < 0.05), with the process it belongs to (``rss_growth_worst``).

Prints a table (a row per window) and writes JSON (``--json OUT``).

    python benchmarks/soak.py --json benchmarks/results/soak.json       # 10 minutes
    python benchmarks/soak.py --quick                                   # 90 seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from persia_planner import load_model, load_topology, plan

# The training modules (torch, torchrec) are imported inside main: the job's processes are forks of local_cluster's
# fork server, which imports what it needs itself.

console = Console(width=max(Console().width, 140))  # the window table has a column per process

WARMUP_FRACTION = 0.2
THROUGHPUT_TARGET = 0.9  # the last window's samples/s over the baseline's, at least
RSS_GROWTH_TARGET = 0.05  # a process's RSS growth after warm-up, below
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


# ---- sampling /proc ---------------------------------------------------------------------------------------------
def read_memory_kb(pid: int) -> tuple[int, int] | None:
    """``(VmRSS, RssAnon)`` of ``pid`` in KiB from ``/proc/PID/status``; None once the process is gone."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon"):
                    fields[key] = int(value.split()[0])
    except (OSError, ValueError):
        return None
    return (fields["VmRSS"], fields.get("RssAnon", 0)) if "VmRSS" in fields else None


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces); None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used; None once the process is gone."""
    rest = _stat_fields(pid)
    return (int(rest[11]) + int(rest[12])) / _TICKS_PER_S if rest else None


def fork_servers_of(parent: int) -> list[int]:
    """The multiprocessing fork servers among ``parent``'s children (the job's workers are forked from one)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        rest = _stat_fields(int(entry))
        if not rest or int(rest[1]) != parent:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmdline:
            found.append(int(entry))
    return found


def machine_cpu_seconds() -> tuple[float, float]:
    """``(busy, total)`` CPU seconds of the whole machine, summed over its CPUs, from ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / _TICKS_PER_S, sum(ticks) / _TICKS_PER_S


@dataclass(frozen=True)
class Sample:
    """One reading of every watched process: at ``t`` (``time.monotonic``), KiB and CPU seconds by name; and the
    whole machine's busy and total CPU seconds (what the neighbours of the job took is the difference)."""

    t: float
    rss_kb: dict[str, int]
    anon_kb: dict[str, int]
    cpu_s: dict[str, float]
    machine_busy_s: float = 0.0
    machine_total_s: float = 0.0


@dataclass
class Sampler:
    """Reads the watched processes every ``interval_s`` on a thread, from :meth:`watch` until :meth:`stop`."""

    interval_s: float
    pids: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def watch(self, job: dict[str, int]) -> None:
        """``local_cluster``'s ``on_start``: the launcher, its fork server and the job's processes, from now on."""
        pids = {"launcher": os.getpid()}
        pids |= {f"forkserver{'' if i == 0 else i}": p for i, p in enumerate(fork_servers_of(os.getpid()))}
        self.pids = pids | job
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.take()
            if self._stop.wait(self.interval_s):
                return

    def take(self) -> None:
        """Read every watched process once (those gone are left out of this sample)."""
        t = time.monotonic()
        rss, anon, cpu = {}, {}, {}
        for name, pid in self.pids.items():
            memory, used = read_memory_kb(pid), cpu_seconds(pid)
            if memory is None or used is None:
                continue
            rss[name], anon[name] = memory
            cpu[name] = used
        self.samples.append(Sample(t, rss, anon, cpu, *machine_cpu_seconds()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ---- analysis (pure) ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    """One window of the training loop: ``[lo_s, hi_s)`` seconds after its start, and its figures."""

    lo_s: float
    hi_s: float
    samples_per_s: float
    samples_per_cpu_s: float
    others_cpu: float  # the share of the machine's CPU taken by processes outside the job
    rss_mb: dict[str, float]  # each process's at the window's last sample


def samples_at(history: list[dict[str, Any]], t_s: float) -> tuple[float, int]:
    """``(t_s, samples)`` of the last step that ended at or before ``t_s`` (``(0, 0)``: none yet)."""
    last = (0.0, 0)
    for h in history:
        if h["t_s"] > t_s:
            break
        last = (h["t_s"], h["samples"])
    return last


def sample_at(samples: list[Sample], t: float) -> Sample:
    """The last sample taken at or before ``t`` (the first one if none was)."""
    before = [s for s in samples if s.t <= t]
    return before[-1] if before else samples[0]


def windows(history: list[dict[str, Any]], samples: list[Sample], started: float, n: int) -> list[Window]:
    """The training loop's span cut into ``n`` equal windows.

    Args:
        history: Trainer 0's steps, each with ``t_s`` (since the loop started) and ``samples`` (global, cumulative).
        samples: The sampler's readings (``time.monotonic``).
        started: The loop's start on the same clock (the summary's ``started_monotonic_s``).
        n: Windows.
    """
    span = history[-1]["t_s"]
    job = [name for name in samples[-1].rss_kb if name.startswith(("ps", "trainer"))]
    out = []
    for i in range(n):
        lo, hi = span * i / n, span * (i + 1) / n
        (t0, s0), (t1, s1) = samples_at(history, lo), samples_at(history, hi)
        rate = (s1 - s0) / (t1 - t0) if t1 > t0 else math.nan
        # CPU time is read at the sampler's instants: count the samples trained between the same instants.
        a, b = sample_at(samples, started + lo), sample_at(samples, started + hi)
        cpu = sum(b.cpu_s.get(p, 0.0) - a.cpu_s.get(p, 0.0) for p in job)
        trained = samples_at(history, b.t - started)[1] - samples_at(history, a.t - started)[1]
        total = b.machine_total_s - a.machine_total_s
        others = max(0.0, b.machine_busy_s - a.machine_busy_s - cpu) / total if total > 0 else math.nan
        per_cpu = trained / cpu if cpu > 0 else math.nan
        out.append(Window(lo, hi, rate, per_cpu, others, {k: v / 1024 for k, v in b.rss_kb.items()}))
    return out


def rss_growth(samples: list[Sample], after_warmup: float, end: float) -> dict[str, dict[str, float]]:
    """Each process's RSS (MiB) at its first sample, after warm-up, at the end and at its peak, and its growth.

    ``growth`` is ``(end - after_warmup) / after_warmup``; ``anon_growth`` the same of the heap (``RssAnon``).
    """
    warm, last = sample_at(samples, after_warmup), sample_at(samples, end)
    out = {}
    for name in last.rss_kb:
        seen = [s.rss_kb[name] for s in samples if name in s.rss_kb and s.t <= end]
        first = next(s.rss_kb[name] for s in samples if name in s.rss_kb)
        w, e = warm.rss_kb.get(name, first), last.rss_kb[name]
        wa, ea = warm.anon_kb.get(name, 0), last.anon_kb[name]
        out[name] = {
            "start": first / 1024,
            "after_warmup": w / 1024,
            "end": e / 1024,
            "peak": max(seen) / 1024,
            "growth": (e - w) / w if w else math.nan,
            "anon_growth": (ea - wa) / wa if wa else math.nan,
        }
    return out


def trend_ratio(points: list[tuple[float, float]]) -> float:
    """A least-squares line through ``(x, y)`` points: its value at the last x over its value at the first."""
    if len(points) < 2:
        return math.nan
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    start = my + slope * (xs[0] - mx)
    return (my + slope * (xs[-1] - mx)) / start if start > 0 else math.nan


# ---- the run --------------------------------------------------------------------------------------------------
def soak_steps(probe: dict[str, Any], seconds_left: float) -> int:
    """Steps that fill ``seconds_left`` at the probe's pace, less what the probe spent outside its loop (start-up,
    final evaluation, shutdown).

    The pace is the probe's loop after its first step (TorchRec's lazy set-up: seconds) up to the end of its final
    flush (``wall_step_ms`` covers the whole loop): a step's own timestamp runs ahead of the servers by up to K steps.
    """
    history = probe["history"]
    loop_s = probe["wall_step_ms"] * probe["steps"] / 1e3
    pace_s = (loop_s - history[0]["t_s"]) / max(1, len(history) - 1)
    overhead = probe["wall_s"] - loop_s
    return max(probe["steps"], int((seconds_left - overhead) / pace_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget, start-up included")
    parser.add_argument("--quick", action="store_true", help="90 seconds (CI)")
    parser.add_argument("--windows", type=int, default=10, help="windows the training span is cut into")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.windows < 5 or args.minutes <= 0:
        parser.error("--windows must be >= 5 and --minutes > 0")
    import torch

    from persia_planner.modules.train import TrainConfig, train_local
    from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY

    began = time.monotonic()
    budget_s = 60 * (1.5 if args.quick else args.minutes)
    spec, topo = load_model(DEFAULT_MODEL), load_topology(DEFAULT_TOPOLOGY)
    the_plan = plan(spec, topo)
    servers = len(topo.servers)

    def run(steps: int, **options: Any) -> dict[str, Any]:
        cfg = TrainConfig(progress=False, steps=steps)
        started = time.monotonic()
        result = train_local(cfg, spec, dict(the_plan.tables), servers=servers, topology=topo, **options)
        result["wall_s"] = time.monotonic() - started
        return result

    probe_steps = 30 if args.quick else 50
    console.print(f"[bold]probe[/]: {probe_steps} steps to measure the step time")
    probe = run(probe_steps)
    steps = soak_steps(probe, budget_s - (time.monotonic() - began))
    interval = min(5.0, max(1.0, budget_s / 120))
    console.print(
        f"[bold]soak[/]: {steps} steps (~{budget_s - (time.monotonic() - began):.0f} s left of {budget_s:.0f} s), "
        f"{spec.name}, {servers} PS + 2 trainers, every process sampled every {interval:g} s"
    )
    sampler = Sampler(interval)
    try:
        # Far beyond the probe's pace: a slow neighbour must not kill the soak, a hung job must still end.
        result = run(steps, on_start=sampler.watch, run_timeout_s=3 * budget_s + 300)
    finally:
        sampler.stop()
    duration = time.monotonic() - began

    history, started = result["history"], result["started_monotonic_s"]
    span = history[-1]["t_s"]
    warm_end = started + WARMUP_FRACTION * span
    wins = windows(history, sampler.samples, started, args.windows)
    first = round(WARMUP_FRACTION * args.windows)  # the baseline: the first window after warm-up
    base, last = wins[first], wins[-1]
    growth = rss_growth(sampler.samples, warm_end, started + span)
    worst = max(growth, key=lambda name: growth[name]["growth"])
    ratio = last.samples_per_s / base.samples_per_s
    cpu_ratio = last.samples_per_cpu_s / base.samples_per_cpu_s
    after = [((w.lo_s + w.hi_s) / 2, w.samples_per_s) for w in wins[first:]]
    after_cpu = [((w.lo_s + w.hi_s) / 2, w.samples_per_cpu_s) for w in wins[first:]]
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "quick": args.quick,
        "model": spec.name,
        "budget_s": budget_s,
        "duration_s": duration,
        "train_s": span,
        "warmup_s": WARMUP_FRACTION * span,
        "warmup": f"the first {WARMUP_FRACTION:.0%} of the training span ({first} of {args.windows} windows)",
        "steps": result["steps"],
        "probe_steps": probe_steps,
        "sample_interval_s": interval,
        "rss_samples": len(sampler.samples),
        "samples_per_s": result["samples_per_s"],
        "samples_per_s_windows": [w.samples_per_s for w in wins],
        "samples_per_cpu_s_windows": [w.samples_per_cpu_s for w in wins],
        "window_s": span / args.windows,
        "baseline_window": first,
        "throughput_ratio_last_vs_first": ratio,
        "throughput_decay": 1 - ratio,
        "throughput_trend_ratio": trend_ratio(after),
        "cpu_ratio_last_vs_first": cpu_ratio,
        "cpu_trend_ratio": trend_ratio(after_cpu),
        "others_cpu_windows": [w.others_cpu for w in wins],
        "rss_growth_max": growth[worst]["growth"],
        "rss_growth_worst": worst,
        "rss_mb": {name: {"first": g["after_warmup"], "last": g["end"]} for name, g in growth.items()},
        "rss_mb_windows": {name: [w.rss_mb.get(name, math.nan) for w in wins] for name in growth},
        "processes": [{"name": name, "pid": sampler.pids[name], **g} for name, g in growth.items()],
        "throughput_pass": ratio >= THROUGHPUT_TARGET,
        "rss_pass": growth[worst]["growth"] < RSS_GROWTH_TARGET,
    }

    names = list(growth)
    table = Table(
        title=f"soak ({'quick' if args.quick else 'full'}): {result['steps']} steps in {span:.0f} s, "
        f"windows of {span / args.windows:.0f} s; RSS in MiB at each window's end"
    )
    for column in ("window (s)", "samples/s", "vs baseline", "samples/CPU-s", "others' CPU", *names):
        table.add_column(column, justify="right")
    for i, w in enumerate(wins):
        label = f"{w.lo_s:.0f}-{w.hi_s:.0f}" + (" warm-up" if i < first else " baseline" if i == first else "")
        table.add_row(
            label,
            f"{w.samples_per_s:,.0f}",
            f"{w.samples_per_s / base.samples_per_s:.2f}x",
            f"{w.samples_per_cpu_s:,.0f}",
            f"{w.others_cpu:.0%}",
            *(f"{w.rss_mb.get(n, math.nan):,.0f}" for n in names),
        )
    console.print(table)

    summary = Table(title="soak: after warm-up")
    for column in ("check", "measured", "target", "ok"):
        summary.add_column(column, justify="left" if column == "check" else "right")

    def mark(ok: bool) -> str:
        return "[green]yes[/]" if ok else "[red]no[/]"

    target = f">= {THROUGHPUT_TARGET}x"
    summary.add_row("samples/s, last window / baseline", f"{ratio:.2f}x", target, mark(ratio >= THROUGHPUT_TARGET))
    summary.add_row("  fitted trend, last / first", f"{results['throughput_trend_ratio']:.2f}x", "(reported)", "")
    summary.add_row("  samples per CPU-s, last / baseline", f"{cpu_ratio:.2f}x", "(reported)", "")
    summary.add_row("  samples per CPU-s, fitted trend", f"{results['cpu_trend_ratio']:.2f}x", "(reported)", "")
    for name, g in growth.items():
        ok = g["growth"] < RSS_GROWTH_TARGET
        summary.add_row(
            f"RSS {name} (MiB, after warm-up -> end; heap growth {g['anon_growth']:+.1%})",
            f"{g['after_warmup']:,.0f} -> {g['end']:,.0f} ({g['growth']:+.1%})",
            f"< {RSS_GROWTH_TARGET:.0%}",
            mark(ok),
        )
    summary.add_row("wall time, probe and start-up included", f"{duration:.0f} s", f"~{budget_s:.0f} s", "")
    console.print(summary)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        console.print(f"wrote {args.json}")
    # Throughput and memory are reported, not enforced: on a shared machine a neighbour moves both.
    return 0


if __name__ == "__main__":
    sys.exit(main())
