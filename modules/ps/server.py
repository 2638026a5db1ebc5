"""One embedding parameter server process: it answers the requests on its tables (:mod:`.server_state`).

A server is a ``torch.distributed.rpc`` worker named ``ps{rank}`` that does nothing but answer requests: :func:`serve`
joins the RPC group and then waits in the group's graceful shutdown (:func:`.group.leave_group`), giving up with
:class:`~.protocol.PeerLostError` on a worker that died or hangs.

The requests are :mod:`.protocol`'s; this module implements them (:func:`create`, :func:`lookup`, :func:`update`,
:func:`save`, :func:`dump`, :func:`load`, :func:`metrics`, registered with :func:`.protocol.handles` on import) against
this process's registry of tables (:func:`.server_state.state`). Each returns its error as a
:class:`~.protocol.RemoteFailure` value instead of raising it (see :mod:`.protocol`), so they can also be called in
process. Tables are created on demand from a :class:`~.protocol.TableConfig` that clients send: creating a table twice
with the same config is a no-op (every trainer may register every table), with a different config an error.

Threading: the RPC agent runs requests on a pool of worker threads, and a table's store is not
thread-safe (lookups insert and evict), so each request holds its table's lock (:class:`.server_state.Table`);
requests for different tables run in parallel, requests for the same table are serialised. Every update is
therefore applied atomically and none is lost, whatever the number of concurrent clients.

Run a server with ``persia ps --rank R --world-size W`` (``MASTER_ADDR``/``MASTER_PORT`` from the environment, as
torchrun sets them).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

import torch

from persia_planner.errors import PlannerError
from persia_planner.modules.ps import protocol
from persia_planner.modules.ps import server_metrics as report
from persia_planner.modules.ps.allocator import allocator_env, tune_allocator
from persia_planner.modules.ps.deltas import dump_incremental
from persia_planner.modules.ps.group import DEFAULT_PEER_TIMEOUT_S, DEFAULT_RPC_TIMEOUT_S, join_rpc_group, leave_group
from persia_planner.modules.ps.protocol import (
    WIRE_DTYPES,
    PeerLostError,
    PsServerError,
    RemoteFailure,
    TableConfig,
    handles,
    server_name,
)
from persia_planner.modules.ps.server_state import Table, close_stores, make_store, state
from persia_planner.modules.ps.table_checkpoints import load_rows, load_seeds, read_latest, save_shard

__all__ = [
    "assign",
    "assign_state",
    "create",
    "drop",
    "dump",
    "load",
    "log_metrics_every",
    "lookup",
    "memory",
    "metrics",
    "read",
    "read_state",
    "save",
    "seed",
    "serve",
    "server_memory",
    "server_metrics",
    "update",
]

log = logging.getLogger(__name__)


def _server_errors(fn):
    """Turn an exception into a returned :class:`RemoteFailure` whose message names the server."""

    @functools.wraps(fn)  # keeps __name__, which the failure's message gives
    def wrapped(*args: Any) -> Any:
        try:
            return fn(*args)
        except PsServerError as err:
            log.warning("%s", err)
            return RemoteFailure(str(err))
        except PlannerError as err:
            # Bad input (a damaged checkpoint file, a table the plan does not give this server): the trainer
            # reports it in one line; the traceback goes to the log file only (INFO), not to the terminal.
            log.info("%s: %s refused: %s", state().name, fn.__name__, err, exc_info=True)
            return RemoteFailure(f"parameter server {state().name}: {fn.__name__}: {type(err).__name__}: {err}")
        except Exception as err:
            log.exception("%s: %s failed", state().name, fn.__name__)
            return RemoteFailure(f"parameter server {state().name}: {fn.__name__}: {type(err).__name__}: {err}")

    return wrapped


@handles(protocol.create)
@_server_errors
def create(config: TableConfig) -> int:
    """Create ``config.name`` unless it exists with the same config; returns this server's index."""
    server = state()
    with server.lock:
        existing = server.tables.get(config.name)
        if existing is None:
            server.tables[config.name] = Table(config, make_store(config, server.index))
            log.info("%s: created table %r: %s", server.name, config.name, config)
        elif existing.config != config:
            raise PsServerError(
                f"parameter server {server.name}: table {config.name!r} already exists with a different config "
                f"({existing.config} != {config}); use another name or restart the servers"
            )
    return server.index


@handles(protocol.drop)
@_server_errors
def drop(table: str) -> bool:
    """Remove ``table`` and its rows (requests already holding it finish on it); returns whether it was there."""
    server = state()
    with server.lock:
        dropped = server.tables.pop(table, None)
    if dropped is not None:
        with dropped.lock:  # requests already holding it finish first; then its files go
            dropped.store.close()
    return dropped is not None


