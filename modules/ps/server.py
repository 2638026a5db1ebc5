"""One embedding parameter server process: a registry of :class:`EmbeddingStore` tables served over torch RPC.

A server is a ``torch.distributed.rpc`` worker (TensorPipe backend) named ``ps{rank}`` that does nothing but answer
requests: :func:`serve` joins the RPC group and then waits in the *graceful* ``rpc.shutdown()``, which returns once
every worker of the group (the trainers included) has reached its own shutdown. Meanwhile it checks that the other
workers still answer: one that died or hangs would keep that shutdown waiting forever, so the server gives up with
:class:`PeerLostError` naming it instead.

Clients (:mod:`.client`) call the module-level functions :func:`_create`, :func:`_lookup`, :func:`_update`,
:func:`_metrics` and :func:`_memory` with ``rpc_async``; RPC pickles them *by reference* (module + name), so they
run here against this process's :data:`_STATE`. Tables are created on demand from a :class:`TableConfig` that clients
send: creating a table twice with the same config is a no-op (every trainer may register every table), with a
different config an error.

Threading: the RPC agent runs requests on a pool of worker threads, and an :class:`EmbeddingStore` is not
thread-safe (lookups insert and evict), so each table has its own lock; requests for different tables run in
parallel, requests for the same table are serialised. Every update is therefore applied atomically and none is lost,
whatever the number of concurrent clients.

Errors raised while serving a request are *returned* as a :class:`RemoteFailure` value, which the client raises as
:class:`PsServerError` (a :class:`PlannerError`). Raising across RPC would not do: the caller receives every remote
exception as a plain ``RuntimeError``, indistinguishable from a timeout or a broken connection. This way every
exception the client gets from the RPC layer means "the server did not answer" (``PsUnavailableError``) and every
``RemoteFailure`` means "the server answered no".

Run a server by hand like torchrun would::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 python -m persia_planner.modules.ps.server --rank 0 --world-size 6
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
import torch.distributed.rpc as rpc

from persia_planner.errors import ErrorKind, PlannerError

from ..config import DEFAULT_RPC_TRANSPORTS, RPC_TRANSPORTS_ENV, master_address, rpc_transports
from .checkpoint import dump_incremental, load_rows, read_latest, save_shard
from .optim import SGD, RowOptimizer
from .store import EmbeddingStore, Eviction, Normal, Uniform

__all__ = [
    "DEFAULT_PEER_TIMEOUT_S",
    "DEFAULT_RPC_TRANSPORTS",
    "RPC_TRANSPORTS_ENV",
    "WIRE_DTYPES",
    "PeerLostError",
    "PsServerError",
    "RemoteFailure",
    "TableConfig",
    "check_wire_dtype",
    "leave_group",
    "rpc_backend_options",
    "rpc_transports",
    "serve",
    "server_memory",
    "server_name",
]

log = logging.getLogger(__name__)

DEFAULT_RPC_TIMEOUT_S = 60.0
# How long a worker waits for another one of its group that stopped answering before it gives up (see leave_group).
DEFAULT_PEER_TIMEOUT_S = 60.0
# Dtypes rows and gradients may travel in (``PsClient(wire_dtype=...)``); the stores always hold float32.
WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DEFAULT_OPTIMIZER = SGD()  # frozen dataclasses: safe to share as defaults
_DEFAULT_INIT = Uniform()


class PsServerError(PlannerError):
    """A parameter server refused or failed a request (bad table config, unknown table, shape mismatch...).

    Takes a single message argument so that RPC can re-create it on the calling side.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, kind=ErrorKind.INPUT)


