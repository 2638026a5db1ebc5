"""How a client's requests reach the parameter servers: one ``rpc_async`` per server, routed, timed out, translated.

A batch's ids are de-duplicated (:func:`distinct_ids`: the distinct ids in order of first occurrence and the
``inverse`` map, in one compiled hash-set pass) and the distinct ids bucketed by :func:`.sharding.server_of` with one
stable sort (:meth:`ServerRequests.split`), so that one request goes to each server that owns any of them;
:meth:`ServerRequests.combined` joins the answers of those requests into one future.

Futures: :meth:`ServerRequests.call` returns a ``torch.futures.Future`` at once; with ``delay_ms`` (a stand-in for a
slow network) the request itself is sent ``delay_ms`` later by one scheduler thread (:class:`.delay.DelayScheduler`),
whose delays overlap.

Errors: every request carries an RPC timeout. A server that did not answer in time or whose connection broke (process
killed, host down) surfaces as :class:`~.protocol.PsUnavailableError` with one line naming the server, the operation and
the table. Errors the server reports (unknown table, conflicting config; returned as a ``RemoteFailure`` value, see
:mod:`.protocol`) are raised as :class:`~.protocol.PsServerError`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from persia_planner.errors import PlannerError
from persia_planner.modules.ps import kernels
from persia_planner.modules.ps.delay import DelayScheduler
from persia_planner.modules.ps.protocol import PsServerError, PsUnavailableError, RemoteFailure, server_index
from persia_planner.modules.ps.sharding import server_of

__all__ = ["ServerRequests", "distinct_ids"]


class ServerRequests:
    """The request channel of one client to a group of parameter servers, for a process that already joined the RPC
    group.

    Args:
        servers: RPC names of the servers, in server-index order (``server_of`` index ``i`` -> ``servers[i]``).
        timeout_s: Timeout of every request (of the RPC itself, not counting ``delay_ms``).
        delay_ms: Injected latency: every request is sent only ``delay_ms`` milliseconds after it was made, without
            blocking the caller.

    Raises:
        ValueError: If an argument is out of range.
        PsUnavailableError: If a name is not a worker of the RPC group.
        PlannerError: If ``servers[i]`` does not have rank ``i`` (servers shard their checkpoints by rank).
    """

    def __init__(self, servers: Sequence[str], *, timeout_s: float = 10.0, delay_ms: float = 0.0) -> None:
        if not servers:
            raise ValueError("PsClient needs at least one server")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not 0 <= delay_ms < math.inf:
            raise ValueError(f"delay_ms must be a finite number >= 0, got {delay_ms}")
        self.servers = list(servers)
        self.timeout_s = float(timeout_s)
        self.delay_ms = float(delay_ms)
        self._delayed = DelayScheduler() if self.delay_ms > 0 else None
        for i, name in enumerate(self.servers):
            try:
                rank = rpc.get_worker_info(name).id
            except RuntimeError as err:
                raise PsUnavailableError(name, "connect", None, self.timeout_s, f"not in the RPC group: {err}") from err
            index = server_index(name, rank)
            if index != i:
                # A server shards its checkpoints by its index (ps{i}, else its rank) and the client routes ids by
                # list position: a mismatch would load and save other servers' rows.
                raise PlannerError(
                    f"parameter server {name} is server {index} but is listed as server {i}: servers must be "
                    "listed in index order",
                    fixes=("name server i ps{i}", "list the servers ordered by index"),
                )

    @property
    def n_servers(self) -> int:
        return len(self.servers)

    def call(self, i: int, fn: Any, args: tuple, operation: str, table: str | None) -> Future:
        """``rpc_async`` of :mod:`.protocol`'s request ``fn`` to server ``i`` (after ``delay_ms``), whose future's
        error, if any, is already translated (``operation`` and ``table`` name the request in it)."""
        out: Future = Future()
        if self._delayed is None:
            self._send(i, fn, args, operation, table, out)
        else:
            self._delayed.at(
                time.monotonic() + self.delay_ms / 1000, lambda: self._send(i, fn, args, operation, table, out)
            )
        return out

    def _send(self, i: int, fn: Any, args: tuple, operation: str, table: str | None, out: Future) -> None:
        """Send the request now; complete ``out`` with its result or translated error."""
        name = self.servers[i]
        try:
            fut = rpc.rpc_async(name, fn, args=args, timeout=self.timeout_s)
        except Exception as err:  # the agent may refuse synchronously (e.g. pipe already known broken)
            out.set_exception(PsUnavailableError(name, operation, table, self.timeout_s, str(err)))
            return

        def done(f: Future) -> None:
            # The server returns its own errors as RemoteFailure values, so an exception here is always the
            # transport's (timeout, connection reset, pipe closed): the server did not answer.
            try:
                result = f.wait()
            except Exception as err:
                out.set_exception(PsUnavailableError(name, operation, table, self.timeout_s, str(err)))
                return
            if isinstance(result, RemoteFailure):
                out.set_exception(PsServerError(result.message))
            else:
                out.set_result(result)

        fut.add_done_callback(done)

    def to_every_server(
        self, fn: Any, args: tuple, operation: str, table: str | None, combine: Callable[[list[Any]], Any]
    ) -> Future:
        """The same request to every server: a future of ``combine`` of their answers, in server order."""
        return self.combined([self.call(i, fn, args, operation, table) for i in range(self.n_servers)], combine)

    @staticmethod
    def combined(futures: list[Future], combine: Callable[[list[Any]], Any]) -> Future:
        """A future of ``combine(results)`` once all ``futures`` are done; the first error (in server order) wins."""
        out: Future = Future()

        def done(all_done: Future) -> None:
            try:
                results = [f.wait() for f in all_done.wait()]
                out.set_result(combine(results))
            except Exception as err:
                out.set_exception(err)

        torch.futures.collect_all(futures).add_done_callback(done)
        return out

    def split(self, table: str, uniq: torch.Tensor) -> tuple[torch.Tensor | None, list[tuple[int, int, int]]]:
        """``order`` (server-sorted -> distinct) and the per-server pieces of the distinct ids ``uniq`` of ``table``.

        Returns:
            ``(order, pieces)`` where ``uniq[order]`` is grouped by server (in ``uniq``'s order within each group) and
            ``pieces`` lists ``(server_index, start, stop)`` of the non-empty groups; ``order`` is None when there
            is a single server (it would be the identity).
        """
        if self.n_servers == 1:  # one owner: no hashing, no sort
            return None, [(0, 0, uniq.numel())]
        owner = server_of(table, uniq, self.n_servers)
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=self.n_servers).tolist()
        pieces, start = [], 0
        for i, c in enumerate(counts):  # a loop over servers, not ids
            if c:
                pieces.append((i, start, start + c))
            start += c
        return order, pieces

    def close(self) -> None:
        """Stop the delay scheduler (if any) once it has sent every request made so far. Idempotent; requests stay
        possible afterwards only if ``delay_ms`` is 0."""
        if self._delayed is not None:
            self._delayed.close()


def distinct_ids(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids of a flat int64 batch (in order of first occurrence) and ``inverse``, ``uniq[inverse] ==
    flat``.

    On CPU one compiled hash-set pass (:func:`.kernels.dedup`), several times faster than the sort-based ``unique``
    of numpy or torch; the servers accept distinct ids in any order. What every lookup and push sends.
    """
    if flat.device.type != "cpu":
        return torch.unique(flat, return_inverse=True)
    return kernels.dedup(flat)
