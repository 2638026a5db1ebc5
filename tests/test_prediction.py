"""``persia predict``: a checkpoint scores new rows as its run scored its own (the same columns, transforms and
tables, the PS ones served again), in file order, with labels or without; bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]

MODEL_YAML = """
name: clicks
batch_size: 64
tables:
  - {name: user_id, rows: 200_000, dim: 16}
  - {name: item_ids, rows: 150_000, dim: 16, pooling_factor: 2}
  - {name: country, rows: 50, dim: 16}
data:
  label: clicked
  dense: [{column: price, log1p: true, standardize: true}]
  sparse:
    user_id: user
    item_ids: {column: items}
    country: country
"""


def _clicks(n: int, seed: int) -> pa.Table:
    """``n`` rows whose click depends on the user and the price (so that the model learns something)."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 40, n)
    price = rng.uniform(0, 1000, n)
    p = 1 / (1 + np.exp(-(np.where(users % 3 == 0, 1.5, -1.0) + (price - 500) / 400)))
    return pa.table(
        {
            "clicked": (rng.random(n) < p).astype(np.int64),
            "price": price,
            "user": [f"u{u}" for u in users],
            "items": [[f"it{(u + k) % 17}" for k in range(u % 3)] for u in users],
            "country": rng.integers(0, 9, n),
        }
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    return subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=540,
    )  # fmt: skip


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_a_checkpoint_scores_rows_as_its_run_evaluated_them(tmp_path):
    """2 PS + 2 trainers train in sync mode (the two large tables on the servers), evaluating on every row of a
    validation file; predict, in one process with 2 fresh servers loaded from the checkpoint, gives those rows the
    run's AUC and log loss. Without the label column the scores are the same."""
    (tmp_path / "model.yaml").write_text(MODEL_YAML)
    pq.write_table(_clicks(1024, seed=1), tmp_path / "train.parquet", row_group_size=256)
    valid = _clicks(256, seed=2)  # 2 trainers x 2 eval batches x 64 rows: every row evaluated
    pq.write_table(valid, tmp_path / "valid.parquet", row_group_size=128)
    ckpt = tmp_path / "ckpt"
    train = _cli(
        "train", "--model", str(tmp_path / "model.yaml"), "--data", f"parquet:{tmp_path / 'train.parquet'}",
        "--eval-data", f"parquet:{tmp_path / 'valid.parquet'}", "--eval-batches", "2", "--batch-size", "64",
        "--epochs", "2", "--mode", "sync", "--checkpoint", str(ckpt), "--json",
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    run = json.loads(train.stdout.strip().splitlines()[-1])
    assert sorted(run["ps_tables"]) == ["item_ids", "user_id"] and run["eval_samples"] == 256

    scored = _cli("predict", "--checkpoint", str(ckpt), "--data", f"parquet:{tmp_path / 'valid.parquet'}",
                  "--out", str(tmp_path / "scores.parquet"), "--batch-size", "100", "--json")  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads(scored.stdout.strip().splitlines()[-1])
    assert result["rows"] == 256 and result["step"] == run["last_step"]
    m = result["metrics"]
    assert m["auc"] == pytest.approx(run["auc"], abs=1e-6) and m["auc"] > 0.6
    assert m["eval_loss"] == pytest.approx(run["eval_loss"], abs=1e-5)
    assert m["normalized_entropy"] == pytest.approx(run["normalized_entropy"], abs=1e-5)
    scores = pq.read_table(tmp_path / "scores.parquet")
    assert scores.column_names == ["row", "score", "label"]
    assert scores["row"].to_pylist() == list(range(256))  # file order, the last partial batch (56 rows) too
    assert scores["label"].to_pylist() == [float(x) for x in valid["clicked"].to_pylist()]

    # Rows to score have no label column: the same scores, no label, no metrics.
    pq.write_table(valid.drop(["clicked"]), tmp_path / "new.parquet")
    step_dir = ckpt / f"step-{run['last_step']:09d}"  # one checkpoint, named
    unlabeled = _cli("predict", "--checkpoint", str(step_dir), "--data", f"parquet:{tmp_path / 'new.parquet'}",
                     "--out", str(tmp_path / "new_scores.parquet"), "--json")  # fmt: skip
    assert unlabeled.returncode == 0, unlabeled.stderr[-3000:]
    assert json.loads(unlabeled.stdout.strip().splitlines()[-1])["metrics"] is None
    again = pq.read_table(tmp_path / "new_scores.parquet")
    assert again.column_names == ["row", "score"]
    assert np.allclose(again["score"].to_numpy(), scores["score"].to_numpy(), atol=1e-6)

    # Bad input: one line, exit 2, nothing overwritten.
    before = (tmp_path / "scores.parquet").read_bytes()
    for args, needle in (
        (["--out", str(tmp_path / "scores.parquet")], "scores.parquet exists; fix: pass --overwrite"),
        (["--out", str(tmp_path / "x.parquet"), "--checkpoint", str(tmp_path)], "no checkpoint in"),
        (["--out", str(tmp_path / "x.parquet"), "--data", f"csv:{tmp_path / 'none.csv'}"], "none.csv"),
    ):
        base = {"--checkpoint": str(ckpt), "--data": f"parquet:{tmp_path / 'valid.parquet'}"}
        given = dict(zip(args[::2], args[1::2], strict=True))
        flat = [x for k, v in (base | given).items() for x in (k, v)]
        bad = _cli("predict", *flat)
        assert bad.returncode == 2 and needle in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert (tmp_path / "scores.parquet").read_bytes() == before