class PeerLostError(PlannerError):
    """Another worker of the group died or stopped answering while this one waited for the group's shutdown.

    The graceful shutdown needs every worker, so it could never complete: this worker stops waiting instead of
    waiting forever (see :func:`leave_group`). Attributes: ``worker`` (this worker's RPC name) and ``peer`` (the
    lost worker's).
    """

    def __init__(self, worker: str, peer: str, cause: str, grace_s: float | None, *, is_server: bool = True) -> None:
        """``cause``: the last failed ping's (or the shutdown's) error; ``grace_s``: how long the shutdown was awaited
        before the second ping, None if the shutdown itself failed on ``peer``; ``is_server``: whether this worker
        is a parameter server (else a trainer)."""
        self.worker = worker
        self.peer = peer
        # The agent's first line is the useful part ("ECONNRESET: connection reset by peer"); drop its source location
        # and the shutdown's preamble ("Followers [...] timed out in _all_gather ... The first exception is ...").
        detail = (cause.strip().splitlines() or ["no details"])[0].split(" (this error originated")[0]
        detail = detail.split("The first exception is ")[-1]
        timed_out = re.search(r"ran for more than set timeout \((\d+) ms\)", detail)
        if timed_out:  # the ping's own timeout: alive, perhaps, but not answering
            detail = f"no answer within {int(timed_out.group(1)) / 1000:g} s"
        if is_server:
            who = f"parameter server {worker}"
            outcome = "this server stops, and the rows it held since the last checkpoint are lost"
            setting = "persia ps --peer-timeout, serve(peer_timeout_s=...)"
        else:
            who = f"trainer {worker}"
            # Servers are named ps0..ps{n-1} (discover_servers relies on it).
            lost_rows = re.fullmatch(r"ps\d+", peer) is not None
            outcome = "this trainer leaves without it" + (
                ", and the rows that server held since the last checkpoint are lost" if lost_rows else ""
            )
            setting = "joined(peer_timeout_s=...), leave_group(peer_timeout_s=...)"
        when = (
            " during the group's shutdown"
            if grace_s is None
            else f", still did not answer {grace_s:g} s later, and the group had not shut down"
        )
        super().__init__(
            f"{who}: worker {peer} of its RPC group stopped answering ({detail}){when}; {outcome}",
            kind=ErrorKind.UNAVAILABLE,
            fixes=(
                f"look at {peer}'s log for why it stopped, then restart the job from its last checkpoint "
                "(persia train --resume, PsClient.load)",
                f"raise the peer timeout ({setting}) if that worker can be busy for that long",
            ),
        )


@dataclass(frozen=True)
class TableConfig:
    """Everything a server needs to create one table; the same config is sent to every server.

    Attributes:
        name: Table name (also salts the id -> server hash, see :func:`.sharding.server_of`).
        dim: Embedding width.
        capacity: Maximum rows **per server** (each server holds about ``1 / n_servers`` of the ids).
        optimizer: The sparse optimizer the servers apply on :meth:`EmbeddingStore.update`.
        init: Initialiser of new rows.
        eviction: LRU or LFU.
        admission_probability: Probability that a new id is inserted on a training lookup.
        clip: If set, weights are clamped to ``[-clip, clip]`` after every update.
        seed: Seed of the initial rows (per id, see ``EmbeddingStore(init_seed=...)``) and of each server's
            admission draws (server ``i`` uses ``seed + i``).
        eviction_chunk: Fraction of the capacity a full table evicts at once (see :class:`EmbeddingStore`).
    """

    name: str
    dim: int
    capacity: int
    optimizer: RowOptimizer = _DEFAULT_OPTIMIZER
    init: Uniform | Normal = _DEFAULT_INIT
    eviction: Eviction = Eviction.LRU
    admission_probability: float = 1.0
    clip: float | None = None
    seed: int = 0
    eviction_chunk: float = 1 / 64

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TableConfig.name must not be empty")
        # Normalise a plain string so that equal configs compare equal on the server (idempotent create).
        object.__setattr__(self, "eviction", Eviction(self.eviction))

    def make_store(self, server_index: int) -> EmbeddingStore:
        """The empty store of this table on server ``server_index``."""
        return EmbeddingStore(
            self.dim,
            self.capacity,
            self.optimizer,
            init=self.init,
            eviction=self.eviction,
            admission_probability=self.admission_probability,
            clip=self.clip,
            seed=self.seed + server_index,
            eviction_chunk=self.eviction_chunk,
            # per-id initial rows: the same on whichever server holds the id, in whatever order ids arrive
            init_seed=(self.seed * 1_000_003 + zlib.crc32(self.name.encode())) & 0x7FFFFFFF,
        )


def server_name(rank: int) -> str:
    """RPC worker name of server ``rank`` (servers take ranks ``0 .. n_servers-1``)."""
    return f"ps{rank}"


def server_index(name: str, rank: int) -> int:
    """Index of a server (its shard of every table and checkpoint): ``i`` of its name ``ps{i}``, else its RPC rank.

    Under torchrun on several nodes the servers are spread over the nodes, so ``ps1`` need not have RPC rank 1.
    """
    m = re.fullmatch(r"ps(\d+)", name)
    return int(m.group(1)) if m else rank


