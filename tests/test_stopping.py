"""A signal stops a job with a checkpoint at a step every trainer agrees on: a final checkpoint, then one line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from processes import descendants_of, gone_within, live

from persia_planner.modules.stopping import REQUEST, STOP_AT, GracefulStop
from persia_planner.modules.train.engine import FINAL_CHECKPOINT_WAIT_S
from persia_planner.modules.train.job_checkpoints import verify

PERSIA = Path(sys.executable).with_name("persia")


def test_every_trainer_stops_after_the_step_trainer_0_chose():
    store = dist.HashStore()
    first, second = GracefulStop(store, 0), GracefulStop(store, 1)
    assert not second.after_step(5)  # trainer 1 finished step 5 before the request came
    store.set(REQUEST, "SIGTERM")  # what the launcher's request_stop writes
    assert not first.after_step(5) and int(store.get(STOP_AT)) == 7
    # Trainer 1 reads the step at the end of its next step: it cannot be past it (step 6 needs trainer 0).
    assert [second.after_step(s) for s in (6, 7)] == [False, True]
    assert [first.after_step(s) for s in (6, 7)] == [False, True]
    assert first.reason == second.reason == "SIGTERM"


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_sigterm_takes_a_final_checkpoint_that_resume_continues(tmp_path):
    ckpt = tmp_path / "ckpt"
    err = (tmp_path / "stderr").open("w")
    train = [str(PERSIA), "train", "--steps", "100000", "--batch-size", "64", "--eval-batches", "1"]
    launcher = subprocess.Popen(
        [*train, "--checkpoint", str(ckpt), "--checkpoint-every", "3", "--json"],
        stdout=subprocess.PIPE, stderr=err, start_new_session=True, cwd=tmp_path, text=True,
    )  # fmt: skip
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not (ckpt / "step-000000003").is_dir():  # the first periodic checkpoint: the job trains
            assert launcher.poll() is None, (tmp_path / "stderr").read_text()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint of step 3 within 300 s"
            time.sleep(0.05)  # the poll interval, not a synchronisation
        seen = descendants_of(launcher.pid)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=FINAL_CHECKPOINT_WAIT_S + 60) == 143
        left = gone_within(seen, 10.0)  # the fork server ends once it sees the launcher gone
        assert not left, f"processes left 10 s after the launcher ended: {left}"
    finally:
        for pid in [launcher.pid, *live(seen)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
    errors = [line for line in (tmp_path / "stderr").read_text().splitlines() if line.strip()]
    assert len(errors) == 1, errors
    found = re.fullmatch(
        r"error: interrupted \(SIGTERM\) after step (\d+); checkpoint in (.*) \(--resume .*", errors[0]
    )
    assert found, errors
    step, where = int(found.group(1)), Path(found.group(2))
    assert step >= 3 and where == (ckpt / f"step-{step:09d}").resolve() and verify(where).step == step
    done = subprocess.run(
        [*train[:2], "--steps", str(step + 2), "--batch-size", "64", "--eval-batches", "1", "--checkpoint", str(ckpt),
         "--resume", "--json"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["resumed_from_step"] == step and result["last_step"] == step + 2


def _semaphores() -> set[str]:
    """multiprocessing's named semaphores now in /dev/shm."""
    return {p.name for p in Path("/dev/shm").glob("sem.mp-*")}


def _until(condition, timeout_s: float) -> bool:
    """Whether ``condition()`` held within ``timeout_s`` (checked until then, no longer)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # the poll interval, not a synchronisation
    return True


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory in /dev/shm")
def test_a_sigkill_of_the_job_leaves_no_semaphores_behind(tmp_path):
    """The job's queue and barrier are named semaphores; multiprocessing's resource tracker, in a session of its
    own, outlives a SIGKILL of the job's process group and unlinks them."""
    before = _semaphores()
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    job = subprocess.Popen(
        [PERSIA, "train", "--steps", "100000", "--batch-size", "64", "--log-dir", str(logs)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        metrics = logs / "metrics.jsonl"
        assert _until(lambda: metrics.is_file() and metrics.stat().st_size > 0, 240), "no step within 240 s"
        created = _semaphores() - before
        assert created, "the job made no named semaphore: nothing to check"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert _until(lambda: not created & _semaphores(), 30), sorted(created & _semaphores())
    assert job.stderr is not None and "leaked semaphore" not in job.stderr.read().decode()
