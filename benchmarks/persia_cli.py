"""persia as a new user runs it, for ``vs_baselines.py``: ``persia data profile`` on the training file writes the
model, ``persia train`` trains it with the defaults (``--data`` and ``--eval-data`` the inner split of the training
rows, on which its defaults pick the epochs and the checkpoint), ``persia predict`` scores every validation row from
that checkpoint; each a process of this environment's ``persia`` executable.

``--tune-hparams`` adds a coordinate search over persia's options (:data:`SEARCH`): on an inner split of the training
rows, each option in turn takes the value of its candidates that scores best, the others held at their best so far;
the chosen options' run is then scored on the validation rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from baseline_models import auc

from persia_planner.errors import PlannerError

__all__ = ["SEARCH", "PersiaRun", "Tuning", "persia_executable", "profile", "train_and_score", "tune"]

SEARCH: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("--epochs", ("1", "2", "4")),
    ("--batch-size", ("256", "1024")),
    ("--sparse-lr", ("0.03", "0.1", "0.3")),
    ("--dense-lr", ("0.01", "0.05", "0.1")),
)
"""The options ``--tune-hparams`` searches, in order, and their candidates besides the default (no option)."""


def persia_executable() -> Path:
    """The ``persia`` command of the environment running this script.

    Raises:
        PlannerError: It is not installed there.
    """
    path = Path(sys.executable).with_name("persia")
    if not path.is_file():
        raise PlannerError(f"{path}: no persia command beside this Python", fixes=("pip install -e '.[train]'",))
    return path


def _run(args: Sequence[str], log: Path) -> str:
    """Runs ``persia ARGS``; its stdout, its stderr kept in ``log``.

    Raises:
        PlannerError: It failed (the last line of its stderr named).
    """
    command = [str(persia_executable()), *args]
    with log.open("w") as err:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        last = lines[-1] if lines else "(no output)"
        raise PlannerError(f"persia {' '.join(args[:2])} failed ({done.returncode}): {last} (log: {log})")
    return done.stdout


def profile(data: str, out: Path) -> Path:
    """``persia data profile DATA --out OUT``: the suggested model.yaml, as a new user gets it."""
    _run(["data", "profile", data, "--out", str(out)], out.with_suffix(".log"))
    return out


@dataclass(frozen=True)
class PersiaRun:
    """One ``persia train`` run scored by ``persia predict``.

    Attributes:
        options: The options beyond the defaults (empty: the defaults).
        auc: The AUC of ``persia predict``'s scores over every row it scored (the figure compared).
        predict_auc: ``persia predict``'s own AUC of the same rows.
        predict_rows: The rows ``persia predict`` scored.
        train_auc: The AUC training reported for its ``--eval-data`` rows.
        train_eval_samples: The rows training's AUC covered.
        steps: Training steps per trainer.
        train_s: Seconds of ``persia train`` (the process, start-up included).
        predict_s: Seconds of ``persia predict``.
    """

    options: dict[str, str]
    auc: float
    predict_auc: float | None
    predict_rows: int
    train_auc: float | None
    train_eval_samples: int | None
    steps: int | None
    train_s: float
    predict_s: float


def train_and_score(
    model: Path, train: str, check: str, score: str, work: Path, options: Mapping[str, str] | None = None
) -> PersiaRun:
    """``persia train --model MODEL --data TRAIN --eval-data CHECK --checkpoint WORK/checkpoint [OPTIONS]``, then
    ``persia predict`` of SCORE from that checkpoint (the one persia predict picks by default); ``work`` must be a
    new folder.

    CHECK is what training evaluates, and by default picks its epochs and its best checkpoint on: rows apart from
    SCORE's, or SCORE's AUC would be chosen on the rows it is measured on."""
    import pyarrow.parquet as pq

    work.mkdir(parents=True)
    checkpoint, scores = work / "checkpoint", work / "scores.parquet"
    options = dict(options or {})
    extra = [x for option, value in options.items() for x in (option, value)]
    started = time.perf_counter()
    trained = json.loads(
        _run(
            [
                "train",
                *("--model", str(model), "--data", train, "--eval-data", check),
                *("--checkpoint", str(checkpoint), "--json", *extra),
            ],
            work / "train.log",
        )
    )
    train_s = time.perf_counter() - started
    started = time.perf_counter()
    predicted = json.loads(
        _run(
            ["predict", "--checkpoint", str(checkpoint), "--data", score, "--out", str(scores), "--json"],
            work / "predict.log",
        )
    )
    predict_s = time.perf_counter() - started
    table = pq.read_table(scores, columns=["score", "label"])
    labels = table.column("label").to_numpy(zero_copy_only=False)
    return PersiaRun(
        options=options,
        auc=auc(labels, table.column("score").to_numpy(zero_copy_only=False)),
        predict_auc=predicted.get("metrics", {}).get("auc"),
        predict_rows=len(labels),
        train_auc=trained.get("auc"),
        train_eval_samples=trained.get("eval_samples"),
        steps=trained.get("steps"),
        train_s=train_s,
        predict_s=predict_s,
    )


@dataclass(frozen=True)
class Tuning:
    """What ``--tune-hparams`` chose on the inner split.

    Attributes:
        options: The chosen options (empty: the defaults won).
        inner_auc: The inner split's AUC of every run, by its options as a command line (``"defaults"``: none).
    """

    options: dict[str, str]
    inner_auc: dict[str, float]


def tune(model: Path, fit: str, check: str, work: Path) -> Tuning:
    """The coordinate search of :data:`SEARCH`: runs trained on ``fit`` and scored on ``check`` (both inner files of
    the training rows) under ``work``."""
    tried: dict[str, float] = {}

    def score(options: dict[str, str]) -> float:
        name = " ".join(f"{k} {v}" for k, v in options.items()) or "defaults"
        if name not in tried:
            tried[name] = train_and_score(model, fit, check, check, work / f"run{len(tried)}", options).auc
        return tried[name]

    best: dict[str, str] = {}
    for option, values in SEARCH:
        candidates = [best] + [best | {option: v} for v in values]
        best = max(candidates, key=score)
    return Tuning(best, tried)
