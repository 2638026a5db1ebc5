"""Early stopping on a validation metric, and the best evaluation's checkpoint that it keeps.

``--early-stop PATIENCE`` watches ``--early-stop-metric`` (AUC, higher is better; or normalized entropy, lower is
better) at every evaluation (each epoch's end, every ``--eval-every`` steps). An evaluation better than every one
before it is the best: its step is checkpointed (if it is not already) and named in ``BEST.json`` beside the
``step-*`` directories, which :func:`.job_checkpoints.prune` never deletes while it is named there. After
``PATIENCE`` evaluations in a row without a better one, every trainer stops. ``persia predict`` given the checkpoint
directory scores with the best checkpoint its run named (:func:`.trained_model.best_checkpoint`); ``--resume`` goes
on from the newest, as before.

``BEST.json``: ``{"format": "persia-best/1", "step": N, "checkpoint": "step-NNNNNNNNN", "metric": "auc",
"value": 0.78, "lineage": "...", "results": {...}}``, written atomically by trainer 0, replaced only by a later
best of the same folder, removed when a run that does not stop early resumes the run that wrote it. A resumed run
starts from the marked best but counts its patience afresh.

Torch-free: ``persia predict`` reads the marker before any process starts.
"""

from __future__ import annotations

import enum
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from persia_planner.errors import PlannerError
from persia_planner.outputs import Output, OutputKind, write_output

__all__ = [
    "BEST_FILE",
    "BEST_FORMAT",
    "BestMark",
    "CheckpointSaver",
    "EarlyStopMetric",
    "EarlyStopping",
    "forget_best",
    "read_best",
]

log = logging.getLogger(__name__)

BEST_FILE = "BEST.json"
"""Beside the ``step-*`` directories: which of them holds the best evaluation."""
BEST_FORMAT = "persia-best/1"


class EarlyStopMetric(enum.StrEnum):
    """What early stopping watches on the validation rows."""

    AUC = "auc"
    NE = "ne"

    @property
    def key(self) -> str:
        """The key of the metric in an evaluation's results (:func:`.batch_stream.click_metrics`)."""
        return "auc" if self is EarlyStopMetric.AUC else "normalized_entropy"

    def better(self, value: float, than: float) -> bool:
        """Whether ``value`` is strictly better than ``than``."""
        return value > than if self is EarlyStopMetric.AUC else value < than


@dataclass(frozen=True)
class BestMark:
    """What ``BEST.json`` says.

    Attributes:
        step: The global step of the best evaluation.
        checkpoint: The ``step-*`` directory (a name in the same folder).
        metric: The metric compared (``auc`` or ``ne``).
        value: Its value at that evaluation.
        lineage: The run that wrote it (:mod:`.job_checkpoints`).
        results: The best evaluation's metrics (a resumed run's summary reports them).
    """

    step: int
    checkpoint: str
    metric: str
    value: float
    lineage: str
    results: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": BEST_FORMAT, **asdict(self)}

    def write(self, root: Path) -> None:
        """Publish the mark in ``root``, whole or not at all, replacing only a mark persia wrote there.

        Raises:
            PlannerError: ``root`` holds a ``BEST.json`` that is not persia's (it is left as it is).
        """
        text = json.dumps(self.to_dict()) + "\n"
        out = Output("--checkpoint", root / BEST_FILE, OutputKind.BEST)
        write_output(out, lambda tmp: tmp.write_text(text), overwrite=True)


def forget_best(root: Path, lineage: str) -> None:
    """Remove ``root``'s mark of run ``lineage``, persia's own: a resumed run that does not stop early ends on its
    last checkpoint, which ``persia predict`` must then score with (and the marked one may be pruned)."""
    mark = read_best(root)
    if mark is not None and mark.lineage == lineage:
        (root / BEST_FILE).unlink(missing_ok=True)


