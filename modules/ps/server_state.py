"""A parameter server process's state: its registry of tables, each a store with its config and its lock.

A server process holds one :class:`ServerState` (:func:`state`), which the request handlers of :mod:`.server` read
and grow: :func:`make_store` builds a table's store with the factory its :class:`~.protocol.TableConfig` names (its
tier's ``TierSpec.store``: :func:`.table_store.memory_store` for rows in DDR, :func:`.ssd_store.disk_store` for rows
on disk), and :func:`close_stores` closes every store at shutdown (a store removes its files). No code here names a
tier: every store is a :class:`~.table_store.TableStore`.

Locking: a store is not thread-safe (lookups insert and evict), so each :class:`Table` has its own lock, which a
request holds for its store operation; the registry's lock guards the registry alone and is never held during one.
:meth:`ServerState.all_tables_locked` takes every table's lock at once, in one order.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed.rpc as rpc

from persia_planner.modules.ps.protocol import PsServerError, TableConfig, server_index, server_name
from persia_planner.modules.ps.table_store import TableStore

__all__ = [
    "ServerState",
    "Table",
    "close_stores",
    "make_store",
    "reset_state",
    "state",
    "store_factory",
]


class Table:
    """A store, its config and the lock that serialises requests on it."""

    def __init__(self, config: TableConfig, store: TableStore) -> None:
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


@functools.cache
def store_factory(path: str) -> Callable[[TableConfig, int], TableStore]:
    """The store factory ``path`` names (``"module:name"``), imported once per process.

    Raises:
        ImportError: The module cannot be imported.
        AttributeError: It has no such name.
        TypeError: That name is not callable.
    """
    module, _, name = path.partition(":")
    factory = importlib.import_module(module)
    for part in name.split("."):
        factory = getattr(factory, part)
    if not callable(factory):
        kind = type(factory).__name__
        raise TypeError(f"{name} is not callable ({'an' if kind[0] in 'aeiou' else 'a'} {kind})")
    return factory


def make_store(config: TableConfig, index: int) -> TableStore:
    """The empty store of ``config``'s table on the server of index ``index``, built by the factory
    ``config.store`` names (:func:`store_factory`).

    Raises:
        PsServerError: That factory cannot be imported (naming the table and the path).
    """
    try:
        factory = store_factory(config.store)
    except (ImportError, AttributeError, TypeError) as err:
        raise PsServerError(
            f"parameter server {server_name(index)}: table {config.name!r}: its store {config.store!r} cannot be "
            f"loaded ({type(err).__name__}: {err}); name a 'module:callable' importable on the servers (the tier's "
            "TierSpec.store; a plugged tier's module must be installed there too)"
        ) from None
    return factory(config, index)


def close_stores() -> None:
    """Close every table's store (at shutdown: the processes end without finalisers, and a store's files must go)."""
    with state().lock:
        tables = list(state().tables.values())
    for table in tables:
        with table.lock:
            table.store.close()
