"""`persia ps`: a real server process driven by a real trainer process over torch RPC on 127.0.0.1."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.modules.launcher.launch import hosted_store, reserved_port

PERSIA = Path(sys.executable).with_name("persia")
TRAINER = """
import sys, torch
from persia_planner.modules.ps.connection import joined
from persia_planner.modules.ps.protocol import TableConfig
from persia_planner.modules.ps.optim import SGD
with joined("trainer1", 1, 2) as client:
    client.register(TableConfig("t", 4, 100, SGD(lr=1.0)))
    ids = torch.tensor([5, 7, 5])
    before = client.lookup("t", ids)
    client.push_gradients("t", ids, torch.ones(3, 4))
    after = client.lookup("t", ids, train=False)
    # id 5 appears twice: its two gradients are summed before the SGD step
    assert torch.allclose(after[0], before[0] - 2) and torch.allclose(after[1], before[1] - 1), (before, after)
    print("rows", client.metrics()[0]["rows"])
    # busy
"""


# A trainer that dies (or hangs) once it has used the server. The lookups run for about a second first, so that the
# server has seen it as a working peer (it pings every 2 s with --peer-timeout 4; the group is formed by then).
LOST_TRAINER = """
import os, signal, sys, time, torch
from persia_planner.modules.ps.connection import connect
from persia_planner.modules.ps.protocol import TableConfig
from persia_planner.modules.ps.optim import SGD
client = connect("trainer1", 1, 2)
client.register(TableConfig("t", 4, 100, SGD(lr=1.0)))
end = time.monotonic() + 1.0
while time.monotonic() < end:
    client.lookup("t", torch.tensor([5, 7, 5]))
print("used the server", flush=True)
if sys.argv[1] == "crash":
    os._exit(3)  # no shutdown: the graceful shutdown of the group can never complete
os.kill(os.getpid(), signal.SIGSTOP)  # hangs: alive, its RPC threads answer nothing
"""


# A trainer whose server dies (or hangs) once it has been used: idle, the trainer finds out leaving the group; in use,
# from its next lookup. Either way one line naming the server, not a wait for it forever.
LOSING_TRAINER = """
import os, select, signal, sys, torch
from persia_planner.errors import PlannerError
from persia_planner.modules.ps.connection import joined
from persia_planner.modules.ps.protocol import TableConfig
from persia_planner.modules.ps.optim import SGD
how, server, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    with joined("trainer1", 1, 2, timeout_s=3, peer_timeout_s=4) as client:
        client.register(TableConfig("t", 4, 100, SGD(lr=1.0)))
        client.lookup("t", torch.tensor([5, 7, 5]))
        if how == "crash":
            died = os.pidfd_open(server)
            os.kill(server, signal.SIGKILL)
            assert select.select([died], [], [], 10)[0], "ps0 did not die"
        else:
            os.kill(server, signal.SIGSTOP)
        if when == "in use":
            client.lookup("t", torch.tensor([5]))
