"""What trainers and parameter servers say to each other: table configs, requests, names, wire dtypes, errors.

Both sides import this module and nothing of each other: a server implements the requests, a client sends them.

Requests are the module-level functions :func:`create`, :func:`drop`, :func:`lookup`, :func:`read`, :func:`assign`,
:func:`read_state`, :func:`assign_state`, :func:`seed`, :func:`update`, :func:`save`, :func:`dump`, :func:`load`,
:func:`metrics` and :func:`memory`, sent with ``rpc_async``. RPC pickles a function *by reference* (module and name), so
the receiving process runs this module's function, which hands the request to the implementation its server module
registered with :func:`handles` when it was imported (:mod:`.server`). A process that registered none answers every
request with a :class:`RemoteFailure`.

Errors raised while serving a request are *returned* as a :class:`RemoteFailure` value, which the client raises as
:class:`PsServerError` (a :class:`PlannerError`). Raising across RPC would not do: the caller receives every remote
exception as a plain ``RuntimeError``, indistinguishable from a timeout or a broken connection. This way every
exception the client gets from the RPC layer means "the server did not answer" (:class:`PsUnavailableError`) and
every ``RemoteFailure`` means "the server answered no".

Servers are the RPC workers named ``ps{i}`` (:func:`server_name`), ``i`` being their index: their shard of every
table and checkpoint.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.model.dtypes import DType
from persia_planner.modules.ps.optim import SGD, RowOptimizer
from persia_planner.modules.ps.policies import Eviction, Normal, Uniform
from persia_planner.modules.wire_dtypes import torch_dtype

__all__ = [
    "MEMORY_STORE",
    "WIRE_DTYPES",
    "CheckpointError",
    "PeerLostError",
    "PsServerError",
    "PsUnavailableError",
    "RemoteFailure",
    "TableConfig",
    "WireOverflowError",
    "assign",
    "assign_state",
    "check_wire_dtype",
    "create",
    "drop",
    "dump",
    "handles",
    "is_server_name",
    "load",
    "lookup",
    "memory",
    "metrics",
    "read",
    "read_state",
    "save",
    "seed",
    "server_index",
    "server_name",
    "unreadable",
    "update",
]

# Dtypes rows and gradients may travel in (``PsClient(wire_dtype=...)``, ``persia train --ps-wire``: the names are
# model.dtypes.DType's); the stores always hold float32.
WIRE_DTYPES = tuple(torch_dtype(wire) for wire in DType)
_DEFAULT_OPTIMIZER = SGD()  # frozen dataclasses: safe to share as defaults
_DEFAULT_INIT = Uniform()
MEMORY_STORE = "persia_planner.modules.ps.table_store:memory_store"
"""The in-memory store's factory (:func:`.table_store.memory_store`): the ``ps`` tier's ``TierSpec.store``, and the
store of a :class:`TableConfig` that names none."""
_SERVER_NAME = re.compile(r"ps(\d+)")

# ------------------------------------------------------------------------------------------------------- errors


class PsServerError(PlannerError):
    """A parameter server refused or failed a request (bad table config, unknown table, shape mismatch...).

    Takes a single message argument so that RPC can re-create it on the calling side.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, kind=ErrorKind.INPUT)


class PsUnavailableError(PlannerError):
    """A parameter server did not answer within the timeout, or its connection broke.

    Attributes:
        server: RPC name of the server.
        operation: ``lookup``, ``push``, ``register`` or ``metrics``.
        table: The table of the request, if any.
    """

    def __init__(self, server: str, operation: str, table: str | None, timeout_s: float, cause: str) -> None:
        self.server, self.operation, self.table = server, operation, table
        what = f"a {operation} of table {table!r}" if table is not None else f"a {operation} request"
        # The agent's first line is the useful part ("eof", "Connection refused"); drop its source location.
        detail = (cause.strip().splitlines() or ["no details"])[0].split(" (this error originated")[0]
        if "timeout" in cause.lower() or "ran for more than" in cause.lower():
            problem = f"did not answer {what} within {timeout_s:g} s"
        else:
            problem = f"did not answer {what}: connection lost ({detail})"
        super().__init__(
            f"parameter server {server} {problem} (is it running? check MASTER_ADDR/MASTER_PORT and its log)",
            kind=ErrorKind.UNAVAILABLE,
        )