def check_wire_dtype(wire_dtype: Any) -> torch.dtype:
    """``wire_dtype`` if it is one of :data:`WIRE_DTYPES`.

    Raises:
        ValueError: Otherwise, in one line naming the accepted values.
    """
    if not isinstance(wire_dtype, torch.dtype) or wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {wire_dtype!r}")
    return wire_dtype


class _Table:
    """A store, its config and the lock that serialises requests on it."""

    def __init__(self, config: TableConfig, store: EmbeddingStore) -> None:
        self.config = config
        self.store = store
        self.lock = threading.Lock()


class _ServerState:
    """Per-process server state: the table registry and the start time for the rates."""

    def __init__(self) -> None:
        self.tables: dict[str, _Table] = {}
        self.lock = threading.Lock()  # guards the registry only, never held during a store operation
        self.started = time.monotonic()
        # Sequence of the last incremental dump this server wrote (or that the checkpoint it loaded covers): a
        # checkpoint records it so that replicas starting from it apply only later deltas.
        self.last_dump_sequence = -1
        self.dumped_or_loaded = False  # then last_dump_sequence is this run's: later files are a rolled-back run's
        try:
            info = rpc.get_worker_info()
            self.name, self.index = info.name, server_index(info.name, info.id)
        except RuntimeError:  # not inside an RPC group (unit use of the functions)
            self.name, self.index = f"pid{os.getpid()}", 0

    def table(self, name: str) -> _Table:
        try:
            return self.tables[name]  # dict reads are atomic; the registry only grows
        except KeyError:
            raise PsServerError(
                f"parameter server {self.name} has no table {name!r}; register it first (PsClient.register)"
            ) from None


_STATE: _ServerState | None = None
_STATE_LOCK = threading.Lock()


def _state() -> _ServerState:
    global _STATE
    if _STATE is None:
        with _STATE_LOCK:
            if _STATE is None:
                _STATE = _ServerState()
    return _STATE


@dataclass(frozen=True)
class RemoteFailure:
    """What an RPC function returns instead of raising (see the module docstring)."""

    message: str


def _server_errors(fn):
    """Turn an exception into a returned :class:`RemoteFailure` whose message names the server."""

    @functools.wraps(fn)  # keeps __qualname__/__module__, so RPC pickles the wrapper by the function's name
    def wrapped(*args: Any) -> Any:
        try:
            return fn(*args)
        except PsServerError as err:
            log.warning("%s", err)
            return RemoteFailure(str(err))
        except Exception as err:
            log.exception("%s: %s failed", _state().name, fn.__name__)
            return RemoteFailure(f"parameter server {_state().name}: {fn.__name__}: {type(err).__name__}: {err}")

    return wrapped


# ------------------------------------------------------------------------------------- functions run via RPC


@_server_errors
def _create(config: TableConfig) -> int:
    """Create ``config.name`` unless it exists with the same config; returns this server's index."""
    state = _state()
    with state.lock:
        existing = state.tables.get(config.name)
        if existing is None:
            state.tables[config.name] = _Table(config, config.make_store(state.index))
            log.info("%s: created table %r: %s", state.name, config.name, config)
        elif existing.config != config:
            raise PsServerError(
                f"parameter server {state.name}: table {config.name!r} already exists with a different config "
                f"({existing.config} != {config}); use another name or restart the servers"
            )
    return state.index


