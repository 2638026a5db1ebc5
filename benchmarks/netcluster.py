"""A cluster on one machine: hosts as network namespaces on one bridge, each host's egress shaped to its NIC.

:class:`NetCluster` builds, for N named hosts, a namespace per host and one more that holds the bridge; a veth pair
joins each host to the bridge, created straight inside the two namespaces, so nothing is added to the machine's own
network namespace. Host ``i`` has the address ``198.18.0.(i + 1)/24`` (RFC 2544's benchmarking range, 198.18.0.0/15)
and loopback; its egress goes through a token bucket (``tc tbf``) at the NIC bandwidth given for it (the topology's
``nic_bandwidth``). ``netem`` is not available here: latency stays ``--ps-delay-ms``'s job.

Processes started in a host (:meth:`NetCluster.popen`) run there through ``ip netns exec``, each in its own process
group; leaving the ``with`` block, or a failure while building, kills them and deletes every namespace, and so do
SIGINT and SIGTERM (``main`` turns them into exceptions) and interpreter exit. Namespaces carry the launcher's pid
(``pp<pid>-...``): a later run deletes those of launchers that are gone. Where the cluster cannot be built (not root,
no ``ip`` or ``tc``), one line says why (:class:`Unavailable`).

The benchmark (:func:`main`) runs the multi-node guide (docs/multinode.md) as written, one ``torchrun`` per host:
trainers on two hosts, parameter servers on two others behind NICs shaped to ``--ps-mbit``; the same K = 0 job on
this machine's own launcher; and K = 4 against K = 0 on the shaped link.

    python benchmarks/netcluster.py --json out.json     # 60 steps per run
    python benchmarks/netcluster.py --quick             # 20 steps per run (CI, where root is available)

JSON keys: ``hosts``, ``trained``, ``sync_equals_single_host``, ``sockets_outside_cluster`` (listening sockets bound
neither to their host's cluster address nor to loopback, listed in ``sockets_outside``), ``k4_over_k0``,
``auc_gap``, ``predicted_ms`` (the plan's step for the declared NICs), ``measured_ms``, ``step_error``,
``measured_mbit`` (a bounded transfer through each shaped NIC), ``root_links_unchanged``, ``torn_down``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
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
        rate_mbit: The rate its egress is shaped to (None: not shaped).
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
        rates_mbit: Per host, the rate its egress is shaped to (hosts not named are not shaped).
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
                # A burst of a few ms of traffic (at least 32 kbit), a queue of at most 50 ms: tbf as NIC pacing.
                burst_kbit = max(32, round(host.rate_mbit * 1000 / 250))
                _tc("-n", host.namespace, "qdisc", "add", "dev", host.interface, "root", "tbf",
                    "rate", f"{host.rate_mbit:g}mbit", "burst", f"{burst_kbit}kbit", "latency", "50ms")  # fmt: skip

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

    def listening(self, host: str) -> list[tuple[str, int]]:
        """The TCP sockets listening in ``host``: ``(address, port)``, ``0.0.0.0`` / ``::`` for every address."""
        out = _ip("netns", "exec", self.hosts[host].namespace, "ss", "-ltnH").stdout
        found = []
        for line in out.splitlines():
            local = line.split()[3]
            address, _, port = local.rpartition(":")
            found.append((address.strip("[]").split("%")[0], int(port)))
        return found

    def qdisc(self, host: str) -> str:
        """``tc qdisc show`` of ``host``'s cluster interface."""
        h = self.hosts[host]
        return _tc("-n", h.namespace, "qdisc", "show", "dev", h.interface).stdout


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


REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "persia_planner" / "examples" / "dlrm_small.yaml"
PROFILE = REPO / "persia_planner" / "examples" / "profiles" / "cpu-2core.yaml"
RDZV_PORT = 29500


def topology_yaml(ps_mbit: float, trainer_mbit: float = 10_000.0) -> str:
    """Two trainer hosts of one CPU trainer each and two parameter-server hosts, with the NICs declared as shaped."""
    return f"""name: netns-2x1-2ps
hosts:
  - name: trainer
    count: 2
    ddr: 8GiB
    nic_bandwidth: {trainer_mbit / 8000:g}GB/s
    profile: {PROFILE}
    cpus: {{count: 1, memory: 4MiB}}
  - name: ps
    count: 2
    role: parameter_server
    ddr: 2GiB
    nic_bandwidth: {ps_mbit / 8000:g}GB/s
    profile: {PROFILE}
network:
  latency: 50us
"""


def plan_for(work: Path, name: str, topology: Path, staleness: int) -> Path:
    """``persia plan`` of the bundled model on ``topology`` for staleness ``staleness``, into ``work/name``."""
    out = work / name
    done = subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", "plan", str(MODEL), str(topology), "--staleness", str(staleness),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"persia plan: {done.stderr.strip()[-500:]}")
    return out


