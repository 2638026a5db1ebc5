"""A checkpoint resumed under another plan, and a job migrating to another plan while it trains (``persia train
--adapt``): at K = 0 a job that migrates at step N trains on bit for bit as a job of the new plan resumed from the
same step-N checkpoint; a job killed during its migration resumes from its last complete checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from adapt_forcing import DECIDER, PLAN_ENV, QCOMMS_ENV
from plans import forced_plan

from persia_planner.errors import PlannerError
from persia_planner.kinds import Sharding
from persia_planner.model.qcomms import QComms
from persia_planner.model.specs import DType, ModelSpec, TableSpec
from persia_planner.modules.launcher.local_job import TrainerError
from persia_planner.modules.train import TrainConfig, train_local
from persia_planner.modules.train.adapt import DECIDER_ENV, plan_file
from persia_planner.modules.train.job_checkpoints import complete_checkpoints
from persia_planner.modules.train.metrics_log import logged_steps
from persia_planner.modules.train.migration import (
    dense_optimizer_for,
    fold_rows,
    saved_plan,
    table_moves,
    whole_optimizer_states,
)
from persia_planner.paths import DEFAULT_TOPOLOGY
from persia_planner.plan.plan import placement_to_dict
from persia_planner.tiers import Tier
from persia_planner.topology.graph import Topology

DIM = 32  # column-wise shards of 16 columns on two trainers


def _topology() -> Topology:
    """This machine's two CPU trainers and one parameter server."""
    data = yaml.safe_load(DEFAULT_TOPOLOGY.read_text())
    for host in data["hosts"]:
        if host.get("role") == "parameter_server":
            host["count"] = 1
        else:
            host["cpus"]["memory"] = "64MiB"
    return Topology.from_dict(data, base_dir=DEFAULT_TOPOLOGY.parent)


TOPOLOGY = _topology()
SPEC = ModelSpec(
    "migrate",
    64,
    (TableSpec("a", 101, DIM), TableSpec("b", 131, DIM), TableSpec("c", 61, DIM), TableSpec("d", 47, DIM)),
)
CPU = Tier.HBM  # a CPU trainer's memory is its device tier


def _plans() -> tuple[dict, dict]:
    """Two plans that move every kind of table: a table-wise -> column-wise, b row-wise -> servers, c servers ->
    table-wise, d data-parallel -> row-wise."""
    ps = (Sharding.PS_HASH, Tier.PS)
    first = {
        "a": (Sharding.TABLE_WISE, CPU),
        "b": (Sharding.ROW_WISE, CPU),
        "c": ps,
        "d": (Sharding.DATA_PARALLEL, CPU),
    }
    second = {"a": (Sharding.COLUMN_WISE, CPU), "b": ps, "c": (Sharding.TABLE_WISE, CPU), "d": (Sharding.ROW_WISE, CPU)}
    return dict(forced_plan(SPEC, TOPOLOGY, first).tables), dict(forced_plan(SPEC, TOPOLOGY, second).tables)


OLD, NEW = _plans()
STEPS, MIGRATE_AT = 7, 4  # a warm-up window and a measured one of 2 steps: trainer 0 decides after step 4


def _run(tables: dict, root: Path, *, on_start=None, steps: int = STEPS, spec: ModelSpec = SPEC, **options) -> dict:
    cfg = TrainConfig(
        progress=False, eval_batches=2, batch_size=32, mode="sync", trainers=2, steps=steps, teacher_rows_scale=3.0,
        checkpoint=str(root), **options,
    )  # fmt: skip
    return train_local(cfg, spec, dict(tables), servers=1, topology=TOPOLOGY, on_start=on_start, run_timeout_s=300)


@pytest.fixture
def forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """--adapt decides to move to NEW at its first window."""
    target = tmp_path / "target.json"
    target.write_text(json.dumps({name: placement_to_dict(p) for name, p in NEW.items()}))
    monkeypatch.setenv(DECIDER_ENV, DECIDER)
    monkeypatch.setenv(PLAN_ENV, str(target))
    return target


