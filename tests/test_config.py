"""The torch-free run configuration: options become enums or one-line errors, and `persia train` refuses bad input
before it imports torch."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
from processes import cli_in_fresh_interpreter
from typer.testing import CliRunner

from persia_planner import ModelSpec, Optimizer, load_model
from persia_planner.cli import app
from persia_planner.errors import PlannerError, SpecError
from persia_planner.model.dtypes import DType
from persia_planner.modules.data.criteo_format import FEATURE_NAMES
from persia_planner.modules.train.config import (
    DenseOptimizer,
    TrainConfig,
    TrainMode,
    sparse_optimizer_of,
)
from persia_planner.modules.train.run_inputs import (
    check_before_start,
    check_id_space,
    describe_hyper_parameters,
    hyper_parameters,
    id_universe,
)
from persia_planner.modules.wire_dtypes import torch_dtype

ROOT = Path(__file__).resolve().parent.parent
SPEC = load_model(ROOT / "persia_planner" / "examples" / "dlrm_small.yaml")


def model(*kinds: str, names: tuple[str, ...] = ()) -> ModelSpec:
    names = names or tuple(f"t{i}" for i in range(len(kinds)))
    tables = [{"name": n, "rows": 10, "dim": 8, "optimizer": k} for n, k in zip(names, kinds, strict=True)]
    return ModelSpec.from_dict({"name": "m", "batch_size": 8, "tables": tables})


def test_strings_become_enums_and_keep_their_value():
    cfg = TrainConfig(mode="sync", ps_wire="bfloat16", dense_optimizer="sgd", sparse_optimizer="adam", staleness=3)
    assert cfg.mode is TrainMode.SYNC and cfg.ps_wire is DType.BF16
    assert cfg.dense_optimizer is DenseOptimizer.SGD and cfg.sparse_optimizer is Optimizer.ADAM
    assert cfg.effective_staleness == 0 and TrainConfig(staleness=3).effective_staleness == 3
    # A StrEnum is its value: results and JSON carry the plain string.
    assert json.dumps({"mode": cfg.mode, "wire": cfg.ps_wire}) == '{"mode": "sync", "wire": "bf16"}'
    assert TrainConfig(mode=TrainMode.SYNC) == TrainConfig(mode="sync")


def test_the_wire_dtype_is_the_planners_dtype_read_in_either_vocabulary():
    import torch

    assert [torch_dtype(d) for d in DType] == [torch.float32, torch.float16, torch.bfloat16]
    assert TrainConfig(ps_wire="float16") == TrainConfig(ps_wire="fp16") == TrainConfig(ps_wire=DType.FP16)
    assert TrainConfig(ps_wire="float16").ps_wire_dtype is torch.float16


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "async"}, "--mode must be hybrid or sync, got 'async'"),
        ({"ps_wire": "int8"}, "--ps-wire must be one of fp32 (float32), fp16 (float16), bf16 (bfloat16), got 'int8'"),
        ({"dense_optimizer": "lamb"}, "--dense-optimizer must be one of adagrad, sgd, adam, got 'lamb'"),
        ({"sparse_optimizer": "lamb"}, "--sparse-optimizer must be one of sgd, rowwise_adagrad, adagrad, adam"),
        ({"resume": True}, "--resume needs --checkpoint DIR"),
        ({"checkpoint_every": 5}, "--checkpoint-every needs --checkpoint DIR"),
        (
            {"checkpoint_every": -1, "checkpoint": "x"},
            "--checkpoint-every must be >= 0 steps (0: only at the end), got -1",
        ),
        ({"keep": 0, "checkpoint": "x"}, "--keep must be in [1, 1000] checkpoints, got 0"),
        ({"data": "hdfs:/x"}, "--data must be 'synthetic', 'criteo:PATH', 'parquet:PATH' or 'csv:PATH', got 'hdfs:/x'"),
        ({"steps": 0}, "--steps, trainers and eval batches must be >= 1"),
        ({"batch_size": 0}, "--batch-size must be >= 1, got 0"),
        ({"staleness": -1}, "--staleness must be >= 0, got -1"),
        ({"ps_delay_ms": -0.5}, "--ps-delay-ms must be a number in [0, 60000] (ms per PS call), got -0.5"),
        ({"ps_delay_ms": float("inf")}, "--ps-delay-ms must be a number in [0, 60000] (ms per PS call), got inf"),
        ({"ps_delay_ms": float("nan")}, "--ps-delay-ms must be a number in [0, 60000] (ms per PS call), got nan"),
        ({"eval_every": -3}, "--eval-every must be >= 0 (0: at each epoch"),
        ({"sparse_lr": -1.0}, "--sparse-lr must be a finite number > 0, got -1.0"),
        ({"dense_lr": float("nan")}, "--dense-lr must be a finite number > 0, got nan"),
        ({"dense_lr": 0.0}, "--dense-lr must be a finite number > 0, got 0.0"),
        ({"teacher_rows_scale": -5.0}, "--id-space must be a number in (0, 1000] (ids per table row), got -5.0"),
        ({"teacher_rows_scale": float("nan")}, "--id-space must be a number in (0, 1000] (ids per table row), got nan"),
        ({"teacher_rows_scale": 1001}, "--id-space must be a number in (0, 1000]"),
        ({"ps_capacity": "huge"}, "--ps-capacity must be planned or unbounded, got 'huge'"),
        ({"ps_capacity": "unbounded", "data": "criteo:/x"}, "--ps-capacity unbounded needs --data synthetic"),
        ({"data": "criteo:"}, "--data must be 'synthetic', 'criteo:PATH', 'parquet:PATH' or 'csv:PATH', got 'criteo:'"),
        ({"data_workers": -1}, "--data-workers must be in [0, 64], got -1"),
        ({"on_bad_row": "drop", "data": "csv:/x.csv"}, "--on-bad-row must be one of fail, skip, impute, got 'drop'"),
        (
            {"on_bad_row": "skip", "data": "criteo:/x"},
            "--on-bad-row says what to do with bad rows of Parquet or CSV files, not of --data criteo:/x; "
            "fix: drop --on-bad-row or pass --data parquet:PATH or csv:PATH",
        ),
    ],
)
def test_bad_options_are_one_line_errors_naming_the_option(options, message):
    with pytest.raises(PlannerError) as info:
        TrainConfig(**options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_training_applies_the_optimizer_the_model_names():
    assert sparse_optimizer_of(TrainConfig(), SPEC) is Optimizer.ROWWISE_ADAGRAD  # the example names none
    assert sparse_optimizer_of(TrainConfig(), model("adagrad", "adagrad")) is Optimizer.ADAGRAD
    assert sparse_optimizer_of(TrainConfig(sparse_optimizer="sgd"), model("adagrad")) is Optimizer.SGD
    with pytest.raises(PlannerError, match=r"tables name different sparse optimizers \(adagrad, sgd\)"):
        sparse_optimizer_of(TrainConfig(), model("sgd", "adagrad"))


def test_inputs_are_checked_before_any_process_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("PERSIA_RPC_TRANSPORTS", raising=False)
    day = tmp_path / "day_0"
    day.write_text("".join(f"{i % 2}\t{i}" + "\t" * 38 + "\n" for i in range(40)))
    criteo_model = model("sgd", "sgd", names=FEATURE_NAMES[:2])
    well = TrainConfig(data=f"criteo:{day}", batch_size=4, eval_split=0.5)
    assert 10 <= check_before_start(well, criteo_model, with_ps=True).data_rows <= 30  # all well, the rows counted
    day.write_text("")
    with pytest.raises(SpecError, match=r"day_0: 0 rows, 0 of them for training, hold no full batch of 4 samples"):
        check_before_start(TrainConfig(data=f"criteo:{day}", batch_size=4), criteo_model, with_ps=False)
    with pytest.raises(SpecError, match="day_1: file or directory not found"):
        check_before_start(TrainConfig(data=f"criteo:{tmp_path / 'day_1'}"), criteo_model, with_ps=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="the directory holds no files"):
        check_before_start(TrainConfig(data=f"criteo:{tmp_path / 'empty'}"), criteo_model, with_ps=False)
    with pytest.raises(SpecError, match=r"m: tables.t0: is not a Criteo feature \(c1..c26\)"):
        check_before_start(TrainConfig(data=f"criteo:{day}"), model("sgd"), with_ps=False)
    with pytest.raises(PlannerError, match=f"--checkpoint {day}/x: {day} is a file, not a directory"):
        check_before_start(TrainConfig(checkpoint=str(day / "x")), criteo_model, with_ps=False)
    # A checkpoint directory that cannot be written is found now, not at the save after training. (/proc refuses
    # new directories even to root, for whom permission bits would not.)
    with pytest.raises(PlannerError, match=r"^--checkpoint /proc/persia-ckpt/run: cannot write there \("):
        check_before_start(TrainConfig(checkpoint="/proc/persia-ckpt/run"), criteo_model, with_ps=False)
    check_before_start(TrainConfig(checkpoint=str(tmp_path / "new" / "ckpt")), criteo_model, with_ps=False)
    assert (tmp_path / "new" / "ckpt").is_dir() and not any((tmp_path / "new" / "ckpt").iterdir())
    with pytest.raises(PlannerError, match=f"--resume: no checkpoint in {tmp_path}/gone \\(no step-"):
        check_before_start(TrainConfig(checkpoint=str(tmp_path / "gone"), resume=True), criteo_model, with_ps=False)
    assert not (tmp_path / "gone").exists()  # a refused resume creates nothing
    # A run from scratch into a directory that holds something would replace it: refused unless asked for.
    used = tmp_path / "used"
    used.mkdir()
    (used / "trainer.pt").write_bytes(b"a run's state")
    with pytest.raises(PlannerError, match=rf"^--checkpoint {used} is not empty; training from scratch would replace"):
        check_before_start(TrainConfig(checkpoint=str(used)), criteo_model, with_ps=False)
    check_before_start(TrainConfig(checkpoint=str(used), overwrite=True), criteo_model, with_ps=False)
    with pytest.raises(PlannerError, match="--resume continues the checkpoint that --overwrite would replace"):
        TrainConfig(checkpoint=str(used), overwrite=True, resume=True)
    assert (used / "trainer.pt").read_bytes() == b"a run's state"  # checks write nothing into it
    # Another trainer of the same run (torchrun, a shared file system) probing the folder, or writing its marker,
    # at the moment this one looks: the folder still holds nothing.
    busy = tmp_path / "busy"
    busy.mkdir()
    for name in (".persia-run", ".persia-probe-k2x9a1", "..persia-run.persia-tmp-0123456789ab"):
        (busy / name).write_text("")
    check_before_start(TrainConfig(checkpoint=str(busy)), criteo_model, with_ps=False)
    (tmp_path / "step-000000004").mkdir()
    (tmp_path / "step-000000004" / "MANIFEST.json").write_text(
        '{"format": "persia-checkpoint/1", "step": 4, "files": {}}'
    )
    check_before_start(TrainConfig(checkpoint=str(tmp_path), resume=True), criteo_model, with_ps=False)
    with pytest.raises(PlannerError, match="tables name different sparse optimizers"):
        check_before_start(TrainConfig(), model("sgd", "adam"), with_ps=False)
    tables = [{"name": n, "rows": 10, "dim": d, "optimizer": "sgd"} for n, d in (("t0", 8), ("t1", 7))]
    two_dims = ModelSpec.from_dict({"name": "m", "batch_size": 8, "tables": tables})
    with pytest.raises(PlannerError, match=r"model 'm': a DLRM needs one embedding dim for all tables, got \[7, "):
        check_before_start(TrainConfig(), two_dims, with_ps=False)
    monkeypatch.setenv("PERSIA_RPC_TRANSPORTS", "foo")
    check_before_start(TrainConfig(), criteo_model, with_ps=False)  # no PS tables: the transports do not matter
    with pytest.raises(PlannerError, match=r"unknown TensorPipe transport\(s\) \['foo'\]"):
        check_before_start(TrainConfig(), criteo_model, with_ps=True)


def test_the_log_dir_is_checked_before_any_process_starts(tmp_path, monkeypatch):
    spec = model("sgd")
    (tmp_path / "afile").write_text("")
    with pytest.raises(PlannerError, match=f"^--log-dir {tmp_path}/afile/x: {tmp_path}/afile is a file, not a dir"):
        check_before_start(TrainConfig(log_dir=str(tmp_path / "afile" / "x")), spec, with_ps=False)
    with pytest.raises(PlannerError, match=r"^--log-dir /proc/persia-logs: cannot write there \("):
        check_before_start(TrainConfig(log_dir="/proc/persia-logs"), spec, with_ps=False)
    logs = tmp_path / "logs"
    check_before_start(TrainConfig(log_dir=str(logs)), spec, with_ps=False)
    assert logs.is_dir() and not any(logs.iterdir())
    (logs / "trainer0.log").write_text("a process log alone is no earlier run's metrics\n")
    check_before_start(TrainConfig(log_dir=str(logs)), spec, with_ps=False)
    (logs / "summary.json").write_text("mine")  # a file of the user's that the run would replace
    for overwrite in (False, True):
        with pytest.raises(PlannerError, match=f"^--log-dir {logs} holds summary.json, which persia train did not wr"):
            check_before_start(TrainConfig(log_dir=str(logs), overwrite=overwrite), spec, with_ps=False)
    (logs / "metrics.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(PlannerError, match=f"^--log-dir {logs} holds summary.json, which persia train did not wr"):
        check_before_start(TrainConfig(log_dir=str(logs), overwrite=True), spec, with_ps=False)
    (logs / "summary.json").unlink()
    with pytest.raises(PlannerError, match=f"^--log-dir {logs} holds metrics.jsonl, which persia train did not wr"):
        check_before_start(TrainConfig(log_dir=str(logs), overwrite=True), spec, with_ps=False)
    # A run of an earlier version left no marker: its steps say whose the folder is.
    (logs / "summary.json").write_text("{}")
    (logs / "metrics.jsonl").write_text('{"step": 1, "loss": 0.7}\n')
    with pytest.raises(PlannerError, match=f"^--log-dir {logs} holds the metrics of an earlier run"):
        check_before_start(TrainConfig(log_dir=str(logs)), spec, with_ps=False)
    check_before_start(TrainConfig(log_dir=str(logs), overwrite=True), spec, with_ps=False)
    assert (logs / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.7}\n'  # checks write nothing into it
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(
        PlannerError, match=r"^--log-dir writes TensorBoard event files: the tensorboard package is not"
    ):
        check_before_start(TrainConfig(log_dir=str(tmp_path / "other")), spec, with_ps=False)


@pytest.mark.processes
def test_persia_train_and_ps_refuse_bad_input_without_importing_torch(tmp_path):
    """Each refusal is exit 2 with the one-line error, and none of them imported torch (a mistake costs < 1 s,
    not the ~7 s of importing torch and torchrec)."""
    (tmp_path / "afile").write_text("")
    ps = ["ps", "--rank", "0", "--world-size", "2"]
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    cases = [
        (["train", "--mode", "async"], {}, "--mode must be hybrid or sync"),
        (["train", "--ps-wire", "int8"], {}, "--ps-wire must be one of fp32 (float32), fp16 (float16)"),
        (["train", "--data", f"criteo:{tmp_path / 'none'}"], {}, "none: file or directory not found"),
        (["train", "--checkpoint", str(tmp_path / "afile" / "x")], {}, "afile is a file, not a directory"),
        (["train", "--checkpoint", str(tmp_path), "--resume"], {}, "no checkpoint in"),
        (["train"], {"PERSIA_RPC_TRANSPORTS": "foo"}, "unknown TensorPipe transport(s) ['foo']"),
        (["train"], {"TORCHELASTIC_RUN_ID": "x"}, "TORCHELASTIC_RUN_ID is set but RANK and WORLD_SIZE are not"),
        (ps, {"MASTER_ADDR": "", "MASTER_PORT": ""}, "MASTER_ADDR and MASTER_PORT must be set"),
        (ps, {**rendezvous, "MASTER_PORT": "http"}, "MASTER_PORT must be a port number"),
        (ps, {**rendezvous, "PERSIA_RPC_TRANSPORTS": "uv,tcp"}, "unknown TensorPipe transport(s) ['tcp']"),
    ]
    results, torch_imported = cli_in_fresh_interpreter([(a, e) for a, e, _ in cases])
    for (args, _, needle), (exit_code, output) in zip(cases, results, strict=True):
        assert exit_code == 2 and needle in output and "Traceback" not in output, (args, output)
    assert torch_imported is False


def test_the_synthetic_id_space_is_checked_against_the_generator_before_any_process_starts():
    # dlrm_small's largest table has 200,000 rows: the default 2% and 300x draw from few enough ids.
    assert id_universe(SPEC, TrainConfig())["c1"] == 4_000
    assert id_universe(SPEC, TrainConfig(teacher_rows_scale=300))["c1"] == 60_000_000
    check_id_space(SPEC, TrainConfig(teacher_rows_scale=300))
    with pytest.raises(PlannerError) as info:
        check_before_start(TrainConfig(teacher_rows_scale=400), SPEC, with_ps=False)
    message = str(info.value)
    assert message.startswith(
        "--id-space 400: table 'c1' would draw from 80,000,000 ids, over the 67,108,864 of one synthetic feature"
    )
    assert "fix: --id-space 335.54 or less" in message and "\n" not in message
    check_id_space(SPEC, TrainConfig(teacher_rows_scale=400, data="criteo:/x"))  # real data: its own ids


def test_hyper_parameters_record_what_the_run_trains_with():
    cfg = TrainConfig(dense_optimizer="adam", dense_lr=0.001, sparse_lr=0.2, batch_size=100, eval_every=5, mode="sync")
    hyper = hyper_parameters(cfg, SPEC, trainers=2)
    assert hyper == {
        "dense_optimizer": "adam",
        "dense_lr": 0.001,
        "sparse_optimizer": "rowwise_adagrad",  # the tables' own (model.yaml names none: the default)
        "sparse_lr": 0.2,
        "sparse_weight_decay": 0.0,
        "sparse_eps": 1e-3,  # row-wise Adagrad's default
        "lr_schedule": "constant",
        "batch_size": 200,  # global: 2 trainers x 100
        "eval_every": 5,
        "staleness": 0,  # sync
        "dense_arch": {"arch": "dlrm", "num_dense": 13, "bottom": [64], "over": [64, 32, 1]},
    }
    assert json.loads(json.dumps(hyper)) == hyper
    assert describe_hyper_parameters(hyper) == "dlrm; dense adam (0.001), sparse rowwise_adagrad (0.2)"
    assert describe_hyper_parameters(None) == "-"
    assert hyper_parameters(TrainConfig(sparse_optimizer="sgd"), SPEC, trainers=1)["sparse_eps"] is None  # none
    regularised = hyper_parameters(
        TrainConfig(sparse_weight_decay=1e-3, lr_schedule="warmup=10,cosine", mode="sync"), SPEC, trainers=2
    )
    assert (regularised["sparse_weight_decay"], regularised["lr_schedule"]) == (1e-3, "warmup=10,decay=cosine")
    assert describe_hyper_parameters(regularised).endswith(
        "sparse rowwise_adagrad (0.1), row decay 0.001; rates warmup=10,decay=cosine"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"epochs": 2}, r"^--epochs reads data files; synthetic data is drawn fresh every step"),
        ({"eval_split": 0.1}, r"^--eval-split reads data files"),
        ({"data": "csv:/x.csv", "eval_split": 0.7}, r"^--eval-split must be in \[0, 0.5\]"),
        ({"data": "csv:/x.csv", "epochs": 0}, r"^--epochs must be >= 1, got 0"),
        ({"data": "csv:/x.csv", "eval_split": 0.1, "eval_data": "csv:/y.csv"}, r"^--eval-data and --eval-split both"),
        ({"data": "csv:/x.csv", "eval_data": "parquet:/y"}, r"^--eval-data parquet:/y is parquet but --data is csv"),
        ({"data": "csv:/x.csv", "shuffle_buffer": -1}, r"^--shuffle-buffer must be >= 0 rows"),
    ],
)
def test_epoch_and_validation_options_are_checked(options, message):
    with pytest.raises(PlannerError, match=message):
        TrainConfig(**options)


def test_steps_default_to_400_on_synthetic_data_and_to_the_epochs_on_files():
    assert TrainConfig().steps == 400 and TrainConfig(steps=7).steps == 7
    files = TrainConfig(data="csv:/x.csv")
    assert files.steps is None and files.held_out_share == 0.05
    # Neither epochs nor steps: until an epoch's evaluation is no better, at most 10 epochs; the best kept only with
    # a checkpoint, which the implied stop (unlike --early-stop) does not ask for.
    assert (files.passes, files.early_stop, files.early_stop_implied) == (10, 1, True)
    assert dataclasses.replace(files, seed=3).early_stop_implied  # a copy stays as it was set
    assert (TrainConfig(data="csv:/x.csv", steps=5).passes, TrainConfig(data="csv:/x.csv", steps=5).early_stop) == (
        1,
        0,
    )
    given = TrainConfig(data="csv:/x.csv", epochs=3)
    assert (given.passes, given.early_stop, given.early_stop_implied) == (3, 0, False)
    assert TrainConfig(data="csv:/x.csv", early_stop=2, checkpoint="/c").early_stop_implied is False
    assert TrainConfig(data="csv:/x.csv", eval_data="csv:/y.csv").held_out_share == 0.0


CLICKS = """
name: clicks
batch_size: 8
tables:
  - {name: user_id, rows: 1000, dim: 8}
