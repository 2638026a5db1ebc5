"""A cluster on one machine: hosts as network namespaces on one bridge, each host's NIC shaped to its rate.

:class:`NetCluster` builds, for N named hosts, a namespace per host and one more that holds the bridge; a veth pair
joins each host to the bridge, created straight inside the two namespaces, so nothing is added to the machine's own
network namespace. Host ``i`` has the address ``198.18.0.(i + 1)/24`` (RFC 2544's benchmarking range, 198.18.0.0/15)
and loopback; its traffic goes through token buckets (``tc tbf``), one each way, at the NIC bandwidth given for it
(the topology's ``nic_bandwidth``). ``netem`` is not available here: latency stays ``--ps-delay-ms``'s job.

Processes started in a host (:meth:`NetCluster.popen`) run there through ``ip netns exec``, each in its own process
group; leaving the ``with`` block, or a failure while building, kills them and deletes every namespace, and so does
interpreter exit (a script turns SIGINT and SIGTERM into exceptions for the same: ``netcluster.py``). Namespaces
carry the launcher's pid (``pp<pid>-...``): a later run deletes those of launchers that are gone. Where the cluster
cannot be built (not root, no ``ip`` or ``tc``, no right to create namespaces), one line says why
(:class:`Unavailable`). Every traffic loop here is bounded in bytes and time (:func:`transfer_mbit`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NETWORK = "198.18.0"  # hosts 198.18.0.1 .. 198.18.0.254, /24: inside the benchmarking range 198.18.0.0/15
MAX_HOSTS = 250
_PREFIX = re.compile(r"^pp(\d+)-")


class Unavailable(RuntimeError):
    """The cluster cannot be built on this machine (one line: why, and what would do)."""


@dataclass(frozen=True)
class NetHost:
    """One host of the cluster.

    Attributes:
        name: Its name (the topology's host name).
        namespace: Its network namespace.
        address: Its cluster address.
        interface: Its interface on the bridge (inside its namespace).
        rate_mbit: The rate its NIC is shaped to, each way (None: not shaped).
    """

    name: str
    namespace: str
    address: str
    interface: str
    rate_mbit: float | None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _command("ip", args, check)


def _tc(*args: str) -> subprocess.CompletedProcess:
    return _command("tc", args, True)


def _command(tool: str, args: Sequence[str], check: bool) -> subprocess.CompletedProcess:
    done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


def _shape(namespace: str, interface: str, rate_mbit: float) -> None:
    """Shape ``interface``'s egress to ``rate_mbit`` with a token bucket: a burst of a few ms of traffic (at least
    32 kbit) and a queue of at most 50 ms, as a NIC paces its frames."""
    burst_kbit = max(32, round(rate_mbit * 1000 / 250))
    _tc("-n", namespace, "qdisc", "add", "dev", interface, "root", "tbf",
        "rate", f"{rate_mbit:g}mbit", "burst", f"{burst_kbit}kbit", "latency", "50ms")  # fmt: skip


def namespaces() -> list[str]:
    """The machine's named network namespaces."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def root_links() -> list[str]:
    """The interface names of the machine's own network namespace (what the cluster must leave alone)."""
    out = _ip("-o", "link", "show", check=False).stdout
    return sorted(line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line)


def check_available() -> None:
    """Raise :class:`Unavailable` where namespaces cannot be built here."""
    if os.geteuid() != 0:
        raise Unavailable("the namespace cluster needs root (ip netns add): run it as root, or skip it")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise Unavailable(f"the namespace cluster needs {' and '.join(missing)} (iproute2): install it, or skip it")
    # Root in a container may still lack the right to create namespaces: one is made and deleted to find out.
    probe = f"pp{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        why = made.stderr.strip().splitlines()[-1] if made.stderr.strip() else f"exit {made.returncode}"
        raise Unavailable(f"cannot create network namespaces here ({why}): run it where root may, or skip it")


