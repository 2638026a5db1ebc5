"""Per-step metrics of a training run, written to ``--log-dir`` as they happen (``persia train --log-dir DIR``).

Trainer 0 hands every step's :class:`StepRecord` and every evaluation to a :class:`MetricsSink`. Two sinks write
them: :class:`JsonLinesSink` (``DIR/metrics.jsonl``, one line per step, the evaluation of a step on its line, and
a line per event such as a new plan, with its ``event``) and :class:`TensorBoardSink` (event files in
``DIR/tensorboard/``, one scalar per field); :class:`Sinks` composes them,
and :func:`open_sinks` builds the pair a run uses. The final summary goes to ``DIR/summary.json``
(:func:`write_summary`).

A resumed run (``--resume``) appends: the steps after the checkpoint it resumes from that an earlier run had already
logged are dropped first (the JSON lines rewritten without them; TensorBoard's ``purge_step``), so every step
appears once and the steps continue. Torch is imported only by the TensorBoard sink, when it is opened.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from persia_planner.modules.atomic import atomic_write
from persia_planner.modules.train.run_directories import METRICS_FILE, SUMMARY_FILE

__all__ = [
    "EVAL_KEYS",
    "METRICS_FILE",
    "SUMMARY_FILE",
    "TENSORBOARD_DIR",
    "JsonLinesSink",
    "MetricsSink",
    "Sinks",
    "StepRecord",
    "TensorBoardSink",
    "logged_steps",
    "open_sinks",
    "write_summary",
]

TENSORBOARD_DIR = "tensorboard"
EVAL_KEYS = ("auc", "eval_loss", "normalized_entropy", "calibration", "teacher_auc")
"""The scalars of an evaluation that the sinks keep (the rest of its result are counts)."""


@dataclass(frozen=True)
class StepRecord:
    """What one training step did, as trainer 0 saw it.

    Attributes:
        step: The global step (a resumed run goes on counting from its checkpoint's).
        loss: Trainer 0's training loss of the step.
        samples_per_s: Training throughput so far, all trainers (evaluations and profiled steps not counted).
        staleness: How many steps behind the freshest PS rows the step's lookups were.
        ps_wait_ms: Time the step waited for PS rows.
        push_ms: Time the step spent sending gradients to the servers.
        data_ms: Time reading the batch before the step (not in ``step_ms``).
        step_ms: The step's time: forward, backward, optimizer, PS waits and pushes.
        t_s: Seconds since the run's loop started, at the step's end (evaluations included).
    """

    step: int
    loss: float
    samples_per_s: float
    staleness: int
    ps_wait_ms: float
    push_ms: float
    data_ms: float
    step_ms: float
    t_s: float

    @classmethod
    def of(cls, step: int, stats: Any, *, samples_per_s: float, t_s: float) -> StepRecord:
        """The record of ``step`` from what the loop measured (a :class:`.loop.StepStats`)."""
        return cls(
            step, stats.loss, samples_per_s, stats.staleness, stats.ps_wait_ms, stats.push_ms, stats.data_ms,
            stats.step_ms, t_s,
        )  # fmt: skip


class MetricsSink(Protocol):
    """Where a run's per-step metrics go."""

    def log_step(self, record: StepRecord) -> None:
        """One training step, in step order."""

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        """An evaluation after ``step`` (already logged): its :data:`EVAL_KEYS` that are numbers are kept."""

    def log_event(self, step: int, event: str, fields: Mapping[str, Any]) -> None:
        """Something that happened after ``step`` other than a step or an evaluation (``event``: ``plan``, a plan
        that starts there; ``adapt``, a re-planning decision), with its ``fields``."""

    def close(self) -> None:
        """Write what is pending and release the files."""


def _eval_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(metrics[k]) for k in EVAL_KEYS if isinstance(metrics.get(k), int | float)}


def _json_value(x: float) -> float | None:
    # JSON has no NaN: a line with one would not parse elsewhere (jq, pandas' strict readers).
    return x if math.isfinite(x) else None


