"""Which topology host each torchrun node is, and what each of its processes runs: a server or a trainer.

A job runs one process per ``role: parameter_server`` host (server ``i`` is ``ps{i}``, ``topology.servers[i]``) and
one per trainer device (trainer ``j`` runs what the plan put on ``topology.gpus[j]``). A torchrun node runs the
processes of one or more whole hosts: its parameter servers first, then its trainers, in the order of its local
ranks. Which hosts a node is:

* named: ``persia train --node-host NAME[,NAME...]`` or ``PERSIA_HOST`` (what SLURM and Kubernetes set per node;
  c10d rendezvous numbers the nodes by their address, not by ``--node-rank``);
* else by rank: the topology's hosts in file order, each taking as many global ranks as it runs processes; the node
  whose ranks start at ``RANK - LOCAL_RANK`` is the hosts its ``LOCAL_WORLD_SIZE`` ranks cover.

Everything here is pure and torch-free: the CLI checks a world against the plan before torch is imported.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

from persia_planner.errors import PlannerError
from persia_planner.topology.graph import Topology
from persia_planner.topology.hardware import Host, Role

__all__ = [
    "NODE_HOST_ENV",
    "ProcessKind",
    "ProcessRole",
    "TorchrunProcess",
    "host_processes",
    "job_hosts",
    "node_hosts",
    "node_layout",
    "node_roles",
    "parse_host_names",
    "process_role",
]

NODE_HOST_ENV = "PERSIA_HOST"
"""The environment variable naming the topology host(s) a torchrun node is (comma-separated)."""


class ProcessKind(enum.StrEnum):
    """What one process of a job runs."""

    SERVER = "server"
    TRAINER = "trainer"


@dataclass(frozen=True)
class ProcessRole:
    """One process of a job.

    Attributes:
        kind: Server or trainer.
        index: The server's index (it is ``ps{index}``) or the trainer's rank in the trainers' group.
        host: The topology host it runs for.
    """

    kind: ProcessKind
    index: int
    host: str

    @property
    def name(self) -> str:
        """Its name in the RPC group: ``ps{i}`` or ``trainer{j}``."""
        return f"ps{self.index}" if self.kind is ProcessKind.SERVER else f"trainer{self.index}"


@dataclass(frozen=True)
class TorchrunProcess:
    """What torchrun told one process about its place in the world.

    Attributes:
        rank: ``RANK``.
        world_size: ``WORLD_SIZE``: processes on every node together.
        local_rank: ``LOCAL_RANK``: its place on its node.
        local_world_size: ``LOCAL_WORLD_SIZE``: its node's processes (``--nproc-per-node``).
        node_rank: ``GROUP_RANK``: its node's rank (the rendezvous's numbering).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TorchrunProcess:
        """Read torchrun's variables (one node of ``WORLD_SIZE`` processes when the node's are unset).

        Raises:
            PlannerError: ``RANK`` or ``WORLD_SIZE`` is unset (``TORCHELASTIC_RUN_ID`` says torchrun started it),
                or a variable is not a whole number.
        """
        env = os.environ if environ is None else environ
        missing = [v for v in ("RANK", "WORLD_SIZE") if v not in env]
        if missing:
            raise PlannerError(
                f"TORCHELASTIC_RUN_ID is set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                "not: not a complete torchrun environment",
                fixes=("launch with torchrun", "unset TORCHELASTIC_RUN_ID to train locally"),
            )
        values = {}
        for var, default in (
            ("RANK", None),
            ("WORLD_SIZE", None),
            ("LOCAL_RANK", "RANK"),
            ("LOCAL_WORLD_SIZE", "WORLD_SIZE"),
            ("GROUP_RANK", None),
        ):
            text = env.get(var, env.get(default, "0") if default else "0")
            try:
                values[var] = int(text)
            except ValueError:
                raise PlannerError(f"{var} is {text!r}, not a whole number", fixes=("launch with torchrun",)) from None
        return cls(
            values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"], values["GROUP_RANK"]
        )


def job_hosts(topology: Topology) -> tuple[Host, ...]:
    """The hosts that run a process of the job (parameter servers and trainer hosts), in the topology file's order."""
    order = {name: i for i, name in enumerate(topology.graph.nodes)}
    return tuple(sorted((*topology.trainers, *topology.servers), key=lambda h: order[h.name]))


def host_processes(topology: Topology, host: Host) -> tuple[ProcessRole, ...]:
    """The processes ``host`` runs: its server, or a trainer per device (trainer ``j`` on ``topology.gpus[j]``)."""
    if host.role is Role.PARAMETER_SERVER:
        return (ProcessRole(ProcessKind.SERVER, topology.servers.index(host), host.name),)
    return tuple(ProcessRole(ProcessKind.TRAINER, topology.gpu_index(g), host.name) for g in host.gpus)


