"""torchrun's c10d rendezvous with its stores listening on the head's address only: ``--rdzv-backend persia``.

torch 2.13's c10d backend serves two stores from the head node's agent: the rendezvous store at
``--rdzv-endpoint`` and the store it hands its workers (``MASTER_ADDR:MASTER_PORT``). Both are ``TCPStore`` servers,
which listen on every interface of the host whatever address they are given. This backend is the same rendezvous
(torch's ``DynamicRendezvousHandler`` over a ``C10dRendezvousBackend``) with both listening sockets bound to the
address first and handed to the store (:func:`~persia_planner.modules.ps.group.host_store`): the rendezvous
store on the endpoint's address, the workers' store on the head's ``--local-addr``.

The package registers it with torchrun (the ``torchrun.handlers`` entry point). torchrun loads every registered
backend when it starts, so this module imports nothing heavy until a run asks for ``persia``; its options
(:func:`rendezvous_options`) are checked without torch. A mistake in them, or an endpoint that nothing serves, ends
torchrun with one ``error: ...; fix: ...`` line and exit 2 (:func:`torchrun_handler`), as the CLI's edge would.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from persia_planner.errors import ErrorKind, PlannerError, abbreviate, one_line
from persia_planner.modules.rpc_environment import (
    MAX_TIMEOUT_S,
    host_name_problem,
    port_number,
    resolve,
    wait_for_listener,
)

__all__ = [
    "BACKEND",
    "DEFAULT_PORT",
    "DEFAULT_READ_TIMEOUT_S",
    "EXIT_BAD_INPUT",
    "RendezvousOptions",
    "create_handler",
    "handler_factory",
    "rendezvous_endpoint",
    "rendezvous_options",
    "torchrun_handler",
]

BACKEND = "persia"
DEFAULT_PORT = 29400  # torch's c10d default
DEFAULT_READ_TIMEOUT_S = 60  # torch's c10d default: the rendezvous store's timeout, its connection's included
EXIT_BAD_INPUT = 2  # the CLI's exit code for bad input (persia_planner.cli.app)

# torch's words for a boolean --rdzv-conf value (RendezvousParameters.get_as_bool).
_TRUE, _FALSE = ("1", "true", "t", "yes", "y"), ("0", "false", "f", "no", "n")
# The --rdzv-conf keys that torch reads as whole seconds (c10d's store, the dynamic handler's timeouts) or counts; a
# value torch would refuse with a traceback (not a number, 0, negative), or one past a week, is refused in one line.
_SECONDS = ("read_timeout", "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout")
_COUNTS = ("keep_alive_interval", "keep_alive_max_attempt")
_MAX_SECONDS = int(MAX_TIMEOUT_S)
_IS_HOST_FIX = (
    "give --rdzv-conf is_host=true on the head node (the one --rdzv-endpoint names), is_host=false on the others"
)


@dataclass(frozen=True)
class RendezvousOptions:
    """A ``--rdzv-backend persia`` node's rendezvous options, checked.

    Attributes:
        host: The rendezvous store's host (``--rdzv-endpoint``).
        port: Its port (0 on the head: one the OS picks).
        is_host: Whether this node serves the store (``--rdzv-conf is_host``).
        read_timeout_s: How long a node waits for the store, its connection included (``read_timeout``).
    """

    host: str
    port: int
    is_host: bool
    read_timeout_s: int

    @property
    def endpoint(self) -> str:
        """``host:port`` as the user would write it (IPv6 in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def rendezvous_endpoint(endpoint: str | None, *, is_host: bool) -> tuple[str, int]:
    """The host and port of ``--rdzv-endpoint`` (``HOST[:PORT]``, IPv6 as ``[ADDR]:PORT``; empty: localhost), as
    torch's ``parse_rendezvous_endpoint`` reads it, without torch. Port 0 only on the head (``is_host``).

    Raises:
        PlannerError: Not a host and a port (one line, naming ``--rdzv-endpoint``).
    """
    text = (endpoint or "").strip()
    if not text:
        return "localhost", DEFAULT_PORT
    if text.startswith("[") and text.endswith("]"):
        host, port_text = text[1:-1], None
    elif text.startswith("[") and "]:" in text:
        host, port_text = text[1:].rsplit("]:", 1)
    elif text.count(":") > 1:  # a bare IPv6 address (its last group is not a port), checked below
        host, port_text = text, None
    else:
        host, _, port_text = text.partition(":") if ":" in text else (text, "", None)
    fix = "give --rdzv-endpoint HOST:PORT, the head node's address and a free port, e.g. 127.0.0.1:29400"
    if port_text is None:
        port = DEFAULT_PORT
    else:
        found = port_number(port_text, low=0 if is_host else 1)
        if found is None:
            wanted = "0..65535 (0: one the OS picks)" if is_host else "1..65535"
            raise PlannerError(
                f"--rdzv-endpoint {abbreviate(text)}: the port must be a number in {wanted}", fixes=(fix,)
            )
        port = found
    problem = host_name_problem(host)
    if problem is not None:
        raise PlannerError(f"--rdzv-endpoint {abbreviate(text)}: the host {abbreviate(host)}: {problem}", fixes=(fix,))
    return host, port


def rendezvous_options(endpoint: str | None, conf: Mapping[str, Any]) -> RendezvousOptions:
    """``--rdzv-endpoint`` and ``--rdzv-conf`` (torchrun's ``RendezvousParameters.config``) checked, without torch.

    Raises:
        PlannerError: ``is_host`` is unset or not a boolean, the endpoint is not ``HOST:PORT``, or a timeout is not
            a whole number in 1..604800 (one line, naming the option).
    """
    is_host = _boolean(conf, "is_host")
    if is_host is None:
        raise PlannerError(f"--rdzv-backend {BACKEND} needs to know which node is the head", fixes=(_IS_HOST_FIX,))
    host, port = rendezvous_endpoint(endpoint, is_host=is_host)
    numbers = {key: _whole(conf, key) for key in (*_SECONDS, *_COUNTS)}
    read_timeout = numbers["read_timeout"]
    return RendezvousOptions(host, port, is_host, DEFAULT_READ_TIMEOUT_S if read_timeout is None else read_timeout)


def _boolean(conf: Mapping[str, Any], key: str) -> bool | None:
    value = conf.get(key)
    if value is None or isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise PlannerError(f"--rdzv-conf {key}={abbreviate(str(value))} is not true or false", fixes=(_IS_HOST_FIX,))


def _whole(conf: Mapping[str, Any], key: str) -> int | None:
    value = conf.get(key)
    if value is None:
        return None
    text = str(value).strip()
    number = int(text) if text.isascii() and text.isdigit() and len(text) <= 7 else None
    if number is None or not 1 <= number <= _MAX_SECONDS:
        raise PlannerError(
            f"--rdzv-conf {key}={abbreviate(str(value))} must be a whole number in 1..{_MAX_SECONDS}",
            fixes=(f"give --rdzv-conf {key}=N with N in 1..{_MAX_SECONDS}, or leave it out (torch's default)",),
        )
    return number


def handler_factory() -> Callable[[Any], Any]:
    """What torchrun's ``torchrun.handlers`` entry point loads: the function that builds the handler."""
    return torchrun_handler


def torchrun_handler(params: Any) -> Any:
    """:func:`create_handler` as torchrun calls it: a :class:`PlannerError` ends torchrun with its one line on
    stderr and exit 2, before any worker starts (:func:`_at_torchruns_edge`)."""
    return _at_torchruns_edge(create_handler, params)


def _at_torchruns_edge(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; a :class:`PlannerError` is printed as the CLI's edge prints it, one line, and ends
    torchrun with exit 2 (``SystemExit``, which torchrun's own edge passes on: it would print the error's traceback
    from its agent and exit 1). This module may not import the CLI, so it prints the line itself."""
    try:
        return fn(*args, **kwargs)
    except PlannerError as err:
        sys.stderr.write(f"error: {one_line(str(err))}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_BAD_INPUT) from None


def create_handler(params: Any) -> Any:
    """A ``DynamicRendezvousHandler`` for torchrun's ``RendezvousParameters`` ``params``.

    The node that hosts the stores must say so (``--rdzv-conf is_host=true``, as docs/multinode.md does) and the
    others ``is_host=false``: guessing it from host names, as c10d does, fails where hosts share a name. A node
    that is not the head waits up to ``read_timeout`` (default 60 s) for the head's store to accept its connection.

    Raises:
        PlannerError: The options are wrong (:func:`rendezvous_options`), the head cannot listen on the endpoint,
            or nothing accepts connections at the endpoint within ``read_timeout`` (one line naming it).
    """
    options = rendezvous_options(params.endpoint, params.config)

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler

    from persia_planner.modules.ps.group import StoreAddress, host_store

    timeout = datetime.timedelta(seconds=options.read_timeout_s)
    if options.is_host:
        endpoint = StoreAddress("--rdzv-endpoint's host", "--rdzv-endpoint port", "torchrun with is_host=true")
        store = host_store(options.host, options.port, timeout, named_by=endpoint)
    else:
        _wait_for_the_head(options)
        try:
            store = TCPStore(options.host, options.port, is_master=False, timeout=timeout)
        except RuntimeError as err:  # it accepted a connection but is no store, or went away meanwhile
            raise _unreachable(options, (str(err).strip().splitlines() or ["no details"])[0]) from None

    class Backend(C10dRendezvousBackend):
        """c10d's state keeping, under this backend's name (torchrun checks it against --rdzv-backend)."""

        @property
        def name(self) -> str:
            return BACKEND

    handler = dynamic_handler(store, Backend(store, params.run_id), params)

    workers_store = StoreAddress("torchrun's --local-addr", "torchrun --master-port", "the head's torchrun")

    def bound_store_server(master_addr: str, master_port: int) -> Any:
        # The workers' store, served by rank 0's agent: on its own address (--local-addr), not every interface.
        return _at_torchruns_edge(host_store, master_addr, master_port, timeout, named_by=workers_store)

    handler._create_tcp_store_server = bound_store_server  # torch's one seam for this store (2.13)
    return handler


def _wait_for_the_head(options: RendezvousOptions) -> None:
    """Return once the head's store accepts a connection; raise one line after ``read_timeout`` (torch's own
    connection would retry as long, logging a C++ backtrace at every try)."""
    problem = resolve(options.host, options.port)
    if problem is not None:
        raise PlannerError(
            f"--rdzv-endpoint {options.endpoint}: the host does not resolve ({problem})",
            fixes=("give --rdzv-endpoint the head node's address and port, as the head's torchrun has it",),
        )
    refused = wait_for_listener(options.host, options.port, options.read_timeout_s)
    if refused is not None:
        raise _unreachable(options, refused)


def _unreachable(options: RendezvousOptions, cause: str) -> PlannerError:
    return PlannerError(
        f"nothing served the rendezvous at --rdzv-endpoint {options.endpoint} within read_timeout "
        f"{options.read_timeout_s} s ({cause})",
        fixes=(
            "start torchrun on the head node (--rdzv-conf is_host=true) with the same --rdzv-endpoint",
            "give --rdzv-endpoint the head node's address and port",
            "raise --rdzv-conf read_timeout=N if the head starts later",
        ),
        kind=ErrorKind.UNAVAILABLE,
    )
