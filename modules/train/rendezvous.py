"""torchrun's c10d rendezvous with its stores listening on the head's address only: ``--rdzv-backend persia``.

torch 2.13's c10d backend serves two stores from the head node's agent: the rendezvous store at
``--rdzv-endpoint`` and the store it hands its workers (``MASTER_ADDR:MASTER_PORT``). Both are ``TCPStore`` servers,
which listen on every interface of the host whatever address they are given. This backend is the same rendezvous
(torch's ``DynamicRendezvousHandler`` over a ``C10dRendezvousBackend``) with both listening sockets bound to the
address first and handed to the store (:func:`~persia_planner.modules.ps.group.host_store`): the rendezvous
store on the endpoint's address, the workers' store on the head's ``--local-addr``.

The package registers it with torchrun (the ``torchrun.handlers`` entry point). torchrun loads every registered
backend when it starts, so this module imports nothing heavy until a run asks for ``persia``.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

__all__ = ["BACKEND", "DEFAULT_PORT", "create_handler", "handler_factory"]

BACKEND = "persia"
DEFAULT_PORT = 29400  # torch's c10d default


def handler_factory() -> Callable[[Any], Any]:
    """What torchrun's ``torchrun.handlers`` entry point loads: the function that builds the handler."""
    return create_handler


def create_handler(params: Any) -> Any:
    """A ``DynamicRendezvousHandler`` for torchrun's ``RendezvousParameters`` ``params``.

    The node that hosts the stores must say so (``--rdzv-conf is_host=true``, as docs/multinode.md does) and the
    others ``is_host=false``: guessing it from host names, as c10d does, fails where hosts share a name.

    Raises:
        ValueError: ``is_host`` is not set (one line naming it).
    """
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from persia_planner.modules.ps.group import host_store

    is_host = params.get_as_bool("is_host")
    if is_host is None:
        raise ValueError(f"--rdzv-backend {BACKEND} needs --rdzv-conf is_host=true on the head node, false elsewhere")
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    timeout = datetime.timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60))
    if is_host:
        store = host_store(host, port, timeout)
    else:
        store = TCPStore(host, port, is_master=False, timeout=timeout)

    class Backend(C10dRendezvousBackend):
        """c10d's state keeping, under this backend's name (torchrun checks it against --rdzv-backend)."""

        @property
        def name(self) -> str:
            return BACKEND

    handler = dynamic_handler(store, Backend(store, params.run_id), params)

    def bound_store_server(master_addr: str, master_port: int) -> Any:
        # The workers' store, served by rank 0's agent: on its own address (--local-addr), not every interface.
        return host_store(master_addr, master_port, timeout)

    handler._create_tcp_store_server = bound_store_server  # torch's one seam for this store (2.13)
    return handler
