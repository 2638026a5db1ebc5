"""persia train on a model with sequence tables (modules/train/loop.py's sequence_model, the HybridSet of
modules/embedding/hybrid_set.py): DIN over a bag collection and a sequence collection, a sequence table on the
parameter servers beside local ones, trained, checkpointed and resumed as a model of bags is; and what it refuses, in
one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.paths import EXAMPLES

TOPOLOGY = str(EXAMPLES / "local_2x1.yaml")  # two CPU trainers, two servers
MODEL = {
    "name": "din-test",
    "batch_size": 256,
    "tables": [
        {"name": "user", "rows": 4000, "dim": 8},
        {"name": "item", "rows": 2000, "dim": 8, "constraints": {"sharding_types": ["row_wise"]}},
        {"name": "history", "rows": 2000, "dim": 8, "pooling": "none", "sequence_length": {"mean": 12, "max": 40},
         "constraints": {"tiers": ["ps"]}},
        {"name": "clicks", "rows": 1000, "dim": 8, "pooling": "none", "sequence_length": {"mean": 4, "max": 20},
         "constraints": {"sharding_types": ["row_wise"]}},
    ],
    "dense": {"arch": "din", "bottom": [16], "over": [32, 1], "attention": [16]},
}  # fmt: skip
PERSIA = [sys.executable, "-m", "persia_planner.cli"]


def _train(tmp_path, *args: str) -> dict:
    done = subprocess.run(
        [*PERSIA, "train", "--model", str(tmp_path / "m.yaml"), "--topology", TOPOLOGY, "--json", *args],
        capture_output=True, text=True, timeout=500, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_din_trains_with_a_ps_sequence_table_and_resumes(tmp_path):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(MODEL))
    first = _train(tmp_path, "--steps", "40", "--checkpoint", "ck", "--eval-batches", "4")
    assert first["ps_tables"] == ["history"] and sorted(first["local_tables"]) == ["clicks", "item", "user"]
    assert first["executed_matches_plan"] is True, first
    assert first["auc"] > 0.55 and first["teacher_auc"] > first["auc"], first
    resumed = _train(tmp_path, "--steps", "60", "--checkpoint", "ck", "--resume", "--eval-batches", "4")
    assert resumed["resumed_from_step"] == 40 and resumed["steps"] == 20, resumed
    assert resumed["auc"] > 0.55, resumed
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-000000040", "step-000000060"]


def test_a_sequence_model_refuses_the_train_pipeline_in_one_line(tmp_path):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(MODEL))
    done = CliRunner().invoke(app, ["train", "--model", str(tmp_path / "m.yaml"), "--topology", TOPOLOGY, "--pipeline"])
    assert done.exit_code == 2, done.output
    line = done.output.strip().splitlines()[-1]
    assert line.startswith("error: --pipeline: model 'din-test' has sequence tables (history, clicks)"), line


def test_a_sequence_model_without_din_is_refused_in_one_line(tmp_path):
    counts = {**MODEL, "dense": {"parameters": 10_000, "flops_per_sample": 20_000}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(counts))
    done = CliRunner().invoke(app, ["train", "--model", str(tmp_path / "m.yaml"), "--topology", TOPOLOGY])
    assert done.exit_code == 2, done.output
    line = done.output.strip().splitlines()[-1]
    assert line.startswith("error: model 'din-test' has sequence tables (history, clicks), which persia train reads")
    assert "fix: write dense: {arch: din}" in line


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_both_collections_with_ps_tables_prefetch_together(tmp_path):
    """A pooled and a sequence table on the servers: the run's HybridSet requests each batch from both or neither,
    K batches ahead, and both collections' pushes keep the bound."""
    both = {**MODEL, "tables": [dict(t) for t in MODEL["tables"]]}
    both["tables"][0]["constraints"] = {"tiers": ["ps"]}  # user, a bag table, on the servers beside the history
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(both))
    result = _train(tmp_path, "--steps", "30", "--staleness", "2", "--eval-batches", "2")
    assert sorted(result["ps_tables"]) == ["history", "user"] and result["executed_matches_plan"] is True, result
    assert result["staleness_max_seen"] <= 2 and result["steps"] == 30, result


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_din_model_trains_on_a_csv_history_column_and_predict_scores_every_row(tmp_path):
    import random

    rng = random.Random(0)
    lines = ["user,item,history,click"]
    for _ in range(3000):
        item, history = rng.randrange(200), [rng.randrange(200) for _ in range(rng.randrange(0, 12))]
        click = int(item in history or rng.random() < 0.1)  # the history decides most clicks
        lines.append(f"u{rng.randrange(300)},i{item},{'|'.join(f'i{h}' for h in history)},{click}")
    (tmp_path / "clicks.csv").write_text("\n".join(lines) + "\n")
    spec = {
        "name": "din-csv",
        "batch_size": 256,
        "tables": [
            {"name": "user", "rows": 1000, "dim": 8},
            {"name": "item", "rows": 1000, "dim": 8},
            {"name": "history", "rows": 1000, "dim": 8, "pooling": "none", "candidate": "item",
             "sequence_length": {"mean": 5.5, "max": 12}, "constraints": {"tiers": ["ps"]}},
        ],
        "dense": {"arch": "din", "bottom": [8], "over": [16, 1]},
        "data": {"label": "click", "sparse": {"user": "user", "item": "item",
                                              "history": {"column": "history", "separator": "|"}}},
    }  # fmt: skip
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    trained = _train(tmp_path, "--data", "csv:clicks.csv", "--epochs", "2", "--checkpoint", "ck")
    assert trained["ps_tables"] == ["history"] and trained["executed_matches_plan"] is True, trained
    done = subprocess.run(
        [*PERSIA, "predict", "--checkpoint", "ck", "--data", "csv:clicks.csv", "--out", "scores.parquet", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    scored = json.loads(done.stdout.strip().splitlines()[-1])
    assert scored["rows"] == 3000 and scored["metrics"]["auc"] > 0.6, scored
