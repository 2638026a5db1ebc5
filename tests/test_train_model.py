"""persia train's model and hyper-parameter options end to end: a DCN-v2 from model.yaml trained with the given
optimizers and learning rates (recorded in --json), and what is refused before training."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import yaml
from test_train import OPTS, PERSIA, PS_TABLES, one_line_error

from persia_planner.paths import DEFAULT_MODEL

pytestmark = pytest.mark.processes  # every test here starts processes


@pytest.mark.timeout(600)
def test_cli_trains_a_dcn_with_the_given_hyper_parameters(tmp_path):
    data = yaml.safe_load(DEFAULT_MODEL.read_text())
    data["dense"] = {"arch": "dcn", "bottom": [32], "over": [32, 1], "dcn_layers": 2, "dcn_low_rank": 8}
    model = tmp_path / "dcn.yaml"
    model.write_text(yaml.safe_dump(data))
    hyper = ["--dense-optimizer", "adam", "--dense-lr", "0.005", "--sparse-lr", "0.05", "--sparse-eps", "0.01",
             "--eval-every", "10"]  # fmt: skip
    done = subprocess.run(
        [*PERSIA, "train", "--model", str(model), "--steps", "20", *hyper, *OPTS],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["steps"] == 20 and math.isfinite(result["loss"]) and 0.0 <= result["auc"] <= 1.0
    assert result["teacher_auc"] is not None and result["ps_tables"] == PS_TABLES
    assert result["hyper_parameters"] == {
        "dense_optimizer": "adam",
        "dense_lr": 0.005,
        "sparse_optimizer": "rowwise_adagrad",
        "sparse_lr": 0.05,
        "batch_size": 512,
        "eval_every": 10,
        "staleness": 2,
        "dense_arch": {"arch": "dcn", "num_dense": 13, "bottom": [32], "over": [32, 1], "dcn_layers": 2,
                       "dcn_low_rank": 8},
        "lr_schedule": "constant",
        "sparse_weight_decay": 0.0,
        "sparse_eps": 0.01,
    }  # fmt: skip


def test_cli_refuses_dense_inputs_the_data_does_not_have(tmp_path):
    data = yaml.safe_load(DEFAULT_MODEL.read_text())
    data["dense"] = {"arch": "dlrm", "num_dense": 5}
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump(data))
    line = one_line_error(["--model", str(model)])
    assert "dense.num_dense: is 5, but the data (synthetic or Criteo) has 13 dense features" in line, line


def test_cli_refuses_adam_for_local_tables_on_cpu_before_training():
    import torch

    if torch.cuda.is_available():
        pytest.skip("fbgemm fuses adam on CUDA")
    line = one_line_error(["--sparse-optimizer", "adam"])
    assert "table 'c2' is a local table, and fbgemm's CPU kernels have no fused adam" in line, line
