"""``persia calibrate --topology T --out-dir DIR`` under torchrun: one profile per host class, measured on the cluster.

Each host of the topology that runs a process of a job (its trainer hosts and parameter servers) runs one process
of the calibration, named as ``persia train`` names its nodes (``--node-host`` / ``PERSIA_HOST``, else by rank: the
hosts in file order, one rank each). They meet in a gloo group in torchrun's store, then:

1. every process measures its own host (:data:`~persia_planner.modules.tools.calibrate.HOST_BENCHMARKS`: memory,
   fbgemm's TBE, the dense network, the servers' store, the disk), each measurement repeated until quiet. Processes
   on one machine (one kernel: network namespaces, containers) take turns, as they would disturb each other;
   machines measure at once;
2. the trainer hosts' processes measure gloo all-to-all and all-reduce among themselves (a group of their own), over
   the links between them (one trainer host: between two local processes, as ``persia calibrate`` does);
3. the first trainer exchanges large messages with every other host's process in turn (gloo send and receive): the
   rate each link reached;
4. the first trainer looks rows up on and pushes gradients to the first parameter server over torch.distributed.rpc,
   as a trainer of a job does (no server: a local one, as ``persia calibrate`` does);
5. the first trainer gathers every host's results and writes ``DIR/<host class>.yaml`` per host class (a ``hosts:``
   entry of the topology): the median of its hosts' measurements, the cluster's collectives and PS requests, and
   where it was measured (``machine.topology_host``, the host names, when; ``where:`` the topology, the hosts and
   the links with their rates).

The step phase (small ``persia train`` jobs) does not run here: the profiles say so (``step.skipped``), and
``persia calibrate --from-runs`` refits the step's factors from jobs run on the cluster.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.modules.tools.cluster_profiles import (
    SIZES,
    STEP_SKIPPED,
    CalibrationHost,
    calibration_host,
    class_profile,
    host_classes,
    host_phase_s,
    profile_outputs,
    sizes_of,
    write_profile,
)
from persia_planner.topology.graph import Topology
from persia_planner.topology.torchrun_nodes import NODE_HOST_ENV, TorchrunProcess, job_hosts

if TYPE_CHECKING:
    from persia_planner.modules.tools.calibrate import Sizes
    from persia_planner.outputs import Output

__all__ = ["GROUP_TIMEOUT_S", "LINK_MESSAGE_BYTES", "calibrate_cluster", "cluster_command"]

GROUP_TIMEOUT_S = 300.0
"""How long a collective of the calibration's group waits for a process that stopped answering."""
_PREFIX = "persia-calibrate"
LINK_MESSAGE_BYTES = 1024**2
"""The least message a link's rate is measured with (a large one: what the NIC reaches, not its latency)."""
LINK_WARMUP_CALLS = 4