except PlannerError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.fixture
def ps_env() -> Iterator[dict[str, str]]:
    """The group's environment, its rendezvous store hosted by the test (rank 0 connects to it as the others do, as
    under torchrun's agent store): no port chosen in advance for a child to bind."""
    with hosted_store() as port:
        yield {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TP_SOCKET_IFNAME": "lo",
        }


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer_timeout", [None, "1"])
def test_persia_ps_serves_a_trainer(peer_timeout, ps_env):
    """With the default peer timeout, and with pings every 0.5 s while the trainer works for 8 s: a server whose pings
    failed while the trainer works (a first one, then one 5 s later) would give up before the trainer shuts down; and
    a trainer that shuts down normally is never taken for a lost one."""
    env = ps_env
    extra = ["--peer-timeout", peer_timeout] if peer_timeout else []
    server = subprocess.Popen(
        [str(PERSIA), "ps", "--rank", "0", "--world-size", "2", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        busy = "import time\n    end = time.monotonic() + 8.0\n    while time.monotonic() < end:\n"
        busy += "        client.lookup('t', torch.tensor([5]))"
        script = TRAINER.replace("# busy", busy) if peer_timeout else TRAINER
        trainer = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=90)
        assert trainer.returncode == 0, trainer.stderr
        assert trainer.stdout.strip().splitlines()[-1] == "rows 2"
        out, _ = server.communicate(timeout=60)  # the server returns once the trainer shut down
        assert server.returncode == 0, out
        assert "ps0: serving (rank 0 of 2" in out
        assert "ps0: shut down after" in out and "gave up" not in out, out
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "cause"), [("crash", "stopped answering ("), ("hang", "(no answer within 2 s)")])
def test_persia_ps_gives_up_on_a_lost_trainer_naming_it(how, cause, ps_env):
    """A trainer that died, or hangs, never reaches the group's shutdown: the server does not wait for it forever
    but exits 2 with one line naming it, after about --peer-timeout."""
    env = ps_env
    server = subprocess.Popen(
        [str(PERSIA), "ps", "--rank", "0", "--world-size", "2", "--peer-timeout", "4"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", LOST_TRAINER, how], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = server.communicate(timeout=90)
        assert server.returncode == 2, err
        lines = err.strip().splitlines()
        assert "Traceback" not in err, err
        assert lines[-1].startswith(
            "error: parameter server ps0: worker trainer1 of its RPC group stopped answering ("
        ), err
        assert "still did not answer 5 s later, and the group had not shut down; this server stops" in lines[-1]
        assert "fix: look at trainer1's log" in lines[-1] and "--peer-timeout" in lines[-1]
        assert cause in lines[-1]
        assert "ps0: gave up on its group after" in err
        assert trainer.stdout.readline() == "used the server\n"
    finally:
        for process in (server, trainer):
            if process.poll() is None:
                process.kill()
            process.communicate()


LOST_SERVER = "error: trainer trainer1: worker ps0 of its RPC group stopped answering"


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("how", "when", "message"),
    [
        ("crash", "idle", f"{LOST_SERVER} ("),
        ("hang", "idle", f"{LOST_SERVER} (no answer within 2 s)"),
        ("hang", "in use", "error: parameter server ps0 did not answer a lookup of table 't' within 3 s"),
    ],
)
def test_a_trainer_names_a_lost_server_instead_of_waiting_for_it(how, when, message, ps_env):
    """Before, a trainer whose server hung waited in the graceful shutdown forever (idle, or after its failed
    lookup), and one whose server died ended in torch's traceback from that shutdown."""
    env = ps_env
    server = subprocess.Popen(
        [str(PERSIA), "ps", "--rank", "0", "--world-size", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        trainer = subprocess.run(
            [sys.executable, "-c", LOSING_TRAINER, how, str(server.pid), when],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert trainer.returncode == 2, trainer.stderr
        assert "Traceback" not in trainer.stderr, trainer.stderr
        (line,) = [x for x in trainer.stderr.splitlines() if x.startswith("error:")]
        assert line.startswith(message), line
        if when == "idle":
            assert "; this trainer leaves without it, and the rows that server held since the last checkpoint" in line
            assert "fix: look at ps0's log" in line and "joined(peer_timeout_s=...)" in line
    finally:
        server.kill()
        server.communicate()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--rank", "2", "--world-size", "2"], {}, "error: --rank 2 must be below --world-size 2\n"),
        (
            ["--rank", "0", "--world-size", "2"],
            {"MASTER_ADDR": "", "MASTER_PORT": ""},
            "error: MASTER_ADDR and MASTER_PORT must be set for the parameter-server RPC group (got MASTER_ADDR='', "
            "MASTER_PORT=''); fix: export MASTER_ADDR=<host of rank 0> MASTER_PORT=<free port>, or launch with "
            "torchrun\n",
        ),
        (
            ["--rank", "0", "--world-size", "2"],
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "PERSIA_RPC_TRANSPORTS": "uv,tcp"},
            "error: PERSIA_RPC_TRANSPORTS='uv,tcp': unknown TensorPipe transport(s) ['tcp']; fix: use a "
            "comma-separated list of uv, shm, ibv (default: uv)\n",
        ),
        (
            ["--rank", "0", "--world-size", "2"],
            {"MASTER_ADDR": "127.0.0.1:29500", "MASTER_PORT": "29500"},
            "error: MASTER_ADDR='127.0.0.1:29500' for the parameter-server RPC group: it holds ':' but is no IPv6 "
            "address; fix: export MASTER_ADDR=<host name or IP address of rank 0> (127.0.0.1 on one machine), its "
            "port in MASTER_PORT\n",
        ),
        (
            ["--rank", "0", "--world-size", "2"],
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "65536"},
            "error: MASTER_PORT must be a port number in 1..65535 for the parameter-server RPC group (got "
            "MASTER_PORT='65536'); fix: export MASTER_PORT=<free port>, e.g. 29500\n",
        ),
    ],
)
def test_persia_ps_bad_input(args, env, message):
    result = CliRunner().invoke(app, ["ps", *args], env=env)
    assert result.exit_code == 2
    assert result.stderr == message