def node_roles(topology: Topology, hosts: tuple[Host, ...]) -> tuple[ProcessRole, ...]:
    """The processes of a node that is ``hosts``, by local rank: its servers first, then its trainers."""
    roles = [r for h in hosts for r in host_processes(topology, h)]
    return tuple(sorted(roles, key=lambda r: r.kind is ProcessKind.TRAINER))  # stable: host order within a kind


def node_layout(topology: Topology) -> tuple[tuple[str, int], ...]:
    """One node per host, in topology order: ``(host, --nproc-per-node)`` (the SLURM and Kubernetes layout)."""
    return tuple((h.name, len(host_processes(topology, h))) for h in job_hosts(topology))


def parse_host_names(text: str, topology: Topology, source: str = "--node-host") -> tuple[Host, ...]:
    """The hosts a ``--node-host`` / ``PERSIA_HOST`` value names (comma-separated), checked against ``topology``.

    Raises:
        PlannerError: A name that is not a host of the job, or one named twice.
    """
    by_name = {h.name: h for h in job_hosts(topology)}
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = ", ".join(by_name)
    if not names:
        raise PlannerError(f"{source} is empty", fixes=(f"name this node's host: one of {known}",))
    for name in names:
        if name not in by_name:
            raise PlannerError(
                f"{source} names {name!r}, not a trainer or parameter_server host of topology {topology.name!r}",
                fixes=(f"name one of {known}",),
            )
    if len(set(names)) < len(names):
        raise PlannerError(f"{source} names a host twice: {text!r}", fixes=("name each host once",))
    return tuple(by_name[n] for n in names)


def _layout_hint(topology: Topology) -> str:
    return ", ".join(f"{host} {procs}" for host, procs in node_layout(topology))


def node_hosts(topology: Topology, process: TorchrunProcess, named: str | None = None) -> tuple[Host, ...]:
    """The hosts this process's node is: those ``named`` (``--node-host`` / ``PERSIA_HOST``), else those its ranks
    cover in topology order.

    Raises:
        PlannerError: A named host is unknown, or the node's ranks do not cover whole hosts.
    """
    if named:
        return parse_host_names(named, topology)
    first, last = process.rank - process.local_rank, process.rank - process.local_rank + process.local_world_size
    covered, start = [], 0
    for host in job_hosts(topology):
        end = start + len(host_processes(topology, host))
        if first < end and start < last:
            if start < first or end > last:
                raise PlannerError(
                    f"torchrun node {process.node_rank} has ranks {first}..{last - 1}, which split host {host.name!r} "
                    f"(ranks {start}..{end - 1} in the host order of topology {topology.name!r})",
                    fixes=(
                        f"give each node whole hosts: --nproc-per-node per host {_layout_hint(topology)}",
                        f"name this node's hosts with --node-host or {NODE_HOST_ENV}",
                    ),
                )
            covered.append(host)
        start = end
    return tuple(covered)


def process_role(topology: Topology, process: TorchrunProcess, named: str | None = None) -> ProcessRole:
    """What this torchrun process runs, with the world checked against the topology first.

    Args:
        topology: The plan's topology.
        process: What torchrun told the process.
        named: The node's host names (``--node-host`` / ``PERSIA_HOST``); None or empty: by rank.

    Raises:
        PlannerError: The world is not the topology's processes (``WORLD_SIZE``), or this node's process count is
            not its hosts' (``LOCAL_WORLD_SIZE``), naming the numbers and the fix.
    """
    servers, trainers = len(topology.servers), len(topology.gpus)
    if process.world_size != servers + trainers:
        raise PlannerError(
            f"the torchrun world has {process.world_size} processes but topology {topology.name!r} runs "
            f"{servers + trainers}: {servers} parameter servers (one per parameter_server host) and {trainers} "
            f"trainers (one per trainer device)",
            fixes=(f"launch {servers + trainers} processes in all, per host: {_layout_hint(topology)}",),
        )
    mine = node_hosts(topology, process, named)
    roles = node_roles(topology, mine)
    if process.local_world_size != len(roles):
        names = ", ".join(h.name for h in mine) or "no host"
        raise PlannerError(
            f"torchrun node {process.node_rank} runs {process.local_world_size} processes (--nproc-per-node) but "
            f"its hosts ({names}) run {len(roles)}",
            fixes=(
                f"--nproc-per-node {len(roles)} on this node" if roles else "name this node's hosts",
                f"one node per host: {_layout_hint(topology)}",
            ),
        )
    if not 0 <= process.local_rank < len(roles):
        raise PlannerError(
            f"LOCAL_RANK {process.local_rank} is outside this node's {len(roles)} processes",
            fixes=("launch with torchrun",),
        )
    return roles[process.local_rank]
