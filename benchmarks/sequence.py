"""A sequence model trained hybrid: DIN over a user's history on the parameter servers (K = 4) against the same model
trained synchronously, the teacher's best AUC, the same model without the history, and the plan's step against the
measured one.

1. Data from a synthetic teacher whose clicks depend on the candidate item attending over the user's history of items
   (``modules/data/synthetic.Interest``): user, item and history columns, a CSV training file and a validation file
   (``--quick``: fewer rows). The teacher's AUC on the validation rows is the best any model can reach.
2. ``persia train`` of model.yaml's DIN (user and item pooled, the history a sequence table held on the servers, the
   item its candidate: looked up in the history's table too, DIN's query) on
   the bundled local cluster (two CPU trainers, two servers): hybrid (``--staleness 4``) and ``--mode sync``; the
   same tables without the history (``dlrm`` over user and item, the history column left unread).
3. ``persia predict`` of each run's checkpoint scores every validation row: the AUCs are over all of them.

    python benchmarks/sequence.py --json out.json     # 200,000 training rows, 2 epochs
    python benchmarks/sequence.py --quick             # 40,000 rows (CI)

JSON keys: ``auc_hybrid``, ``auc_sync``, ``auc_teacher``, ``auc_gap`` (``auc_sync - auc_hybrid``: what the servers'
staleness costs), ``auc_no_history`` (how far the model gets without the history), ``history_gain``
(``auc_hybrid - auc_no_history``), ``auc_teacher_no_history`` (the teacher without the history's term: the most it
can add), ``cost_error`` (``|measured - predicted| / measured`` of the hybrid run's median
step), ``predicted_step_ms``, ``step_ms``, and ``runs`` (each run's figures).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
PERSIA = [sys.executable, "-m", "persia_planner.cli"]
TOPOLOGY = REPO / "persia_planner" / "examples" / "local_2x1.yaml"
USERS, ITEMS, DIM = 20_000, 5_000, 16
HISTORY_MEAN, HISTORY_MAX = 10.0, 40


def teacher() -> Any:
    """The hidden click model: a user and a candidate item (pooled), the user's history of items."""
    from persia_planner.modules.data.synthetic import Interest, Teacher

    interest = Interest("history", of="item", mean_length=HISTORY_MEAN, weight=1.5, sharpness=4.0)
    rows = {"user": USERS, "item": ITEMS, "history": ITEMS}
    return Teacher(features=("user", "item", "history"), rows=rows, dim=8, num_dense=0, interests=(interest,), seed=7)


