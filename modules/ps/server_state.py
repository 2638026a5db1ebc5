"""A parameter server process's state: its registry of tables, each a store with its config and its lock.

A server process holds one :class:`ServerState` (:func:`state`), which the request handlers of :mod:`.server` read
and grow: :func:`make_store` builds a table's store from the :class:`~.protocol.TableConfig` a client registers (in
memory, or on the ``ssd`` tier a DDR cache over a file of rows), :func:`close_files` removes those files at shutdown.

Locking: an :class:`EmbeddingStore` is not thread-safe (lookups insert and evict), so each :class:`Table` has its own
lock, which a request holds for its store operation; the registry's lock guards the registry alone and is never held
during one. :meth:`ServerState.all_tables_locked` takes every table's lock at once, in one order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed.rpc as rpc

from persia_planner.modules.ps.protocol import PsServerError, TableConfig, server_index
from persia_planner.modules.ps.ssd_files import remove_stale, scratch_name, this_process
from persia_planner.modules.ps.ssd_store import SsdStore
from persia_planner.modules.ps.store import EmbeddingStore

__all__ = ["ServerState", "Table", "close_files", "make_store", "reset_state", "state"]

log = logging.getLogger("persia_planner.modules.ps.server")  # the server's own log, as its other lines


class Table:
    """A store, its config and the lock that serialises requests on it."""

    def __init__(self, config: TableConfig, store: EmbeddingStore | SsdStore) -> None:
        self.config = config
        self.store = store
        self.lock = threading.Lock()


class ServerState:
    """Per-process server state: the table registry and the start time for the rates."""

    def __init__(self) -> None:
        self.tables: dict[str, Table] = {}
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

    def table(self, name: str) -> Table:
        """The registered table ``name``.

        Raises:
            PsServerError: No table has that name here.
        """
        try:
            return self.tables[name]  # dict reads are atomic; the registry only grows
        except KeyError:
            raise PsServerError(
                f"parameter server {self.name} has no table {name!r}; register it first (PsClient.register)"
            ) from None

    @contextlib.contextmanager
    def all_tables_locked(self) -> Iterator[dict[str, Table]]:
        """Every table, with all their locks held (in name order, so two callers cannot deadlock): a consistent
        snapshot for checkpoints and dumps while lookups and updates wait."""
        with self.lock:
            tables = dict(sorted(self.tables.items()))
        with contextlib.ExitStack() as stack:
            for t in tables.values():
                stack.enter_context(t.lock)
            yield tables


_STATE: ServerState | None = None
_STATE_LOCK = threading.Lock()


def state() -> ServerState:
    """This process's server state, created on first use (a process serves one set of tables)."""
    global _STATE
    if _STATE is None:
        with _STATE_LOCK:
            if _STATE is None:
                _STATE = ServerState()
    return _STATE


def reset_state() -> None:
    """Drop this process's server state and its tables: the next request starts from an empty registry, as a
    restarted server would (for callers that run the handlers in process: tests, benchmarks)."""
    global _STATE
    with _STATE_LOCK:
        _STATE = None


def make_store(config: TableConfig, index: int) -> EmbeddingStore | SsdStore:
    """The empty store of ``config``'s table on the server of index ``index`` (its admission draws are seeded
    ``config.seed + index``): on the ``ssd`` tier (``config.ssd_rows``), its DDR cache over a new file of rows
    in ``config.ssd_dir``, named for the table, the server and this process, with a header saying it is this
    process's (:mod:`.ssd_files`: only such files of a dead server are removed, never another file)."""
    store = EmbeddingStore(
        config.dim,
        config.capacity,
        config.optimizer,
        init=config.init,
        eviction=config.eviction,
        admission_probability=config.admission_probability,
        clip=config.clip,
        seed=config.seed + index,
        eviction_chunk=config.eviction_chunk,
        weight_dtype=config.weight_dtype,
        # per-id initial rows: the same on whichever server holds the id, in whatever order ids arrive
        init_seed=config.init_seed,
    )
    if not config.ssd_rows:
        return store
    directory = Path(config.ssd_dir or tempfile.gettempdir())
    directory.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale(directory, config.name, index):  # files of ours whose server was killed
        log.info("removed %s: a file of rows its dead server left", stale)
    owner = this_process()
    path = directory / scratch_name(config.name, index, owner.run)
    return SsdStore(store, path, config.ssd_rows, header=owner.header())


def close_files() -> None:
    """Remove the files of this server's ``ssd`` tables (at shutdown: the processes end without finalisers)."""
    with state().lock:
        tables = list(state().tables.values())
    for table in tables:
        if isinstance(table.store, SsdStore):
            with table.lock:
                table.store.close()