@_server_errors
def _lookup(
    table: str, ids: torch.Tensor, train: bool, distinct: bool = False, wire_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Rows ``[len(ids), dim]`` of ``ids``; ``train=False`` never inserts. ``distinct=True``: the caller promises
    the ids do not repeat (the client de-duplicates), so the store skips its own ``unique`` and gather.
    ``wire_dtype``: the dtype the rows travel back in (None: the store's float32, unchanged)."""
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise PsServerError(f"parameter server {_state().name}: cannot send rows as {wire_dtype}")
    t = _state().table(table)
    half = wire_dtype == torch.float16
    with t.lock:
        try:
            # float16 rows are converted (and range-checked) by the gather itself: no pass of their own.
            rows = t.store.lookup(ids, train=train, distinct=distinct, dtype=torch.float16 if half else torch.float32)
        except OverflowError as err:
            # A weight that float16 rounds to inf would reach the trainer as inf: refuse, as the client refuses
            # such gradients (nan travels as nan, as it would in float32).
            raise PsServerError(
                f"parameter server {_state().name}: table {table!r} {err}; send bfloat16 "
                "(wire_dtype=torch.bfloat16, --ps-wire bfloat16) or clip the weights"
            ) from None
    # bfloat16 is cast after releasing the lock: the rows are this request's own copy, other requests need not wait.
    if wire_dtype is None or rows.dtype == wire_dtype:
        return rows
    wired = rows.to(wire_dtype)
    # bfloat16's range ends just below float32's (~3.39e38): a finite weight beyond it would arrive as inf. One
    # reduction over the narrow copy in the common case; the float32 rows are consulted only if something is inf.
    if not bool(torch.isfinite(wired).all()) and bool((torch.isinf(wired) & torch.isfinite(rows)).any()):
        peak = float(rows.nan_to_num(nan=0.0).abs().amax())
        raise PsServerError(
            f"parameter server {_state().name}: table {table!r} holds weights up to {peak:.6g}, beyond {wire_dtype}'s "
            "range; send float32 (wire_dtype=torch.float32, --ps-wire float32) or clip the weights"
        )
    return wired


@_server_errors
def _update(table: str, ids: torch.Tensor, grads: torch.Tensor, distinct: bool = False) -> int:
    """Apply the table's optimizer to the rows of ``ids`` with ``grads``; returns the number of rows updated.

    ``grads`` may arrive in a narrower wire dtype (float16, bfloat16); they are upcast to float32 before anything
    is summed or stepped, so the optimizer and its state stay float32. ``distinct=True``: see
    :meth:`EmbeddingStore.update`.
    """
    if grads.dtype != torch.float32:
        grads = grads.to(torch.float32)  # outside the lock, like the lookup's cast
    t = _state().table(table)
    with t.lock:
        return t.store.update(ids, grads, distinct=distinct)


@contextlib.contextmanager
def _all_tables_locked() -> Iterator[dict[str, _Table]]:
    """Every table of this server, with all their locks held (in name order, so two callers cannot deadlock):
    a consistent snapshot for checkpoints and dumps while lookups and updates wait."""
    state = _state()
    with state.lock:
        tables = dict(sorted(state.tables.items()))
    with contextlib.ExitStack() as stack:
        for t in tables.values():
            stack.enter_context(t.lock)
        yield tables


@_server_errors
def _save(directory: str, n_servers: int, version: int) -> int:
    """Write this server's tables into checkpoint ``version`` (not committed: the client commits when every server
    has written). Returns rows saved."""
    with _all_tables_locked() as tables:
        configs = {name: {"dim": t.config.dim, "capacity": t.config.capacity} for name, t in tables.items()}
        stores = {name: t.store for name, t in tables.items()}
        state = _state()
        save_shard(
            stores,
            directory,
            server=state.index,
            n_servers=n_servers,
            configs=configs,
            version=version,
            delta_sequence=state.last_dump_sequence,
        )
        return sum(len(store) for store in stores.values())


@_server_errors
def _dump(directory: str, sequence: int) -> int:
    """Write the rows touched since this server's previous dump as delta ``sequence``; returns their number."""
    with _all_tables_locked() as tables:
        stores = {name: t.store for name, t in tables.items()}
        dirty = sum(int(store.dirty_rows()) for store in stores.values())
        state = _state()
        # After a load or a dump this server knows its run's previous dump: files after it are a rolled-back run's.
        supersedes = state.last_dump_sequence if state.dumped_or_loaded else None
        if supersedes is not None and sequence <= supersedes:
            # A replica folds the deltas after a checkpoint's delta_sequence, in sequence order: a number at or below
            # the last one would be skipped, or applied before older rows.
            raise PsServerError(
                f"parameter server {state.name}: dump sequence {sequence} must be above {supersedes}, this server's "
                "last dump (or its checkpoint's delta_sequence); number dumps upward from there"
            )
        dump_incremental(stores, directory, server=state.index, sequence=sequence, supersedes=supersedes)
        state.last_dump_sequence = sequence
        state.dumped_or_loaded = True
    return dirty


@_server_errors
def _load(directory: str, n_servers: int) -> int:
    """Replace the registered tables' rows by this server's share of the committed checkpoint (re-sharded from
    whatever server count saved it). Returns rows loaded."""
    state = _state()
    rows, _ = load_rows(directory, server=state.index, n_servers=n_servers)
    latest = read_latest(directory)
    unknown = sorted(set(rows) - set(state.tables))
    if unknown:
        raise PsServerError(
            f"parameter server {state.name}: the checkpoint holds table(s) {unknown} that are not registered; "
            "register every table (PsClient.register) before loading"
        )
    loaded = 0
    with _all_tables_locked() as tables:
        # Every table is checked before any is replaced: a refused table (too many rows for its capacity, another
        # dim) leaves the server as it was, not half loaded. Tables the checkpoint does not hold keep their rows.
        for name, table_rows in rows.items():
            try:
                tables[name].store.check_state_dict(table_rows)
            except ValueError as err:
                raise PsServerError(
                    f"parameter server {state.name}: cannot load table {name!r} from {directory}: {err}; nothing "
                    "was loaded (raise the table's capacity or load with more servers)"
                ) from None
        for name, table_rows in rows.items():
            tables[name].store.load_state_dict(table_rows)
            loaded += len(tables[name].store)
    if latest is not None:
        state.last_dump_sequence = latest["delta_sequence"]  # this run goes on from the checkpoint's dumps
        state.dumped_or_loaded = True
    return loaded


@_server_errors
def _metrics() -> dict[str, Any]:
    """This server's metrics (see :func:`server_metrics`), also logged at INFO."""
    m = server_metrics()
    _log_metrics(m)
    return m


@_server_errors
def _memory() -> dict[str, Any]:
    """This server's memory (see :func:`server_memory`)."""
    return server_memory()


def _log_metrics(m: dict[str, Any]) -> None:
    log.info(
        "%s: %d rows, %.1f MiB, %d evictions, %.0f lookups/s, %.0f updates/s",
        m["name"],
        m["rows"],
        m["bytes"] / 2**20,
        m["evictions"],
        m["lookups_per_s"],
        m["updates_per_s"],
    )


def log_metrics_every(interval_s: float, stop: threading.Event) -> threading.Thread:
    """Start a daemon thread that logs :func:`server_metrics` at INFO every ``interval_s`` seconds until ``stop``
    is set (the rates are averages since the server started)."""
    if not interval_s > 0:
        raise ValueError(f"interval_s must be positive, got {interval_s}")

    def run() -> None:
        while not stop.wait(interval_s):
            try:
                _log_metrics(server_metrics())
            except Exception:  # never let the logger take the server down
                log.exception("logging the parameter-server metrics failed")

    thread = threading.Thread(target=run, name="ps-metrics-log", daemon=True)
    thread.start()
    return thread


def server_metrics() -> dict[str, Any]:
    """Metrics of this process's server.

    Returns:
        ``name``, ``pid``, ``uptime_s``; totals over tables of ``rows``, ``evictions``, ``lookups`` (ids looked up,
        with repeats), ``updates`` (rows updated), ``bytes`` (weights + optimizer state of the rows held, float32);
        ``lookups_per_s`` / ``updates_per_s`` (averages since the server state was created); ``tables``: each
        table's :meth:`EmbeddingStore.metrics` plus its ``bytes``.
    """
    state = _state()
    uptime = max(time.monotonic() - state.started, 1e-9)
    tables: dict[str, dict[str, int]] = {}
    for name, t in list(state.tables.items()):
        with t.lock:
            m = dict(t.store.metrics())
        m["bytes"] = m["rows"] * (t.store.dim + t.store.state_width) * 4
        tables[name] = m
    totals = {k: sum(m[k] for m in tables.values()) for k in ("rows", "evictions", "lookups", "updates", "bytes")}
    return {
        "name": state.name,
        "pid": os.getpid(),
        "uptime_s": uptime,
        **totals,
        "lookups_per_s": totals["lookups"] / uptime,
        "updates_per_s": totals["updates"] / uptime,
        "tables": tables,
    }


def server_memory() -> dict[str, Any]:
    """This process's resident memory and its stores' own account of theirs.

    Freed heap is first handed back to the system (glibc's ``malloc_trim``; :func:`tune_allocator` keeps up to
    256 MiB of it otherwise), so the resident set holds what the process still uses: its stores, plus a constant for
    the interpreter, the libraries and the RPC agent. The difference of ``resident_bytes`` between two calls is then
    what the stores grew by. Trimming costs the next requests their warm buffers: call it to measure, not while
    serving.

    Returns:
        ``name``, ``pid``, ``resident_bytes`` (the process's resident set from ``/proc/self/statm``; 0 where that
        file does not exist), ``store_bytes`` (the sum over tables) and ``tables``: each table's ``rows`` and
        ``bytes`` (:meth:`EmbeddingStore.resident_bytes`).
    """
    import ctypes

    state = _state()
    tables: dict[str, dict[str, int]] = {}
    for name, t in list(state.tables.items()):
        with t.lock:
            tables[name] = {"rows": len(t.store), "bytes": t.store.resident_bytes()}
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    resident = 0
    with contextlib.suppress(OSError), open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {
        "name": state.name,
        "pid": os.getpid(),
        "resident_bytes": resident,
        "store_bytes": sum(t["bytes"] for t in tables.values()),
        "tables": tables,
    }


# ------------------------------------------------------------------------------------------------ process


def rpc_backend_options(rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe options with the rendezvous at ``MASTER_ADDR:MASTER_PORT`` (the torchrun convention) and the
    transports of :func:`rpc_transports`.

    Raises:
        PlannerError: If either variable is unset, or ``PERSIA_RPC_TRANSPORTS`` names an unknown transport.
    """
    # init_rpc's own all_gather trips torch's deprecation notice about gloo groups: noise for our users.
    warnings.filterwarnings("ignore", message="You are using a Backend <class 'torch.distributed")
    addr, port = master_address("the parameter-server RPC group")
    # Channels stay TensorPipe's defaults (cma for tensors between processes of one host, then mpt_uv, basic).
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"{_RENDEZVOUS_SCHEME}://{addr}:{port}?timeout_s={rpc_timeout_s:g}",
        rpc_timeout=rpc_timeout_s,
        _transports=rpc_transports(),
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
    plain = parsed._replace(scheme="tcp", query=urllib.parse.urlencode(query)).geturl()
    yield from torch.distributed.rendezvous(plain, rank=rank, world_size=world_size, timeout=timeout, **kwargs)


torch.distributed.register_rendezvous_handler(_RENDEZVOUS_SCHEME, _bounded_tcp_rendezvous)


def join_rpc_group(name: str, rank: int, world_size: int, rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> None:
    """``rpc.init_rpc`` with :func:`rpc_backend_options`, whose rendezvous gives up after ``rpc_timeout_s``.

    Raises:
        PlannerError: ``MASTER_ADDR``/``MASTER_PORT`` or ``PERSIA_RPC_TRANSPORTS`` are wrong, or the group did not
            come together within ``rpc_timeout_s`` (rank 0 unreachable, or a rank missing): one line naming the
            address, this worker and the timeout.
    """
    options = rpc_backend_options(rpc_timeout_s)
    addr, port = master_address("the parameter-server RPC group")

    def failed(cause: str) -> PlannerError:
        return PlannerError(
            f"{name} (rank {rank} of {world_size}) could not join the RPC group at {addr}:{port} within "
            f"{rpc_timeout_s:g} s: {cause}",
            fixes=(
                "start rank 0 (the first parameter server) and every other rank with the same MASTER_ADDR/MASTER_PORT",
                "raise --rpc-timeout if the ranks start far apart",
            ),
            kind=ErrorKind.UNAVAILABLE,
        )

    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # This rank connects to the store rather than hosting it. Wait for a listener here: torch's own connect
        # loop would give up as well, but logs a C++ backtrace of ~35 lines to stderr first.
        refused = _wait_for_listener(addr, port, rpc_timeout_s)
        if refused is not None:
            raise failed(f"nothing accepts connections there ({refused}); is rank 0 running?")
    try:
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except RuntimeError as err:  # torch's DistStoreError / DistNetworkError, or the agent's own timeout
        raise failed((str(err).strip().splitlines() or ["no details"])[0]) from err


def _wait_for_listener(addr: str, port: int, timeout_s: float) -> str | None:
    """None once a TCP connection to ``addr:port`` succeeds, or the last error after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, left))):
                return None
        except OSError as err:
            if left <= 0:
                return str(err) or type(err).__name__
        time.sleep(0.1)  # the retry interval of a connect loop (as torch's own), not a synchronisation


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc mallopt parameters (malloc.h)
# glibc tunables for request buffers (see allocator_env), each applied unless the environment already names it.
_TUNABLES = {"glibc.malloc.tcache_count": "0", "glibc.malloc.hugetlb": "1"}
_tuned = False