def write_rows(path: Path, rows: int, seed: int) -> tuple[float, float]:
    """``rows`` samples of the teacher as a CSV file at ``path`` (history ids ``|``-separated); the teacher's AUC,
    and its AUC without the history's term (the best a model that cannot read the history may do)."""
    import torch
    from torchmetrics.functional.classification import binary_auroc

    from persia_planner.modules.data.synthetic import SyntheticClicks

    batch = 10_000
    hidden = teacher()
    data = SyntheticClicks(
        hidden, batch_size=batch, num_batches=-(-rows // batch), pooling={"history": HISTORY_MEAN}, seed=seed
    )
    probs, blind, labels = [], [], []
    with path.open("w") as out:
        out.write("user,item,history,click\n")
        for b in data:
            jt = b.sparse.to_dict()
            users, items = jt["user"].values().tolist(), jt["item"].values().tolist()
            history, lengths = jt["history"].values().tolist(), jt["history"].lengths().tolist()
            start = 0
            for i, (user, item, label) in enumerate(zip(users, items, b.labels.tolist(), strict=True)):
                ids = history[start : start + lengths[i]]
                start += lengths[i]
                out.write(f"{user},{item},{'|'.join(map(str, ids))},{int(label)}\n")
            probs.append(b.teacher_prob)
            blind.append(hidden.prob(b, without=["history"]))
            labels.append(b.labels)
    y = torch.cat(labels).long()
    return float(binary_auroc(torch.cat(probs), y)), float(binary_auroc(torch.cat(blind), y))


def model(history: bool, on_servers: bool) -> dict[str, Any]:
    """model.yaml: DIN over user, item and the history (on the servers where asked), or DLRM without it."""
    tables: list[dict[str, Any]] = [
        {"name": "user", "rows": USERS, "dim": DIM},
        {"name": "item", "rows": ITEMS, "dim": DIM},
    ]
    sparse: dict[str, Any] = {"user": "user", "item": "item"}
    if history:
        seq: dict[str, Any] = {"name": "history", "rows": ITEMS, "dim": DIM, "pooling": "none", "candidate": "item",
                               "sequence_length": {"mean": HISTORY_MEAN, "max": HISTORY_MAX}}  # fmt: skip
        if on_servers:
            seq["constraints"] = {"tiers": ["ps"]}
        tables.append(seq)
        sparse["history"] = {"column": "history", "separator": "|"}
    dense = {"arch": "din" if history else "dlrm", "bottom": [32], "over": [64, 32, 1]}
    return {"name": "din-bench" if history else "no-history", "batch_size": 1024, "tables": tables, "dense": dense,
            "data": {"label": "click", "sparse": sparse}}  # fmt: skip


def run(work: Path, name: str, spec: dict[str, Any], epochs: int, extra: list[str]) -> dict[str, Any]:
    """``persia train`` of ``spec`` then ``persia predict`` of its checkpoint on every validation row."""
    model_path = work / f"{name}.yaml"
    model_path.write_text(yaml.safe_dump(spec))
    checkpoint = work / f"{name}-ckpt"
    command = [*PERSIA, "train", "--model", str(model_path), "--topology", str(TOPOLOGY), "--data",
               f"csv:{work / 'train.csv'}", "--eval-data", f"csv:{work / 'valid.csv'}", "--epochs", str(epochs),
               "--checkpoint", str(checkpoint), "--json", *extra]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"persia train ({name}) failed: {done.stderr[-3000:]}")
    trained = json.loads(done.stdout.strip().splitlines()[-1])
    scores = work / f"{name}-scores.parquet"
    command = [*PERSIA, "predict", "--checkpoint", str(checkpoint), "--data", f"csv:{work / 'valid.csv'}", "--out",
               str(scores), "--json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"persia predict ({name}) failed: {done.stderr[-3000:]}")
    scored = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "auc": scored["metrics"]["auc"],
        "rows": scored["rows"],
        "step_ms": trained["step_ms"],
        "predicted_step_ms": trained["plan_step_ms"],
        "ps_tables": trained["ps_tables"],
        "staleness": trained["staleness"],
        "executed_matches_plan": trained["executed_matches_plan"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40,000 training rows (CI)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    rows, epochs = (40_000, 2) if args.quick else (200_000, 2)
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="persia-sequence-bench-") as tmp:
        work = Path(tmp)
        write_rows(work / "train.csv", rows, seed=1)
        auc_teacher, auc_teacher_no_history = write_rows(work / "valid.csv", rows // 5, seed=2)
        runs = {
            "hybrid": run(work, "hybrid", model(True, True), epochs, ["--staleness", "4"]),
            "sync": run(work, "sync", model(True, True), epochs, ["--mode", "sync"]),
            "no_history": run(work, "no_history", model(False, False), epochs, []),
        }
    hybrid = runs["hybrid"]
    out: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "quick": args.quick, "train_rows": rows, "epochs": epochs},
        "auc_hybrid": hybrid["auc"],
        "auc_sync": runs["sync"]["auc"],
        "auc_teacher": auc_teacher,
        "auc_gap": runs["sync"]["auc"] - hybrid["auc"],
        "auc_no_history": runs["no_history"]["auc"],
        "auc_teacher_no_history": auc_teacher_no_history,
        "history_gain": hybrid["auc"] - runs["no_history"]["auc"],
        "predicted_step_ms": hybrid["predicted_step_ms"],
        "step_ms": hybrid["step_ms"],
        "cost_error": abs(hybrid["step_ms"] - hybrid["predicted_step_ms"]) / hybrid["step_ms"],
        "runs": runs,
    }
    print(f"{'run':<12} {'AUC':>8} {'step ms':>9} {'plan ms':>9}")
    for name, r in runs.items():
        print(f"{name:<12} {r['auc']:>8.4f} {r['step_ms']:>9.1f} {r['predicted_step_ms']:>9.1f}")
    print(f"{'teacher':<12} {auc_teacher:>8.4f}")
    print(f"auc_gap {out['auc_gap']:+.4f}  history_gain {out['history_gain']:+.4f}  cost_error {out['cost_error']:.1%}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
