"""Does the trained model reach a logistic regression on the same rows? hybrid and sync against the classic baseline.

A click log from the synthetic teacher (the default model's 26 sparse and 13 dense features, written as a Criteo
file) is trained by ``persia train``'s engine twice, sync (K = 0) and hybrid (K = 4), for ``--epochs`` passes with 10%
of the rows held out by the validation split. A logistic regression (scikit-learn, on one-hot ids and the
standardized log1p counts) is fitted on exactly the training rows of that split, read by the same reader, and scored
on its held-out rows; its regularization is the best of a small grid *on the held-out rows*, an optimistic baseline.
The teacher is additive in its features, so logistic regression is the right family: a model that cannot reach it
is under-trained, not out-matched. The persia runs use the best learning rates of a few tried (the dense network
with Adam at 0.001, the tables at 0.05: ``--sparse-lr``, ``--dense-optimizer``, ``--dense-lr``); their AUC peaks
within 2-3 epochs and then declines, the tables' rows over-fitting rare ids without a weight decay.

Every AUC comes from this same invocation. Prints a table and writes JSON (``--json OUT``) with ``lr_auc``,
``sync_auc``, ``hybrid_auc``, ``sync_minus_lr``, ``hybrid_minus_lr`` and ``pass`` (both within 0.002 of the
regression, or above it).

    python benchmarks/vs_logistic.py --json out.json    # 400k rows, 2 epochs: ~4 minutes on 2 cores
    python benchmarks/vs_logistic.py --quick            # 100k rows
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from persia_planner import load_model, load_topology, plan

# The training modules are imported inside the functions: local_cluster's processes run this file's top level again.

console = Console()
HELD_OUT = 0.1
TOLERANCE = 0.002
C_GRID = (0.03, 0.1, 0.3, 1.0)


def write_log(spec: Any, rows: int, path: Path, seed: int) -> float:
    """``rows`` samples of the teacher of ``spec`` as a Criteo file at ``path``; returns the teacher's AUC on them."""
    from persia_planner.modules.data import SyntheticClicks, teacher_auc, to_criteo
    from persia_planner.modules.train import TrainConfig, teacher_for

    batch = 4096
    teacher = teacher_for(spec, TrainConfig(seed=seed))
    data = SyntheticClicks(teacher, batch_size=batch, num_batches=rows // batch, seed=seed)  # one id per feature
    to_criteo(data, path)
    return teacher_auc(data)


def train(spec: Any, the_plan: Any, topology: Any, data: Path, epochs: int, **options: Any) -> dict[str, Any]:
    from persia_planner.modules.train import TrainConfig, train_local

    cfg = TrainConfig(
        data=f"criteo:{data}",
        epochs=epochs,
        eval_split=HELD_OUT,
        eval_batches=10**6,  # every held-out batch
        batch_size=1024,
        progress=False,
        **options,
    )
    started = time.perf_counter()
    result = train_local(cfg, spec, dict(the_plan.tables), servers=len(topology.servers), topology=topology)
    result["wall_s"] = time.perf_counter() - started
    return result


def _rows(data: Path, held_out: bool) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """One side of the split, read as ``persia train`` reads it: per feature the id of each row (-1: none), the
    dense features (log1p counts) and the labels."""
    from persia_planner.modules.data import CriteoReader
    from persia_planner.modules.data.shards import DataPass
    from persia_planner.modules.data.split import RowSplit

    reading = DataPass(split=RowSplit(HELD_OUT, held_out=held_out))
    ids: list[list[np.ndarray]] = []
    dense, labels = [], []
    for batch in CriteoReader(data, batch_size=8192, num_workers=0, reading=reading):
        per_key = batch.sparse.to_dict()
        row_ids = []
        for key in batch.sparse.keys():  # noqa: SIM118  (a KeyedJaggedTensor is no dict)
            jagged = per_key[key]
            one = np.full(len(batch.labels), -1, dtype=np.int64)
            lengths = jagged.lengths().numpy()
            one[lengths > 0] = jagged.values().numpy()  # Criteo bags hold at most one id
            row_ids.append(one)
        ids.append(row_ids)
        dense.append(batch.dense.numpy())
        labels.append(batch.labels.numpy())
    features = [np.concatenate([b[f] for b in ids]) for f in range(len(ids[0]))]
    return features, np.concatenate(dense), np.concatenate(labels)


def logistic_regression(data: Path) -> dict[str, Any]:
    """The baseline: one-hot ids (the training rows' vocabulary; an unseen id is all zeros) and standardized dense
    features, L2-regularized logistic regression at each C of the grid; the best held-out AUC wins."""
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    train_ids, train_dense, train_y = _rows(data, held_out=False)
    test_ids, test_dense, test_y = _rows(data, held_out=True)
    mean, std = train_dense.mean(axis=0), train_dense.std(axis=0) + 1e-6

    def matrix(ids: list[np.ndarray], dense: np.ndarray, vocab: list[np.ndarray]) -> Any:
        blocks = []
        for column, known in zip(ids, vocab, strict=True):
            position = np.searchsorted(known, column)
            hit = (position < len(known)) & (known[np.minimum(position, len(known) - 1)] == column) & (column >= 0)
            rows = np.flatnonzero(hit)
            blocks.append(
                sparse.csr_matrix((np.ones(len(rows)), (rows, position[hit])), shape=(len(column), len(known)))
            )
        blocks.append(sparse.csr_matrix((dense - mean) / std))
        return sparse.hstack(blocks, format="csr")

    vocab = [np.unique(c[c >= 0]) for c in train_ids]
    x_train, x_test = matrix(train_ids, train_dense, vocab), matrix(test_ids, test_dense, vocab)
    by_c = {}
    started = time.perf_counter()
    for c in C_GRID:
        model = LogisticRegression(C=c, max_iter=1000, solver="lbfgs")
        model.fit(x_train, train_y)
        by_c[c] = float(roc_auc_score(test_y, model.predict_proba(x_test)[:, 1]))
    best = max(by_c, key=lambda c: by_c[c])
    return {
        "auc": by_c[best],
        "best_c": best,
        "auc_by_c": {str(c): a for c, a in by_c.items()},
        "train_rows": len(train_y),
        "held_out_rows": len(test_y),
        "features": x_train.shape[1],
        "fit_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100k rows instead of 400k")
    parser.add_argument("--epochs", type=int, default=2, help="passes of both persia runs (default 2)")
    parser.add_argument("--sparse-lr", type=float, default=0.05, help="persia's sparse learning rate (default 0.05)")
    parser.add_argument("--dense-optimizer", default="adam", help="persia's dense optimizer (default adam)")
    parser.add_argument("--dense-lr", type=float, default=0.001, help="persia's dense learning rate (default 0.001)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    import torch

    from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY

    spec, topology = load_model(DEFAULT_MODEL), load_topology(DEFAULT_TOPOLOGY)
    the_plan = plan(spec, topology)
    rows = 100_000 if args.quick else 400_000
    with tempfile.TemporaryDirectory(prefix="persia-vs-lr-") as work:
        data = Path(work) / "day_0"
        console.print(f"[bold]the log[/]: {rows:,} rows of the teacher of {spec.name} (Criteo format)")
        teacher = write_log(spec, rows, data, seed=11)
        console.print(f"[bold]persia train[/]: sync (K = 0) and hybrid (K = 4), {args.epochs} epochs each")
        tuning = {"sparse_lr": args.sparse_lr, "dense_optimizer": args.dense_optimizer, "dense_lr": args.dense_lr}
        sync = train(spec, the_plan, topology, data, args.epochs, mode="sync", **tuning)
        hybrid = train(spec, the_plan, topology, data, args.epochs, staleness=4, **tuning)
        console.print(f"[bold]logistic regression[/]: C in {list(C_GRID)} on the same training rows")
        lr = logistic_regression(data)
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "model": spec.name,
        "rows": rows,
        "epochs": args.epochs,
        "held_out_share": HELD_OUT,
        "hyper_parameters": sync["hyper_parameters"],
        "teacher_auc": teacher,
        "lr_auc": lr["auc"],
        "sync_auc": sync["auc"],
        "hybrid_auc": hybrid["auc"],
        "sync_minus_lr": sync["auc"] - lr["auc"],
        "hybrid_minus_lr": hybrid["auc"] - lr["auc"],
        "sync_normalized_entropy": sync["normalized_entropy"],
        "hybrid_normalized_entropy": hybrid["normalized_entropy"],
        "eval_samples": sync["eval_samples"],
        "epoch_steps": sync["epoch_steps"],
        "wall_s": {"sync": sync["wall_s"], "hybrid": hybrid["wall_s"], "lr_fit": lr["fit_s"]},
        "logistic_regression": {k: v for k, v in lr.items() if k != "auc"},
    }
    results["pass"] = min(results["sync_minus_lr"], results["hybrid_minus_lr"]) >= -TOLERANCE
    table = Table(title=f"vs logistic regression: {rows:,} rows, {args.epochs} epochs, {HELD_OUT:.0%} held out")
    for column in ("model", "held-out AUC", "minus LR"):
        table.add_column(column, justify="left" if column == "model" else "right")
    table.add_row("teacher (best possible)", f"{teacher:.4f}", f"{teacher - lr['auc']:+.4f}")
    table.add_row(f"logistic regression (C {lr['best_c']:g})", f"{lr['auc']:.4f}", "-")
    table.add_row("persia sync (K = 0)", f"{sync['auc']:.4f}", f"{results['sync_minus_lr']:+.4f}")
    table.add_row("persia hybrid (K = 4)", f"{hybrid['auc']:.4f}", f"{results['hybrid_minus_lr']:+.4f}")
    console.print(table)
    console.print(f"pass (both within {TOLERANCE} of the regression or above): {results['pass']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if results["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
