"""The processes of a job: what they listen on, and that they end with their launcher."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from processes import descendants_of, gone_within, live

from persia_planner.errors import PlannerError
from persia_planner.modules.launcher.launch import barrier, local_cluster, reserved_port, trainers_store
from persia_planner.modules.launcher.local_job import POLL_S, TrainerError
from persia_planner.modules.launcher.progress import process_state, publish_progress
from persia_planner.modules.ps.group import host_store

PERSIA = Path(sys.executable).with_name("persia")


def _listening() -> dict[int, str]:
    """Listening TCP sockets of this network namespace: socket inode -> ``address:port``."""
    found = {}
    for name, family in (("tcp", 4), ("tcp6", 6)):
        path = Path("/proc/self/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != "0A":  # TCP_LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as host-order 32-bit words
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.IPv4Address(raw) if family == 4 else ipaddress.IPv6Address(raw)
            found[inode] = f"{addr}:{int(hex_port, 16)}"
    return found


def _sockets_of(pid: int) -> set[int]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass  # the process is gone
    return inodes


def listeners(pids: list[int]) -> list[tuple[int, str]]:
    """``(pid, address:port)`` of every listening TCP socket the processes ``pids`` hold."""
    table = _listening()
    return sorted((pid, table[inode]) for pid in pids for inode in _sockets_of(pid) if inode in table)


def _list_the_jobs_listeners(j: int, client: object) -> tuple[list[tuple[int, str]] | None, tuple[str, str]]:
    # The trainers' gloo group as the training job forms it: its listeners exist once the group is up.
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", store=trainers_store(), rank=j, world_size=2, timeout=timeout)
    dist.all_reduce(torch.ones(1))
    barrier()  # every worker is up: servers (the trainers joined the RPC group), trainers' RPC agents and gloo pairs
    found = None
    if j == 0:
        launcher = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[1])
        found = listeners([launcher, *descendants_of(launcher)])
    barrier()  # nobody leaves before trainer 0 has looked
    dist.destroy_process_group()
    return found, (os.environ.get("TP_SOCKET_IFNAME", ""), os.environ.get("GLOO_SOCKET_IFNAME", ""))


def _beyond_loopback(found: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return [(pid, where) for pid, where in found if not where.startswith(("127.0.0.1:", "::1:"))]


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_every_listening_socket_of_a_local_job_is_on_loopback(monkeypatch):
    """The launcher's store, the servers' and trainers' RPC agents and the trainers' gloo pairs: all on loopback.

    (On a host whose name resolves to a network address, TensorPipe and gloo would listen there without the
    interface variables: the test checks that the workers have them too.)"""
    monkeypatch.delenv("TP_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    (found, interfaces), (_, interfaces_1) = local_cluster(1, 2, _list_the_jobs_listeners, run_timeout_s=120)
    pids = {pid for pid, _ in found}
    assert os.getpid() in pids and len(pids) >= 4, f"expected the store, the RPC agents and gloo to listen: {found}"
    assert not _beyond_loopback(found), f"listening beyond loopback: {_beyond_loopback(found)}"
    assert interfaces == interfaces_1 == ("lo", "lo")


def test_host_store_listens_on_its_address_only_and_names_one_it_cannot_listen_on():
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=10))
    assert listeners([os.getpid()]).count((os.getpid(), f"127.0.0.1:{store.port}")) == 1
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store
    # 192.0.2.0/24 is reserved for documentation: no host has it
    with pytest.raises(PlannerError, match=r"^cannot listen on 192\.0\.2\.1:29500 for the rendezvous store: ") as info:
        host_store("192.0.2.1", 29500, datetime.timedelta(seconds=10))
    assert "MASTER_ADDR must be an address of the host that runs rank 0" in str(info.value)


JOINING_TRAINER = """
import sys
from persia_planner.modules.ps.connection import joined
with joined("trainer1", 1, 2) as client:
    print("joined", flush=True)
    sys.stdin.readline()  # until the test has looked