def _losses(result: dict) -> list[float]:
    return [h["loss"] for h in result["history"]]


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_job_migrating_at_step_n_trains_on_bit_for_bit_as_the_new_plan_resumed_from_its_checkpoint(tmp_path, forced):
    logs = tmp_path / "logs"
    moved = _run(OLD, tmp_path / "moved", adapt=True, adapt_window=2, log_dir=str(logs), checkpoint_every=3, keep=5)
    assert moved["steps"] == STEPS and moved["first_step"] == 0 and moved["last_step"] == STEPS
    assert [(p["index"], p["from_step"], p["to_step"], p["reason"]) for p in moved["plans"]] == [
        (0, 0, MIGRATE_AT, "initial"),
        (1, MIGRATE_AT, None, "faster plan"),
    ]
    assert moved["plans"][1]["tables_moved"] == ["a", "b", "c", "d"] and moved["plans"][0]["measured_ms"] > 0
    assert moved["ps_tables"] == ["b"] and moved["executed_matches_plan"]  # the summary is the new plan's
    assert moved["executed_plan"]["a"]["sharding"] == "column_wise"
    # The new plan's run, resumed from a copy of the step-4 checkpoint the migration went through.
    migration = tmp_path / "moved" / f"step-{MIGRATE_AT:09d}"
    assert json.loads((migration / "plan.json").read_text())["b"]["mode"] == "sync"  # saved under the old plan
    shutil.copytree(migration, tmp_path / "resumed" / migration.name)
    resumed = _run(NEW, tmp_path / "resumed", resume=True)
    assert resumed["resumed_from_step"] == MIGRATE_AT and resumed["ps_tables"] == ["b"]
    assert _losses(resumed) == _losses(moved)[MIGRATE_AT:]  # bit for bit
    assert resumed["auc"] == moved["auc"] and resumed["eval_loss"] == moved["eval_loss"]
    # The plans in the logs: the JSON lines' events, each plan's file, the checkpoints' plan.json.
    events = [line for line in logged_steps(logs / "metrics.jsonl") if "event" in line]
    starts = [(e["step"], e["index"]) for e in events if e["event"] == "plan" and "reason" in e]
    assert starts == [(0, 0), (MIGRATE_AT, 1)], events
    assert [e["reason"] for e in events if e["event"] == "adapt"] == ["faster plan"]
    written = json.loads(plan_file(logs, 1).read_text())
    assert {n: t["sharding"] for n, t in written["tables"].items()} == {n: p.sharding.value for n, p in NEW.items()}
    assert (logs / "profile.fitted.yaml").is_file()  # the model refitted at the checkpoints
    last = tmp_path / "moved" / f"step-{STEPS:09d}"
    assert json.loads((last / "plan.json").read_text()) == {n: placement_to_dict(p) for n, p in NEW.items()}


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_migration_that_narrows_the_collectives_alone_trains_on_as_the_narrowed_plan_resumed(tmp_path, monkeypatch):
    """A re-plan may change only the collectives' precisions (the plan chose them): no table moves, the model is
    rebuilt with fp16 collectives, and it trains on bit for bit as the same tables in fp16 resumed from the
    migration's checkpoint."""
    target = tmp_path / "target.json"
    target.write_text(json.dumps({name: placement_to_dict(p) for name, p in OLD.items()}))
    monkeypatch.setenv(DECIDER_ENV, DECIDER)
    monkeypatch.setenv(PLAN_ENV, str(target))
    monkeypatch.setenv(QCOMMS_ENV, "fp16")
    # At fbgemm's epsilon a row's step does not scale with its gradient, so the fp16 collectives' rounding shows in
    # the losses of the few steps after the migration (at the default 1e-3 the steps are too small to move them).
    eps = 1e-8
    moved = _run(OLD, tmp_path / "moved", adapt=True, adapt_window=2, adapt_qcomms=True, sparse_eps=eps)
    assert [(p["reason"], p["tables_moved"], p["qcomms"]) for p in moved["plans"]] == [
        ("initial", [], None),
        ("faster plan", [], {"forward": "fp16", "backward": "fp16"}),
    ]
    migration = tmp_path / "moved" / f"step-{MIGRATE_AT:09d}"
    shutil.copytree(migration, tmp_path / "resumed" / migration.name)
    narrow = dataclasses.replace(SPEC, qcomms=QComms(DType.FP16, DType.FP16))
    resumed = _run(OLD, tmp_path / "resumed", resume=True, spec=narrow, sparse_eps=eps)
    assert resumed["resumed_from_step"] == MIGRATE_AT
    assert _losses(resumed) == _losses(moved)[MIGRATE_AT:]  # bit for bit
    unchanged = _run(OLD, tmp_path / "wide", resume=False, sparse_eps=eps)
    assert _losses(unchanged)[MIGRATE_AT:] != _losses(moved)[MIGRATE_AT:]  # fp16 collectives are not float32's


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_table_moved_to_the_servers_answers_as_the_local_table_did(tmp_path):
    """local -> ps and local -> local keep the function: the first step after a resume under a plan that puts b on
    the servers and splits a by columns has the loss the old plan's run has at that step (to the summation order of
    other kernels)."""
    old = dict(OLD) | {"c": NEW["c"]}
    new = {n: NEW[n] for n in "ab"} | {n: old[n] for n in "cd"}  # a table-wise -> column-wise, b local -> ps
    whole = _run(old, tmp_path / "whole", checkpoint_every=3, keep=3)
    shutil.copytree(tmp_path / "whole" / "step-000000003", tmp_path / "moved" / "step-000000003")
    moved = _run(new, tmp_path / "moved", resume=True)
    assert moved["ps_tables"] == ["b"] and moved["resumed_from_step"] == 3
    assert _losses(moved)[0] == pytest.approx(_losses(whole)[3], rel=1e-6, abs=1e-7)


