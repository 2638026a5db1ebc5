"""Does persia, as a new user runs it, beat the simple baselines on real click logs?

For each log (``DATA``: ``csv:PATH``, ``parquet:PATH`` or ``criteo:PATH``, a file or a folder, as ``persia train
--data`` names it; without one, a Criteo file written from the synthetic teacher of the default model, the one CI
runs) and each of ``--splits`` random splits (seeds 0, 1, 2, ...: ``--valid-share`` of the rows validate, 10% by
default), plus one by time with ``--time-column`` (the latest rows validate), the split's training and validation rows
are written to files that all three models read:

* **persia, no tuning**: ``persia data profile KIND:train --out model.yaml``, ``persia train --model model.yaml
  --data KIND:inner_train --eval-data KIND:inner_valid --checkpoint ...`` with every other option at its default,
  then ``persia predict`` from the checkpoint on the validation file: the AUC over every validation row. The inner
  files split the training rows (10% held out, as the baselines choose on): persia's defaults pick the epochs and
  the checkpoint on ``--eval-data``, which must not be the rows it is scored on (training's own figure, on the
  inner rows, is recorded beside). ``--tune-hparams`` adds a coordinate search over ``--epochs``, ``--batch-size``,
  ``--sparse-lr`` and ``--dense-lr`` on the same inner split, reported beside.
* **logistic regression** (scikit-learn; one-hot ids, standardized log1p dense values; ``C`` chosen on an inner
  split of the training rows) and a **factorization machine** (torch; a 16-vector and a weight per feature of the
  same design, lazy Adam, L2 strength and epochs chosen on the inner split), both on the columns the profile's
  model.yaml feeds persia (its ``data:``), read with pyarrow.

Prints a table and writes JSON (``--json OUT``): per data set ``auc_persia``, ``auc_persia_tuned`` (with
``--tune-hparams``), ``auc_lr``, ``auc_fm`` (means over the random splits), ``rows``, ``persia_minus_lr``,
``persia_minus_fm``, each split's figures under ``splits`` (and ``by_time``); on the teacher's log also
``auc_teacher``, the best AUC any model can reach on those rows.

    python benchmarks/vs_baselines.py --quick --json out.json        # the teacher, 50k rows: ~4 minutes on 2 cores
    python benchmarks/vs_baselines.py csv:ml100k.csv --time-column timestamp --tune-hparams --json ml.json

Public click logs to run it on (fetch them yourself, from their official sources, under their terms; **never commit
them**: their licences forbid redistribution, and the project keeps logs it tests on to itself):

* Criteo: the 1TB Click Logs (https://ailab.criteo.com/download-criteo-1tb-click-logs-dataset/) or the Kaggle Display
  Advertising Challenge's (https://www.kaggle.com/c/criteo-display-ad-challenge); the first N lines of a day
  (``head -n 100000 day_0 > criteo_100k.txt``) are a sample in the ``criteo:`` format.
* Avazu: the Kaggle Click-Through Rate Prediction competition (https://www.kaggle.com/c/avazu-ctr-prediction); its
  ``train`` file is a CSV with the label in ``click`` (``csv:avazu_100k.csv``; ``--time-column hour``).
* MovieLens (https://grouplens.org/datasets/movielens/, e.g. ml-100k): as a click task, a rating of 4 or more is a
  click (``click = rating >= 4``); join ``u.data`` (user, item, rating, timestamp) with the user's and the item's
  attributes from ``u.user`` and ``u.item`` into one CSV of ``user_id, item_id, ..., timestamp, click``, without the
  rating (``--time-column timestamp`` for the split by time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

if str(Path(__file__).resolve().parent) not in sys.path:  # the modules beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_models import auc, factorization_machine, logistic_regression
from click_logs import LogKind, LogRows, LogSource, Split, inner_split, random_split, read_rows, time_split, write_rows
from log_features import FeatureColumns, one_hot, read_features, read_times
from persia_cli import persia_executable, profile, train_and_score, tune

from persia_planner.errors import PlannerError

console = Console(width=max(Console().width, 140))  # a column per model
TEACHER_ROWS = {True: 50_000, False: 200_000}
"""Rows of the synthetic teacher's log, by ``--quick``."""
TEACHER_SEED = 11