def test_persia_ps_names_an_address_that_does_not_resolve_at_once():
    """Before, rank 1 retried the name for --rpc-timeout; now one line before torch is imported (the resolver's
    reason in the middle depends on the machine's resolver)."""
    env = {"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"}
    result = CliRunner().invoke(app, ["ps", "--rank", "1", "--world-size", "2"], env=env)
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "error: MASTER_ADDR='no-such-host.invalid' for the parameter-server RPC group does not resolve ("
    )
    assert result.stderr.endswith(
        "); fix: export MASTER_ADDR=<host name or IP address of rank 0>, e.g. 127.0.0.1 on one machine\n"
    )
    assert result.stderr.count("\n") == 1


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 1])
def test_persia_ps_gives_up_on_an_incomplete_group_within_the_rpc_timeout(rank):
    """Rank 1 with no rank 0 to connect to, and rank 0 waiting for a rank 1 that never starts: one line naming the
    address after --rpc-timeout, not torch's 30-minute rendezvous wait."""
    with reserved_port() as port:  # rank 0 binds it; for rank 1, nothing listens there
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TP_SOCKET_IFNAME": "lo"}
        args = [str(PERSIA), "ps", "--rank", str(rank), "--world-size", "2", "--rpc-timeout", "3"]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"ps{rank} (rank {rank} of 2) could not join the RPC group at 127.0.0.1:{port} within 3 s" in lines[0]


GROUP_FIX = (
    "fix: start rank 0 (the first parameter server) and every other rank with the same MASTER_ADDR/MASTER_PORT or on "
    "several machines under torchrun, give the head node's torchrun --local-addr <its address>: its agent otherwise "
    "hands out its host name, which may resolve to loopback elsewhere or raise --rpc-timeout if the ranks start far "
    "apart"
)

# What rank 0 (waiting for the others) and rank 1 (refused) say when the group does not come together.
WHY_NOT_JOINED = {
    0: "1 of its 2 ranks joined",
    1: "nothing accepts connections there ([Errno 111] Connection refused); is rank 0 running?",
}


def _binds_port_1(addr: str) -> bool:
    """Whether this process may listen on port 1 (root, or CAP_NET_BIND_SERVICE)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((addr, 1))
        except PermissionError:
            return False
    return True


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["rank 0 may bind it", "rank 0 may not bind it", "rank 1"])
def test_persia_ps_with_master_port_1_is_one_line_within_the_rpc_timeout(case):
    """MASTER_PORT=1, a privileged port nobody listens on, with a complete-looking environment. Rank 0 binds it as
    root and waits for the others (one line after --rpc-timeout), or may not bind it (one line at once, saying why);
    rank 1 is refused until --rpc-timeout. Rank 0 listens on a loopback address of its own (127.0.0.0/8), so that no
    other test's rank 1 could ever join it."""
    rank = 1 if case == "rank 1" else 0
    addr = "127.0.0.1" if rank else f"127.{random.randrange(1, 255)}.{random.randrange(256)}.{random.randrange(1, 255)}"
    prefix: list[str] = []
    if case == "rank 0 may bind it" and not _binds_port_1(addr):
        pytest.skip("this user may not listen on a port below 1024")
    if case == "rank 0 may not bind it" and _binds_port_1(addr):
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to run without CAP_NET_BIND_SERVICE")
        prefix = ["setpriv", "--bounding-set", "-net_bind_service", "--inh-caps", "-net_bind_service"]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_USE_AGENT_STORE", "TP_SOCKET_IFNAME")}
    env |= {"MASTER_ADDR": addr, "MASTER_PORT": "1", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    args = [*prefix, str(PERSIA), "ps", "--rank", str(rank), "--world-size", "2", "--rpc-timeout", "3"]
    started = time.monotonic()
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=100)
    seconds = time.monotonic() - started
    if case == "rank 0 may not bind it":
        expected = (
            f"error: cannot listen on {addr}:1 for the rendezvous store: Permission denied; fix: MASTER_ADDR must be "
            "an address of the host that runs rank 0 (127.0.0.1 on one machine) or choose a MASTER_PORT above 1023 "
            "(ports below 1024 need root)\n"
        )
    else:
        cause = WHY_NOT_JOINED[rank]
        expected = f"error: ps{rank} (rank {rank} of 2) could not join the RPC group at {addr}:1 within 3 s: {cause}; "
        expected += f"{GROUP_FIX}\n"
        assert seconds >= 3
    assert (done.returncode, done.stderr) == (2, expected)
    assert seconds < 90