@pytest.mark.processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize("when", ["writing", "written"])
def test_a_job_killed_during_its_migration_resumes_from_its_last_complete_checkpoint(tmp_path, forced, when):
    """SIGKILL to the trainers while the migration's checkpoint (step 4) is being written (its staging folder
    exists: the servers' save is delayed by --ps-delay-ms), or right after it was published (the next plan being
    built): a resume starts from the newest complete checkpoint, step 3 or 4, and trains on exactly as the job
    that was never interrupted."""
    reference = _run(OLD, tmp_path / "reference", steps=6)
    root = tmp_path / "job"
    marker = f".step-{MIGRATE_AT:09d}.tmp-*" if when == "writing" else f"step-{MIGRATE_AT:09d}"
    pids: dict[str, int] = {}
    done = threading.Event()
    killed: list[str] = []

    def kill_at_marker() -> None:
        while not done.is_set():
            if pids and any(root.glob(marker)):
                for name, pid in pids.items():
                    if name.startswith("trainer"):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(name)
                return
            time.sleep(0.002)  # the poll interval, not a synchronisation

    killer = threading.Thread(target=kill_at_marker, daemon=True)
    killer.start()
    try:
        with pytest.raises(TrainerError):
            _run(OLD, root, on_start=pids.update, adapt=True, adapt_window=2, checkpoint_every=3, ps_delay_ms=100)
    finally:
        done.set()
        killer.join()
    assert killed == ["trainer0", "trainer1"]
    last = 3 if when == "writing" else MIGRATE_AT
    assert [p.name for p in complete_checkpoints(root)] == [f"step-{s:09d}" for s in range(last, 2, -1)]
    resumed = _run(OLD, root, resume=True, steps=last + 2)
    assert resumed["resumed_from_step"] == last and resumed["last_step"] == last + 2
    assert _losses(resumed) == _losses(reference)[last : last + 2]  # the checkpoint's weights, bit for bit


# ---- the parts, without processes ---------------------------------------------------------------------------


def test_the_moves_between_two_plans():
    moves = table_moves(OLD, NEW)
    assert (moves.local_to_local, moves.ps_to_ps) == (("a", "d"), ())
    assert (moves.ps_to_local, moves.local_to_ps) == (("c",), ("b",))
    assert moves.placements_changed == ("a", "b", "c", "d")
    with pytest.raises(PlannerError, match=r"place different tables \(e\): they are plans of different models"):
        table_moves(OLD, NEW | {"e": NEW["a"]})


def test_ps_rows_fold_into_a_local_table_by_id_mod_rows():
    ids = torch.tensor([1, 6, 11, -1, 3])  # 1, 6, 11 land on row 1 of 5; -1 (2**64 - 1) on row 4 (torch.remainder)
    values = torch.tensor([[1.0], [2.0], [6.0], [7.0], [9.0]])
    default = torch.full((5, 1), -5.0)
    folded = fold_rows(ids, values, 5, default)
    assert folded.squeeze(1).tolist() == [-5.0, 3.0, -5.0, 9.0, 7.0]  # colliding ids: their mean; others: default
    assert torch.equal(fold_rows(ids[:0], values[:0], 5, default), default)


