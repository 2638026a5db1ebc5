"""The RPC group's environment, read without torch: the rendezvous address and the TensorPipe transports."""

from __future__ import annotations

import socket
import time

import pytest

from persia_planner.errors import PlannerError
from persia_planner.modules.rpc_environment import (
    check_rpc_environment,
    is_loopback,
    listen_where_the_rendezvous_is,
    master_address,
    rendezvous_interface,
    rpc_channels,
    rpc_transports,
    wait_for_listener,
)


def test_rpc_transports_default_to_uv_and_follow_the_variable():
    assert rpc_transports({}) == ["uv"]
    assert rpc_transports({"PERSIA_RPC_TRANSPORTS": " shm, uv "}) == ["shm", "uv"]
    with pytest.raises(PlannerError, match="PERSIA_RPC_TRANSPORTS='ipc': unknown TensorPipe transport"):
        rpc_transports({"PERSIA_RPC_TRANSPORTS": "ipc"})


def test_rpc_channels_are_tensorpipes_own_unless_the_variable_names_them():
    assert rpc_channels({}) is None
    assert rpc_channels({"PERSIA_RPC_CHANNELS": "basic, mpt_uv"}) == ["basic", "mpt_uv"]
    with pytest.raises(PlannerError, match=r"PERSIA_RPC_CHANNELS='shm': unknown TensorPipe channel\(s\) \['shm'\]"):
        rpc_channels({"PERSIA_RPC_CHANNELS": "shm"})


@pytest.mark.parametrize("port", ["abc", "99999", "0", "-1"])
def test_master_address_rejects_a_bad_port(monkeypatch, port):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(PlannerError, match=r"^MASTER_PORT must be a port number in 1\.\.65535 for the servers") as info:
        master_address("the servers")
    message = str(info.value)
    assert f"MASTER_PORT={port!r}" in message and "export MASTER_PORT=<free port>" in message and "\n" not in message
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert master_address("the servers") == ("127.0.0.1", 29500)


def test_tensorpipe_and_gloo_listen_where_the_rendezvous_is():
    """Loopback for a job on this machine; the interface of the route to MASTER_ADDR for one on several (the
    namespace cluster's test checks a cluster address, tests/test_netns.py); nothing where it does not
    resolve."""
    assert all(map(is_loopback, ["127.0.0.1", "127.0.1.1", "::1", "localhost"]))
    assert not any(map(is_loopback, ["10.0.0.1", "0.0.0.0", "::", "host0", ""]))
    environ = {"MASTER_ADDR": "127.0.0.1"}
    listen_where_the_rendezvous_is(environ)
    assert environ == {"MASTER_ADDR": "127.0.0.1", "TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    chosen = {"MASTER_ADDR": "::1", "TP_SOCKET_IFNAME": "eth1"}  # the user's choice stays
    listen_where_the_rendezvous_is(chosen)
    assert chosen == {"MASTER_ADDR": "::1", "TP_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "lo"}
    unknown = {"MASTER_ADDR": "no-such-host.invalid"}
    listen_where_the_rendezvous_is(unknown)
    assert unknown == {"MASTER_ADDR": "no-such-host.invalid"} and rendezvous_interface("") is None


@pytest.mark.parametrize(
    ("addr", "port", "message"),
    [
        ("127.0.0.1", "+1", "MASTER_PORT must be a port number in 1..65535 for the servers (got MASTER_PORT='+1')"),
        ("127.0.0.1", "٢٩٥٠٠", "MASTER_PORT must be a port number in 1..65535 for the servers (got MASTER_PORT="),
        ("127.0.0.1:29500", "29500", "MASTER_ADDR='127.0.0.1:29500' for the servers: it holds ':' but is no IPv6"),
        ("a b", "29500", "MASTER_ADDR='a b' for the servers: it is not a host name or an IP address"),
        ("x\x1b[2J", "29500", r"MASTER_ADDR='x\x1b[2J' for the servers: it is not a host name"),
        ("h" * 300, "29500", "MASTER_ADDR='hhhhhhhhhh"),
    ],
)
def test_master_address_rejects_what_cannot_be_a_host_or_a_port(addr, port, message):
    with pytest.raises(PlannerError) as info:
        master_address("the servers", {"MASTER_ADDR": addr, "MASTER_PORT": port})
    line = str(info.value)
    assert line.startswith(message) and "; fix: export MASTER_" in line and len(line) < 400, line
    assert "\x1b" not in line


def test_an_address_that_does_not_resolve_is_one_line_at_once():
    env = {"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"}
    assert check_rpc_environment("the servers", env, resolve_address=False) == ("no-such-host.invalid", 29500)
    with pytest.raises(PlannerError, match=r"^MASTER_ADDR='no-such-host\.invalid' for the servers does not resolve \("):
        check_rpc_environment("the servers", env)
    started = time.monotonic()
    assert wait_for_listener("no-such-host.invalid", 29500, timeout_s=30).startswith("no-such-host.invalid does not")
    assert time.monotonic() - started < 10


def test_wait_for_listener_answers_once_a_socket_listens_and_names_a_refusal_after_the_timeout():
    with socket.socket() as held:  # bound, never listening: connections to it are refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        started = time.monotonic()
        assert wait_for_listener("127.0.0.1", port, timeout_s=0.5) == "[Errno 111] Connection refused"
        assert 0.5 <= time.monotonic() - started < 5
        held.listen()
        assert wait_for_listener("127.0.0.1", port, timeout_s=5) is None