class CheckpointError(PlannerError):
    """A checkpoint file that is missing, truncated, corrupt or not one of ours; the message names the file.

    Takes a single message argument so that RPC can re-create it on the calling side.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, kind=ErrorKind.INPUT)


def unreadable(path: object, err: BaseException | str) -> CheckpointError:
    """The :class:`CheckpointError` of a checkpoint file that could not be read or is not what it should be
    (``err``: why), with the fix."""
    if isinstance(err, BaseException):
        err = f"{type(err).__name__}: {(str(err).strip().splitlines() or ['no detail'])[0][:200]}"
    return CheckpointError(
        f"checkpoint file {path} is unreadable ({err}); restore it, or resume from another checkpoint directory"
    )


class WireOverflowError(PlannerError, ValueError):
    """A finite summed gradient does not fit the client's narrower wire dtype; nothing was sent.

    A ``PlannerError`` (the CLI prints it as one line and exits 2: diverging gradients are the run's condition, not a
    bug of ours) and a ``ValueError`` (a bad value was passed in).
    """


class PeerLostError(PlannerError):
    """Another worker of the group died or stopped answering while this one waited for the group's shutdown.

    The graceful shutdown needs every worker, so it could never complete: this worker stops waiting instead of
    waiting forever (see :func:`.group.leave_group`). Attributes: ``worker`` (this worker's RPC name) and ``peer`` (the
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
            lost_rows = is_server_name(peer)
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
class RemoteFailure:
    """What a request returns instead of raising: the server's refusal or failure, raised by the client as
    :class:`PsServerError` (see the module docstring)."""

    message: str


# ------------------------------------------------------------------------------------------ tables, names, wire


@dataclass(frozen=True)
class TableConfig:
    """Everything a server needs to create one table; the same config is sent to every server.

    Attributes:
        name: Table name (also salts the id -> server hash, see :func:`.sharding.server_of`).
        dim: Embedding width.
        capacity: Maximum rows **per server** (each server holds about ``1 / n_servers`` of the ids).
        optimizer: The sparse optimizer the servers apply on ``EmbeddingStore.update``.
        init: Initialiser of new rows.
        eviction: LRU or LFU.
        admission_probability: Probability that a new id is inserted on a training lookup.
        clip: If set, weights are clamped to ``[-clip, clip]`` after every update.
        seed: Seed of the initial rows (per id, see ``EmbeddingStore(init_seed=...)``) and of each server's
            admission draws (server ``i`` uses ``seed + i``).
        eviction_chunk: Fraction of the capacity a full table evicts at once (see :class:`~.store.EmbeddingStore`).
        weight_dtype: The dtype the servers keep the rows in (the plan's ``embedding_dtype``; see
            ``EmbeddingStore(weight_dtype=...)``).
        store: The factory of the table's store on each server, ``"module:name"`` of a callable
            ``(TableConfig, server_index) -> store`` (:class:`.table_store.TableStore`): the table's tier's
            ``TierSpec.store`` (default: :data:`MEMORY_STORE`, the ``ps`` tier's rows in DDR).
        backing_rows: Rows **per server** the store keeps beyond its ``capacity`` in-memory rows, in its tier's
            backing memory (the ``ssd`` tier's disk); ``capacity`` is then the in-memory cache's. 0: every row in
            the store's ``capacity``.
        store_dir: The directory of a store's files on each server's host (created if missing); None: the system's
            temporary directory.
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
    weight_dtype: torch.dtype = torch.float32
    store: str = MEMORY_STORE
    backing_rows: int = 0
    store_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TableConfig.name must not be empty")
        module, _, factory = self.store.partition(":")
        if not (module and factory):
            raise ValueError(f"TableConfig.store must be 'module:name' (a store factory), got {self.store!r}")
        if self.backing_rows and self.backing_rows < self.capacity:
            raise ValueError(
                f"TableConfig.backing_rows ({self.backing_rows:,}) must hold the cache's {self.capacity:,} rows"
            )
        # Normalise a plain string so that equal configs compare equal on the server (idempotent create).
        object.__setattr__(self, "eviction", Eviction(self.eviction))

    @property
    def init_seed(self) -> int:
        """The seed of this table's initial rows, per id (``EmbeddingStore(init_seed=...)``): derived from ``seed``
        and the name alone, so every server, arrival order and resumed run gives an id the same initial row."""
        return (self.seed * 1_000_003 + zlib.crc32(self.name.encode())) & 0x7FFFFFFF


def server_name(rank: int) -> str:
    """RPC worker name of server ``rank`` (servers take ranks ``0 .. n_servers-1``)."""
    return f"ps{rank}"


def server_index(name: str, rank: int) -> int:
    """Index of a server (its shard of every table and checkpoint): ``i`` of its name ``ps{i}``, else its RPC rank.

    Under torchrun each server runs on its topology host's node, so ``ps1`` need not have RPC rank 1.
    """
    m = _SERVER_NAME.fullmatch(name)
    return int(m.group(1)) if m else rank


def is_server_name(name: str) -> bool:
    """Whether ``name`` is a server's RPC name, ``ps{i}`` (trainers take other names)."""
    return _SERVER_NAME.fullmatch(name) is not None


def check_wire_dtype(wire_dtype: Any) -> torch.dtype:
    """``wire_dtype`` if it is one of :data:`WIRE_DTYPES`.

    Raises:
        ValueError: Otherwise, in one line naming the accepted values.
    """
    if not isinstance(wire_dtype, torch.dtype) or wire_dtype not in WIRE_DTYPES:
        *first, last = (str(dtype) for dtype in WIRE_DTYPES)
        raise ValueError(f"wire_dtype must be {', '.join(first)} or {last}, got {wire_dtype!r}")
    return wire_dtype


# ----------------------------------------------------------------------------------------------------- requests

_F = TypeVar("_F", bound=Callable[..., Any])
# Request name -> this process's implementation, registered by the server module (see handles).
_HANDLERS: dict[str, Callable[..., Any]] = {}


def handles(request: Callable[..., Any]) -> Callable[[_F], _F]:
    """Decorator: register the decorated function as this process's implementation of ``request`` (one of this
    module's request functions). It takes the request's arguments and returns its answer or a
    :class:`RemoteFailure`; a later registration replaces an earlier one."""

    def register(fn: _F) -> _F:
        _HANDLERS[request.__name__] = fn
        return fn

    return register


def _serve(request: str, *args: Any) -> Any:
    handler = _HANDLERS.get(request)
    if handler is None:
        return RemoteFailure(f"process {os.getpid()} is not a parameter server: it cannot serve {request!r}")
    return handler(*args)


def create(config: TableConfig) -> int:
    """Create ``config.name`` unless it exists with the same config (a different one is refused); returns the
    server's index."""
    return _serve("create", config)


def drop(table: str) -> bool:
    """Remove ``table`` and its rows from the server (a table of its own that a measurement used); returns whether
    it was there."""
    return _serve("drop", table)


def lookup(
    table: str, ids: torch.Tensor, train: bool, distinct: bool = False, wire_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Rows ``[len(ids), dim]`` of ``ids``; ``train=False`` never inserts. ``distinct=True``: the caller promises
    the ids do not repeat (the client de-duplicates). ``wire_dtype``: the dtype the rows travel back in (None: the
    store's float32)."""
    return _serve("lookup", table, ids, train, distinct, wire_dtype)


def read(table: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``[len(ids), dim]`` of the distinct ``ids`` as the table holds them, without side effects: an id it does
    not hold reads as its initial value (a TorchRec state dict of the table)."""
    return _serve("read", table, ids)


def assign(table: str, ids: torch.Tensor, weights: torch.Tensor) -> int:
    """Set the rows of the distinct ``ids`` to ``weights``, their optimizer state as new (a TorchRec state dict
    loaded into the table); returns the rows written."""
    return _serve("assign", table, ids, weights)


def seed(table: str, weights: torch.Tensor | None, state: torch.Tensor | None = None) -> bool:
    """Start the ids the table does not hold from row ``id mod len(weights)`` of ``weights`` (and of the optimizer
    ``state``): a table moved from the trainers' local tables to the servers; None removes the seed."""
    return _serve("seed", table, weights, state)


def update(
    table: str, ids: torch.Tensor, grads: torch.Tensor, distinct: bool = False, optimizer: RowOptimizer | None = None
) -> int:
    """Apply the table's optimizer to the rows of ``ids`` with ``grads`` (any float dtype, upcast to float32);
    returns the number of rows updated. ``optimizer``: this push's hyper-parameters (the table's kind of optimizer
    with a schedule's current learning rate); None: the table's own."""
    if optimizer is None:  # the request as it always was
        return _serve("update", table, ids, grads, distinct)
    return _serve("update", table, ids, grads, distinct, optimizer)


def read_state(table: str, ids: torch.Tensor) -> torch.Tensor:
    """Optimizer state ``[len(ids), width]`` of the distinct ``ids`` as the table holds it, without side effects: an
    id it does not hold reads as a new row's state (a TorchRec optimizer state dict of the table)."""
    return _serve("read_state", table, ids)


def assign_state(table: str, ids: torch.Tensor, state: torch.Tensor, start: int) -> int:
    """Set columns ``[start, start + state.shape[1])`` of the optimizer state of the distinct ``ids`` (a TorchRec
    optimizer state dict loaded into the table); returns the rows written."""
    return _serve("assign_state", table, ids, state, start)


def save(directory: str, n_servers: int, version: int) -> int:
    """Write the server's tables into checkpoint ``version`` (committed by the client once every server wrote);
    returns rows saved."""
    return _serve("save", directory, n_servers, version)


def dump(directory: str, sequence: int) -> int:
    """Write the rows touched since the server's previous dump as delta ``sequence``; returns their number."""
    return _serve("dump", directory, sequence)


def load(directory: str, n_servers: int, tables: list[str] | None = None) -> int:
    """Replace the registered tables' rows (``tables``' only, where given) by the server's share of the committed
    checkpoint; returns rows loaded."""
    return _serve("load", directory, n_servers, tables)


def metrics() -> dict[str, Any]:
    """The server's metrics (``server.server_metrics``)."""
    return _serve("metrics")


def memory() -> dict[str, Any]:
    """The server's resident memory and its stores' own account of theirs (``server.server_memory``)."""
    return _serve("memory")
