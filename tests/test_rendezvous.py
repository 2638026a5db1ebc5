"""modules/train/rendezvous.py: torchrun's ``persia`` rendezvous backend, its stores bound to the head's address, and
its mistakes in one line."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest

from persia_planner.errors import PlannerError
from persia_planner.modules.train import rendezvous
from persia_planner.modules.train.rendezvous import RendezvousOptions, rendezvous_options

TORCHRUN = Path(sys.executable).with_name("torchrun")
ENDPOINT_FIX = "fix: give --rdzv-endpoint HOST:PORT, the head node's address and a free port, e.g. 127.0.0.1:29400"
HEAD_FIX = (
    "fix: give --rdzv-conf is_host=true on the head node (the one --rdzv-endpoint names), is_host=false on the others"
)


def _listening(port: int) -> list[str]:
    """The local addresses of the sockets listening on ``port`` (``ss``), e.g. ``127.0.0.1:1234`` or ``*:1234``."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[3] for line in out.splitlines()]


def _params(endpoint: str, **conf: str):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters("persia", endpoint, "run-1", 1, 1, **conf)


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port of 127.0.0.1 that refuses connections: bound by this test, never listening (nobody else can bind it)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def test_torchrun_finds_the_backend_through_the_entry_point():
    (found,) = [e for e in entry_points(group="torchrun.handlers") if e.name == rendezvous.BACKEND]
    assert found.load()() is rendezvous.torchrun_handler


@pytest.mark.processes  # ss
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_both_stores_listen_on_the_given_address_only():
    handler = rendezvous.create_handler(_params("127.0.0.1:0", is_host="true"))
    assert handler.get_backend() == "persia"
    store = handler._state_holder._backend._store  # the rendezvous store the backend keeps its state in
    assert _listening(store.port) == [f"127.0.0.1:{store.port}"]
    # What rank 0's agent serves its workers (torch's DynamicRendezvousHandler asks for it by this name).
    workers = handler._create_tcp_store_server("127.0.0.1", 0)
    assert _listening(workers.port) == [f"127.0.0.1:{workers.port}"]
    workers.set("k", "v")
    assert workers.get("k") == b"v"


def test_the_head_must_be_named():
    with pytest.raises(PlannerError) as info:
        rendezvous.create_handler(_params("127.0.0.1:29400"))
    assert str(info.value) == f"--rdzv-backend persia needs to know which node is the head; {HEAD_FIX}"


def test_the_options_torch_would_take():
    assert rendezvous_options("127.0.0.1:29500", {"is_host": "true"}) == RendezvousOptions("127.0.0.1", 29500, True, 60)
    assert rendezvous_options(" [::1]:7 ", {"is_host": "N", "read_timeout": "5"}) == RendezvousOptions(
        "::1", 7, False, 5
    )
    assert rendezvous_options("", {"is_host": "1"}) == RendezvousOptions("localhost", 29400, True, 60)
    assert rendezvous_options("head", {"is_host": "yes"}).endpoint == "head:29400"
    assert rendezvous_options("::1", {"is_host": "0"}).endpoint == "[::1]:29400"
    assert rendezvous_options("head:0", {"is_host": "t"}).port == 0  # the head may let the OS pick its port


