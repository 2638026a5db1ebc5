"""Membership of a PS group: joining the torch RPC group, leaving it gracefully, and watching the other workers.

Servers and trainers alike are ``torch.distributed.rpc`` workers (TensorPipe backend) of one group.

* Joining (:func:`join_rpc_group`): the rendezvous goes through a ``persia-tcp://`` handler, torch's ``tcp://`` with
  the store connection bounded by the RPC timeout (torch's own waits 30 minutes and takes no timeout), after
  waiting for rank 0 to listen; a group that does not come together fails in one line naming the address. Rank 0
  hosts the store on ``MASTER_ADDR`` only (:func:`host_store`), and TensorPipe listens on loopback when that
  address is a loopback one (:func:`~persia_planner.modules.rpc_environment.listen_where_the_rendezvous_is`).
* Leaving (:func:`leave_group`): the graceful ``rpc.shutdown()`` returns once every worker reached its own; a worker
  that died or hangs would keep it waiting forever, so meanwhile every other worker is pinged, and a lost one ends
  the wait with :class:`~.protocol.PeerLostError` naming it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import re
import socket
import threading
import urllib.parse
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
import torch.distributed.rpc as rpc

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.modules.ps.protocol import PeerLostError
from persia_planner.modules.rpc_environment import (
    DEFAULT_RPC_TIMEOUT_S,
    check_rpc_environment,
    check_timeouts,
    listen_where_the_rendezvous_is,
    master_address,
    rpc_channels,
    rpc_transports,
    wait_for_listener,
)

__all__ = [
    "DEFAULT_PEER_TIMEOUT_S",
    "DEFAULT_RPC_TIMEOUT_S",
    "MASTER_STORE",
    "StoreAddress",
    "host_store",
    "join_rpc_group",
    "leave_group",
    "rpc_backend_options",
    "shutdown_error",
    "unanswered",
]

# How long a worker waits for another one of its group that stopped answering before it gives up (see leave_group).
DEFAULT_PEER_TIMEOUT_S = 60.0


def rpc_backend_options(rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe options with the rendezvous at ``MASTER_ADDR:MASTER_PORT`` (the torchrun convention) and the
    transports of :func:`rpc_transports` and channels of :func:`rpc_channels`.

    Raises:
        PlannerError: If either variable is unset, or ``PERSIA_RPC_TRANSPORTS`` / ``PERSIA_RPC_CHANNELS`` name an
            unknown transport or channel.
    """
    # init_rpc's own all_gather trips torch's deprecation notice about gloo groups: noise for our users.
    warnings.filterwarnings("ignore", message="You are using a Backend <class 'torch.distributed")
    addr, port = master_address("the parameter-server RPC group")
    listen_where_the_rendezvous_is()
    # Channels stay TensorPipe's defaults (cma for tensors between processes of one host, then mpt_uv, basic) unless
    # PERSIA_RPC_CHANNELS names some.
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"{_RENDEZVOUS_SCHEME}://{addr}:{port}?timeout_s={rpc_timeout_s:g}",
        rpc_timeout=rpc_timeout_s,
        _transports=rpc_transports(),
        _channels=rpc_channels(),
    )


# init_rpc's tcp:// rendezvous connects to (or, on rank 0, waits for) the group's store for torch's default 30 minutes
# and takes no timeout of its own: a trainer started without its rank 0 hung that long. This scheme is tcp:// with
# the store's connection bounded by the RPC timeout, which torch already applies to every store wait after it.
_RENDEZVOUS_SCHEME = "persia-tcp"


