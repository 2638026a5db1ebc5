"""Requests sent late on purpose: the client's stand-in for a slow network (``PsClient(delay_ms=...)``)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["DelayScheduler"]

log = logging.getLogger(__name__)


class DelayScheduler:
    """One daemon thread that runs callbacks at their due times (``time.monotonic()``), earliest first.

    A heap of ``(due, sequence, callback)`` under a condition variable; :meth:`at` never blocks on the callbacks, and
    a callback must not block either (it only issues an ``rpc_async``). Callbacks due at the same time run in the
    order they were scheduled.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ps-client-delay", daemon=True)
        self._thread.start()

    def at(self, due: float, callback: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the client's delay scheduler is closed")
            heapq.heappush(self._heap, (due, next(self._seq), callback))
            if self._heap[0][2] is callback:
                self._cond.notify()  # a new earliest deadline: wake the thread to re-arm its wait

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._heap:
                        wait = self._heap[0][0] - time.monotonic()
                        if wait <= 0:
                            _, _, callback = heapq.heappop(self._heap)
                            break
                    elif self._closed:
                        return  # closed and drained
                    else:
                        wait = None
                    self._cond.wait(wait)
            try:
                callback()  # outside the lock: at() never waits for an rpc_async
            except Exception:  # a callback completes its own future; never let one kill the scheduler
                log.exception("delayed parameter-server request failed to send")
