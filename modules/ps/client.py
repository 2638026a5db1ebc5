"""Trainer-side client of the embedding parameter servers (torch RPC, TensorPipe).

Request batching: a batch of ids is de-duplicated and the distinct ids bucketed by server
(:mod:`.server_requests`), and **one** request per server that owns any of them is sent with ``rpc_async``; one
gather (the ``inverse``, composed with the server order) puts the answers' rows in the caller's order. There is no
per-id Python loop. Pushes (:mod:`.pushes`) do the same and additionally sum the gradients of duplicate ids on the
client, so the wire carries ``distinct ids x dim`` values, not ``ids x dim``.

Wire dtype: ``PsClient(wire_dtype=torch.float16)`` (or ``torch.bfloat16``) halves those values' bytes, as Persia
does: servers send rows in it and the client upcasts them; the client sends its float32 gradient sums in it and
the servers upcast them before the optimizer step. Weights and optimizer state stay float32 on the servers; the
default wire dtype, float32, is exact.

Futures: ``*_async`` methods return a ``torch.futures.Future`` that completes once every server involved answered.
Pushes are fire-and-forget until :meth:`PsClient.flush`, which waits for every outstanding push and raises the first
error of the pushes since the previous flush (also of one that failed before it was called). RPC gives no ordering
between requests, so a lookup issued while a push of the same rows is in flight may or may not see it (bounded
staleness, as in Persia); call :meth:`PsClient.flush` or wait on the push's future first when it must.

Requests are :mod:`.protocol`'s functions, sent through :class:`.server_requests.ServerRequests` (timeouts, the
injected delay, and the errors: :class:`~.protocol.PsUnavailableError` for a server that did not answer,
:class:`~.protocol.PsServerError` for one that refused): the client knows the servers only by name and protocol. A
process joins the group and gets a client with :func:`persia_planner.modules.ps.connection.connect` or
:func:`persia_planner.modules.ps.connection.joined`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.futures import Future

from persia_planner.modules.ps import kernels, protocol
from persia_planner.modules.ps.index import as_ids
from persia_planner.modules.ps.protocol import PsServerError, TableConfig, check_wire_dtype
from persia_planner.modules.ps.pushes import GradientPushes
from persia_planner.modules.ps.server_requests import ServerRequests, distinct_ids
from persia_planner.modules.ps.table_checkpoints import commit, prune, read_latest

__all__ = ["PsClient"]

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
        self.wire_dtype = check_wire_dtype(wire_dtype)
        # Every request goes through it: routing, timeouts, the injected delay, errors.
        self.requests = ServerRequests(servers, timeout_s=timeout_s, delay_ms=delay_ms)
        self._configs: dict[str, TableConfig] = {}
        self.pushes = GradientPushes(self.requests, self.wire_dtype)

    @property
    def servers(self) -> list[str]:
        """RPC names of the servers, in server-index order."""
        return self.requests.servers

    @property
    def n_servers(self) -> int:
        return self.requests.n_servers

    @property
    def timeout_s(self) -> float:
        """Timeout of every request, in seconds."""
        return self.requests.timeout_s

    @property
    def delay_ms(self) -> float:
        """Injected latency of every request, in milliseconds."""
        return self.requests.delay_ms

    def close(self) -> None:
        """Stop the delay scheduler (if any) once it has sent every request made so far. Idempotent; the client
        stays usable without a delay scheduler only if ``delay_ms`` is 0."""
        self.requests.close()

    def _config(self, table: str) -> TableConfig:
        try:
            return self._configs[table]
        except KeyError:
            raise PsServerError(f"table {table!r} is not registered with this client; call register(config)") from None

    # ------------------------------------------------------------------------------------------------ API

    def register(self, config: TableConfig) -> None:
        """Create ``config``'s table on every server (idempotent; a different config under the same name raises).

        Every trainer registers the tables it uses: the client needs the config (``dim``) and the servers ignore a
        repeated identical create.

        Raises:
            PsServerError: A server holds the table with a different config.
            PsUnavailableError: A server did not answer.
        """
        self.requests.to_every_server(protocol.create, (config,), "register", config.name, _nothing).wait()
        self._configs[config.name] = config

    def registered(self, table: str) -> bool:
        """Whether ``table`` was registered with this client (and not dropped since)."""
        return table in self._configs

    def drop(self, table: str) -> None:
        """Remove ``table`` and its rows from every server (e.g. a table only a measurement used, so that no
        checkpoint or metrics carry it). The table must have no requests in flight."""
        self.requests.to_every_server(protocol.drop, (table,), "drop", table, _nothing).wait()
        self._configs.pop(table, None)

    def lookup_async(self, table: str, ids: torch.Tensor, *, train: bool = True) -> Future:
        """Future of the rows of ``ids``: float32 ``[*ids.shape, dim]``; see :meth:`lookup`.

        The rows are put in the batch's order on the RPC thread that receives the last answer, so a trainer's
        forward and backward passes run meanwhile.
        """
        futs, expand = self._send_lookup(table, ids, train)
        return self.requests.combined(futs, expand)

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
        order, pieces = self.requests.split(table, uniq)
        multi = len(pieces) > 1
        sorted_ids = uniq[order] if multi else uniq
        op = ("lookup", table)
        # The wire dtype is named only when it is not float32, so the default request stays what it always was.
        wire = () if self.wire_dtype == torch.float32 else (self.wire_dtype,)
        # clone: a slice shares the whole batch's storage, which must not travel to every server.
        # distinct=True: the ids are unique, so the server skips its own de-duplication and gather.
        futs = [
            self.requests.call(
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
        return expand(self.requests.combined(futs, list).wait())

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
        order, pieces = self.requests.split(table, uniq)
        sorted_ids = uniq if order is None else uniq[order]
        futs = [
            self.requests.call(i, protocol.read, (table, sorted_ids[a:b].clone()), "read", table) for i, a, b in pieces
        ]
        rows = torch.cat(self.requests.combined(futs, list).wait())
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
        order, pieces = self.requests.split(table, flat)
        if order is not None:
            flat, rows = flat[order], rows[order]
        futs = [
            self.requests.call(i, protocol.assign, (table, flat[a:b].clone(), rows[a:b].clone()), "assign", table)
            for i, a, b in pieces
        ]
        return self.requests.combined(futs, sum).wait()

    def read_state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Optimizer state of the distinct ``ids`` as the servers hold it, float32 ``[len(ids), width]``, changing
        nothing: an id never trained reads as a new row's state (a TorchRec optimizer state dict of a PS table)."""
        self._config(table)
        flat = as_ids(ids)
        order, pieces = self.requests.split(table, flat)
        sorted_ids = flat if order is None else flat[order]
        futs = [
            self.requests.call(i, protocol.read_state, (table, sorted_ids[a:b].clone()), "read", table)
            for i, a, b in pieces
        ]
        state = torch.cat(self.requests.combined(futs, list).wait())
        return state if order is None else torch.empty_like(state).index_copy_(0, order, state)

    def assign_state(self, table: str, ids: torch.Tensor, state: torch.Tensor, start: int = 0) -> int:
        """Set columns ``[start, start + state.shape[1])`` of the optimizer state of the distinct ``ids`` on their
        servers (inserting the rows not held, as a training lookup would); returns the rows written. Pushes made
        before are applied first."""
        flat = as_ids(ids)
        state = state.reshape(flat.numel(), -1).to(torch.float32)
        self.flush()
        order, pieces = self.requests.split(table, flat)
        if order is not None:
            flat, state = flat[order], state[order]
        futs = [
            self.requests.call(
                i, protocol.assign_state, (table, flat[a:b].clone(), state[a:b].clone(), start), "assign", table
            )
            for i, a, b in pieces
        ]
        return self.requests.combined(futs, sum).wait()

    def push_gradients_async(
        self, table: str, ids: torch.Tensor, grads: torch.Tensor, *, optimizer: Any = None
    ) -> Future:
        """Send ``grads`` ``[*ids.shape, dim]`` of ``ids``; the future holds the number of rows the servers updated.

        The push is tracked: :meth:`flush` waits for it and raises its error if it failed (also if it failed before
        the flush). The gradients of duplicate ids are summed in float32 here and each sum travels once, in
        :attr:`wire_dtype`. ``optimizer`` (a :class:`~.optim.RowOptimizer` of the table's kind) travels with the push
        and steps these rows instead of the table's own: a schedule's learning rate at the step the gradients are of.

        Raises:
            ValueError: ``grads`` do not match ``ids`` x ``dim``.
            WireOverflowError: A finite summed gradient exceeds the range of :attr:`wire_dtype` (float16: 65504);
                nothing is sent then.
        """
        return self.pushes.send(table, self._config(table).dim, ids, grads, track=True, optimizer=optimizer)

    def push_gradients(self, table: str, ids: torch.Tensor, grads: torch.Tensor, *, optimizer: Any = None) -> int:
        """Synchronous :meth:`push_gradients_async`: returns once applied, with the number of rows updated; an
        error is raised here (and not again by :meth:`flush`)."""
        dim = self._config(table).dim
        return self.pushes.send(table, dim, ids, grads, track=False, optimizer=optimizer).wait()

    def flush(self) -> None:
        """Wait for every outstanding push; raises the first error of the pushes made since the previous flush
        (after all completed), also of those that failed before this call, whether or not their own futures were
        waited on. The error is reported once: the next flush raises only newer ones."""
        self.pushes.flush()

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
        self.requests.to_every_server(
            protocol.save, (str(directory), self.n_servers, version), "save", None, sum
        ).wait()
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
        return self.requests.to_every_server(protocol.dump, (str(directory), sequence), "dump", None, sum).wait()

    def load(self, directory: str | os.PathLike, *, tables: Sequence[str] | None = None) -> int:
        """Load the committed checkpoint of ``directory`` into the servers, re-sharded to their number (which may
        differ from the number that saved it). Register every table first. ``tables``: only these (a job under
        another plan resumes the tables it keeps on the servers). Returns the rows loaded."""
        self.flush()
        only = (None,) if tables is None else (sorted(tables),)
        args = (str(directory), self.n_servers, *only)
        return self.requests.to_every_server(protocol.load, args, "load", None, sum).wait()

    def seed(self, table: str, weights: torch.Tensor | None, state: torch.Tensor | None = None) -> None:
        """Start every id ``table`` does not hold from row ``id mod len(weights)`` of ``weights`` (and of the
        optimizer ``state``) on every server: a table moved from the trainers' local tables keeps answering as they
        did (:meth:`.store.EmbeddingStore.seed`; checkpoints keep the seed). None removes it.

        Raises:
            PsServerError: The shapes do not match the table's dim or its optimizer's state.
        """
        self._config(table)
        args = (table, None if weights is None else weights.detach().float().contiguous(), state)
        self.requests.to_every_server(protocol.seed, args, "seed", table, _nothing).wait()

    def metrics(self) -> list[dict[str, Any]]:
        """Each server's metrics (:func:`.server.server_metrics`), in server order."""
        return self.requests.to_every_server(protocol.metrics, (), "metrics", None, list).wait()

    def memory(self) -> list[dict[str, Any]]:
        """Each server's resident memory and its stores' bytes (``server.server_memory``), in server order."""
        return self.requests.to_every_server(protocol.memory, (), "memory", None, list).wait()


def _nothing(_answers: list[Any]) -> None:
    """The combined answer of requests that answer nothing (create, drop, seed)."""
