"""benchmarks/netns.py: hosts as network namespaces on a bridge of their own, shaped NICs, always torn down,
nothing added to the machine's own namespace."""

from __future__ import annotations

import os
import signal
import sys

import pytest
from benchmark_modules import load

netns = load("netns")


@pytest.fixture
def namespaces_here() -> None:
    """Skip, saying why, where network namespaces cannot be made (checking makes one: a process)."""
    try:
        netns.check_available()
    except netns.Unavailable as err:
        pytest.skip(str(err))


def _ours() -> list[str]:
    return [ns for ns in netns.namespaces() if ns.startswith(f"pp{os.getpid()}-")]


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_hosts_reach_each_other_on_their_addresses_with_shaped_egress_and_leave_nothing_behind(namespaces_here):
    before = netns.root_links()
    with netns.NetCluster(["a", "b", "c"], {"a": 50.0}) as cluster:
        assert [h.address for h in cluster.hosts.values()] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        for ingress in (False, True):  # a full-duplex NIC: shaped each way
            assert "tbf" in cluster.qdisc("a", ingress) and "rate 50Mbit" in cluster.qdisc("a", ingress)
            assert "tbf" not in cluster.qdisc("b", ingress)
        assert netns.root_links() == before  # every link is inside the cluster's namespaces
        # A receiver on b's address, a bounded transfer from a (through a's shaped egress).
        assert netns.transfer_mbit(cluster, "a", "b", 20_000) > 0
        # Each host finds its own interface on the route to the rendezvous (TensorPipe's and gloo's, unset).
        probe = "from persia_planner.modules.rpc_environment import rendezvous_interface as r; print(r('198.18.0.1'))"
        for host in ("a", "b"):
            assert cluster.run(host, [sys.executable, "-c", probe]).stdout.strip() == "eth0"
        sleeper = cluster.popen("c", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert len(_ours()) == 4  # the bridge's namespace and the three hosts'
    assert _ours() == [] and netns.root_links() == before
    assert sleeper.poll() == -signal.SIGKILL  # what ran in the cluster ended with it


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_failure_while_building_tears_down_what_was_built(namespaces_here, monkeypatch):
    def refuse(*args: str) -> None:
        raise RuntimeError(f"tc {' '.join(args)}: refused")

    monkeypatch.setattr(netns, "_tc", refuse)  # the second host's shaping fails, after two namespaces exist
    with pytest.raises(RuntimeError, match=r"tc -n pp\d+-h1 qdisc add"), netns.NetCluster(["a", "b"], {"b": 5.0}):
        pass
    assert _ours() == []


def test_where_namespaces_cannot_be_made_it_says_why_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/sbin/{tool}")
    refused = netns.subprocess.CompletedProcess(
        [], 1, "", "mount --make-shared /run/netns failed: Operation not permitted\n"
    )
    monkeypatch.setattr(netns, "_ip", lambda *args, check=True: refused)
    with pytest.raises(netns.Unavailable, match=r"^cannot create network namespaces here \(mount --make-shared"):
        netns.check_available()


def test_without_root_it_says_why_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netns.Unavailable, match=r"^the namespace cluster needs root \(ip netns add\)"):
        netns.check_available()
    with pytest.raises(ValueError, match="rates for hosts"):
        netns.NetCluster(["a"], {"z": 1.0})
    with pytest.raises(ValueError, match="NIC rates must be positive"):
        netns.NetCluster(["a"], {"a": -5.0})