def _bounded_tcp_rendezvous(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    parsed = urllib.parse.urlparse(url)
    query = dict(urllib.parse.parse_qsl(parsed.query))
    timeout = datetime.timedelta(seconds=float(query.pop("timeout_s")))
    rank, world_size = int(query.pop("rank")), int(query.pop("world_size"))
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # torch's rank 0 would host the store on every interface, whatever the address says.
        assert parsed.hostname is not None and parsed.port is not None  # join_rpc_group built the URL from both
        # As torch's rank 0, it waits for the other ranks here, up to the timeout: later waits may not end.
        store = host_store(parsed.hostname, parsed.port, timeout, world_size=world_size, wait_for_workers=True)
        yield store, 0, world_size
        raise RuntimeError(f"{_RENDEZVOUS_SCHEME}:// cannot rendezvous again")  # as torch's tcp:// handler
    plain = parsed._replace(scheme="tcp", query=urllib.parse.urlencode(query)).geturl()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    for store, r, w in torch.distributed.rendezvous(plain, rank=rank, world_size=world_size, timeout=timeout, **kwargs):
        if restart is not None:
            # torchrun's agent keeps its store across restarts (--max-restarts): a restarted group would read the
            # addresses its previous attempt published there, and connect to processes that are gone.
            store = torch.distributed.PrefixStore(f"persia-rpc-{restart}", store)
        yield store, r, w


torch.distributed.register_rendezvous_handler(_RENDEZVOUS_SCHEME, _bounded_tcp_rendezvous)


@dataclass(frozen=True)
class StoreAddress:
    """Where a store's address came from, for the fixes of a failure to listen there.

    Attributes:
        address: What names its host (``MASTER_ADDR``).
        port: What names its port (``MASTER_PORT``).
        host: The process that must run on that host (``rank 0``).
    """

    address: str
    port: str
    host: str


MASTER_STORE = StoreAddress("MASTER_ADDR", "MASTER_PORT", "rank 0")
"""The RPC group's store, at ``MASTER_ADDR:MASTER_PORT``."""


def host_store(
    addr: str,
    port: int,
    timeout: datetime.timedelta,
    *,
    world_size: int | None = None,
    wait_for_workers: bool = False,
    named_by: StoreAddress = MASTER_STORE,
) -> torch.distributed.TCPStore:
    """A rendezvous store served by this process, listening on ``addr:port`` only (port 0: one the OS picks).

    With ``wait_for_workers`` it returns once ``world_size`` clients (this process among them) connected, and
    raises torch's ``DistStoreError`` after ``timeout``.

    ``TCPStore(addr, port, is_master=True)`` listens on every interface of the host (torch 2.13, libuv backend or
    not; ``addr`` only tells its clients where to connect), so anyone who reaches the port could read and write the
    group's keys. Here the listening socket is bound to ``addr`` first and handed to the store
    (``master_listen_fd``), which owns and closes it from then on. The store's ``port`` is the one bound.

    Raises:
        PlannerError: ``addr:port`` cannot be listened on (an address of another host, a name that does not
            resolve, a port taken or, without root, below 1024): one line, its fixes naming ``named_by``.
    """

    def cannot_listen(err: OSError | UnicodeError) -> PlannerError:
        port_fix = f"choose a free {named_by.port}"
        if getattr(err, "errno", None) == errno.EACCES and port < 1024:
            port_fix = f"choose a {named_by.port} above 1023 (ports below 1024 need root)"
        return PlannerError(
            f"cannot listen on {addr}:{port} for the rendezvous store: {getattr(err, 'strerror', None) or err}",
            fixes=(
                f"{named_by.address} must be an address of the host that runs {named_by.host} (127.0.0.1 on one "
                "machine)",
                port_fix,
            ),
            kind=ErrorKind.UNAVAILABLE,
        )

    try:
        family, kind, proto, _name, sockaddr = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as err:  # UnicodeError: a label longer than DNS allows
        raise cannot_listen(err) from err
    try:
        # As torch's own store server: a restarted rank 0 takes its port back while old connections linger.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise cannot_listen(err) from err
    bound = sock.getsockname()[1]
    try:
        return torch.distributed.TCPStore(
            addr,
            bound,
            world_size=world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=wait_for_workers,
            master_listen_fd=sock.fileno(),
        )
    finally:
        # The store owns the descriptor from here on (and closes it when it fails waiting for the workers); a
        # second close could close another file that took its number.
        sock.detach()


def join_rpc_group(name: str, rank: int, world_size: int, rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> None:
    """``rpc.init_rpc`` with :func:`rpc_backend_options`, whose rendezvous gives up after ``rpc_timeout_s``.

    Raises:
        PlannerError: ``MASTER_ADDR``/``MASTER_PORT`` or ``PERSIA_RPC_TRANSPORTS`` are wrong, or the group did not
            come together within ``rpc_timeout_s`` (rank 0 unreachable, or a rank missing): one line naming the
            address, this worker and the timeout.
    """
    # The environment as persia ps checks it before torch (a name that does not resolve is one line at once, not
    # a wait for the timeout), for callers that did not.
    check_timeouts(rpc_timeout=rpc_timeout_s)
    addr, port = check_rpc_environment("the parameter-server RPC group")
    options = rpc_backend_options(rpc_timeout_s)

    def failed(cause: str) -> PlannerError:
        return PlannerError(
            f"{name} (rank {rank} of {world_size}) could not join the RPC group at {addr}:{port} within "
            f"{rpc_timeout_s:g} s: {cause}",
            fixes=(
                "start rank 0 (the first parameter server) and every other rank with the same MASTER_ADDR/MASTER_PORT",
                "on several machines under torchrun, give the head node's torchrun --local-addr <its address>: its "
                "agent otherwise hands out its host name, which may resolve to loopback elsewhere",
                "raise --rpc-timeout if the ranks start far apart",
            ),
            kind=ErrorKind.UNAVAILABLE,
        )

    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # This rank connects to the store rather than hosting it. Wait for a listener here: torch's own connect
        # loop would give up as well, but logs a C++ backtrace of ~35 lines to stderr first.
        refused = wait_for_listener(addr, port, rpc_timeout_s)
        if refused is not None:
            raise failed(f"nothing accepts connections there ({refused}); is rank 0 running?")
    try:
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except RuntimeError as err:  # torch's DistStoreError / DistNetworkError, or the agent's own timeout
        cause = (str(err).strip().splitlines() or ["no details"])[0]
        # Rank 0's store: "Timed out after 4 seconds waiting for clients. 1/2 clients joined." (its whole seconds)
        joined_ranks = re.search(r"(\d+)/(\d+) clients joined", cause)
        if joined_ranks is not None:
            cause = f"{joined_ranks[1]} of its {joined_ranks[2]} ranks joined"
        raise failed(cause) from err


def leave_group(*, peer_timeout_s: float | None = DEFAULT_PEER_TIMEOUT_S, is_server: bool = False) -> None:
    """Leave this process's RPC group gracefully: ``rpc.shutdown()``, giving up on a worker that stopped answering.

    The graceful shutdown returns once every worker of the group reached its own; one that died, or hangs, never
    does. So the shutdown waits on a thread of its own while every other worker is asked every
    ``peer_timeout_s / 2`` seconds whether it is alive (its RPC threads answer, whatever its main thread is doing).
    One that did not answer within ``peer_timeout_s / 2`` is asked again ``peer_timeout_s / 2`` (at least 5 s)
    later, unless the shutdown completed meanwhile (a worker that has just shut down also stops answering); if it
    fails again this worker gives up. :func:`.server.serve` ends with it; a trainer does through
    :func:`persia_planner.modules.ps.connection.joined`.

    Args:
        peer_timeout_s: Give up on a worker that stopped answering after this long (seconds); None or 0: wait for
            every worker forever (``rpc.shutdown()`` alone).
        is_server: Whether this process is a parameter server (only the error's wording depends on it).

    Raises:
        PeerLostError: Another worker of the group died or stopped answering (naming it); the RPC agent is left
            as it is, so the process should exit.
    """
    agent = rpc._get_current_rpc_agent()
    name = agent.get_worker_info().name
    # Read before the shutdown starts: it resets the agent.
    peers = sorted(info.name for info in agent.get_worker_infos() if info.name != name)
    shut_down = threading.Event()
    if peer_timeout_s:
        # A worker already lost is named before the shutdown starts: the shutdown would fail on it (torch logs a
        # traceback first) or wait for it. Until this worker starts its shutdown every live peer answers.
        lost = _lost_peer(peers, peer_timeout_s, shut_down)
        if lost is not None:
            raise PeerLostError(name, *lost, is_server=is_server)
    failure: list[BaseException] = []

    def graceful_shutdown() -> None:
        try:
            with _quiet_shutdown_failure():
                rpc.shutdown()
        except BaseException as err:  # handed to the calling thread
            failure.append(err)
        finally:
            shut_down.set()

    # The shutdown waits on its own thread so that this one can watch the peers (and take a Ctrl-C).
    threading.Thread(target=graceful_shutdown, name=f"{name}-shutdown", daemon=True).start()
    lost = _watch_peers(peers, peer_timeout_s, shut_down)
    if lost is not None:
        raise PeerLostError(name, *lost, is_server=is_server)
    if failure:
        error = shutdown_error(name, peers, failure[0], is_server=is_server)
        if error is failure[0]:
            raise error
        raise error from failure[0]


def shutdown_error(name: str, peers: Sequence[str], err: BaseException, *, is_server: bool) -> BaseException:
    """What to raise for a graceful shutdown that failed with ``err``: a :class:`PeerLostError` naming the worker it
    failed on where torch's error tells which, else ``err`` itself.

    torch's shutdown is an all-gather led by the smallest worker name: a follower fails on the leader (its
    ``rpc_sync`` to it), the leader on the followers it lists (``Followers ['trainer1'] timed out ...``).
    """
    if not isinstance(err, RuntimeError):
        return err
    leader = min([name, *peers])
    named = re.search(r"Followers \['([^']+)'", str(err))
    peer = leader if name != leader else named.group(1) if named else None
    return err if peer is None else PeerLostError(name, peer, str(err), None, is_server=is_server)


class _DropShutdownFailure(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Shutdown Proceed" not in record.getMessage()


@contextlib.contextmanager
def _quiet_shutdown_failure() -> Iterator[None]:
    """Drop torch's own log of a failed graceful shutdown (a traceback at ERROR): :func:`leave_group` reports that
    failure as one line naming the worker."""
    logger = logging.getLogger("torch.distributed.rpc.api")
    drop = _DropShutdownFailure()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


# A worker stops answering the moment it completed the group's shutdown, a little before this server's own shutdown
# returns (it still waits for its in-flight requests and stops its threads): never less time than this for that.
_MIN_SHUTDOWN_GRACE_S = 5.0


def _watch_peers(
    peers: Sequence[str], timeout_s: float | None, shut_down: threading.Event
) -> tuple[str, str, float] | None:
    """Until ``shut_down`` is set, ask every worker in ``peers`` every ``timeout_s / 2`` s whether it is alive
    (:func:`_lost_peer`). Returns ``(peer, cause, grace_s)`` for a lost one; None once the group shut down. Waits
    for the shutdown alone where ``timeout_s`` is None or 0.
    """
    if not timeout_s:
        shut_down.wait()
        return None
    while not shut_down.wait(timeout_s / 2):
        lost = _lost_peer(peers, timeout_s, shut_down)
        if lost is not None:
            return lost
    return None


def _lost_peer(peers: Sequence[str], timeout_s: float, shut_down: threading.Event) -> tuple[str, str, float] | None:
    """Ask every worker in ``peers`` whether it is alive; ``(peer, cause, grace_s)`` for one that is lost.

    A worker that fails to answer within ``timeout_s / 2`` (a dead process fails at once: its connection is reset)
    is asked again ``grace_s`` later (``timeout_s / 2``, at least 5 s), unless the group shut down meanwhile: workers
    that have just completed the shutdown stop answering too, and a loaded one may miss a single ping. It is lost if
    it fails again. None if every worker answered or the group shut down.
    """
    half = timeout_s / 2
    grace = max(half, _MIN_SHUTDOWN_GRACE_S)
    for peer in unanswered(peers, half):
        if shut_down.wait(grace):
            return None
        again = unanswered([peer], half)
        if again and not shut_down.is_set():
            return peer, again[peer], grace
    return None


def unanswered(peers: Sequence[str], timeout_s: float) -> dict[str, str]:
    """The workers among ``peers`` that did not answer a ping within ``timeout_s``, with the RPC layer's error."""
    pings, failed = {}, {}
    for peer in peers:
        try:
            # os.getpid is importable in every peer, whatever else it runs; its RPC threads answer it, busy or not.
            pings[peer] = rpc.rpc_async(peer, os.getpid, timeout=timeout_s)
        except Exception as err:  # this agent is shutting down: the caller checks for that
            failed[peer] = str(err)
    for peer, ping in pings.items():
        try:
            ping.wait()
        except Exception as err:  # any failure of the RPC layer means "did not answer"
            failed[peer] = str(err)
    return failed
