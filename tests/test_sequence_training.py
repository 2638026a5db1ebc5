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