def test_optimizer_state_is_made_whole_from_any_sharding_and_row_wise_column_shards_by_their_mean():
    rows, dims = {"t": 3, "u": 4}, {"t": 2, "u": 2}
    pieces = {
        ("embedding_bags.t.weight", "t.momentum1", (0,)): torch.tensor([1.0, 2.0, 3.0]),  # column shard 0
        ("embedding_bags.t.weight", "t.momentum1", (3,)): torch.tensor([3.0, 4.0, 5.0]),  # column shard 1
        ("embedding_bags.u.weight", "u.momentum1", (0, 0)): torch.ones(2, 2),  # element-wise, split by rows
        ("embedding_bags.u.weight", "u.momentum1", (2, 0)): torch.zeros(2, 2),
    }
    whole = whole_optimizer_states(pieces, rows, dims)
    assert whole["t"]["momentum1"].tolist() == [2.0, 3.0, 4.0]
    assert whole["u"]["momentum1"].tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]


def test_the_dense_optimizer_keeps_its_state_and_gains_or_loses_the_replicas():
    dense = {"step": torch.tensor(3.0), "sum": torch.ones(2)}
    saved = {"state": {"over.weight": dense, "ebc.embedding_bags.old.weight": {"step": 1, "sum": torch.ones(3, 1)}}}
    fresh = {"step": torch.tensor(0.0), "sum": torch.zeros(4, 1)}
    current = {"state": {"over.weight": {"step": 0, "sum": torch.zeros(2)}, "ebc.embedding_bags.new.weight": fresh}}
    out = dense_optimizer_for(saved, current, {"new": {"momentum1": torch.arange(4.0)}})
    assert list(out["state"]) == ["over.weight", "ebc.embedding_bags.new.weight"]
    assert out["state"]["over.weight"] is dense
    assert out["state"]["ebc.embedding_bags.new.weight"]["sum"].tolist() == [[0.0], [1.0], [2.0], [3.0]]


def test_a_checkpoints_plan_that_is_no_plan_is_one_line(tmp_path):
    assert saved_plan(tmp_path) is None
    (tmp_path / "plan.json").write_text("[1]")
    with pytest.raises(PlannerError, match=r"plan.json is not a table -> placement object"):
        saved_plan(tmp_path)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_migration_under_torchrun_trains_as_on_one_machine(tmp_path, forced):
    """The same job under torchrun (one node: the server, then the two trainers), migrating at step 4: every loss is
    the one-machine run's."""
    import subprocess
    import sys
    from dataclasses import replace

    from persia_planner.modules.launcher.launch import reserved_port
    from persia_planner.modules.train.adapt import plan_of

    topology = yaml.safe_load(DEFAULT_TOPOLOGY.read_text())
    for host in topology["hosts"]:
        host["profile"] = str(DEFAULT_TOPOLOGY.parent / host["profile"])
        host |= {"count": 1} if host.get("role") == "parameter_server" else {"cpus": {"count": 2, "memory": "64MiB"}}
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    tables = [{"name": t.name, "rows": t.rows, "dim": t.dim} for t in SPEC.tables]
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({"name": SPEC.name, "batch_size": 64, "tables": tables}))
    plan_of(replace(SPEC, staleness=0), TOPOLOGY, OLD).save(tmp_path / "plan.json")
    one_machine = _run(OLD, tmp_path / "one", adapt=True, adapt_window=2)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    with reserved_port() as port:
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "3", "--master-port", str(port)]
        done = subprocess.run(
            [*torchrun, "-m", "persia_planner.cli", "train", "--model", str(tmp_path / "model.yaml"),
             "--topology", str(tmp_path / "topology.yaml"), "--plan", str(tmp_path / "plan.json"), "--steps", "7",
             "--batch-size", "32", "--mode", "sync", "--id-space", "3", "--eval-batches", "2", "--adapt",
             "--adapt-window", "2", "--checkpoint", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs"),
             "--json"],
            capture_output=True, text=True, timeout=500, env=env,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]
    result = json.loads(line)
    assert [p["reason"] for p in result["plans"]] == ["initial", "faster plan"] and result["ps_tables"] == ["b"]
    steps = [x for x in logged_steps(tmp_path / "logs" / "metrics.jsonl") if "event" not in x]
    assert [x["loss"] for x in steps] == _losses(one_machine)


def test_a_replicas_table_is_read_from_its_bag_or_sequence_key():
    from persia_planner.modules.train.migration import replica_table

    assert replica_table("model.sparse_arch.embedding_bag_collection.local.ebc.embedding_bags.user.weight") == "user"
    assert replica_table("embedding_collection.local.ec.embeddings.clicks.weight") == "clicks"
    assert replica_table("over_arch.0.weight") is None
