"""The RPC group's environment, read without torch: the rendezvous address and the TensorPipe transports.

``persia ps`` and ``persia train`` check it before they import torch, so a mistake is answered at once; the group
itself (:mod:`.ps.group`) reads it when a process joins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from persia_planner.errors import PlannerError

__all__ = ["DEFAULT_RPC_TRANSPORTS", "RPC_TRANSPORTS_ENV", "master_address", "rpc_transports"]


def master_address(purpose: str) -> tuple[str, int]:
    """``MASTER_ADDR`` and ``MASTER_PORT`` (the torchrun convention), the rendezvous of ``purpose``.

    Raises:
        PlannerError: If either variable is unset, or ``MASTER_PORT`` is not a port number in 1..65535 (one line,
            naming the variable and ``purpose``).
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise PlannerError(
            f"MASTER_ADDR and MASTER_PORT must be set for {purpose} (got MASTER_ADDR={addr!r}, MASTER_PORT={port!r})",
            fixes=("export MASTER_ADDR=<host of rank 0> MASTER_PORT=<free port>, or launch with torchrun",),
        )
    try:
        number = int(port)
    except ValueError:
        number = 0
    if not 1 <= number <= 65535:
        raise PlannerError(
            f"MASTER_PORT must be a port number in 1..65535 for {purpose} (got MASTER_PORT={port!r})",
            fixes=("export MASTER_PORT=<free port>, e.g. 29500",),
        )
    return addr, number


# TensorPipe transports the group uses unless PERSIA_RPC_TRANSPORTS names others (see rpc_transports).
RPC_TRANSPORTS_ENV = "PERSIA_RPC_TRANSPORTS"
DEFAULT_RPC_TRANSPORTS = ("uv",)
_KNOWN_TRANSPORTS = ("uv", "shm", "ibv")


def rpc_transports(environ: Mapping[str, str] | None = None) -> list[str]:
    """The TensorPipe transports of this process: ``PERSIA_RPC_TRANSPORTS`` (comma-separated, in order of
    preference) or :data:`DEFAULT_RPC_TRANSPORTS`.

    Why ``uv`` (TCP, epoll) and not TensorPipe's default ``shm`` first: the shm transport's reactor thread polls
    without sleeping, so every PS and trainer process on a host keeps a core busy even when idle; on a 2-core machine
    with a server and a trainer that is the whole machine. Tensors between processes of one host still take
    TensorPipe's ``cma`` channel (one kernel copy) with uv, and lookups cost less CPU with it
    (``docs/decisions/0009-rpc-transport-uv.md``). Hosts with spare cores may prefer ``PERSIA_RPC_TRANSPORTS=shm,uv``
    (a few tens of microseconds less latency per call). Every process of a group must offer at least one transport
    of the others.

    Raises:
        PlannerError: The variable names a transport TensorPipe does not have (one line, naming the variable).
    """
    environ = os.environ if environ is None else environ
    value = environ.get(RPC_TRANSPORTS_ENV, "").strip()
    if not value:
        return list(DEFAULT_RPC_TRANSPORTS)
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in _KNOWN_TRANSPORTS]
    if unknown or not names:
        raise PlannerError(
            f"{RPC_TRANSPORTS_ENV}={value!r}: unknown TensorPipe transport(s) {unknown or [value]}",
            fixes=(f"use a comma-separated list of {', '.join(_KNOWN_TRANSPORTS)} (default: uv)",),
        )
    return names