def run_on_cluster(
    cluster: NetCluster, work: Path, topology: Path, plan: Path, train_args: Sequence[str], timeout_s: float = 600.0
) -> tuple[dict[str, Any], list[tuple[str, str, int]]]:
    """The job as docs/multinode.md runs it: one torchrun per host, c10d on the first host's cluster address (its
    torchrun with ``--local-addr``), no interface variables. Returns the first trainer's ``--json`` result and every
    listening socket seen while it ran: ``(host, address, port)``."""
    head = cluster.hosts[next(iter(cluster.hosts))].address
    args = ["-m", "persia_planner.cli", "train", "--model", str(MODEL), "--topology", str(topology),
            "--plan", str(plan), *train_args, "--json"]  # fmt: skip
    rdzv = ["--nnodes", str(len(cluster.hosts)), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:{RDZV_PORT}",
            "--rdzv-id", plan.stem]  # fmt: skip
    nodes = {}
    for i, name in enumerate(cluster.hosts):
        host_args = (
            ["--local-addr", head, "--rdzv-conf", "is_host=true"] if i == 0 else ["--rdzv-conf", "is_host=false"]
        )
        env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")} | {"PERSIA_HOST": name}
        with open(work / f"{plan.stem}-{name}.out", "w") as out, open(work / f"{plan.stem}-{name}.err", "w") as err:
            nodes[name] = cluster.popen(
                name,
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    *rdzv,
                    *host_args,
                    "--nproc-per-node",
                    "1",
                    *args,
                ],
                env=env,
                stdout=out,
                stderr=err,
                cwd=work,
            )
    sockets: set[tuple[str, str, int]] = set()
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in nodes.values()) and time.monotonic() < deadline:  # bounded in time
        for name in cluster.hosts:
            sockets |= {(name, a, port) for a, port in cluster.listening(name)}
        time.sleep(1.0)
    for p in nodes.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    codes = {name: p.wait() for name, p in nodes.items()}
    if any(codes.values()):
        name = next(n for n, c in codes.items() if c)
        tail = (work / f"{plan.stem}-{name}.err").read_text()[-800:]
        raise RuntimeError(f"the job failed on {name} (exit {codes[name]}): {tail}")
    lines = [x for n in cluster.hosts for x in (work / f"{plan.stem}-{n}.out").read_text().splitlines()]
    result = json.loads(next(x for x in lines if x.startswith("{")))
    return result, sorted(sockets)


def run_single_host(topology: Path, plan: Path, train_args: Sequence[str]) -> dict[str, Any]:
    """The same job with ``persia train``'s own launcher on this machine's loopback."""
    done = subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", "train", "--model", str(MODEL), "--topology", str(topology),
         "--plan", str(plan), *train_args, "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"persia train on one host: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def outside_cluster(cluster: NetCluster, sockets: Sequence[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """The listening sockets bound neither to their host's cluster address nor to loopback."""
    own = {name: {h.address, "127.0.0.1", "::1"} for name, h in cluster.hosts.items()}
    return [s for s in sockets if s[1] not in own[s[0]]]


@contextlib.contextmanager
def _signals_as_exceptions() -> Iterator[None]:
    """SIGINT and SIGTERM raise here, so that the ``with`` blocks above tear the cluster down."""

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--ps-mbit", type=float, default=200.0, help="the PS hosts' NIC rate (default 200)")
    parser.add_argument("--quick", action="store_true", help="fewer steps (CI)")
    args = parser.parse_args(argv)
    try:
        check_available()
    except Unavailable as err:
        print(f"skipped: {err}")
        return 0
    steps = 20 if args.quick else 60
    job = ["--steps", str(steps), "--batch-size", "1024", "--eval-batches", "4"]
    hosts = ["trainer0", "trainer1", "ps0", "ps1"]
    shaped = {"ps0": args.ps_mbit, "ps1": args.ps_mbit}
    before = root_links()
    machine = {"platform": platform.platform(), "cpus": os.cpu_count()}
    results: dict[str, Any] = {"machine": machine, "hosts": len(hosts), "ps_mbit": args.ps_mbit, "steps": steps}
    with tempfile.TemporaryDirectory(prefix="persia-netcluster-") as tmp, _signals_as_exceptions():
        work = Path(tmp)
        topology = work / "topology.yaml"
        topology.write_text(topology_yaml(args.ps_mbit))
        k0_plan, k4_plan = plan_for(work, "k0.json", topology, 0), plan_for(work, "k4.json", topology, 4)
        with NetCluster(hosts, shaped) as cluster:
            nbytes = int(args.ps_mbit * 1e6 / 8 * 0.5)
            results["measured_mbit"] = {s: transfer_mbit(cluster, s, "trainer0", nbytes) for s in shaped}
            k0, sockets = run_on_cluster(cluster, work, topology, k0_plan, [*job, "--mode", "sync"])
            k4, more = run_on_cluster(cluster, work, topology, k4_plan, [*job, "--staleness", "4"])
            outside = outside_cluster(cluster, sorted({*sockets, *more}))
            tags = [cluster.bridge, *(h.namespace for h in cluster.hosts.values())]
        single = run_single_host(topology, k0_plan, [*job, "--mode", "sync"])
    plan_ms = (
        json.loads(k4_plan.read_text() if k4_plan.exists() else "{}").get("step_ms") if False else k4["plan_step_ms"]
    )
    results |= {
        "trained": k0["steps"] == steps and k4["steps"] == steps,
        "sync_equals_single_host": all(abs(k0[k] - single[k]) <= 1e-6 for k in ("loss", "auc", "eval_loss")),
        "sockets_outside_cluster": len(outside),
        "sockets_outside": [list(s) for s in outside],
        "k0_samples_per_s": k0["samples_per_s"],
        "k4_samples_per_s": k4["samples_per_s"],
        "k4_over_k0": k4["samples_per_s"] / k0["samples_per_s"],
        "auc_k0": k0["auc"],
        "auc_k4": k4["auc"],
        "auc_gap": abs(k4["auc"] - k0["auc"]),
        "predicted_ms": plan_ms,
        "measured_ms": k4["step_ms"],
        "step_error": abs(plan_ms - k4["step_ms"]) / k4["step_ms"],
        "root_links_unchanged": root_links() == before,
        "torn_down": not set(tags) & set(namespaces()),
    }
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if results["root_links_unchanged"] and results["torn_down"] and results["trained"] else 1


if __name__ == "__main__":
    sys.exit(main())