"""


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_persia_ps_hosts_its_store_and_listens_on_master_addr_only():
    """``persia ps`` rank 0 hosts the group's store itself (torch's tcp:// rendezvous): on MASTER_ADDR only."""
    env = {k: v for k, v in os.environ.items() if k not in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
    reserved = contextlib.ExitStack()  # the port stays ours until the test ends: rank 0 may bind it, nobody else
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(reserved.enter_context(reserved_port()))}
    server = subprocess.Popen(
        [str(PERSIA), "ps", "--rank", "0", "--world-size", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", JOINING_TRAINER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout.readline() == "joined\n", trainer.communicate(timeout=60)[1]
        found = listeners([server.pid, trainer.pid])
        trainer.stdin.write("done\n")
        trainer.stdin.flush()
        _, err = trainer.communicate(timeout=60)
        assert trainer.returncode == 0, err
        out, _ = server.communicate(timeout=60)
        assert server.returncode == 0, out
    finally:
        for p in (trainer, server):
            if p.poll() is None:
                p.kill()
                p.wait()
        reserved.close()
    port = env["MASTER_PORT"]
    assert (server.pid, f"127.0.0.1:{port}") in found, found  # the store
    assert {pid for pid, _ in found} == {server.pid, trainer.pid}, found  # and both RPC agents
    assert not _beyond_loopback(found), f"listening beyond loopback: {_beyond_loopback(found)}"


def _described(pids: list[int]) -> list[str]:
    """``pid name state`` of each process (for a failure message that says which are left, and how)."""
    found = []
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            name = "?"
        found.append(f"{pid} {name} {process_state(pid)}")
    return found


def _workers_started(launcher: subprocess.Popen, n: int, timeout_s: float) -> list[int]:
    """Wait until ``n`` workers (grandchildren of the launcher: children of its fork server) exist; every
    descendant of the launcher then."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = descendants_of(launcher.pid)
        direct = set(_children_of(launcher.pid))
        if len([pid for pid in found if pid not in direct]) >= n:
            return found
        assert launcher.poll() is None, f"persia train ended early ({launcher.returncode})"
        assert time.monotonic() < deadline, f"no {n} workers within {timeout_s:g} s: {found}"
        time.sleep(0.05)  # the poll interval, not a synchronisation


def _children_of(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# 2 servers and 2 trainers on synthetic data, with steps enough to still be training whenever the signal comes.
TRAIN = [str(PERSIA), "train", "--steps", "100000", "--eval-batches", "1"]


def _start_training(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    out = (tmp_path / "stderr").open("w")
    launcher = subprocess.Popen(
        TRAIN, stdout=subprocess.DEVNULL, stderr=out, start_new_session=True, cwd=tmp_path, text=True
    )
    return launcher, _workers_started(launcher, 4, timeout_s=120)


def _kill_what_is_left(launcher: subprocess.Popen, pids: list[int]) -> None:
    for pid in [launcher.pid, *live(pids)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.wait()


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_workers_die_with_a_killed_launcher(tmp_path):
    launcher, descendants = _start_training(tmp_path)
    try:
        launcher.kill()
        launcher.wait()
        left = gone_within(descendants, 10.0)
        assert not left, f"still running 10 s after the launcher was killed: {_described(left)}"
    finally:
        _kill_what_is_left(launcher, descendants)


@pytest.mark.processes
@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_the_job_with_one_error_line(tmp_path, signum, code):
    launcher, descendants = _start_training(tmp_path)
    try:
        launcher.send_signal(signum)
        assert launcher.wait(timeout=60) == code
        left = gone_within(descendants, 10.0)
        assert not left, f"still running 10 s after the launcher stopped: {left}"
    finally:
        _kill_what_is_left(launcher, descendants)
    errors = [line for line in (tmp_path / "stderr").read_text().splitlines() if line.strip()]
    name = signal.Signals(signum).name
    assert len(errors) == 1 and re.fullmatch(rf"error: interrupted \({name}\); stopped [1-4] workers?", errors[0]), (
        errors
    )


def _workers_named(descendants: list[int]) -> dict[str, int]:
    """The job's workers by the name they show (``ps0``, ``trainer1``: /proc/PID/comm)."""
    names = {}
    for pid in descendants:
        with contextlib.suppress(OSError):
            names[Path(f"/proc/{pid}/comm").read_text().strip()] = pid
    return names


def _established_to(pid: int) -> int:
    """How many TCP connections process ``pid`` holds (established)."""
    table = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/self/net") / name
        if path.exists():
            table |= {int(f.split()[9]) for f in path.read_text().splitlines()[1:] if f.split()[3] == "01"}
    return len(_sockets_of(pid) & table)


@pytest.mark.processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["ps0", "trainer1", "trainer0"])
def test_a_killed_worker_stops_the_job_with_one_line_naming_it(tmp_path, victim):
    """SIGKILL one worker mid-run: the job ends within the trainers' PS request timeout with one line naming the lost
    process (the survivors' TensorPipe warnings stay off the terminal), and nothing is left running."""
    from persia_planner.modules.train.engine import PS_REQUEST_TIMEOUT_S

    launcher, descendants = _start_training(tmp_path)
    try:
        # Wait until the workers named themselves and the RPC group is up (ps0 talks to the 3 others), so that the
        # loss is one of a running job.
        deadline = time.monotonic() + 120
        while True:
            named = _workers_named(descendants_of(launcher.pid))
            if {"ps0", "ps1", "trainer0", "trainer1"} <= set(named) and _established_to(named["ps0"]) >= 3:
                break
            assert launcher.poll() is None, f"persia train ended early ({launcher.returncode})"
            assert time.monotonic() < deadline, f"the RPC group did not come together within 120 s: {named}"
            time.sleep(0.05)  # the poll interval, not a synchronisation
        os.kill(named[victim], signal.SIGKILL)
        # A lost server fails the next request at once (connection reset); its timeout bounds it in any case.
        assert launcher.wait(timeout=PS_REQUEST_TIMEOUT_S + 2 * POLL_S) == 2
        left = gone_within(descendants, 10.0)
        assert not left, f"still running 10 s after the launcher ended: {left}"
    finally:
        _kill_what_is_left(launcher, descendants)
    lines = [line for line in (tmp_path / "stderr").read_text().splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith("train ")]  # the progress bar's last line
    assert len(errors) == 1 and errors[0].startswith("error: ") and victim in errors[0], lines
    if victim.startswith("trainer"):
        assert errors[0] == f"error: local cluster failed: {victim} was killed (SIGKILL)", lines


HANG_S = 3.0  # the hang timeout of the stopped-trainer test; its gloo group waits far longer (GROUP_S)
GROUP_S = 120.0


def _step_until_trainer1_stops(j: int, client: object, where: str) -> None:
    Path(where, f"trainer{j}.pid").write_text(str(os.getpid()))
    timeout = datetime.timedelta(seconds=GROUP_S)
    dist.init_process_group("gloo", store=trainers_store(), rank=j, world_size=2, timeout=timeout)
    step = 0
    while True:
        if j == 1 and step == 5:
            Path(where, "stopped-at").write_text(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock per machine
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(1))  # trainer0 waits here for the stopped one
        step += 1
        publish_progress(step)


@pytest.mark.processes
@pytest.mark.timeout(GROUP_S)
def test_a_stopped_trainer_is_named_within_the_hang_timeout(tmp_path):
    """SIGSTOP on one trainer: the job stops after the hang timeout (not the group's), naming that trainer and the
    steps, and leaves no process behind."""
    stop_grace_s = 5.0
    try:
        with pytest.raises(TrainerError) as info:
            local_cluster(
                0, 2, _step_until_trainer1_stops, str(tmp_path), hang_timeout_s=HANG_S, stop_grace_s=stop_grace_s
            )
        ended = time.monotonic()
        stalled_for = ended - float((tmp_path / "stopped-at").read_text())
    finally:
        pids = [
            int((tmp_path / f"trainer{j}.pid").read_text()) for j in range(2) if (tmp_path / f"trainer{j}.pid").exists()
        ]
        for pid in pids:
            if process_state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    assert re.fullmatch(
        r"trainer1 made no progress for \d+ s \(at step 5, stopped \(SIGSTOP\); the others at step 5\); "
        r"fix: resume it \(kill -CONT \d+\) or find what stopped it",
        str(info.value),
    ), str(info.value)
    # The watch sees the last step within a poll, gives up HANG_S later (on its next poll), then kills the trainers.
    assert HANG_S <= stalled_for <= HANG_S + 2 * POLL_S + stop_grace_s, stalled_for
    assert len(pids) == 2 and all(process_state(pid) is None for pid in pids), [process_state(p) for p in pids]
