"""The RPC group's environment, read without torch: the rendezvous address and the TensorPipe transports."""

from __future__ import annotations

import pytest

from persia_planner.errors import PlannerError
from persia_planner.modules.rpc_environment import (
    is_loopback,
    listen_where_the_rendezvous_is,
    master_address,
    rendezvous_interface,
    rpc_channels,
    rpc_transports,
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