@pytest.mark.parametrize(
    ("endpoint", "conf", "line"),
    [
        ("127.0.0.1:29400", {"is_host": "maybe"}, f"--rdzv-conf is_host='maybe' is not true or false; {HEAD_FIX}"),
        ("127.0.0.1:70000", {"is_host": "false"}, "--rdzv-endpoint '127.0.0.1:70000': the port must be a number in "
         f"1..65535; {ENDPOINT_FIX}"),
        ("127.0.0.1:0", {"is_host": "false"}, "--rdzv-endpoint '127.0.0.1:0': the port must be a number in "
         f"1..65535; {ENDPOINT_FIX}"),
        ("127.0.0.1:x", {"is_host": "true"}, "--rdzv-endpoint '127.0.0.1:x': the port must be a number in 0..65535 "
         f"(0: one the OS picks); {ENDPOINT_FIX}"),
        ("http://head:1", {"is_host": "true"}, "--rdzv-endpoint 'http://head:1': the host 'http://head:1': it is not a "
         f"host name or an IP address (letters, digits, '.', '-', '_', ':' only); {ENDPOINT_FIX}"),
        ("a:b:c", {"is_host": "false"}, "--rdzv-endpoint 'a:b:c': the host 'a:b:c': it holds ':' but is no IPv6 "
         f"address; {ENDPOINT_FIX}"),
        (":29400", {"is_host": "false"}, f"--rdzv-endpoint ':29400': the host '': it is empty; {ENDPOINT_FIX}"),
        ("h:1", {"is_host": "false", "read_timeout": "0"}, "--rdzv-conf read_timeout='0' must be a whole number in "
         "1..604800; fix: give --rdzv-conf read_timeout=N with N in 1..604800, or leave it out (torch's default)"),
        ("h:1", {"is_host": "false", "join_timeout": "1e3"}, "--rdzv-conf join_timeout='1e3' must be a whole number "
         "in 1..604800; fix: give --rdzv-conf join_timeout=N with N in 1..604800, or leave it out (torch's default)"),
    ],
)  # fmt: skip
def test_a_wrong_endpoint_or_conf_is_one_line(endpoint, conf, line):
    with pytest.raises(PlannerError) as info:
        rendezvous_options(endpoint, conf)
    assert str(info.value) == line


def test_torchrun_gets_the_line_and_exit_2_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        rendezvous.torchrun_handler(SimpleNamespace(endpoint="127.0.0.1:29400", config={}, run_id="r"))
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: --rdzv-backend persia needs to know which node is the head; {HEAD_FIX}\n"
    assert captured.out == ""


def test_a_head_that_cannot_serve_its_workers_store_ends_torchrun_in_one_line(capsys):
    """The head's agent serves its workers' store on --local-addr once the nodes met (inside torch's rendezvous):
    an address of another host was 52 lines of the agent's traceback, exit 1."""
    handler = rendezvous.create_handler(_params("127.0.0.1:0", is_host="true"))
    with pytest.raises(SystemExit) as info:
        handler._create_tcp_store_server("198.18.255.254", 0)  # no host here has it
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "error: cannot listen on 198.18.255.254:0 for the rendezvous store: Cannot assign requested address; fix: "
        "torchrun's --local-addr must be an address of the host that runs the head's torchrun (127.0.0.1 on one "
        "machine) or choose a free torchrun --master-port\n"
    )


def test_a_name_that_does_not_resolve_is_one_line_at_once():
    options = _params("no-such-host.invalid:29400", is_host="false", read_timeout="30")
    started = time.monotonic()
    with pytest.raises(PlannerError, match=r"^--rdzv-endpoint no-such-host\.invalid:29400: the host does not resolve"):
        rendezvous.create_handler(options)
    assert time.monotonic() - started < 10


def _torchrun(endpoint: str, conf: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """torchrun with ``--rdzv-backend persia`` on one node of one process that would run ``true``."""
    args = [str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "persia"]
    args += ["--rdzv-endpoint", endpoint, "--rdzv-id", "c55", *conf, "--no-python", "true"]
    started = time.monotonic()
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    return done, time.monotonic() - started


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_torchrun_without_is_host_prints_the_line_alone(closed_port):
    """Before, torchrun's agent printed the ValueError's traceback (26 lines) and exited 1."""
    done, _ = _torchrun(f"127.0.0.1:{closed_port}", [])
    assert (done.returncode, done.stderr, done.stdout) == (
        2,
        f"error: --rdzv-backend persia needs to know which node is the head; {HEAD_FIX}\n",
        "",
    )


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_an_endpoint_nothing_serves_is_one_line_after_read_timeout(closed_port):
    """Before, a node whose head never came printed 192 lines of torch's retries and tracebacks after 63 s."""
    done, seconds = _torchrun(f"127.0.0.1:{closed_port}", ["--rdzv-conf", "is_host=false,read_timeout=3"])
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr == (
        f"error: nothing served the rendezvous at --rdzv-endpoint 127.0.0.1:{closed_port} within read_timeout 3 s "
        "([Errno 111] Connection refused); fix: start torchrun on the head node (--rdzv-conf is_host=true) with the "
        "same --rdzv-endpoint or give --rdzv-endpoint the head node's address and port or raise --rdzv-conf "
        "read_timeout=N if the head starts later\n"
    )
    assert 3 <= seconds < 90  # read_timeout, plus torchrun's start on a busy machine