def read_best(root: Path) -> BestMark | None:
    """The mark ``BEST.json`` of ``root`` holds; None where there is none, or it is not one persia wrote (a file of
    that name someone else put there is left alone and ignored)."""
    if not OutputKind.BEST.written_by_persia(root / BEST_FILE):
        return None
    try:
        raw = json.loads((root / BEST_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("format") != BEST_FORMAT:
        return None
    try:
        return BestMark(
            step=int(raw["step"]),
            checkpoint=str(raw["checkpoint"]),
            metric=str(raw["metric"]),
            value=float(raw["value"]),
            lineage=str(raw["lineage"]),
            results=raw.get("results") if isinstance(raw.get("results"), dict) else None,
        )
    except (KeyError, TypeError, ValueError):
        return None


class CheckpointSaver(Protocol):
    """What keeps a run's checkpoints (:class:`.trainer_state.Saver`), as early stopping uses it."""

    root: Path | None
    lineage: str
    last_step: int | None

    @property
    def last_path(self) -> Path | None:
        """The newest checkpoint this run published (None: none yet, or not this trainer's to publish)."""

    def save(self, step: int) -> float:
        """Checkpoint global step ``step`` (every trainer calls it); returns the seconds it took."""


@dataclass
class EarlyStopping:
    """The early-stopping rule over a run's evaluations (every trainer holds one and sees the same metrics).

    Args:
        metric: What it watches.
        patience: Evaluations in a row without a better one before it stops (0: never stops; it still tracks the
            best).
    """

    metric: EarlyStopMetric
    patience: int
    best_value: float | None = None
    best_step: int | None = None
    best_results: dict[str, Any] | None = None
    since_best: int = 0
    history: list[tuple[int, float]] = field(default_factory=list)

    @classmethod
    def of_run(cls, metric: EarlyStopMetric, patience: int, root: Path | None, lineage: str) -> EarlyStopping:
        """The rule for a run keeping its checkpoints in ``root``: a resumed run (its ``lineage`` continued) starts
        from the best its earlier part marked there, so that only a better evaluation replaces that checkpoint."""
        stopping = cls(metric, patience)
        mark = read_best(root) if root is not None else None
        if mark is not None and mark.lineage == lineage and mark.metric == metric.value:
            stopping.best_value, stopping.best_step, stopping.best_results = mark.value, mark.step, mark.results
        return stopping

    def observe(self, step: int, results: dict[str, Any]) -> bool:
        """Record the evaluation of ``step``; returns whether it is the best so far. A metric that is None or not
        finite (every label the same) is never the best."""
        value = results.get(self.metric.key)
        if value is None or not math.isfinite(float(value)):
            self.since_best += 1
            return False
        value = float(value)
        self.history.append((step, value))
        if self.best_value is None or self.metric.better(value, self.best_value):
            self.best_value, self.best_step, self.best_results, self.since_best = value, step, dict(results), 0
            return True
        self.since_best += 1
        return False

    def keep_best(self, step: int, results: dict[str, Any], saver: CheckpointSaver, *, publish: bool) -> float:
        """After the evaluation of ``step`` (every trainer, with the same results): when it is the best so far and
        the run stops early (``patience``) and keeps checkpoints, make sure ``step`` has one and, ``publish``
        (trainer 0), name it in ``BEST.json``. Returns the seconds a checkpoint took (not training time)."""
        if not self.observe(step, results) or saver.root is None or not self.patience:
            return 0.0
        seconds = saver.save(step) if saver.last_step != step else 0.0
        if publish and saver.last_path is not None:
            value = float(self.best_value or 0)
            mark = BestMark(step, saver.last_path.name, self.metric.value, value, saver.lineage, self.best_results)
            try:
                mark.write(saver.root)
            except PlannerError as err:  # training goes on; persia predict then scores with the newest checkpoint
                log.warning("the best evaluation (step %d) is not marked: %s", step, err.message)
        return seconds

    @property
    def should_stop(self) -> bool:
        """Whether ``patience`` evaluations in a row were no better than the best."""
        return self.patience > 0 and self.since_best >= self.patience

    def summary(self) -> dict[str, Any]:
        """What the run's summary says of it."""
        return {
            "metric": self.metric.value,
            "patience": self.patience,
            "best_step": self.best_step,
            "best_value": self.best_value,
            "best": self.best_results,
            "evaluations": [{"step": s, "value": v} for s, v in self.history],
        }