def teacher_log(path: Path, rows: int) -> np.ndarray:
    """``rows`` (rounded down to whole batches) of the teacher of the default model as a Criteo file at ``path``;
    the teacher's click probability of each row, in file order."""
    import torch

    from persia_planner import load_model
    from persia_planner.modules.data import SyntheticClicks, to_criteo
    from persia_planner.modules.train import TrainConfig, teacher_for
    from persia_planner.paths import DEFAULT_MODEL

    batch = 4096
    teacher = teacher_for(load_model(DEFAULT_MODEL), TrainConfig(seed=TEACHER_SEED))
    data = SyntheticClicks(teacher, batch_size=batch, num_batches=rows // batch, seed=TEACHER_SEED)
    to_criteo(data, path)
    return torch.cat([b.teacher_prob for b in data]).numpy()


def _side(rows: LogRows, index: np.ndarray, folder: Path, name: str) -> Path:
    return write_rows(rows, index, folder / f"{name}{rows.source.suffix()}")


def persia_options(args: argparse.Namespace) -> dict[str, str]:
    """``--persia-options`` as ``train_and_score``'s options (``--flag value`` pairs)."""
    try:
        words = shlex.split(args.persia_options)
    except ValueError as err:  # an unclosed quote
        raise PlannerError(f"--persia-options {args.persia_options!r}: {err}", fixes=("close the quote",)) from None
    if len(words) % 2 or any(not w.startswith("--") for w in words[::2]):
        raise PlannerError(
            f"--persia-options {args.persia_options!r}: not pairs of --option value",
            fixes=("e.g. --persia-options '--sparse-eps 1e-8 --sparse-lr 0.05'",),
        )
    return dict(zip(words[::2], words[1::2], strict=True))


def run_split(
    rows: LogRows, split: Split, seed: int, work: Path, args: argparse.Namespace, teacher: Any
) -> dict[str, Any]:
    """Every model on one split (files under ``work``); its record (``auc_*``, and how each got there)."""
    source = rows.source
    folder = work / split.name.replace(" ", "_")
    folder.mkdir(parents=True)
    train, valid = _side(rows, split.train, folder, "train"), _side(rows, split.valid, folder, "valid")
    inner = inner_split(split, seed)
    fit = source.arg(_side(rows, split.train[inner.train], folder, "inner_train"))
    check = source.arg(_side(rows, split.train[inner.valid], folder, "inner_valid"))
    started = time.perf_counter()
    model = profile(source.arg(train), folder / "model.yaml")
    persia = train_and_score(model, fit, check, source.arg(valid), folder / "persia", persia_options(args))
    console.print(f"  {split.name}: persia {persia.auc:.4f} ({time.perf_counter() - started:.0f} s)")
    columns = FeatureColumns.of_model(model, source.kind)
    design = one_hot(read_features(source.kind, train, columns), read_features(source.kind, valid, columns), columns)
    lr = logistic_regression(design.train, design.y_train, design.valid, inner)
    fm = factorization_machine(design.train, design.y_train, design.valid, inner, seed)
    record: dict[str, Any] = {
        "name": split.name,
        "train_rows": len(split.train),
        "valid_rows": len(split.valid),
        "auc_persia": persia.auc,
        "auc_lr": auc(design.y_valid, lr.scores),
        "auc_fm": auc(design.y_valid, fm.scores),
        "features": sum(design.widths.values()),
        "profile": _profiled(model, columns),
        "persia": asdict(persia),
        "lr": {"chosen": lr.chosen, "inner_auc": lr.inner_auc, "fit_s": lr.fit_s},
        "fm": {"chosen": fm.chosen, "inner_auc": fm.inner_auc, "fit_s": fm.fit_s},
    }
    if teacher is not None:
        record["auc_teacher"] = auc(design.y_valid, teacher[split.valid])
    console.print(f"  {split.name}: logistic regression {record['auc_lr']:.4f}, FM {record['auc_fm']:.4f}")
    if args.tune_hparams:
        tuning = tune(model, fit, check, folder / "tuning")
        tuned = train_and_score(model, fit, check, source.arg(valid), folder / "persia_tuned", tuning.options)
        record["auc_persia_tuned"] = tuned.auc
        record["persia_tuned"] = asdict(tuned) | {"inner_auc": tuning.inner_auc}
        console.print(f"  {split.name}: persia tuned {tuned.auc:.4f} ({' '.join(sum(tuning.options.items(), ()))})")
    return record


def _profiled(model: Path, columns: FeatureColumns) -> dict[str, Any]:
    """What the profile chose, as the record keeps it: the batch, the tables and the columns of each role."""
    from persia_planner import load_model

    spec = load_model(model)
    return {
        "batch_size": spec.batch_size,
        "tables": {t.name: t.rows for t in spec.tables},
        "dense": [d.name for d in columns.dense],
        "sparse": [s.name if s.separator is None else f"{s.name} (split by {s.separator!r})" for s in columns.sparse],
    }


def _differences(record: dict[str, Any]) -> dict[str, Any]:
    out = {"persia_minus_lr": record["auc_persia"] - record["auc_lr"]}
    out["persia_minus_fm"] = record["auc_persia"] - record["auc_fm"]
    if "auc_persia_tuned" in record:
        out["persia_tuned_minus_lr"] = record["auc_persia_tuned"] - record["auc_lr"]
        out["persia_tuned_minus_fm"] = record["auc_persia_tuned"] - record["auc_fm"]
    return out


def run_data_set(rows: LogRows, args: argparse.Namespace, work: Path, teacher: Any = None) -> dict[str, Any]:
    """Every split of one log; its record (the means over the random splits, each split's, and by time)."""
    source = rows.source
    console.print(f"[bold]{source.name}[/]: {len(rows):,} rows of {source.arg()}")
    splits = [random_split(len(rows), args.valid_share, seed) for seed in range(args.splits)]
    records = [run_split(rows, s, seed, work, args, teacher) for seed, s in enumerate(splits)]
    record: dict[str, Any] = {"name": source.name, "data": source.arg(), "rows": len(rows)}
    for key in ("auc_persia", "auc_persia_tuned", "auc_lr", "auc_fm", "auc_teacher"):
        if key in records[0]:
            record[key] = float(np.mean([r[key] for r in records]))
            record[f"{key}_splits"] = [r[key] for r in records]
    record |= _differences(record)
    record["splits"] = [r | _differences(r) for r in records]
    if args.time_column:  # (read_times found the column before anything ran)
        by_time = run_split(rows, time_split(read_times(rows, args.time_column), args.valid_share), 0, work, args, None)
        record["by_time"] = by_time | _differences(by_time)
    return record


def _environment() -> dict[str, Any]:
    import pyarrow
    import sklearn
    import torch

    import persia_planner

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "versions": {
            "persia_planner": getattr(persia_planner, "__version__", None),
            "scikit_learn": sklearn.__version__,
            "pyarrow": pyarrow.__version__,
        },
        "commit": commit,
        "date": datetime.date.today().isoformat(),
    }