def allocator_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables to start a server or trainer process with so that its request buffers stay warm.

    * ``glibc.malloc.tcache_count=0``: torch allocates tensors with ``posix_memalign(64)``; glibc puts the few bytes
      it trims off each aligned chunk into the thread's tcache, where they can never merge, so a freed MB-sized
      tensor cannot be reused for the next one of the same size and every request's tensors land on fresh pages
      (4,096 page faults and ~1.5-5 ms for the 16 MB answer of a 64k-id lookup on a VM).
    * ``glibc.malloc.hugetlb=1`` (glibc >= 2.35; older ones ignore it): the heap is advised ``MADV_HUGEPAGE``, so
      the MB-sized buffers every request writes, sends and reads (ids, the answer's rows, the expanded batch) sit on
      transparent huge pages: fewer TLB misses in each copy, and TensorPipe's cross-process read (``cma``) pins 2 MiB
      pages instead of 4 KiB ones. One server + one client, 64k Zipf ids on a full 10M-row table, runs alternating
      without and with it: the RPC of a lookup's 6.6 MB answer 4.0-5.0 -> 1.9-2.6 ms (3 pairs); 4 lookups in flight
      faster in 5 pairs of 5 (e.g. 9.5 -> 7.4, 5.9 -> 5.8 ms per lookup); one blocking lookup faster in 7 pairs of
      lookups alone (10.4-14.9 -> 7.8-11.3 ms) but not in 5 pairs of ``benchmarks/ps.py`` (9.2-11.5 without,
      9.3-13.2 ms with; two pairs slower by 1.7 ms). The heap then holds ~75 MB of huge pages in a client, ~150 MB
      in a server.

    Both take effect only at process start, hence an environment (:func:`.launch.local_cluster` starts its
    processes with it). Returns ``{"GLIBC_TUNABLES": ...}``: ``environ``'s value with the tunables it does not
    already name appended (the user's own setting of one stands), or ``{}`` if it names both or
    ``PS_TUNE_MALLOC=0``.
    """
    environ = os.environ if environ is None else environ
    current = environ.get("GLIBC_TUNABLES", "")
    if environ.get("PS_TUNE_MALLOC", "1") == "0":
        return {}
    named = {item.split("=", 1)[0] for item in current.split(":") if item}
    missing = [f"{name}={value}" for name, value in _TUNABLES.items() if name not in named]
    if not missing:
        return {}
    return {"GLIBC_TUNABLES": ":".join([current, *missing] if current else missing)}


def tune_allocator() -> bool:
    """Keep freed request-sized buffers in the process instead of returning them to the OS (glibc only).

    Every request allocates a few MB-sized tensors (ids, rows, the gathered answer) and frees them once sent. With
    glibc's defaults most of them are fresh mappings: each first write page-faults (about 1,600 faults, 1.5 ms for
    the 6.6 MB answer of a 64k-id batch on a VM), and the RPC agent's worker threads each warm their own arena. One
    arena, ``malloc`` up to 32 MiB from the heap and trimming only above 256 MiB of free heap make the buffers of
    the previous request serve the next one. Larger allocations (the stores' tables) are still mapped lazily.
    Call it before the process starts threads (``init_rpc``); :func:`serve` and :func:`.client.connect` do.
    Returns whether it applied (False on a non-glibc platform or if ``PS_TUNE_MALLOC=0``).
    """
    global _tuned
    if _tuned:
        return True
    if os.environ.get("PS_TUNE_MALLOC", "1") == "0":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = all(
            libc.mallopt(param, value) == 1
            for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 256 << 20))
        )
    except (OSError, AttributeError):
        return False
    _tuned = ok
    return ok


def serve(
    rank: int,
    world_size: int,
    *,
    name: str | None = None,
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    metrics_interval_s: float | None = 60.0,
    peer_timeout_s: float | None = DEFAULT_PEER_TIMEOUT_S,
) -> None:
    """Join the RPC group as server ``name`` (default ``ps{rank}``) and serve until every worker shuts down.

    Waits in the graceful ``rpc.shutdown()`` (:func:`leave_group`), which returns once all workers of the group
    reached theirs, giving up on a worker that died or hangs after about ``peer_timeout_s``; then logs the final
    metrics.

    Args:
        rank: This process's rank; servers conventionally take ``0 .. n_servers-1``.
        world_size: Servers plus trainers.
        name: RPC worker name; clients address the server by it.
        rpc_timeout_s: Default timeout of RPCs this process issues (the rendezvous and shutdown barrier).
        metrics_interval_s: Log the metrics at INFO this often (seconds); None or 0: only at shutdown.
        peer_timeout_s: Give up on a worker that stopped answering after this long (seconds); None or 0: wait for
            every worker forever.

    Raises:
        PeerLostError: Another worker of the group died or stopped answering (naming it); the RPC agent is left
            as it is, so the process should exit.
    """
    name = name or server_name(rank)
    tune_allocator()
    join_rpc_group(name, rank, world_size, rpc_timeout_s)
    state = _state()
    log.info("%s: serving (rank %d of %d, pid %d)", name, rank, world_size, os.getpid())
    hint = allocator_env()
    if hint:
        log.info("%s: set %s in its environment for faster requests (see allocator_env)", name, hint)
    stop = threading.Event()
    if metrics_interval_s:
        log_metrics_every(metrics_interval_s, stop)
    outcome = "failed to shut down"
    try:
        leave_group(peer_timeout_s=peer_timeout_s, is_server=True)
        outcome = "shut down"
    except PeerLostError:
        outcome = "gave up on its group"
        raise
    except KeyboardInterrupt:
        outcome = "was interrupted"
        raise
    finally:
        stop.set()
        m = server_metrics()
        log.info(
            "%s: %s after %.1f s: %d rows, %d lookups, %d updates",
            state.name,
            outcome,
            m["uptime_s"],
            m["rows"],
            m["lookups"],
            m["updates"],
        )


def leave_group(*, peer_timeout_s: float | None = DEFAULT_PEER_TIMEOUT_S, is_server: bool = False) -> None:
    """Leave this process's RPC group gracefully: ``rpc.shutdown()``, giving up on a worker that stopped answering.

    The graceful shutdown returns once every worker of the group reached its own; one that died, or hangs, never
    does. So the shutdown waits on a thread of its own while every other worker is asked every
    ``peer_timeout_s / 2`` seconds whether it is alive (its RPC threads answer, whatever its main thread is doing).
    One that did not answer within ``peer_timeout_s / 2`` is asked again ``peer_timeout_s / 2`` (at least 5 s)
    later, unless the shutdown completed meanwhile (a worker that has just shut down also stops answering); if it
    fails again this worker gives up. :func:`serve` ends with it; a trainer does through :func:`.client.joined`.

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
        error = _shutdown_error(name, peers, failure[0], is_server=is_server)
        if error is failure[0]:
            raise error
        raise error from failure[0]


def _shutdown_error(name: str, peers: Sequence[str], err: BaseException, *, is_server: bool) -> BaseException:
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
    for peer in _unanswered(peers, half):
        if shut_down.wait(grace):
            return None
        again = _unanswered([peer], half)
        if again and not shut_down.is_set():
            return peer, again[peer], grace
    return None


def _unanswered(peers: Sequence[str], timeout_s: float) -> dict[str, str]:
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


def main(argv: list[str] | None = None) -> None:
    """``python -m persia_planner.modules.ps.server --rank R --world-size W`` (MASTER_ADDR/PORT from the env)."""
    parser = argparse.ArgumentParser(description="Run one embedding parameter server (torch RPC, TensorPipe).")
    parser.add_argument("--rank", type=int, required=True, help="rank of this server; servers take 0..n-1")
    parser.add_argument("--world-size", type=int, required=True, help="servers + trainers")
    parser.add_argument("--name", default=None, help="RPC worker name (default ps{rank})")
    parser.add_argument("--rpc-timeout", type=float, default=DEFAULT_RPC_TIMEOUT_S, help="seconds")
    parser.add_argument("--metrics-interval", type=float, default=60.0, help="log metrics every N s (0: off)")
    parser.add_argument(
        "--peer-timeout",
        type=float,
        default=DEFAULT_PEER_TIMEOUT_S,
        help="give up on a worker that stopped answering after N s (0: wait forever)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(
        args.rank,
        args.world_size,
        name=args.name,
        rpc_timeout_s=args.rpc_timeout,
        metrics_interval_s=args.metrics_interval,
        peer_timeout_s=args.peer_timeout,
    )


if __name__ == "__main__":
    # Run the imported module, not __main__: clients pickle the RPC functions as
    # persia_planner.modules.ps.server._lookup etc., so the state must live in that module.
    from persia_planner.modules.ps import server as _server

    _server.main()
