"""Trainer-side client of the embedding parameter servers (torch RPC, TensorPipe).

Request batching: a batch of ids is de-duplicated (distinct ids in order of first occurrence and the ``inverse`` map, in
one compiled hash-set pass: :func:`.kernels.dedup`), the distinct ids are bucketed by :func:`.sharding.server_of` with
one stable sort, and **one** request per server that owns any of them is sent with ``rpc_async``; one gather (the
``inverse``, composed with the server order) puts the answers' rows in the caller's order. There is no per-id Python
loop. Pushes do the same and additionally **sum the gradients of duplicate ids on the client**
(``index_add_``), so each server receives each id once (and is told so: it skips its own de-duplication) and the wire
carries ``distinct ids x dim`` values, not ``ids x dim``.

Wire dtype: ``PsClient(wire_dtype=torch.float16)`` (or ``torch.bfloat16``) halves those values' bytes, as Persia
does: servers send rows in it and the client upcasts them; the client sends its float32 gradient sums in it and
the servers upcast them before the optimizer step. Weights and optimizer state stay float32 on the servers; the
default wire dtype, float32, is exact.

Futures: ``*_async`` methods return a ``torch.futures.Future`` that completes once every server involved answered.
Pushes are fire-and-forget until :meth:`PsClient.flush`, which waits for every outstanding push and raises the first
error of the pushes since the previous flush (also of one that failed before it was called). RPC gives no ordering
between requests, so a lookup issued while a push of the same rows is in flight may or may not see it (bounded
staleness, as in Persia); call :meth:`PsClient.flush` or wait on the push's future first when it must.

Errors: every request carries an RPC timeout. A server that did not answer in time or whose connection broke
(process killed, host down) surfaces as :class:`~.protocol.PsUnavailableError` with one line naming the server, the
operation and the table. Errors the server reports (unknown table, conflicting config; returned as a
``RemoteFailure`` value, see :mod:`.protocol`) are raised as :class:`~.protocol.PsServerError`.

Requests are :mod:`.protocol`'s functions: the client knows the servers only by name and protocol. A process joins
the group and gets a client with :func:`persia_planner.modules.ps.connection.connect` or
:func:`persia_planner.modules.ps.connection.joined`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from persia_planner.errors import PlannerError
from persia_planner.modules.ps import kernels, protocol
from persia_planner.modules.ps.delay import DelayScheduler
from persia_planner.modules.ps.index import as_ids
from persia_planner.modules.ps.protocol import (
    PsServerError,
    PsUnavailableError,
    RemoteFailure,
    TableConfig,
    WireOverflowError,
    check_wire_dtype,
    server_index,
)
from persia_planner.modules.ps.sharding import server_of
from persia_planner.modules.ps.table_checkpoints import commit, prune, read_latest

__all__ = ["PsClient", "distinct_ids"]

log = logging.getLogger(__name__)


class PsClient:
    """Client of a group of parameter servers, for a process that already joined the RPC group.

    Args:
        servers: RPC names of the servers, in server-index order (``server_of`` index ``i`` -> ``servers[i]``).
        timeout_s: Timeout of every request (of the RPC itself, not counting ``delay_ms``).
        delay_ms: Injected latency, a stand-in for a slow network: every request is sent only ``delay_ms``
            milliseconds after it was made. The caller is not blocked (the ``*_async`` methods return at once) and
            the delays of concurrent requests overlap: one scheduler thread per client sends each request when it
            is due and chains its answer into the future already returned.
        wire_dtype: The dtype embedding rows and gradients travel in: ``torch.float32`` (default: exact),
            ``torch.float16`` or ``torch.bfloat16`` (half the bytes, as Persia sends them). Only the wire is
            narrowed: servers keep the rows in their table's dtype and the optimizer state in float32, lookups
            still return float32 rows (each value rounded once to ``wire_dtype``), and gradients are summed per id in
            float32 on the client, rounded once for the wire and upcast by the server before its optimizer step.
            float16 holds magnitudes up to 65504 (larger gradients or weights are refused, not sent as inf) and
            flushes those below about 6e-8 to zero; bfloat16 keeps float32's range with 8 bits of mantissa instead
            of 11.

    Raises:
        ValueError: If an argument is out of range (``wire_dtype`` not one of the three dtypes above).
        PsUnavailableError: If a name is not a worker of the RPC group.
        PlannerError: If ``servers[i]`` does not have rank ``i`` (servers shard their checkpoints by rank).
    """

    def __init__(
        self,
        servers: Sequence[str],
        *,
        timeout_s: float = 10.0,
        delay_ms: float = 0.0,
        wire_dtype: torch.dtype = torch.float32,
    ) -> None:
        if not servers:
            raise ValueError("PsClient needs at least one server")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not 0 <= delay_ms < math.inf:
            raise ValueError(f"delay_ms must be a finite number >= 0, got {delay_ms}")
        self.wire_dtype = check_wire_dtype(wire_dtype)
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
        self._configs: dict[str, TableConfig] = {}
        self._pending: set[Future] = set()
        self._failed: BaseException | None = None  # the first push that failed since the last flush()
        self._pending_lock = threading.Lock()

    @property
    def n_servers(self) -> int:
        return len(self.servers)

    # ------------------------------------------------------------------------------------------- requests

    def _call(self, i: int, fn: Any, args: tuple, operation: str, table: str | None) -> Future:
        """``rpc_async`` to server ``i`` (after ``delay_ms``) whose future's error, if any, is already translated."""
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

    def close(self) -> None:
        """Stop the delay scheduler (if any) once it has sent every request made so far. Idempotent; the client
        stays usable without a delay scheduler only if ``delay_ms`` is 0."""
        if self._delayed is not None:
            self._delayed.close()

    @staticmethod
    def _all(futures: list[Future], combine: Any) -> Future:
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

    def _config(self, table: str) -> TableConfig:
        try:
            return self._configs[table]
        except KeyError:
            raise PsServerError(f"table {table!r} is not registered with this client; call register(config)") from None

    def _split(self, table: str, uniq: torch.Tensor) -> tuple[torch.Tensor | None, list[tuple[int, int, int]]]:
        """``order`` (server-sorted -> distinct) and the per-server pieces of the distinct ids ``uniq``.

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

    # ------------------------------------------------------------------------------------------------ API

    def register(self, config: TableConfig) -> None:
        """Create ``config``'s table on every server (idempotent; a different config under the same name raises).

        Every trainer registers the tables it uses: the client needs the config (``dim``) and the servers ignore a
        repeated identical create.

        Raises:
            PsServerError: A server holds the table with a different config.
            PsUnavailableError: A server did not answer.
        """
        futs = [self._call(i, protocol.create, (config,), "register", config.name) for i in range(self.n_servers)]
        self._all(futs, lambda _: None).wait()
        self._configs[config.name] = config

    def drop(self, table: str) -> None:
        """Remove ``table`` and its rows from every server (e.g. a table only a measurement used, so that no
        checkpoint or metrics carry it). The table must have no requests in flight."""
        futs = [self._call(i, protocol.drop, (table,), "drop", table) for i in range(self.n_servers)]
        self._all(futs, lambda _: None).wait()
        self._configs.pop(table, None)

    def lookup_async(self, table: str, ids: torch.Tensor, *, train: bool = True) -> Future:
        """Future of the rows of ``ids``: float32 ``[*ids.shape, dim]``; see :meth:`lookup`.

        The rows are put in the batch's order on the RPC thread that receives the last answer, so a trainer's
        forward and backward passes run meanwhile.
        """
        futs, expand = self._send_lookup(table, ids, train)
        return self._all(futs, expand)

    def _send_lookup(
        self, table: str, ids: torch.Tensor, train: bool
    ) -> tuple[list[Future], Callable[[list[torch.Tensor]], torch.Tensor]]:
        """Send a lookup's requests: the futures of the servers' answers and ``expand(answers)``, which puts their
        rows in the batch's order (an empty batch sends nothing)."""
        dim = self._config(table).dim
        shape = tuple(ids.shape)
        flat = ids.reshape(-1)
        if flat.dtype == torch.uint64:
            flat = flat.view(torch.int64)  # the uint64 bit pattern, as the store and server_of expect
        if flat.numel() == 0:
            return [], lambda _: torch.zeros(*shape, dim)
        uniq, inverse = distinct_ids(flat)
        order, pieces = self._split(table, uniq)
        multi = len(pieces) > 1
        sorted_ids = uniq[order] if multi else uniq
        op = ("lookup", table)
        # The wire dtype is named only when it is not float32, so the default request stays what it always was.
        wire = () if self.wire_dtype == torch.float32 else (self.wire_dtype,)
        # clone: a slice shares the whole batch's storage, which must not travel to every server.
        # distinct=True: the ids are unique, so the server skips its own de-duplication and gather.
        futs = [
            self._call(
                i, protocol.lookup, (table, sorted_ids[a:b].clone() if multi else sorted_ids, train, True, *wire), *op
            )
            for i, a, b in pieces
        ]
        if multi:
            # The answers arrive in server order (uniq[order]): compose the two maps so that one gather puts the
            # rows in the caller's order, instead of scattering them back to uniq's order first.
            assert order is not None
            position = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
            inverse = position.index_select(0, inverse)

        def expand(results: list[torch.Tensor]) -> torch.Tensor:
            rows = results[0] if len(results) == 1 else torch.cat(results)
            if rows.dtype not in (torch.float32, torch.float16):
                # Upcast the distinct rows before the expansion: fewer values to convert than the expanded batch has.
                # (gather_rows widens float16 rows itself, in the expansion's own pass.)
                rows = rows.to(torch.float32)
            # Streaming stores (kernels.gather_rows): the expanded batch is the largest tensor of the path and is read
            # only later by the trainer; index_select below 1 MiB. Either is faster than rows[inverse] on CPU.
            return kernels.gather_rows(rows, inverse).reshape(*shape, dim)

        return futs, expand

    def lookup(self, table: str, ids: torch.Tensor, *, train: bool = True) -> torch.Tensor:
        """Rows of ``ids`` (int64 carrying uint64 bit patterns, or uint64), float32 ``[*ids.shape, dim]``.

        With ``train=True`` missing ids are admitted and initialised by their server; with ``train=False`` nothing is
        inserted and missing ids read as zero rows. With a narrower :attr:`wire_dtype` every value is the server's
        float32 value rounded once to it (``rows.half().float()`` for float16).

        Raises:
            PsUnavailableError: A server owning some of the ids did not answer within ``timeout_s``.
        """
        futs, expand = self._send_lookup(table, ids, train)
        # The caller waits anyway: the rows are put in the batch's order on its own thread instead of on the RPC
        # thread, which would then have to wake it (never slower in alternating runs, and faster under load).
        return expand(self._all(futs, list).wait())

    def read_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` as the servers hold them, float32 ``[*ids.shape, dim]``, changing nothing: an id never
        trained reads as its initial value (what a training lookup would insert). TorchRec's state dict of a PS
        table reads ``arange(num_embeddings)`` so.

        Raises:
            PsUnavailableError: A server owning some of the ids did not answer within ``timeout_s``.
        """
        dim = self._config(table).dim
        flat = as_ids(ids)
        if flat.numel() == 0:
            return torch.zeros(*ids.shape, dim)
        uniq, inverse = distinct_ids(flat)
        order, pieces = self._split(table, uniq)
        sorted_ids = uniq if order is None else uniq[order]
        futs = [self._call(i, protocol.read, (table, sorted_ids[a:b].clone()), "read", table) for i, a, b in pieces]
        rows = torch.cat(self._all(futs, list).wait())
        if order is not None:  # back from server order to uniq's
            rows = torch.empty_like(rows).index_copy_(0, order, rows)
        return rows.index_select(0, inverse).reshape(*ids.shape, dim)

    def assign_rows(self, table: str, ids: torch.Tensor, weights: torch.Tensor) -> int:
        """Set the rows of ``ids`` to ``weights`` ``[*ids.shape, dim]`` on their servers, each with a new row's
        optimizer state (a TorchRec state dict loaded into a PS table); returns the rows written. Pushes made
        before are applied first.

        Raises:
            ValueError: ``weights`` do not match ``ids`` x ``dim``, or an id repeats.
        """
        dim = self._config(table).dim
        flat = as_ids(ids)
        if weights.numel() != flat.numel() * dim or weights.dim() == 0 or weights.shape[-1] != dim:
            raise ValueError(f"weights of shape {tuple(weights.shape)} do not match ids {tuple(ids.shape)} x dim {dim}")
        uniq, _ = distinct_ids(flat)
        if uniq.numel() != flat.numel():
            raise ValueError(f"assign_rows: the {flat.numel()} ids of table {table!r} repeat")
        self.flush()
        rows = weights.reshape(-1, dim).to(torch.float32)
        order, pieces = self._split(table, flat)
        if order is not None:
            flat, rows = flat[order], rows[order]
        futs = [
            self._call(i, protocol.assign, (table, flat[a:b].clone(), rows[a:b].clone()), "assign", table)
            for i, a, b in pieces
        ]
        return self._all(futs, sum).wait()

    def push_gradients_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Future:
        """Send ``grads`` ``[*ids.shape, dim]`` of ``ids``; the future holds the number of rows the servers updated.

        The push is tracked: :meth:`flush` waits for it and raises its error if it failed (also if it failed before
        the flush). The gradients of duplicate ids are summed in float32 here and each sum travels once, in
        :attr:`wire_dtype`.

        Raises:
            ValueError: ``grads`` do not match ``ids`` x ``dim``.
            WireOverflowError: A finite summed gradient exceeds the range of :attr:`wire_dtype` (float16: 65504);
                nothing is sent then.
        """
        return self._push(table, ids, grads, track=True)

    def _push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, *, track: bool) -> Future:
        """:meth:`push_gradients_async`; ``track=False`` leaves the push out of :meth:`flush` (its caller waits)."""
        dim = self._config(table).dim
        flat = ids.reshape(-1)
        if flat.dtype == torch.uint64:
            flat = flat.view(torch.int64)
        # The last axis must be dim too: a transposed [dim, n] tensor has the right numel but would be misassigned.
        if grads.numel() != flat.numel() * dim or grads.dim() == 0 or grads.shape[-1] != dim:
            raise ValueError(f"grads of shape {tuple(grads.shape)} do not match ids {tuple(ids.shape)} x dim {dim}")
        if flat.numel() == 0:
            done: Future = Future()
            done.set_result(0)
            return done
        uniq, inverse = distinct_ids(flat)
        order, pieces = self._split(table, uniq)
        # Sum duplicates here: the servers get one gradient row per distinct id (less traffic, same result).
        summed = torch.zeros(uniq.numel(), dim).index_add_(0, inverse, grads.reshape(-1, dim).to(torch.float32))
        if self.wire_dtype != torch.float32:
            summed = self._to_wire(table, summed)  # rounded once, after the float32 sum
        # distinct=True: the ids are unique, so the server skips its own de-duplication and summation.
        if len(pieces) == 1:  # one owner: the whole (fresh) tensors travel, no reordering or copies
            ((i, _, _),) = pieces
            futs = [self._call(i, protocol.update, (table, uniq, summed, True), "push", table)]
        else:
            sorted_ids, sorted_grads = uniq[order], summed[order]
            futs = [
                self._call(
                    i,
                    protocol.update,
                    (table, sorted_ids[a:b].clone(), sorted_grads[a:b].clone(), True),
                    "push",
                    table,
                )
                for i, a, b in pieces
            ]
        out = self._all(futs, sum)
        if not track:
            return out
        with self._pending_lock:
            self._pending.add(out)

        def forget(f: Future) -> None:
            try:
                f.wait()  # done already: returns at once, or raises the push's error
                failed = None
            except Exception as err:
                failed = err
            with self._pending_lock:
                if f in self._pending:  # else a flush() claimed it and reports its error itself
                    self._pending.discard(f)
                    # A fire-and-forget push that fails before flush() is called must still be reported by it.
                    self._failed = self._failed or failed

        out.add_done_callback(forget)
        return out

    def _to_wire(self, table: str, summed: torch.Tensor) -> torch.Tensor:
        """``summed`` in :attr:`wire_dtype`; raises where a finite gradient would turn into ``inf``.

        An ``inf`` gradient would make the row's weights ``inf`` or ``nan`` on the server for good, so the push is
        refused instead. Gradients that already hold ``inf`` or ``nan`` pass as they would in float32.

        Raises:
            WireOverflowError: A finite summed gradient exceeds the largest value of :attr:`wire_dtype`.
        """
        # One reduction over the float32 sum: CPU float16 has no fast isinf to scan the narrowed copy with.
        peak = summed.abs().amax()
        if not torch.isfinite(peak):
            # A nan or inf elsewhere must not hide a finite value that overflows: look at the finite ones only.
            peak = torch.where(torch.isfinite(summed), summed.abs(), 0.0).amax()
        if torch.isinf(peak.to(self.wire_dtype)):
            fixes = ("scale the gradients down (lower the learning rate or the loss scale)",)
            if self.wire_dtype == torch.float16:
                fixes = ("send bfloat16 (wire_dtype=torch.bfloat16, --ps-wire bfloat16)", *fixes)
            raise WireOverflowError(
                f"gradients of table {table!r} overflow {self.wire_dtype} on the wire (wire_dtype / --ps-wire): "
                f"largest summed |gradient| {float(peak):.6g} > {torch.finfo(self.wire_dtype).max:.6g}",
                fixes=fixes,
            )
        return summed.to(self.wire_dtype)

    def push_gradients(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> int:
        """Synchronous :meth:`push_gradients_async`: returns once applied, with the number of rows updated; an
        error is raised here (and not again by :meth:`flush`)."""
        return self._push(table, ids, grads, track=False).wait()

    def flush(self) -> None:
        """Wait for every outstanding push; raises the first error of the pushes made since the previous flush
        (after all completed), also of those that failed before this call, whether or not their own futures were
        waited on. The error is reported once: the next flush raises only newer ones."""
        with self._pending_lock:
            # Claim the outstanding pushes: their errors are reported by this call, not recorded by their callbacks
            # (a future's waiters may wake before its done-callback ran), so each error is reported exactly once.
            pending = list(self._pending)
            self._pending.clear()
        first: BaseException | None = None
        for f in pending:
            try:
                f.wait()
            except Exception as err:
                first = first or err
        with self._pending_lock:
            first, self._failed = self._failed or first, None  # one that failed before this call came first
        if first is not None:
            raise first

    def save(self, directory: str | os.PathLike, *, keep: int | None = None) -> int:
        """Checkpoint every server into ``directory`` (a filesystem every server sees); returns the new version.

        Waits for this client's outstanding pushes first. Each server writes its shard; only when all have written
        does the version become current (``LATEST`` is replaced atomically), so a crash mid-save leaves the
        previous checkpoint in place.

        Args:
            directory: The checkpoint directory.
            keep: If set, then delete all but the ``keep`` newest committed versions
                (:func:`persia_planner.modules.ps.table_checkpoints.prune`).
        """
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.flush()
        latest = read_latest(directory)
        version = (latest["version"] if latest else 0) + 1
        futs = [
            self._call(i, protocol.save, (str(directory), self.n_servers, version), "save", None)
            for i in range(self.n_servers)
        ]
        self._all(futs, sum).wait()
        commit(directory, version, n_servers=self.n_servers)
        if keep is not None:
            try:
                prune(directory, keep)
            except OSError as err:  # the new version is committed: a failed clean-up must not report a failed save
                log.warning("checkpoint %d of %s saved, but pruning older versions failed: %s", version, directory, err)
        return version

    def dump_incremental(self, directory: str | os.PathLike, sequence: int) -> int:
        """Every server writes the rows inserted or updated since its previous dump as delta ``sequence`` (for
        serving replicas: :func:`.deltas.apply_deltas`); returns the number of rows dumped.

        ``sequence`` must be above the previous dump's (after :meth:`load`: above the checkpoint's
        ``delta_sequence``, from :func:`persia_planner.modules.ps.table_checkpoints.read_latest`); a restored server's
        first dump removes the deltas it wrote after that point in the run that was rolled back.

        Raises:
            PsServerError: ``sequence`` is not above a server's last dump.
        """
        self.flush()
        futs = [self._call(i, protocol.dump, (str(directory), sequence), "dump", None) for i in range(self.n_servers)]
        return self._all(futs, sum).wait()

    def load(self, directory: str | os.PathLike, *, tables: Sequence[str] | None = None) -> int:
        """Load the committed checkpoint of ``directory`` into the servers, re-sharded to their number (which may
        differ from the number that saved it). Register every table first. ``tables``: only these (a job under
        another plan resumes the tables it keeps on the servers). Returns the rows loaded."""
        self.flush()
        only = (None,) if tables is None else (sorted(tables),)
        futs = [
            self._call(i, protocol.load, (str(directory), self.n_servers, *only), "load", None)
            for i in range(self.n_servers)
        ]
        return self._all(futs, sum).wait()

    def seed(self, table: str, weights: torch.Tensor | None, state: torch.Tensor | None = None) -> None:
        """Start every id ``table`` does not hold from row ``id mod len(weights)`` of ``weights`` (and of the
        optimizer ``state``) on every server: a table moved from the trainers' local tables keeps answering as they
        did (:meth:`.store.EmbeddingStore.seed`; checkpoints keep the seed). None removes it.

        Raises:
            PsServerError: The shapes do not match the table's dim or its optimizer's state.
        """
        self._config(table)
        args = (table, None if weights is None else weights.detach().float().contiguous(), state)
        futs = [self._call(i, protocol.seed, args, "seed", table) for i in range(self.n_servers)]
        self._all(futs, lambda _: None).wait()

    def metrics(self) -> list[dict[str, Any]]:
        """Each server's metrics (:func:`.server.server_metrics`), in server order."""
        futs = [self._call(i, protocol.metrics, (), "metrics", None) for i in range(self.n_servers)]
        return self._all(futs, list).wait()

    def memory(self) -> list[dict[str, Any]]:
        """Each server's resident memory and its stores' bytes (``server.server_memory``), in server order."""
        futs = [self._call(i, protocol.memory, (), "memory", None) for i in range(self.n_servers)]
        return self._all(futs, list).wait()


def distinct_ids(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids of a flat int64 batch (in order of first occurrence) and ``inverse``, ``uniq[inverse] ==
    flat``.

    On CPU one compiled hash-set pass (:func:`.kernels.dedup`), several times faster than the sort-based ``unique``
    of numpy or torch; the servers accept distinct ids in any order. What every lookup and push sends.
    """
    if flat.device.type != "cpu":
        return torch.unique(flat, return_inverse=True)
    return kernels.dedup(flat)