data:
  label: clicked
  dense: [price]
  sparse: {user_id: user}
"""


def _clicks_csv(path: Path, rows: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("clicked,price,user\n" + "".join(f"{i % 2},{i},u{i}\n" for i in range(rows)))
    return path


EVAL_FIX = (
    "validating on training rows; fix: pass --eval-data files that are not training files or drop --eval-data: "
    "--eval-split holds rows of --data out"
)


def test_eval_data_that_is_also_training_data_is_refused_before_any_process_starts(tmp_path):
    (tmp_path / "model.yaml").write_text(CLICKS)
    spec = load_model(tmp_path / "model.yaml")
    d = _clicks_csv(tmp_path / "data" / "d.csv")
    other = _clicks_csv(tmp_path / "data" / "e.csv")
    (tmp_path / "link.csv").symlink_to(d)
    os.link(d, tmp_path / "hard.csv")
    folder = tmp_path / "data"
    cases = [
        (f"csv:{d}", f"csv:{d}", f"({d})"),  # the same file
        (f"csv:{d}", f"csv:{tmp_path / 'link.csv'}", f"({tmp_path / 'link.csv'} is {d})"),  # a symbolic link to it
        (f"csv:{d}", f"csv:{tmp_path / 'hard.csv'}", f"({tmp_path / 'hard.csv'} is {d})"),  # a hard link
        (f"csv:{d}", f"csv:{folder}", f"({d})"),  # a folder holding it
        (f"csv:{folder}", f"csv:{other}", f"({other})"),  # a file of the training folder
    ]
    for data, eval_data, shown in cases:
        with pytest.raises(PlannerError) as err:
            check_before_start(TrainConfig(data=data, eval_data=eval_data, trainers=1), spec, with_ps=False)
        assert str(err.value) == f"--eval-data {eval_data} is also in --data {data} {shown}: {EVAL_FIX}"
    run = CliRunner().invoke(
        app,
        ["train", "--model", str(tmp_path / "model.yaml"), "--data", f"csv:{d}", "--eval-data", f"csv:{d}"],
        prog_name="persia",
    )
    assert (
        run.exit_code == 2 and run.stderr == f"error: --eval-data csv:{d} is also in --data csv:{d} ({d}): {EVAL_FIX}\n"
    )
    # Apart: accepted.
    cfg = TrainConfig(data=f"csv:{d}", eval_data=f"csv:{other}", trainers=1)
    assert check_before_start(cfg, spec, with_ps=False).data_rows == 64


def test_persia_train_refuses_a_schema_with_a_std_out_of_range_in_one_line(tmp_path):
    (tmp_path / "model.yaml").write_text(CLICKS)
    schema = tmp_path / "s.yaml"
    schema.write_text(
        "label: clicked\ndense: [{column: price, standardize: true, mean: 0, std: 1e-300}]\nsparse: {user_id: user}\n"
    )
    d = _clicks_csv(tmp_path / "d.csv")
    args = ["train", "--model", str(tmp_path / "model.yaml"), "--data", f"csv:{d}", "--schema", str(schema)]
    run = CliRunner().invoke(app, args, prog_name="persia")
    assert run.exit_code == 2 and run.stderr == (
        "error: s.yaml: dense[0].std: must be in [1.2e-38, 3.4e+38] (a positive float32: standardize divides by it), "
        "got '1e-300'; fix: leave mean and std out for a first pass to measure them\n"
    )


def test_criteo_data_for_a_model_of_columns_says_where_its_columns_come_from(tmp_path):
    """No --schema given: the line names the model's data:, and the fix is the data, not --schema nor the tables."""
    (tmp_path / "model.yaml").write_text(CLICKS)
    d = _clicks_csv(tmp_path / "d.csv")
    run = CliRunner().invoke(
        app, ["train", "--model", str(tmp_path / "model.yaml"), "--data", f"criteo:{d}"], prog_name="persia"
    )
    assert run.exit_code == 2 and run.stderr == (
        f"error: --data criteo:{d}: model clicks maps Parquet or CSV columns (data: of model.yaml), not Criteo's "
        "c1..c26 (its table 'user_id' is none of them); fix: pass --data parquet:PATH or csv:PATH, files with those "
        "columns\n"
    )


def test_persia_train_refuses_an_unknown_on_bad_row_in_one_line(tmp_path):
    (tmp_path / "model.yaml").write_text(CLICKS)
    d = _clicks_csv(tmp_path / "d.csv")
    args = ["train", "--model", str(tmp_path / "model.yaml"), "--data", f"csv:{d}", "--on-bad-row", "drop"]
    run = CliRunner().invoke(app, args, prog_name="persia")
    assert run.exit_code == 2 and run.stderr == "error: --on-bad-row must be one of fail, skip, impute, got 'drop'\n"
