"""The roles of a torchrun job's processes, announced in the job's store: a host claimed twice is refused, and the
first trainer reports where every process ran.

Which role a process has is decided without torch (:func:`persia_planner.topology.torchrun_nodes.process_role`); here
each process claims its role in the rendezvous store torchrun's agents share, under the run's namespace
(:func:`.launcher.launch.trainers_store`), so two nodes that name the same host do not both run its processes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist

from persia_planner.errors import PlannerError
from persia_planner.modules.launcher.launch import trainers_store
from persia_planner.topology.torchrun_nodes import NODE_HOST_ENV, ProcessRole, TorchrunProcess

__all__ = ["claim_role", "job_processes", "with_processes"]


def _roles_store() -> dist.Store:
    return dist.PrefixStore("roles", trainers_store())


def claim_role(role: ProcessRole, process: TorchrunProcess) -> None:
    """Claim ``role`` for this process and publish where it runs.

    Raises:
        PlannerError: Another process claimed the same role first (two nodes are the same topology host).
    """
    store = _roles_store()
    if store.add(f"claim/{role.name}", 1) > 1:
        raise PlannerError(
            f"{role.name} of host {role.host!r} is run by two torchrun processes (node {process.node_rank} is the "
            "second): two nodes are the same topology host",
            fixes=(f"name each host on one node only (--node-host or {NODE_HOST_ENV})",),
        )
    entry = {"rank": process.rank, "node": process.node_rank, "host": role.host, "role": role.name}
    entry |= {"pid": os.getpid(), "agent_pid": os.getppid()}  # agent: the node's torchrun, which started it
    store.set(f"rank/{process.rank}", json.dumps(entry))


def job_processes(world_size: int) -> list[dict[str, Any]]:
    """Where every process of the job runs, by global rank: ``{"rank", "node", "host", "role", "pid",
    "agent_pid"}`` (waits for each process's :func:`claim_role`, up to the store's timeout)."""
    store = _roles_store()
    return [json.loads(store.get(f"rank/{rank}")) for rank in range(world_size)]


def with_processes(result: dict[str, Any] | None, world_size: int) -> dict[str, Any] | None:
    """The first trainer's summary with ``processes`` (:func:`job_processes`) added; None stays None."""
    return None if result is None else result | {"processes": job_processes(world_size)}