class JsonLinesSink:
    """``metrics.jsonl``: one JSON object per step (:class:`StepRecord`'s fields), with the evaluation of that step
    (``auc``, ``eval_loss``, ``normalized_entropy``, ``calibration``, ``teacher_auc``) on the same line.

    A step's line is written when the next step, its evaluation or :meth:`close` comes (so its evaluation joins
    it), and flushed at once: a run that crashes keeps every line but the last step's.

    Args:
        path: The file; appended to.
        after_step: Drop the lines of steps after this one first (a resumed run's checkpoint step); None keeps all.
    """

    def __init__(self, path: Path, *, after_step: int | None = None) -> None:
        if after_step is not None and path.exists():
            _truncate_after(path, after_step)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run, closed by close())
        self._pending: dict[str, Any] | None = None

    def log_step(self, record: StepRecord) -> None:
        self._write_pending()
        self._pending = {k: _json_value(v) if isinstance(v, float) else v for k, v in asdict(record).items()}

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = {k: _json_value(v) for k, v in _eval_scalars(metrics).items()}
        if self._pending is not None and self._pending["step"] == step:
            self._pending.update(scalars)
        elif scalars:  # an evaluation of a step this run did not log (none trained): a line of its own
            self._write_pending()
            self._pending = {"step": step, **scalars}
        self._write_pending()

    def log_event(self, step: int, event: str, fields: Mapping[str, Any]) -> None:
        self._write_pending()  # after its step's line: the file stays in step order
        line = {
            "step": step,
            "event": event,
            **{k: _json_value(v) if isinstance(v, float) else v for k, v in fields.items()},
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        self._write_pending()
        self._file.close()

    def _write_pending(self) -> None:
        if self._pending is None:
            return
        self._file.write(json.dumps(self._pending) + "\n")
        self._file.flush()
        self._pending = None


def logged_steps(path: Path) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl`` that parse (a crash may have cut the last one short)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return lines


def _truncate_after(path: Path, step: int) -> None:
    kept = [line for line in logged_steps(path) if line.get("step", 0) <= step]
    atomic_write(path, lambda f: f.write("".join(json.dumps(line) + "\n" for line in kept).encode()))


class TensorBoardSink:
    """TensorBoard event files: every field of :class:`StepRecord` and of an evaluation as a scalar of the same name
    (``loss``, ``step_ms``, ``auc``, ...) at its global step.

    Args:
        directory: Where the event files go (a new file per run; TensorBoard reads them all).
        purge_step: Events of this step and later that an earlier run wrote are hidden from readers (a resumed
            run's first step); None hides nothing.
        flush_s: How often the writer flushes to disk.
    """

    def __init__(self, directory: Path, *, purge_step: int | None = None, flush_s: float = 5.0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # torch, only in the trainer that logs

        self._writer = SummaryWriter(str(directory), purge_step=purge_step, flush_secs=flush_s)

    def log_step(self, record: StepRecord) -> None:
        for name, value in asdict(record).items():
            if name != "step":
                self._writer.add_scalar(name, value, record.step)

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        for name, value in _eval_scalars(metrics).items():
            self._writer.add_scalar(name, value, step)

    def log_event(self, step: int, event: str, fields: Mapping[str, Any]) -> None:
        """A number of the event's as the scalar ``<event>/<field>`` (``plan/index``, ``plan/predicted_ms``, ...)."""
        for name, value in fields.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(f"{event}/{name}", value, step)

    def close(self) -> None:
        self._writer.close()


class Sinks:
    """Several sinks as one: each call goes to every sink, in order; :meth:`close` closes them all."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def log_step(self, record: StepRecord) -> None:
        for sink in self.sinks:
            sink.log_step(record)

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.log_eval(step, metrics)

    def log_event(self, step: int, event: str, fields: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.log_event(step, event, fields)

    def close(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except OSError as err:  # the others still get closed: their files keep what was logged
                errors.append(err)
        if errors:
            raise errors[0]


def open_sinks(log_dir: str | os.PathLike[str] | None, *, first_step: int = 0) -> Sinks:
    """The sinks of a run with ``--log-dir log_dir`` (none without one): ``metrics.jsonl`` and TensorBoard.

    Args:
        log_dir: The run's log directory (created if missing).
        first_step: The step the run starts after (a resumed run's checkpoint step): what was logged after it is
            dropped.
    """
    if log_dir is None:
        return Sinks()
    root = Path(log_dir)
    root.mkdir(parents=True, exist_ok=True)
    return Sinks(
        JsonLinesSink(root / METRICS_FILE, after_step=first_step),
        TensorBoardSink(root / TENSORBOARD_DIR, purge_step=first_step + 1),
    )


def write_summary(log_dir: str | os.PathLike[str], result: Mapping[str, Any]) -> Path:
    """``DIR/summary.json``: the run's summary (what ``--json`` prints, without the per-step history)."""
    path = Path(log_dir) / SUMMARY_FILE
    summary = {k: v for k, v in result.items() if k != "history"}
    atomic_write(path, lambda f: f.write(json.dumps(summary, indent=1, sort_keys=True, default=str).encode()))
    return path