def _machine_key() -> str:
    """What processes of one machine share (one kernel: network namespaces and containers of it alike)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _say(line: str) -> None:
    print(f"persia calibrate: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _World:
    """The calibration's gloo group, and where each host's process is in it."""

    me: CalibrationHost
    rank_of: dict[str, int]
    wait_s: float

    def barrier(self, phase: str) -> None:
        """Wait for every process to finish ``phase``, at most :attr:`wait_s`."""
        import torch.distributed as dist

        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.wait_s), wait_all_ranks=True)
        except RuntimeError as err:
            raise PlannerError(
                f"{self.me.host}: not every host finished {phase} within {self.wait_s:g} s "
                f"({str(err).strip().splitlines()[0][:200]})",
                fixes=("see the other hosts' torchrun output for the host that failed first",),
                kind=ErrorKind.UNAVAILABLE,
            ) from None


@contextmanager
def _group(me: CalibrationHost) -> Iterator[None]:
    """The calibration's gloo group of every host's process, in torchrun's store under a namespace of its own."""
    import torch.distributed as dist

    from persia_planner.modules.rpc_environment import listen_where_the_rendezvous_is, master_address

    addr, port = master_address("persia calibrate's group")
    listen_where_the_rendezvous_is()
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    run, restart = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"{_PREFIX}-{run}-{restart}", dist.TCPStore(addr, port, is_master=False, timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=me.rank, world_size=me.world_size, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def calibrate_cluster(
    topology: Topology,
    classes: Mapping[str, str],
    me: CalibrationHost,
    sizes: Sizes,
    *,
    quick: bool,
    out_dir: Path,
    overwrite: bool,
    host_phase_s: float,
) -> dict[Path, dict[str, Any]]:
    """Calibrate the cluster from this process (see the module docstring); every host's process calls it.

    Args:
        topology: The job's topology.
        classes: Each host's class (:func:`host_classes`).
        me: This process's host (:func:`calibration_host`).
        sizes: What to measure (:func:`sizes_of`).
        quick: Recorded in the profiles' ``machine:``.
        out_dir: Where the first trainer writes the profiles (checked there before anything is measured).
        overwrite: Whether the profiles may replace ones persia wrote.
        host_phase_s: How long one host's own benchmarks may take (the others wait that long per turn).

    Returns:
        On the first trainer, each profile written and its content; elsewhere nothing.

    Raises:
        PlannerError: Two processes claim one host, a class mixes device kinds, ``--out-dir`` is refused (on every
            host, naming it), or a host did not finish a phase in time.
    """
    import torch
    import torch.distributed as dist

    from persia_planner.modules.tools.calibrate import device_kind

    torch.set_num_threads(1)  # as one trainer process runs
    writer = topology.trainers[0].name
    wanted = sorted(set(classes.get(h.name, h.name) for h in job_hosts(topology)))
    with _group(me):
        refused = None
        outputs: list[Output] = []
        if me.host == writer:
            try:
                outputs = profile_outputs(out_dir, wanted, overwrite=overwrite)
            except PlannerError as err:
                refused = str(err)
        claims: list[Any] = [None] * me.world_size
        dist.all_gather_object(claims, (me.host, _machine_key(), device_kind(), refused))
        _check_claims(claims, classes, me.host)
        turns: dict[str, list[str]] = {}
        for host, key, _, _ in claims:
            turns.setdefault(key, []).append(host)
        world = _World(me, {c[0]: r for r, c in enumerate(claims)}, host_phase_s)
        # Every process takes as many turns as the most crowded machine has hosts: the barriers then match.
        rounds = max(len(hosts) for hosts in turns.values())
        mine = _own_benchmarks(me, sizes, quick, world, turns[_machine_key()], rounds)
        cluster = _between_hosts(topology, world, sizes)
        gathered: list[Any] = [None] * me.world_size
        dist.all_gather_object(gathered, mine)
    if me.host != writer:
        return {}
    cluster["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    cluster["quiet"] = dataclasses.asdict(sizes.quiet)
    written = {}
    for out, host_class in zip(outputs, wanted, strict=True):
        results = [g for g in gathered if classes.get(g["host"], g["host"]) == host_class]
        profile = class_profile(host_class, results, cluster, topology.name)
        write_profile(out, profile, overwrite)
        written[out.path] = profile
    return written


def _check_claims(claims: Sequence[Any], classes: Mapping[str, str], me: str) -> None:
    """Refuse, on every process alike, what the processes' claims (host, machine, device kind, refusal) show wrong:
    the writer's refusal of ``--out-dir`` (named as that host's elsewhere), a host claimed twice, a class of hosts
    with different devices."""
    refused = next((c for c in claims if c[3] is not None), None)
    if refused is not None:
        raise PlannerError(refused[3] if me == refused[0] else f"on host {refused[0]}: {refused[3]}")
    seen: dict[str, int] = {}
    for rank, (host, *_rest) in enumerate(claims):
        if host in seen:
            raise PlannerError(
                f"host {host!r} is measured by two processes (ranks {seen[host]} and {rank}): two nodes name it",
                fixes=(f"name each host on one node only (--node-host or {NODE_HOST_ENV})",),
            )
        seen[host] = rank
    devices: dict[str, set[str]] = {}
    for host, _, device, _ in claims:
        devices.setdefault(classes.get(host, host), set()).add(device)
    mixed = next(((c, d) for c, d in devices.items() if len(d) > 1), None)
    if mixed is not None:
        raise PlannerError(
            f"the hosts of class {mixed[0]!r} have different devices ({', '.join(sorted(mixed[1]))}): one profile "
            "cannot describe them",
            fixes=("give each kind of machine a hosts: entry of its own",),
        )


def _own_benchmarks(
    me: CalibrationHost, sizes: Sizes, quick: bool, world: _World, turns: Sequence[str], rounds: int
) -> dict[str, Any]:
    """This host's own benchmarks, in its machine's turn (``turns``: the hosts of its machine in order) of
    ``rounds`` turns that every process takes alike: ``host``, ``machine``, ``benchmarks`` and ``noise``."""
    from persia_planner.modules.tools.calibrate import BENCHMARKS, HOST_BENCHMARKS, machine_section
    from persia_planner.modules.tools.noise import NoiseLog

    result: dict[str, Any] = {"host": me.host}
    for turn in range(rounds):
        if turn < len(turns) and turns[turn] == me.host:
            result["machine"] = machine_section(quick, me.host_class)
            noise = NoiseLog(sizes.quiet)
            result["benchmarks"] = {}
            for name in HOST_BENCHMARKS:
                started = time.perf_counter()
                result["benchmarks"][name] = BENCHMARKS[name](sizes, noise.timer(name))
                _say(f"{me.host}: {name} done ({time.perf_counter() - started:.1f} s)")
            result["noise"] = noise.benchmarks
        world.barrier(f"its own benchmarks (turn {turn + 1} of {rounds} on one machine)")
    return result


def _between_hosts(topology: Topology, world: _World, sizes: Sizes) -> dict[str, Any]:
    """The measurements over the links, on every process: collectives among the trainer hosts, each link's rate
    from the first trainer, PS requests from the first trainer to the first server. The first trainer returns
    them (``collectives``, ``rpc``, ``links``, ``noise``, ``collectives_hosts``, ``rpc_hosts``)."""
    import torch.distributed as dist

    from persia_planner.modules.tools.calibrate import collectives, measure_collectives, rpc
    from persia_planner.modules.tools.noise import Timer

    me, first = world.me.host, topology.trainers[0].name
    trainers = [h.name for h in topology.trainers]
    noise: dict[str, list[dict[str, Any]]] = {"collectives": [], "links": [], "rpc": []}
    out: dict[str, Any] = {"noise": noise, "links": {}}
    group = dist.new_group(sorted(world.rank_of[t] for t in trainers))  # every process takes part in making it
    if len(trainers) > 1:
        if me in trainers:
            result = measure_collectives(sizes, Timer(sizes.quiet, noise["collectives"]), group)
            out["collectives"] = {"backend": "gloo", "processes": len(trainers), **result}
        out["collectives_hosts"] = trainers
    elif me == first:  # one trainer host: its devices' collectives are between its own processes
        out["collectives"] = collectives(sizes, Timer(sizes.quiet, noise["collectives"]))
        out["collectives_hosts"] = [first]
    world.barrier("the collectives")
    size = max(*sizes.message_bytes, LINK_MESSAGE_BYTES)
    for peer in (h.name for h in job_hosts(topology) if h.name != first):
        if me in (first, peer):
            rate = _link_rate(world.rank_of[first], world.rank_of[peer], me == first, size, sizes, noise["links"])
            out["links"][f"{first}-{peer}"] = {"between": [first, peer], "message_bytes": size, "bytes_per_s": rate}
        dist.barrier()
    servers = [h.name for h in topology.servers]
    out["rpc_hosts"] = [first, *servers[:1]] if servers else [first]
    if servers and me in (first, servers[0]):
        measured = _rpc_to_first_server(me == first, sizes, noise["rpc"])
        if measured is not None:
            out["rpc"], out["links"][f"{first}-{servers[0]}"]["rpc_lookup_bytes_per_s"] = measured
    elif not servers and me == first:  # no server host: a server process on this host
        out["rpc"] = rpc(sizes, Timer(sizes.quiet, noise["rpc"]))
    world.barrier("the PS requests")
    return out


def _link_rate(first: int, peer: int, leads: bool, n_bytes: int, sizes: Sizes, records: list[dict[str, Any]]) -> float:
    """Bytes a second one way between ranks ``first`` and ``peer``: a message of ``n_bytes`` there and back (gloo
    send and receive); the first rank times it and decides when it stops (the peer follows its verdict)."""
    import torch
    import torch.distributed as dist

    from persia_planner.modules.tools.noise import Timer

    x = torch.zeros(n_bytes // 4)
    other = peer if leads else first

    def there_and_back() -> None:
        if leads:
            dist.send(x, other)
            dist.recv(x, other)
        else:
            dist.recv(x, other)
            dist.send(x, other)

    def verdict(stop: bool) -> bool:
        flag = torch.tensor([int(stop)])
        dist.send(flag, other) if leads else dist.recv(flag, other)
        return bool(flag.item())

    timer = Timer(sizes.quiet, records if leads else [])
    # A link idle since the last phase restarts TCP's slow start: the first exchanges are slower, and not counted.
    point = f"rank {first} <-> rank {peer}, {n_bytes} B"
    seconds = timer.median_s(point, there_and_back, sizes.repeats * 2, LINK_WARMUP_CALLS, verdict)
    return 2 * n_bytes / seconds


def _rpc_to_first_server(
    trainer: bool, sizes: Sizes, records: list[dict[str, Any]]
) -> tuple[dict[str, Any], float] | None:
    """PS requests between the first trainer and the first server (``ps0``), in an RPC group of their own, joined
    as a job's trainer and server join theirs. The trainer returns the ``rpc`` section and the bytes a second of
    rows that lookups of :data:`LINK_MESSAGE_BYTES` of rows bring back."""
    import torch

    from persia_planner.modules.ps.connection import joined
    from persia_planner.modules.ps.protocol import TableConfig
    from persia_planner.modules.ps.server import serve
    from persia_planner.modules.tools.calibrate import measure_rpc
    from persia_planner.modules.tools.noise import Timer

    if not trainer:
        serve(0, 2, name="ps0", rpc_timeout_s=GROUP_TIMEOUT_S, metrics_interval_s=None)
        return None
    timer = Timer(sizes.quiet, records)
    with joined("trainer0", 1, 2, servers=["ps0"], timeout_s=GROUP_TIMEOUT_S, rpc_timeout_s=GROUP_TIMEOUT_S) as client:
        points = measure_rpc(client, sizes, timer)
        dim = points[0]["dim"]
        rows = LINK_MESSAGE_BYTES // (dim * 4)
        client.register(TableConfig("calibrate-link", dim, capacity=2 * rows))
        ids = torch.arange(rows)

        def lookup() -> None:  # the first call (a warm-up) admits the rows
            client.lookup("calibrate-link", ids)

        seconds = timer.median_s(f"lookup {rows} rows (link)", lookup, sizes.repeats * 2, LINK_WARMUP_CALLS)
    return {"dim": dim, "requests": points}, rows * dim * 4 / seconds


def cluster_command(
    topology_file: Path | None,
    out_dir: Path | None,
    *,
    sizes_name: str,
    longer: float = 1.0,
    overwrite: bool = False,
    node_host: str | None = None,
) -> None:
    """``persia calibrate --topology T --out-dir DIR`` in one torchrun process: everything that needs no torch is
    checked first (the options, the topology, this process's host, torchrun's store), then
    :func:`calibrate_cluster`; the first trainer prints what it wrote and what was disturbed.

    Raises:
        PlannerError: One line naming the option, file or host and the fix.
    """
    if topology_file is None or out_dir is None:
        missing = "--topology" if topology_file is None else "--out-dir"
        raise PlannerError(
            f"a cluster calibration needs {missing} too",
            fixes=("run persia calibrate --topology T --out-dir DIR under torchrun, one process per host",),
        )
    if sizes_name not in SIZES:
        raise PlannerError(f"--sizes {sizes_name!r} is not one of {', '.join(SIZES)}", fixes=("use --quick",))
    from persia_planner.topology.graph import load_topology

    topology = load_topology(topology_file)
    classes = host_classes(topology_file)
    if "RANK" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        raise PlannerError(
            "persia calibrate --topology runs under torchrun, one process per host of the topology",
            fixes=("launch it as docs/multinode.md's 'Calibrating the cluster' shows",),
        )
    me = calibration_host(topology, classes, TorchrunProcess.from_environ(), node_host or os.environ.get(NODE_HOST_ENV))
    from persia_planner.modules.train.torchrun_start import require_job_store
    from persia_planner.modules.train_extra import require_training_stack

    require_job_store()
    require_training_stack("persia calibrate")
    sizes = sizes_of(sizes_name, longer)
    written = calibrate_cluster(
        topology,
        classes,
        me,
        sizes,
        quick=sizes_name != "full",
        out_dir=out_dir,
        overwrite=overwrite,
        host_phase_s=host_phase_s(sizes_name, longer),
    )
    if not written:
        return
    from persia_planner.topology.profile import HardwareProfile
    from persia_planner.topology.provenance import disturbed_warnings

    for path, raw in written.items():
        fitted = HardwareProfile.from_dict(raw, str(path))
        links = ", ".join(f"{k} {v['bytes_per_s'] / 1e6:,.0f} MB/s" for k, v in raw["where"]["links"].items())
        print(f"wrote {path}: {', '.join(raw['where']['hosts'])}" + (f"; links {links}" if links else ""), flush=True)
        for line in disturbed_warnings(fitted.noise, repeated_longer=longer > 1):
            print(f"{path.stem}: {line}", file=sys.stderr, flush=True)
    _say(f"the step phase does not run under torchrun: {STEP_SKIPPED}")