def _print(results: dict[str, Any]) -> None:
    data_sets = results["data_sets"]
    shown = [("auc_persia", "persia"), ("auc_persia_tuned", "persia tuned"), ("auc_lr", "LR"), ("auc_fm", "FM")]
    shown += [("auc_teacher", "teacher"), ("persia_minus_lr", "persia - LR"), ("persia_minus_fm", "persia - FM")]
    shown = [(k, name) for k, name in shown if any(k in d for d in data_sets)]  # no empty column
    table = Table(title="AUC over every validation row: persia (the profile's model, the defaults) vs the baselines")
    for column in ("data set", "split", "train / valid rows", *(name for _, name in shown), "persia's own (rows)"):
        table.add_column(column, justify="left" if column in ("data set", "split") else "right")

    def row(name: str, split: str, r: dict[str, Any], sizes: str, own: str) -> None:
        signed = {"persia_minus_lr", "persia_minus_fm"}
        cells = [f"{r[k]:+.4f}" if k in signed else f"{r[k]:.4f}" if k in r else "-" for k, _ in shown]
        table.add_row(name, split, sizes, *cells, own)

    for d in data_sets:
        for s in d["splits"] + ([d["by_time"]] if "by_time" in d else []):
            p = s["persia"]
            own = "-" if p["train_auc"] is None else f"{p['train_auc']:.4f} ({p['train_eval_samples']:,})"
            row(d["name"], s["name"], s, f"{s['train_rows']:,} / {s['valid_rows']:,}", own)
        row(d["name"], f"mean of {len(d['splits'])}", d, f"{d['rows']:,}", "")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "data", nargs="*", help="click logs: csv:PATH, parquet:PATH or criteo:PATH (default: the teacher)"
    )
    parser.add_argument("--splits", type=int, default=3, help="random splits per log, seeds 0, 1, ... (default 3)")
    parser.add_argument("--valid-share", type=float, default=0.1, help="rows that validate (default 0.1)")
    parser.add_argument("--time-column", help="also split each log by this column: its latest rows validate")
    parser.add_argument("--tune-hparams", action="store_true", help="also search persia's options (inner split)")
    parser.add_argument(
        "--persia-options",
        default="",
        help="options persia train's untuned run adds to the defaults, e.g. '--sparse-eps 1e-8' (what one measures)",
    )
    parser.add_argument("--quick", action="store_true", help="the teacher's log: 50k rows instead of 200k")
    parser.add_argument("--work", type=Path, help="keep the split files, models and logs in this new folder")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        if args.splits < 1:
            raise PlannerError(f"--splits {args.splits}: must be at least 1", fixes=("--splits 3",))
        persia_options(args)  # refused now, not after the baselines ran
        if args.time_column and not args.data:
            raise PlannerError("--time-column: the teacher's log has no time", fixes=("name logs (DATA) to split",))
        if args.work is not None and args.work.exists():
            raise PlannerError(f"--work {args.work}: exists already", fixes=("name a new folder",))
        persia_executable()
        logs = [read_rows(LogSource.parse(d)) for d in args.data]
        if args.time_column:  # a log without the column is refused now, not after the others ran
            for rows in logs:
                read_times(rows, args.time_column)
        with tempfile.TemporaryDirectory(prefix="persia-vs-baselines-") as scratch:
            work = args.work or Path(scratch)
            work.mkdir(parents=True, exist_ok=True)
            data_sets = []
            if not logs:
                (work / "0-teacher").mkdir()
                path = work / "0-teacher" / "teacher.txt"
                console.print(f"[bold]the teacher[/]: {TEACHER_ROWS[args.quick]:,} rows of the default model's teacher")
                probabilities = teacher_log(path, TEACHER_ROWS[args.quick])
                teacher = read_rows(LogSource(LogKind.CRITEO, path))
                data_sets.append(run_data_set(teacher, args, work / "0-teacher", probabilities))
            data_sets += [run_data_set(r, args, work / f"{i}-{r.source.name}") for i, r in enumerate(logs, 1)]
    except PlannerError as err:
        console.print(f"error: {err}", markup=False, highlight=False)
        return 2
    everything = [s for d in data_sets for s in d["splits"] + ([d["by_time"]] if "by_time" in d else [])]
    results: dict[str, Any] = _environment() | {
        "quick": args.quick,
        "splits": args.splits,
        "valid_share": args.valid_share,
        "time_column": args.time_column,
        "tune_hparams": args.tune_hparams,
        "persia_options": args.persia_options,
        "persia_minus_lr_min": min(d["persia_minus_lr"] for d in data_sets),
        "persia_minus_fm_min": min(d["persia_minus_fm"] for d in data_sets),
        "persia_at_least_lr": all(d["persia_minus_lr"] >= 0 for d in data_sets),
        "persia_at_least_lr_every_split": all(s["persia_minus_lr"] >= 0 for s in everything),
        "wall_s": time.perf_counter() - started,
        "data_sets": data_sets,
    }
    _print(results)
    verdict = results["persia_at_least_lr"]
    console.print(f"persia at least the logistic regression on every data set (mean of the splits): {verdict}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
