"""Hybrid training end to end: the default job learns, resume continues exactly, the CLI reports and refuses."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from persia_planner import Topology, load_model, load_topology, plan
from persia_planner.errors import PlannerError
from persia_planner.modules.train import TrainConfig, train_local
from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY

SPEC = load_model(DEFAULT_MODEL)
TOPOLOGY = load_topology(DEFAULT_TOPOLOGY)
PLAN = plan(SPEC, TOPOLOGY)
PS_TABLES = sorted(n for n, p in PLAN.tables.items() if p.tier.value == "ps")
PERSIA = [sys.executable, "-m", "persia_planner.cli"]


def test_default_plan_sends_the_largest_tables_to_the_servers():
    largest = sorted(SPEC.tables, key=lambda t: t.rows, reverse=True)[:3]
    assert sorted(t.name for t in largest) == PS_TABLES


def run(on_start=None, **options) -> dict:
    cfg = TrainConfig(progress=False, eval_batches=2, **options)
    return train_local(
        cfg, SPEC, dict(PLAN.tables), servers=len(TOPOLOGY.servers), topology=TOPOLOGY, on_start=on_start
    )


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_default_job_learns_with_both_paths():
    started: list[dict[str, int]] = []
    result = run(steps=40, batch_size=512, on_start=started.append)
    # The job's processes, named, once (what benchmarks/soak.py watches); each step's time since the loop began.
    assert len(started) == 1 and sorted(started[0]) == ["ps0", "ps1", "trainer0", "trainer1"], started
    assert len(set(started[0].values())) == 4 and os.getpid() not in started[0].values()
    times = [h["t_s"] for h in result["history"]]
    assert times[0] > 0 and times == sorted(times), times
    assert result["ps_tables"] == PS_TABLES and len(result["local_tables"]) == 23
    assert result["servers"] == 2 and result["trainers"] == 2 and result["batch_size"] == 1024
    assert result["steps"] == 40 and len(result["history"]) == 40
    assert 0 <= result["staleness_max_seen"] <= 4
    assert all(h["staleness"] <= 4 for h in result["history"])
    assert 0.6 < result["auc"] <= 1.0 and result["teacher_auc"] > result["auc"] - 0.02
    first = sum(h["loss"] for h in result["history"][:8]) / 8
    assert result["loss"] < first - 0.02, (first, result["loss"])
    assert result["samples_per_s"] > 0 and result["step_ms"] > 0
    # PS tables: no profiled window (decision 0014); the PS wait and push are timed directly, the rest is "other".
    parts = result["step_breakdown_ms"]
    assert set(parts) == {"data", "ps_wait", "push", "other"} and parts["data"] > 0, parts
    assert parts["ps_wait"] > 0 and parts["push"] > 0 and parts["other"] > 0, parts
    assert parts["ps_wait"] + parts["push"] <= result["step_ms"] * 1.5, parts  # medians of parts, not of the sum


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_an_all_local_run_measures_its_step_breakdown():
    data = yaml.safe_load(DEFAULT_TOPOLOGY.read_text())
    data["hosts"] = [h for h in data["hosts"] if h.get("role") != "parameter_server"]
    for host in data["hosts"]:
        host["cpus"]["memory"] = "256MiB"
    topology = Topology.from_dict(data, base_dir=DEFAULT_TOPOLOGY.parent)
    the_plan = plan(SPEC, topology)
    assert not the_plan.remote_tables()
    cfg = TrainConfig(progress=False, eval_batches=1, steps=24, batch_size=256, mode="sync")
    result = train_local(cfg, SPEC, dict(the_plan.tables), servers=0, topology=topology)
    parts = result["step_breakdown_ms"]
    assert set(parts) == {"data", "embedding", "all_to_all", "dense", "all_reduce", "ps_wait", "push"}
    assert parts["embedding"] > 0 and parts["all_to_all"] > 0 and parts["dense"] > 0, parts
    assert parts["ps_wait"] == 0 and parts["push"] == 0, parts
    assert sum(v for k, v in parts.items() if k != "data") == pytest.approx(result["step_ms"], rel=1e-6)


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_resume_continues_exactly_where_the_checkpoint_left(tmp_path, monkeypatch):
    # Two trainers in sync mode (K = 0): one gathered row-wise Adagrad update per id and step, so the run is
    # reproducible and "exactly" is a fair demand. (With K > 0 the servers apply pushes in arrival order.)
    import shutil

    common = {"batch_size": 256, "mode": "sync", "trainers": 2}
    whole = run(steps=6, checkpoint=str(tmp_path / "whole"), checkpoint_every=3, keep=3, **common)
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == [".persia-run", "step-000000003", "step-000000006"]
    assert whole["checkpoint"] == str((tmp_path / "whole" / "step-000000006").resolve())
    # The job killed after step 4: its directory holds the checkpoint of step 3 (and nothing else of step 6).
    shutil.copytree(tmp_path / "whole" / "step-000000003", tmp_path / "step-000000003")
    rest = run(steps=6, checkpoint=str(tmp_path), resume=True, **common)  # --steps: the job's total
    assert rest["first_step"] == 3 and rest["resumed_from_step"] == 3 and rest["last_step"] == 6
    assert [h["loss"] for h in rest["history"]] == [h["loss"] for h in whole["history"][3:]]  # bit-exact
    assert rest["auc"] == whole["auc"]
    # The same command once more: the job's 6 steps are done, which it says rather than training 6 more.
    with pytest.raises(PlannerError, match=r"newest checkpoint is at step 6, which the job's --steps 6 already reac"):
        run(steps=6, checkpoint=str(tmp_path), resume=True, **common)
    tmp_path = tmp_path / "step-000000006"  # the resumed run's checkpoint, newest: the checks below damage it
    # A trainer state saved with another model (here: one dense weight of another shape) is refused in one line.
    import torch

    from persia_planner.modules.train.job_checkpoints import MANIFEST, publish

    state = torch.load(tmp_path / "trainer.pt", weights_only=True)
    key = next(k for k, v in state["dense"].items() if v.dim() == 2)
    state["dense"][key] = torch.zeros(state["dense"][key].shape[0] + 1, state["dense"][key].shape[1])
    torch.save(state, tmp_path / "trainer.pt")
    lineage = json.loads((tmp_path / MANIFEST).read_text())["lineage"]
    staged = tmp_path.parent / ".step-000000006.tmp-0"
    tmp_path.rename(staged)
    publish(staged, step=6, lineage=lineage, world={"trainers": 2, "servers": 2})  # a consistent, other model
    tmp_path = tmp_path.parent
    with pytest.raises(PlannerError, match=rf"holds {key} of shape .*saved with another model.yaml"):
        run(steps=1, checkpoint=str(tmp_path), resume=True, **common)
    # So is a resume with another data layout (step 3 would point at other samples of the stream), and before any
    # process starts.
    from persia_planner.modules.launcher import launch

    def no_cluster(*args, **kwargs):
        raise AssertionError("local_cluster started for a resume that must be refused")

    monkeypatch.setattr(launch, "local_cluster", no_cluster)
    with pytest.raises(PlannerError, match=r"--trainers is 1 but topology 'local-2trainers-2ps' has 2 trainer dev"):
        run(steps=1, checkpoint=str(tmp_path), resume=True, **(common | {"trainers": 1, "batch_size": 128}))
    with pytest.raises(PlannerError, match=r"trained with batch_size 256 \(now 64\); resum"):
        run(steps=1, checkpoint=str(tmp_path), resume=True, **(common | {"batch_size": 64}))
    # Another seed is another teacher labelling the synthetic samples: another task, refused as well.
    with pytest.raises(PlannerError, match=r"trained with seed 0 \(now 5\); resum"):
        run(steps=1, checkpoint=str(tmp_path), resume=True, seed=5, **common)


@pytest.mark.processes
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--mode", "async"], "--mode must be hybrid or sync"),
        (["--resume"], "--resume needs --checkpoint DIR"),
        (["--data", "criteo:/nonexistent/day_0"], "/nonexistent/day_0: file or directory not found"),
        (["--data", "hdfs:/x"], "--data must be 'synthetic', 'criteo:PATH', 'parquet:PATH' or 'csv:PATH'"),
        (["--model", "/nonexistent.yaml"], "nonexistent.yaml"),
        (["--steps", "0"], "--steps"),
        (["--ps-wire", "int8"], "--ps-wire must be one of fp32 (float32), fp16 (float16), bf16 (bfloat16), got 'int8'"),
        (["--id-space", "0"], "--id-space must be a number in (0, 1000] (ids per table row), got 0.0"),
        (["--id-space", "500"], "--id-space 500: table 'c1' would draw from 100,000,000 ids"),
        (["--ps-capacity", "infinite"], "--ps-capacity must be planned or unbounded, got 'infinite'"),
        (["--ps-capacity", "unbounded", "--data", "criteo:/x"], "--ps-capacity unbounded needs --data synthetic"),
        (["--checkpoint", "/nonexistent-ckpt", "--resume"], "no checkpoint in /nonexistent-ckpt (no step-* directory)"),
        (["--checkpoint", "/nonexistent-ckpt", "--resume", "--overwrite"], "--resume continues the checkpoint that"),
        (["--dense-lr", "0"], "--dense-lr must be a finite number > 0, got 0.0"),
        (["--sparse-lr", "nan"], "--sparse-lr must be a finite number > 0, got nan"),
        (["--sparse-weight-decay", "20"], "--sparse-weight-decay must be in [0, 1 / --sparse-lr) = [0, 10), got 20"),
        (["--sparse-eps", "nan"], "Invalid value for '--sparse-eps': Input should be less than or equal to 1"),
        (["--lr-schedule", "exponential"], "--lr-schedule 'exponential': 'exponential' is not warmup=STEPS"),
        (["--dense-optimizer", "lamb"], "--dense-optimizer must be one of adagrad, sgd, adam, got 'lamb'"),
        (["--sparse-optimizer", "lamb"], "--sparse-optimizer must be one of sgd, rowwise_adagrad, adagrad, adam"),
        (["--eval-every", "-1"], "--eval-every"),
        (["--log-dir", "/dev/null/logs"], "--log-dir /dev/null/logs: /dev/null is a file, not a directory"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args, needle):
    done = subprocess.run([*PERSIA, "train", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.processes
def test_cli_model_tables_must_match_criteo_features(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("name: m\nbatch_size: 64\ntables:\n  - {name: user, rows: 100, dim: 8}\n")
    data = tmp_path / "day_0"
    data.write_text("0" + "\t" * 39 + "\n")
    done = subprocess.run(
        [*PERSIA, "train", "--model", str(model), "--data", f"criteo:{data}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "tables.user" in done.stderr and "c1..c26" in done.stderr, done.stderr


def one_line_error(args: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run([*PERSIA, "train", *args], capture_output=True, text=True, timeout=300, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith("error: "), done.stderr[-3000:]
    # only the progress bar may come before it
    assert all(not line.strip() or line.lstrip().startswith("train") for line in lines[:-1]), done.stderr[-3000:]
    return lines[-1]


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_cli_refuses_before_training_and_reports_trainer_errors_in_one_line(tmp_path):
    quick = ["--steps", "2", "--eval-batches", "1", "--batch-size", "64"]
    (tmp_path / "afile").write_text("")
    assert "afile is a file, not a directory" in one_line_error([*quick, "--checkpoint", str(tmp_path / "afile/x")])
    (tmp_path / "empty").mkdir()
    assert "empty: the directory holds no files" in one_line_error([*quick, "--data", f"criteo:{tmp_path / 'empty'}"])
    env = {**os.environ, "PERSIA_RPC_TRANSPORTS": "foo"}
    assert "unknown TensorPipe transport(s) ['foo']" in one_line_error(quick, env)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {"TORCHELASTIC_RUN_ID": "x"}
    assert "TORCHELASTIC_RUN_ID is set but RANK and WORLD_SIZE are not" in one_line_error(quick, env)
    # An error inside a trainer process (a malformed Criteo line): the parent's line, no child traceback before it.
    model = tmp_path / "m.yaml"
    model.write_text("name: m\nbatch_size: 64\ntables:\n  - {name: c1, rows: 100, dim: 8}\n")
    (tmp_path / "day_0").write_text("not a criteo line\n" * 800)
    logs = tmp_path / "logs"
    bad_data = ["--model", str(model), "--data", f"criteo:{tmp_path / 'day_0'}", "--log-dir", str(logs)]
    bad_data += ["--eval-split", "0.2"]
    line = one_line_error([*quick, *bad_data])
    # Both trainers read bad lines: the launcher names the first to report (the cause, whichever rank it is).
    found = re.search(r"(trainer[01]) failed: SpecError: .*day_0:\d+: expected 40 tab-separated columns", line)
    assert found, line
    # With --log-dir the terminal shows the same; the traceback is in the trainer's log, the line in the launcher's.
    assert "Traceback (most recent call last)" in (logs / f"{found.group(1)}.log").read_text()
    assert line.removeprefix("error: ").split(";")[0] in (logs / "launcher.log").read_text()


OPTS = ["--eval-batches", "2", "--json", "--staleness", "2", "--batch-size", "256"]
FP16 = ["--ps-wire", "float16"]  # the half-size wire of a multi-machine run, exercised end to end


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_cli_trains_on_criteo_files_and_prints_json(tmp_path):
    from persia_planner.modules.data import SyntheticClicks, Teacher, to_criteo

    teacher = Teacher(rows={t.name: max(1, t.rows // 50) for t in SPEC.tables}, seed=3)
    to_criteo(SyntheticClicks(teacher, batch_size=256, num_batches=24, seed=3), tmp_path / "day_0")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [
            *PERSIA,
            "train",
            "--data",
            f"criteo:{tmp_path / 'day_0'}",
            "--eval-split",
            "0.2",
            "--steps",
            "8",
            *FP16,
            *OPTS,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    for key in ("auc", "teacher_auc", "loss", "samples_per_s", "step_ms", "batch_size", "steps", "staleness"):
        assert key in result, key
    assert result["steps"] == 8 and result["batch_size"] == 512 and result["staleness"] == 2
    assert result["teacher_auc"] is None  # real-format data carries no teacher
    assert result["eval_samples"] == 2 * 2 * 256 and 0.0 <= result["auc"] <= 1.0
    assert result["ps_tables"] == PS_TABLES and result["ps_wire"] == "float16"
    servers = result["ps_servers"]  # per-server usage: the default 2% of the rows never fills a store
    assert [s["name"] for s in servers] == ["ps0", "ps1"] and all(s["evictions"] == 0 for s in servers), servers
    assert all(s["admissions"] == s["rows"] > 0 and s["planned_bytes"] > 0 for s in servers), servers
    assert math.isfinite(result["loss"]) and math.isfinite(result["eval_loss"])
    assert Path(tmp_path / "day_0").is_file()


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_same_entry_point_runs_under_torchrun(tmp_path):
    from persia_planner.modules.launcher.launch import reserved_port

    with reserved_port() as port:  # ours until the run ends: torchrun may bind it (SO_REUSEADDR), nobody else
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "4", "--master-port", str(port)]
        done = _run_torchrun(torchrun, ["--log-dir", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]  # only the first trainer prints
    result = json.loads(line)
    assert result["trainers"] == 2 and result["servers"] == 2 and result["steps"] == 4
    assert result["ps_tables"] == PS_TABLES and result["batch_size"] == 256
    assert result["ps_wire"] == "bfloat16"
    # one node: its servers first, then its trainers
    assert [(p["rank"], p["role"]) for p in result["processes"]] == [
        (0, "ps0"),
        (1, "ps1"),
        (2, "trainer0"),
        (3, "trainer1"),
    ]
    # Each process logs into its own file for the job only: the result above still reached the terminal.
    for name in ("ps0", "ps1", "trainer0", "trainer1"):
        assert (tmp_path / f"{name}.log").read_text().startswith(f"==== {name} (pid "), name
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and json.loads((tmp_path / "summary.json").read_text())["auc"] == result["auc"]


def _run_torchrun(torchrun: list[str], extra: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *torchrun,
            "-m",
            "persia_planner.cli",
            "train",
            "--steps",
            "4",
            "--batch-size",
            "128",
            "--eval-batches",
            "1",
            "--ps-wire",
            "bfloat16",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_the_checkpoint_is_saved_before_the_final_evaluation(tmp_path):
    """Data whose held-out rows turn out fewer than counted (one row copied over and over, which the split keeps on
    the training side in every copy): the final evaluation finds no batch, and the training done is saved all the
    same."""
    import torch

    from persia_planner.modules.data import SyntheticClicks, Teacher, to_criteo
    from persia_planner.modules.data.criteo_format import parse_chunk
    from persia_planner.modules.data.split import RowSplit

    teacher = Teacher(rows={t.name: max(1, t.rows // 50) for t in SPEC.tables}, seed=3)
    to_criteo(SyntheticClicks(teacher, batch_size=64, num_batches=1, seed=3), tmp_path / "sample")
    lines = (tmp_path / "sample").read_bytes().splitlines(keepends=True)
    trained = RowSplit(0.01, held_out=False)
    line = next(x for x in lines if trained.mask(parse_chunk(x).row_keys())[0])
    (tmp_path / "day_0").write_bytes(line * 12_800)  # 128 held out by the count
    with pytest.raises(PlannerError, match="no evaluation samples: no trainer read a held-out row"):
        run(
            steps=3,
            batch_size=64,
            eval_split=0.01,
            data=f"criteo:{tmp_path / 'day_0'}",
            checkpoint=str(tmp_path / "ckpt"),
        )
    (saved,) = (tmp_path / "ckpt").glob("step-*")
    state = torch.load(saved / "trainer.pt", weights_only=True)
    assert state["step"] == int(saved.name.removeprefix("step-")) == 3 and state["seed"] == 0
    assert state["data"] == f"criteo:{(tmp_path / 'day_0').resolve()}" and state["epoch_lengths"] == []


def _edited_plan(tmp_path: Path, edit: dict[str, dict], topology: Path = DEFAULT_TOPOLOGY) -> Path:
    """plan.json of the default job with some tables' placements rewritten by hand, as a user would."""
    out = tmp_path / "plan.json"
    done = subprocess.run([*PERSIA, "plan", str(DEFAULT_MODEL), str(topology), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    data["tables"].update(edit)
    out.write_text(json.dumps(data))
    return out


def _shard(device: str, rows: tuple[int, int], cols: tuple[int, int], tier: str = "hbm", **extra) -> dict:
    # what `persia validate` checks: rows x (cols x fp32 + row-wise Adagrad's one float per row)
    held = (rows[1] - rows[0]) * ((cols[1] - cols[0]) * 4 + 4)
    return {"rows": list(rows), "cols": list(cols), "tier": tier, "device": device, "bytes": held, **extra}


CPU0, CPU1 = "trainer0/cpu0", "trainer0/cpu1"
HAND_EDITED = {
    "c3": {"sharding": "column_wise", "mode": "sync",
           "shards": [_shard(CPU1, (0, 5000), (0, 8)), _shard(CPU0, (0, 5000), (8, 16))]},
    "c12": {"sharding": "row_wise", "mode": "sync",
            "shards": [_shard(CPU0, (0, 4000), (0, 16)), _shard(CPU1, (4000, 8000), (0, 16))]},
    "c2": {"sharding": "table_wise", "mode": "sync", "shards": [_shard(CPU1, (0, 2000), (0, 16))]},
    "c21": {"sharding": "data_parallel", "mode": "sync",
            "shards": [_shard(g, (0, 9000), (0, 16), replica=True) for g in (CPU0, CPU1)]},
}  # fmt: skip


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_hand_edited_plan_is_run_exactly_as_written(tmp_path):
    path = _edited_plan(tmp_path, HAND_EDITED)
    done = subprocess.run([*PERSIA, "validate", str(DEFAULT_MODEL), str(DEFAULT_TOPOLOGY), str(path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    quick = ["--steps", "3", "--eval-batches", "1", "--batch-size", "64", "--json"]
    done = subprocess.run([*PERSIA, "train", "--plan", str(path), *quick], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    executed = result["executed_plan"]
    fp32 = {"dtype": "float32", "comms": {"forward": "float32", "backward": "float32"}}  # a plan without qcomms
    assert executed["c3"] == {"sharding": "column_wise", "kernel": "fused", "ranks": [1, 0], **fp32}
    assert executed["c12"] == {"sharding": "row_wise", "kernel": "fused", "ranks": [0, 1], **fp32}
    assert executed["c2"] == {"sharding": "table_wise", "kernel": "fused", "ranks": [1], **fp32}
    assert executed["c21"] == {"sharding": "data_parallel", "kernel": "dense", "ranks": [0, 1], "dtype": "float32"}
    assert executed["c1"] == {"servers": ["ps0", "ps1"]}
    assert result["executed_matches_plan"] is True


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_plan_torchrec_would_change_or_the_wrong_trainer_count_is_refused_before_training(tmp_path):
    # The same machine described with GPU-like trainers (the default describes CPU trainers, which have no DDR tier)
    gpus = {"count": 2, "hbm": "4MiB", "hbm_bandwidth": "20GB/s", "tflops": 0.5, "pcie_bandwidth": "10GB/s"}
    trainer = {"name": "trainer", "ddr": "64MiB", "ddr_bandwidth": "10GB/s", "nic_bandwidth": "10GB/s", "gpus": gpus}
    server = {"name": "ps", "count": 2, "role": "parameter_server", "ddr": "2GiB", "ddr_bandwidth": "10GB/s"}
    server["nic_bandwidth"] = "1GB/s"
    topology = tmp_path / "gpus.yaml"
    topology.write_text(yaml.safe_dump({"name": "local-gpus", "hosts": [trainer, server]}))
    shard = _shard("trainer0/gpu1", (0, 2000), (0, 16), "ddr")
    uvm = {"c2": {"sharding": "table_wise", "mode": "sync", "shards": [shard]}}
    args = ["--plan", str(_edited_plan(tmp_path, uvm, topology)), "--topology", str(topology), "--steps", "2"]
    line = one_line_error(args)
    # c2 edited onto ddr, or a table the planner itself put in host memory for these GPU-like trainers
    assert re.search(r"table 'c\d+' is planned on tier (ddr|hbm_cache) \(TorchRec kernel fused_uvm(_caching)?\), "
                     r"which needs CUDA", line), line  # fmt: skip
    line = one_line_error(["--trainers", "3", "--steps", "2"])
    assert "--trainers is 3 but topology 'local-2trainers-2ps' has 2 trainer devices" in line, line
    assert "use --trainers 2" in line


def _torchrun_node(port: int, extra: list[str]) -> subprocess.Popen:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    rdzv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-id", "two-nodes"]
    rdzv += ["--rdzv-endpoint", f"localhost:{port}"]  # the first agent to come hosts the store
    return subprocess.Popen(
        [torchrun, *rdzv, "-m", "persia_planner.cli", "train", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_two_torchrun_nodes_train_and_give_the_single_launcher_result():
    """Two torchrun node groups on this machine run the same K = 0 job as the single launcher, step for step; with
    no host named, the node of ranks 0-1 is the trainer host (first in local_2x1.yaml), the other both servers'."""
    from persia_planner.modules.launcher.launch import reserved_port

    job = ["--mode", "sync", "--steps", "4", "--batch-size", "128", "--eval-batches", "1", "--json"]
    with reserved_port() as port:  # the first agent binds it (SO_REUSEADDR, as the reservation); nobody else may
        nodes = [_torchrun_node(port, job) for _ in range(2)]
        outs = [p.communicate(timeout=540) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    lines = [x for out, _ in outs for x in out.splitlines() if x.startswith("{")]
    assert len(lines) == 1, lines  # only the first trainer prints
    multi = json.loads(lines[0])
    assert multi["trainers"] == 2 and multi["servers"] == 2 and multi["executed_matches_plan"] is True
    placed = [(p["rank"], p["node"], p["host"], p["role"]) for p in multi["processes"]]
    assert placed == [
        (0, 0, "trainer0", "trainer0"),
        (1, 0, "trainer0", "trainer1"),
        (2, 1, "ps0", "ps0"),
        (3, 1, "ps1", "ps1"),
    ]
    done = subprocess.run([*PERSIA, "train", *job], capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    single = json.loads(done.stdout)
    for key in ("loss", "auc", "eval_loss"):
        assert multi[key] == pytest.approx(single[key], abs=1e-6), key


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_cli_logs_every_step_and_a_resume_appends(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs, quick = tmp_path / "logs", ["--mode", "sync", "--batch-size", "64", "--eval-batches", "1", "--json"]
    common = [*quick, "--checkpoint", str(tmp_path / "ckpt"), "--log-dir", str(logs)]
    done = subprocess.run([*PERSIA, "train", "--steps", "3", *common], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    lines = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    keys = {"loss", "samples_per_s", "staleness", "ps_wait_ms", "push_ms", "data_ms", "step_ms", "t_s"}
    assert all(keys <= line.keys() for line in lines) and lines[-1]["auc"] == result["auc"]
    assert json.loads((logs / "summary.json").read_text()) == result
    for name in ("launcher", "ps0", "ps1", "trainer0", "trainer1"):
        assert (logs / f"{name}.log").stat().st_size > 0, name
    # The same directory again: refused from scratch, appended to by a resume (steps go on from the checkpoint, up
    # to --steps, the job's total).
    again = [*PERSIA, "train", "--steps", "2", *quick, "--log-dir", str(logs)]
    refused = subprocess.run(again, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "holds the metrics of an earlier run" in refused.stderr, refused.stderr
    resumed = [*PERSIA, "train", "--steps", "5", "--resume", *common]
    done = subprocess.run(resumed, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    events = EventAccumulator(str(logs / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([line["loss"] for line in lines])
    assert (logs / "trainer0.log").read_text().count("==== trainer0 (pid ") == 2


MIXED_DTYPES = """name: mixed
batch_size: 128
staleness: 4
tables:
  - {name: h16, rows: 5000, dim: 16, embedding_dtype: fp16}
  - {name: f32, rows: 5000, dim: 16}
  - {name: wide, rows: 200000, dim: 16, embedding_dtype: fp16}
"""


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_plan_runs_with_the_staleness_wire_and_dtypes_it_was_priced_for(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text(MIXED_DTYPES)
    path = tmp_path / "plan.json"
    done = subprocess.run([*PERSIA, "plan", str(model), str(DEFAULT_TOPOLOGY), "--staleness", "0", "--ps-wire",
                           "fp16", "--out", str(path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = json.loads(path.read_text())
    assert (written["staleness"], written["ps_wire_dtype"]) == (0, "fp16")
    assert written["tables"]["wide"]["sharding"] == "ps_hash"  # 7 MB: over a trainer's 4 MiB
    # Another K or wire than the plan's is refused before anything starts.
    base = ["--model", str(model), "--plan", str(path)]
    assert "priced for staleness K = 0, but this run trains" in one_line_error([*base, "--staleness", "2"])
    assert "priced for parameter-server traffic in float16" in one_line_error([*base, "--ps-wire", "float32"])
    quick = ["--steps", "3", "--eval-batches", "1", "--json"]
    done = subprocess.run([*PERSIA, "train", *base, "--mode", "sync", *quick], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert (result["plan_staleness"], result["staleness"], result["ps_wire"]) == (0, 0, "float16")
    executed = result["executed_plan"]
    assert (executed["h16"]["dtype"], executed["f32"]["dtype"]) == ("float16", "float32")
    assert executed["wide"] == {"servers": ["ps0", "ps1"]} and result["executed_matches_plan"] is True