def sweep_stale() -> list[str]:
    """Delete the namespaces of launchers that are gone (a run killed before it could tear down); returns them."""
    gone = []
    for ns in namespaces():
        m = _PREFIX.match(ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    return gone


class NetCluster(contextlib.AbstractContextManager):
    """Hosts as network namespaces on one bridge (see the module docstring).

    Args:
        hosts: The hosts' names, in address order.
        rates_mbit: Per host, the rate its NIC is shaped to, each way (hosts not named are not shaped).
    """

    def __init__(self, hosts: Sequence[str], rates_mbit: Mapping[str, float] | None = None) -> None:
        if not 1 <= len(hosts) <= MAX_HOSTS or len(set(hosts)) != len(hosts):
            raise ValueError(f"a cluster of 1 to {MAX_HOSTS} distinct host names, got {list(hosts)}")
        rates = dict(rates_mbit or {})
        unknown = sorted(set(rates) - set(hosts))
        if unknown:
            raise ValueError(f"rates for hosts {unknown} that the cluster does not have")
        bad = {h: r for h, r in rates.items() if not 0 < r < float("inf")}
        if bad:
            raise ValueError(f"NIC rates must be positive Mbit/s, got {bad}")
        tag = f"pp{os.getpid()}"
        self.bridge = f"{tag}-br"
        self.hosts = {
            name: NetHost(name, f"{tag}-h{i}", f"{NETWORK}.{i + 1}", "eth0", rates.get(name))
            for i, name in enumerate(hosts)
        }
        self._processes: list[subprocess.Popen] = []
        self._built: list[str] = []

    # ---- building and tearing down ------------------------------------------------------------------------------

    def __enter__(self) -> NetCluster:
        check_available()
        sweep_stale()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.bridge)
        self._built.append(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts.values()):
            _ip("netns", "add", host.namespace)
            self._built.append(host.namespace)
            # Both ends made inside their namespaces: the machine's own namespace never holds either.
            _ip("link", "add", host.interface, "netns", host.namespace, "type", "veth", "peer", "name", f"p{i}",
                "netns", self.bridge)  # fmt: skip
            _ip("-n", self.bridge, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.bridge, "link", "set", f"p{i}", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            if host.rate_mbit is not None:
                # A NIC is full duplex: the host's egress is shaped on its end of the pair, its ingress on the bridge's.
                _shape(host.namespace, host.interface, host.rate_mbit)
                _shape(self.bridge, f"p{i}", host.rate_mbit)

    def close(self) -> None:
        """Kill every process started in the cluster and delete its namespaces (idempotent)."""
        for p in self._processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self._processes.clear()
        for ns in reversed(self._built):
            _ip("netns", "del", ns, check=False)
        self._built.clear()

    # ---- running things in a host -------------------------------------------------------------------------------

    def popen(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> Any:
        """Start ``argv`` in ``host``'s namespace, in a process group of its own (killed by :meth:`close`)."""
        ns = self.hosts[host].namespace
        process = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv], env=dict(env) if env is not None else None, start_new_session=True,
            **kwargs,
        )  # fmt: skip
        self._processes.append(process)
        return process

    def run(
        self, host: str, argv: Sequence[str], timeout_s: float = 60.0, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``host`` to its end (at most ``timeout_s``); its output captured as text."""
        process = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = process.communicate(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def listening(self, host: str) -> list[tuple[str, int, int]]:
        """The TCP sockets listening in ``host``: ``(address, port, pid)``, address ``*`` / ``0.0.0.0`` / ``::`` for
        every address of the host, pid 0 where ``ss`` names no process."""
        out = _ip("netns", "exec", self.hosts[host].namespace, "ss", "-ltnpH").stdout
        found = []
        for line in out.splitlines():
            local = line.split()[3]
            address, _, port = local.rpartition(":")
            pid = re.search(r"pid=(\d+)", line)
            found.append((address.strip("[]").split("%")[0], int(port), int(pid.group(1)) if pid else 0))
        return found

    def qdisc(self, host: str, ingress: bool = False) -> str:
        """``tc qdisc show`` of ``host``'s cluster interface, or with ``ingress`` of the bridge's end of its link
        (which shapes what the host receives)."""
        h = self.hosts[host]
        if ingress:
            return _tc("-n", self.bridge, "qdisc", "show", "dev", f"p{list(self.hosts).index(host)}").stdout
        return _tc("-n", h.namespace, "qdisc", "show", "dev", h.interface).stdout

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process of ``host``'s namespace at once (a machine that lost power); returns their pids."""
        pids = [int(x) for x in _ip("netns", "pids", self.hosts[host].namespace).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def outside(self, sockets: Sequence[tuple[str, str, int, str]]) -> list[tuple[str, str, int, str]]:
        """Of ``(host, address, port, owner)`` listening sockets, those bound neither to their host's cluster address
        nor to loopback."""
        own = {name: {h.address, "127.0.0.1", "::1"} for name, h in self.hosts.items()}
        return [s for s in sockets if s[1] not in own[s[0]]]


# A receiver that counts bytes until its sender closes, and a sender of a fixed amount: the transfer is bounded in
# bytes and in time (both ends time out), never a loop of its own.
_RECEIVE = """
import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(float(sys.argv[3]))
c, _ = s.accept()
c.settimeout(float(sys.argv[3]))
n, t0 = 0, None
while True:
    b = c.recv(1 << 16)
    if t0 is None:
        t0 = time.perf_counter()
    if not b:
        break
    n += len(b)
print(n, time.perf_counter() - t0)
"""
_SEND = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[4])
while True:
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
c.sendall(b"x" * int(sys.argv[3]))
c.close()
"""


@contextlib.contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """SIGINT and SIGTERM raise here, so that a :class:`NetCluster`'s ``with`` block tears the cluster down."""

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def transfer_mbit(cluster: NetCluster, src: str, dst: str, nbytes: int, timeout_s: float = 60.0) -> float:
    """Megabits per second of one TCP transfer of ``nbytes`` from ``src`` to ``dst`` (bounded in bytes and time)."""
    address, port = cluster.hosts[dst].address, 45000
    receiver = cluster.popen(
        dst, [sys.executable, "-c", _RECEIVE, address, str(port), str(timeout_s)], stdout=subprocess.PIPE, text=True
    )
    sender = cluster.run(src, [sys.executable, "-c", _SEND, address, str(port), str(nbytes), str(timeout_s)], timeout_s)
    if sender.returncode != 0:
        raise RuntimeError(f"transfer {src} -> {dst} failed: {sender.stderr.strip()[-300:]}")
    out, _ = receiver.communicate(timeout=timeout_s)
    received, seconds = out.split()
    if int(received) != nbytes:
        raise RuntimeError(f"transfer {src} -> {dst}: {received} of {nbytes} bytes arrived")
    return nbytes * 8 / 1e6 / max(float(seconds), 1e-9)
