"""A trainer's membership of a PS group: join it and get a :class:`~.client.PsClient`, leave it at the end.

:func:`connect` joins the RPC group (:func:`.group.join_rpc_group`) and finds the servers ``ps0 .. ps{n-1}``
(:func:`discover_servers`); :func:`joined` also leaves the group when its block ends, gracefully after a normal exit
(giving up on a lost worker, :func:`.group.leave_group`) and at once after an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc

from persia_planner.errors import PlannerError
from persia_planner.modules.ps.allocator import tune_allocator
from persia_planner.modules.ps.client import PsClient
from persia_planner.modules.ps.group import DEFAULT_PEER_TIMEOUT_S, DEFAULT_RPC_TIMEOUT_S, join_rpc_group, leave_group
from persia_planner.modules.ps.protocol import check_wire_dtype, is_server_name, server_index

__all__ = ["connect", "discover_servers", "joined"]


def discover_servers() -> list[str]:
    """Names ``ps0 .. ps{n-1}`` of the servers in the current RPC group, in index order."""
    agent = rpc.api._get_current_rpc_agent()
    found = {
        server_index(info.name, info.id): info.name for info in agent.get_worker_infos() if is_server_name(info.name)
    }
    if sorted(found) != list(range(len(found))):
        raise PlannerError(f"parameter servers must be named ps0..ps{{n-1}}, found {sorted(found.values())}")
    return [found[i] for i in range(len(found))]


def connect(
    name: str,
    rank: int,
    world_size: int,
    *,
    servers: Sequence[str] | None = None,
    timeout_s: float = 10.0,
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    delay_ms: float = 0.0,
    wire_dtype: torch.dtype = torch.float32,
) -> PsClient:
    """Join the RPC group as trainer ``name`` (``MASTER_ADDR``/``MASTER_PORT`` from the env) and return a client.

    Args:
        name: This trainer's RPC name (e.g. ``trainer0``).
        rank: Its rank; trainers conventionally follow the servers.
        world_size: Servers plus trainers.
        servers: Server names in index order; default: every ``ps{i}`` worker of the group.
        timeout_s: Per-request timeout of the client.
        rpc_timeout_s: Default RPC timeout of this process (rendezvous, shutdown barrier).
        delay_ms: Latency injected before every request (see :class:`PsClient`).
        wire_dtype: The dtype rows and gradients travel in (see :class:`PsClient`).

    The caller leaves the group once done: :func:`.group.leave_group` (a graceful ``rpc.shutdown()`` that gives up
    on a worker that died or hangs) or ``rpc.shutdown()``. :func:`joined` does it all.

    Raises:
        ValueError: ``wire_dtype`` is not torch.float32, torch.float16 or torch.bfloat16 (checked before joining
            the group, whose other members would otherwise wait for this one at shutdown).
        PlannerError: The group did not come together within ``rpc_timeout_s`` (see
            :func:`.group.join_rpc_group`).
    """
    check_wire_dtype(wire_dtype)
    tune_allocator()
    join_rpc_group(name, rank, world_size, rpc_timeout_s)
    return PsClient(
        list(servers) if servers is not None else discover_servers(),
        timeout_s=timeout_s,
        delay_ms=delay_ms,
        wire_dtype=wire_dtype,
    )


@contextlib.contextmanager
def joined(
    name: str,
    rank: int,
    world_size: int,
    *,
    peer_timeout_s: float | None = DEFAULT_PEER_TIMEOUT_S,
    **options: Any,
) -> Iterator[PsClient]:
    """:func:`connect`, and leave the group when the block ends, never waiting forever for a lost worker.

    On a normal exit the client flushes its pushes and waits for the rest of the group in the graceful shutdown
    (:func:`.group.leave_group`); a server that died or hangs meanwhile is given up on after about
    ``peer_timeout_s`` with one line naming it, instead of keeping this trainer waiting forever. If the block (or the
    flush) raises, the trainer leaves at once (``rpc.shutdown(graceful=False)``) and the error goes on as it came:
    a graceful shutdown would wait for the very server that failed it, or for other trainers that wait for this one
    in a collective. The servers then give up on this trainer after their own peer timeout (``persia ps``), or the
    launcher (torchrun) ends the job::

        with joined(f"trainer{i}", rank, world_size) as client:
            client.register(config)
            ...

    Args:
        name: This trainer's RPC worker name, as for :func:`connect`.
        rank: Its rank in the group, as for :func:`connect`.
        world_size: Servers + trainers, as for :func:`connect`.
        peer_timeout_s: See :func:`.group.leave_group`; None or 0: wait for every worker forever.
        **options: :func:`connect`'s keyword arguments (``timeout_s``, ``wire_dtype``...).

    Raises:
        PeerLostError: A worker of the group stopped answering while this one waited for the shutdown.
    """
    client = connect(name, rank, world_size, **options)
    try:
        yield client
        client.flush()
    except BaseException:
        client.close()
        rpc.shutdown(graceful=False)
        raise
    client.close()
    leave_group(peer_timeout_s=peer_timeout_s)
