"""What a parameter server reports of itself: its metrics (rows, evictions, request rates) and its memory (resident
set and its stores' own account), answered by :func:`.server.metrics` and :func:`.server.memory`."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from persia_planner.modules.ps.server_state import ServerState

__all__ = ["log_metrics", "log_metrics_every", "memory_of", "metrics_of"]

log = logging.getLogger("persia_planner.modules.ps.server")  # the server's own log, as before


def log_metrics(m: dict[str, Any]) -> None:
    """Log a server's metrics (:func:`metrics_of`) in one line at INFO."""
    log.info(
        "%s: %d rows, %.1f MiB, %d evictions, %.0f lookups/s, %.0f updates/s",
        m["name"],
        m["rows"],
        m["bytes"] / 2**20,
        m["evictions"],
        m["lookups_per_s"],
        m["updates_per_s"],
    )


def log_metrics_every(interval_s: float, stop: threading.Event, read: Callable[[], dict[str, Any]]) -> threading.Thread:
    """Start a daemon thread that logs ``read()`` (:func:`metrics_of` a server) at INFO every ``interval_s`` seconds
    until ``stop`` is set."""
    if not interval_s > 0:
        raise ValueError(f"interval_s must be positive, got {interval_s}")

    def run() -> None:
        while not stop.wait(interval_s):
            try:
                log_metrics(read())
            except Exception:  # never let the logger take the server down
                log.exception("logging the parameter-server metrics failed")

    thread = threading.Thread(target=run, name="ps-metrics-log", daemon=True)
    thread.start()
    return thread


def metrics_of(server: ServerState) -> dict[str, Any]:
    """Metrics of ``server``.

    Returns:
        ``name``, ``pid``, ``uptime_s``; totals over tables of ``rows``, ``evictions``, ``lookups`` (ids looked up,
        with repeats), ``updates`` (rows updated), ``bytes`` (weights + optimizer state of the rows held, float32);
        ``lookups_per_s`` / ``updates_per_s`` (averages since the server state was created); ``tables``: each
        table's store's metrics (:meth:`.EmbeddingStore.metrics`) plus its ``bytes``; ``stores``: each table's store
        as ``"module:QualName"`` of its class (which store ran it).
    """
    uptime = max(time.monotonic() - server.started, 1e-9)
    tables: dict[str, dict[str, int]] = {}
    stores: dict[str, str] = {}
    for name, t in list(server.tables.items()):
        with t.lock:
            m = dict(t.store.metrics())
        m["bytes"] = m["rows"] * (t.store.dim + t.store.state_width) * 4
        tables[name] = m
        stores[name] = f"{type(t.store).__module__}:{type(t.store).__qualname__}"
    totals = {k: sum(m[k] for m in tables.values()) for k in ("rows", "evictions", "lookups", "updates", "bytes")}
    return {
        "name": server.name,
        "pid": os.getpid(),
        "uptime_s": uptime,
        **totals,
        "lookups_per_s": totals["lookups"] / uptime,
        "updates_per_s": totals["updates"] / uptime,
        "tables": tables,
        "stores": stores,
    }


def memory_of(current: ServerState) -> dict[str, Any]:
    """This process's resident memory and ``current`` server's stores' own account of theirs.

    Freed heap is first handed back to the system (glibc's ``malloc_trim``; :func:`~.allocator.tune_allocator` keeps
    up to 256 MiB of it otherwise), so the resident set holds what the process still uses: its stores, plus a constant
    for the interpreter, the libraries and the RPC agent. The difference of ``resident_bytes`` between two calls is
    then what the stores grew by. Trimming costs the next requests their warm buffers: call it to measure, not while
    serving.

    Returns:
        ``name``, ``pid``, ``resident_bytes`` (the process's resident set from ``/proc/self/statm``; 0 where that
        file does not exist), ``store_bytes`` (the sum over tables) and ``tables``: each table's ``rows`` and
        ``bytes`` (:meth:`.EmbeddingStore.resident_bytes`).
    """
    import ctypes

    tables: dict[str, dict[str, int]] = {}
    for name, t in list(current.tables.items()):
        with t.lock:
            tables[name] = {"rows": len(t.store), "bytes": t.store.resident_bytes()}
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    resident = 0
    with contextlib.suppress(OSError), open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {
        "name": current.name,
        "pid": os.getpid(),
        "resident_bytes": resident,
        "store_bytes": sum(t["bytes"] for t in tables.values()),
        "tables": tables,
    }