@handles(protocol.lookup)
@_server_errors
def lookup(
    table: str, ids: torch.Tensor, train: bool, distinct: bool = False, wire_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Rows ``[len(ids), dim]`` of ``ids``; ``train=False`` never inserts. ``distinct=True``: the caller promises
    the ids do not repeat (the client de-duplicates), so the store skips its own ``unique`` and gather.
    ``wire_dtype``: the dtype the rows travel back in (None: float32)."""
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise PsServerError(f"parameter server {state().name}: cannot send rows as {wire_dtype}")
    t = state().table(table)
    half = wire_dtype == torch.float16
    with t.lock:
        try:
            # float16 rows are converted (and range-checked) by the gather itself: no pass of their own.
            rows = t.store.lookup(ids, train=train, distinct=distinct, dtype=torch.float16 if half else torch.float32)
        except OverflowError as err:
            # A weight that float16 rounds to inf would reach the trainer as inf: refuse, as the client refuses
            # such gradients (nan travels as nan, as it would in float32).
            raise PsServerError(
                f"parameter server {state().name}: table {table!r} {err}; send bfloat16 "
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
            f"parameter server {state().name}: table {table!r} holds weights up to {peak:.6g}, beyond {wire_dtype}'s "
            "range; send float32 (wire_dtype=torch.float32, --ps-wire float32) or clip the weights"
        )
    return wired


@handles(protocol.read)
@_server_errors
def read(table: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows of ``ids`` as held, unheld ones as their initial value; nothing changes
    (:meth:`.store.EmbeddingStore.read`)."""
    t = state().table(table)
    with t.lock:
        return t.store.read(ids)


@handles(protocol.assign)
@_server_errors
def assign(table: str, ids: torch.Tensor, weights: torch.Tensor) -> int:
    """Set the rows of ``ids`` to ``weights`` (:meth:`.store.EmbeddingStore.assign`); returns the rows written."""
    t = state().table(table)
    with t.lock:
        return t.store.assign(ids, weights.to(torch.float32))


@handles(protocol.seed)
@_server_errors
def seed(table: str, weights: torch.Tensor | None, row_state: torch.Tensor | None = None) -> bool:
    """Seed ``table``'s unheld ids from ``weights`` (and ``row_state``, the optimizer's)
    (:meth:`.store.EmbeddingStore.seed`); None unseeds. Returns whether the table is seeded now."""
    server = state()
    t = server.table(table)
    with t.lock:
        try:
            t.store.seed(weights, row_state)
        except ValueError as err:
            raise PsServerError(f"parameter server {server.name}: table {table!r}: {err}") from None
    return weights is not None


@handles(protocol.read_state)
@_server_errors
def read_state(table: str, ids: torch.Tensor) -> torch.Tensor:
    """Optimizer state of ``ids`` as held, unheld ones' as new; nothing changes
    (:meth:`.store.EmbeddingStore.read_state`)."""
    t = state().table(table)
    with t.lock:
        return t.store.read_state(ids)


@handles(protocol.assign_state)
@_server_errors
def assign_state(table: str, ids: torch.Tensor, row_state: torch.Tensor, start: int) -> int:
    """Set optimizer state columns of ``ids`` (:meth:`.store.EmbeddingStore.assign_state`); returns the rows written."""
    server = state()
    t = server.table(table)
    with t.lock:
        try:
            return t.store.assign_state(ids, row_state, start)
        except ValueError as err:
            raise PsServerError(f"parameter server {server.name}: table {table!r}: {err}") from None


@handles(protocol.update)
@_server_errors
def update(table: str, ids: torch.Tensor, grads: torch.Tensor, distinct: bool = False, optimizer: Any = None) -> int:
    """Apply the table's optimizer (``optimizer``: this push's hyper-parameters, None: the table's) to the rows of
    ``ids`` with ``grads``; returns the number of rows updated.

    ``grads`` may arrive in a narrower wire dtype (float16, bfloat16); they are upcast to float32 before anything
    is summed or stepped, so the optimizer and its state stay float32. ``distinct=True``: see
    :meth:`.store.EmbeddingStore.update`.
    """
    if grads.dtype != torch.float32:
        grads = grads.to(torch.float32)  # outside the lock, like the lookup's cast
    server = state()
    t = server.table(table)
    with t.lock:
        try:
            return t.store.update(ids, grads, distinct=distinct, optimizer=optimizer)
        except ValueError as err:
            raise PsServerError(f"parameter server {server.name}: table {table!r}: {err}") from None


@handles(protocol.save)
@_server_errors
def save(directory: str, n_servers: int, version: int) -> int:
    """Write this server's tables into checkpoint ``version`` (not committed: the client commits when every server
    has written). Returns rows saved."""
    with state().all_tables_locked() as tables:
        configs = {name: {"dim": t.config.dim, "capacity": t.config.capacity} for name, t in tables.items()}
        stores = {name: t.store for name, t in tables.items()}
        server = state()
        save_shard(
            stores,
            directory,
            server=server.index,
            n_servers=n_servers,
            configs=configs,
            version=version,
            delta_sequence=server.last_dump_sequence,
        )
        return sum(len(store) for store in stores.values())


@handles(protocol.dump)
@_server_errors
def dump(directory: str, sequence: int) -> int:
    """Write the rows touched since this server's previous dump as delta ``sequence``; returns their number."""
    with state().all_tables_locked() as tables:
        stores = {name: t.store for name, t in tables.items()}
        dirty = sum(int(store.dirty_rows()) for store in stores.values())
        server = state()
        # After a load or a dump this server knows its run's previous dump: files after it are a rolled-back run's.
        supersedes = server.last_dump_sequence if server.dumped_or_loaded else None
        if supersedes is not None and sequence <= supersedes:
            # A replica folds the deltas after a checkpoint's delta_sequence, in sequence order: a number at or below
            # the last one would be skipped, or applied before older rows.
            raise PsServerError(
                f"parameter server {server.name}: dump sequence {sequence} must be above {supersedes}, this server's "
                "last dump (or its checkpoint's delta_sequence); number dumps upward from there"
            )
        dump_incremental(stores, directory, server=server.index, sequence=sequence, supersedes=supersedes)
        server.last_dump_sequence = sequence
        server.dumped_or_loaded = True
    return dirty


@handles(protocol.load)
@_server_errors
def load(directory: str, n_servers: int, only: list[str] | None = None) -> int:
    """Replace the registered tables' rows (those in ``only``, where given) by this server's share of the committed
    checkpoint (re-sharded from whatever server count saved it), and their seeds by the checkpoint's. Returns rows
    loaded."""
    server = state()
    rows, _ = load_rows(directory, server=server.index, n_servers=n_servers, tables=only)
    seeds = load_seeds(directory, only if only is not None else list(rows))
    latest = read_latest(directory)
    unknown = sorted(set(rows) - set(server.tables))
    if unknown:
        raise PsServerError(
            f"parameter server {server.name}: the checkpoint holds table(s) {unknown} that are not registered; "
            "register every table (PsClient.register) before loading"
        )
    loaded = 0
    with state().all_tables_locked() as tables:
        # Every table is checked before any is replaced: a refused table (too many rows for its capacity, another
        # dim) leaves the server as it was, not half loaded. Tables the checkpoint does not hold keep their rows.
        for name, table_rows in rows.items():
            try:
                tables[name].store.check_state_dict(table_rows)
            except ValueError as err:
                raise PsServerError(
                    f"parameter server {server.name}: cannot load table {name!r} from {directory}: {err}; nothing "
                    "was loaded (raise the table's capacity or load with more servers)"
                ) from None
        for name, table_rows in rows.items():
            tables[name].store.load_state_dict(table_rows)
            seed = seeds.get(name)
            tables[name].store.seed(seed["weights"] if seed else None, seed.get("state") if seed else None)
            loaded += len(tables[name].store)
    if latest is not None:
        server.last_dump_sequence = latest["delta_sequence"]  # this run goes on from the checkpoint's dumps
        server.dumped_or_loaded = True
    return loaded


@handles(protocol.metrics)
@_server_errors
def metrics() -> dict[str, Any]:
    """This server's metrics (see :func:`server_metrics`), also logged at INFO."""
    m = server_metrics()
    report.log_metrics(m)
    return m


@handles(protocol.memory)
@_server_errors
def memory() -> dict[str, Any]:
    """This server's memory (see :func:`server_memory`)."""
    return server_memory()


def log_metrics_every(interval_s: float, stop: threading.Event) -> threading.Thread:
    """Start a daemon thread that logs :func:`server_metrics` at INFO every ``interval_s`` seconds until ``stop``
    is set (the rates are averages since the server started)."""
    return report.log_metrics_every(interval_s, stop, server_metrics)


def server_metrics() -> dict[str, Any]:
    """Metrics of this process's server (:func:`persia_planner.modules.ps.server_metrics.metrics_of`)."""
    return report.metrics_of(state())


def server_memory() -> dict[str, Any]:
    """This process's resident memory and its stores' own account of theirs
    (:func:`persia_planner.modules.ps.server_metrics.memory_of`)."""
    return report.memory_of(state())


# ------------------------------------------------------------------------------------------------ process


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

    Waits in the graceful ``rpc.shutdown()`` (:func:`.group.leave_group`), which returns once all workers of the group
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
    server = state()
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
        close_stores()
        log.info(
            "%s: %s after %.1f s: %d rows, %d lookups, %d updates",
            server.name,
            outcome,
            m["uptime_s"],
            m["rows"],
            m["lookups"],
            m["updates"],
        )
