"""A run's folders belong to one run at a time (modules/train/run_lock.py): a second run, or a --resume of a checkpoint
being written, is refused in one line naming the holder; a marker persia did not write is never touched; a lock goes
with its process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.errors import PlannerError
from persia_planner.modules.train.run_directories import check_checkpoint_dir
from persia_planner.modules.train.run_lock import RUN_FORMAT, hold_run_folders, refuse_held
from persia_planner.outputs import RUN_MARKER

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def in_use(folder: Path, option: str = "--checkpoint", what: str = "checkpoint") -> str:
    marker = json.loads((folder / RUN_MARKER).read_text())
    return (
        f"{option} {folder} is in use by another persia train run (pid {os.getpid()} on host {socket.gethostname()} "
        f"since {marker['started']}): its {what} would be mixed with this run's; fix: wait for that run to end or "
        "pass another folder"
    )


def test_a_held_folder_is_refused_naming_its_holder(tmp_path):
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    with hold_run_folders({"--checkpoint": ck, "--log-dir": logs}):
        marker = json.loads((ck / RUN_MARKER).read_text())
        assert marker["format"] == RUN_FORMAT and marker["role"] == "--checkpoint" and marker["pid"] == os.getpid()
        with pytest.raises(PlannerError) as err:
            refuse_held("--checkpoint", ck)
        assert str(err.value) == in_use(ck)
        with pytest.raises(PlannerError) as err:
            refuse_held("--log-dir", logs)
        assert str(err.value) == in_use(logs, "--log-dir", "logs")
        with pytest.raises(PlannerError) as err, hold_run_folders({"--checkpoint": ck}):
            pass
        assert str(err.value) == in_use(ck)
    refuse_held("--checkpoint", ck)  # released with the run
    with hold_run_folders({"--checkpoint": ck}):
        pass


def test_a_marker_left_by_a_run_that_ended_does_not_hold_the_folder(tmp_path):
    (tmp_path / RUN_MARKER).write_text(json.dumps({"format": RUN_FORMAT, "pid": 1, "host": "h", "started": "then"}))
    refuse_held("--checkpoint", tmp_path)
    with hold_run_folders({"--checkpoint": tmp_path}):
        assert json.loads((tmp_path / RUN_MARKER).read_text())["pid"] == os.getpid()


def test_the_same_torchrun_run_is_not_refused_by_its_first_trainers_hold(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with hold_run_folders({"--checkpoint": tmp_path}):
        assert json.loads((tmp_path / RUN_MARKER).read_text())["run_id"] == "job-7@10.0.0.1:29500"
        refuse_held("--checkpoint", tmp_path)  # another process of run job-7
        # Another job given the same --rdzv-id has another store (one live job serves an address at a time).
        monkeypatch.setenv("MASTER_PORT", "29501")
        with pytest.raises(PlannerError, match="is in use by another persia train run"):
            refuse_held("--checkpoint", tmp_path)


@pytest.mark.parametrize("kind", ["text", "link", "folder"])
def test_a_marker_persia_did_not_write_is_refused_and_kept(tmp_path, kind):
    ck = tmp_path / "ck"
    ck.mkdir()
    mine = tmp_path / "mine.txt"
    mine.write_text("precious")
    if kind == "text":
        (ck / RUN_MARKER).write_text("my notes")
    elif kind == "link":
        (ck / RUN_MARKER).symlink_to(mine)
    else:
        (ck / RUN_MARKER).mkdir()
    why = {"text": "not a marker of persia train", "link": "Too many levels of symbolic links", "folder": "Is a "
           "directory"}[kind]  # fmt: skip
    line = (
        f"--checkpoint {ck} holds {RUN_MARKER}, which persia did not write ({why}): it is kept as it is; fix: pass "
        "another folder"
    )
    for attempt in (
        lambda: refuse_held("--checkpoint", ck),
        lambda: hold_run_folders({"--checkpoint": ck}).__enter__(),
    ):
        with pytest.raises(PlannerError) as err:
            attempt()
        assert str(err.value) == line
    assert mine.read_text() == "precious"
    if kind == "text":
        assert (ck / RUN_MARKER).read_text() == "my notes"


def test_a_folder_holding_only_the_marker_counts_as_empty(tmp_path):
    from persia_planner.modules.train.config import TrainConfig

    with hold_run_folders({"--checkpoint": tmp_path}):
        pass
    check_checkpoint_dir(TrainConfig(checkpoint=str(tmp_path)))  # a run that saved nothing left only its marker
    (tmp_path / "step-000000002").mkdir()
    with pytest.raises(PlannerError, match="is not empty; training from scratch would replace what it holds"):
        check_checkpoint_dir(TrainConfig(checkpoint=str(tmp_path)))


@pytest.mark.parametrize("mode", [[], ["--overwrite"], ["--resume"]])
def test_persia_train_into_a_held_checkpoint_is_one_line(tmp_path, mode):
    ck = tmp_path / "ck"
    with hold_run_folders({"--checkpoint": ck}):
        result = runner.invoke(app, ["train", "--checkpoint", str(ck), *mode], prog_name="persia")
        assert result.exit_code == 2, result.output
        assert result.stderr == f"error: {in_use(ck)}\n"
    assert sorted(p.name for p in ck.iterdir()) == [RUN_MARKER]


# ---- two real runs -------------------------------------------------------------------------------------------------
def _persia(*args: str, **kwargs) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    return subprocess.Popen([sys.executable, "-m", "persia_planner.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, **kwargs)  # fmt: skip


def _wait_until_held(folder: Path, first: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()
        try:
            refuse_held("--checkpoint", folder)
        except PlannerError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{folder} was not taken within {timeout_s} s")


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_second_run_on_one_checkpoint_folder_is_refused_and_the_first_keeps_its_checkpoints(tmp_path):
    from persia_planner.modules.train.job_checkpoints import complete_checkpoints, newest_complete

    ck = tmp_path / "ck"
    args = ["train", "--checkpoint-every", "20", "--keep", "3", "--json"]
    # The first run trains until it is told to stop: however fast it is, it holds the folder while the others try.
    first = _persia(*args, "--steps", "1000000", "--checkpoint", str(ck))
    try:
        _wait_until_held(ck, first, timeout_s=120)
        for mode in (["--overwrite"], ["--resume"]):
            second = subprocess.run([sys.executable, "-m", "persia_planner.cli", *args, "--checkpoint", str(ck), *mode],
                                    capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
            assert second.returncode == 2, second.stderr[-2000:]
            (line,) = second.stderr.splitlines()
            assert line.startswith(f"error: --checkpoint {ck} is in use by another persia train run (pid {first.pid} ")
        first.send_signal(signal.SIGINT)  # it stops at a step all trainers agree on and saves that step
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, err[-3000:]
    newest = newest_complete(ck)
    assert err.splitlines()[-1].endswith(f"checkpoint in {newest.path} (--resume goes on from there)")
    lineages = {json.loads((p / "MANIFEST.json").read_text())["lineage"] for p in complete_checkpoints(ck)}
    assert lineages == {newest.lineage}  # the refused runs wrote nothing, and pruned nothing
