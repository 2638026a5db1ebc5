"""A model's hybrid collections trained as one: its bag collection and its sequence collection (DIN's), or either.

A training run drives its tables through one object: prefetch a batch's PS rows, flush the pushes, read the
staleness, gather and restore the local tables and their optimizer state for a checkpoint. :class:`HybridSet` gives
that protocol over several :class:`~.hybrid_tables.HybridTables` (one per kind), and :class:`LocalSet` the local
tables' state over their local modules, so that a run with sequence tables checkpoints, resumes and migrates as a run
of bags does. Tables are named uniquely across a model, so every per-table mapping simply merges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from persia_planner.errors import PlannerError
from persia_planner.modules.embedding.hybrid_tables import HybridTables
from persia_planner.modules.embedding.local import LocalEmbeddingBags

__all__ = ["HybridSet", "LocalSet", "TrainedTables"]


class TrainedTables(Protocol):
    """What a training run asks of its model's tables: one hybrid collection (:class:`~.hybrid_tables.HybridTables`)
    or several (:class:`HybridSet`)."""

    max_staleness: int

    @property
    def ps(self) -> Any: ...
    @property
    def local(self) -> Any: ...
    @property
    def ps_tables(self) -> list[Any]: ...
    @property
    def local_tables(self) -> list[Any]: ...
    @property
    def staleness(self) -> int: ...
    @property
    def staleness_max_seen(self) -> int: ...
    @property
    def pending_pushes(self) -> int: ...
    def table_configs(self) -> list[Any]: ...
    def prefetch(self, features: Any, *, block: bool = True) -> bool: ...
    def flush(self) -> None: ...
    def release(self) -> None: ...
    def ps_time_ms(self) -> dict[str, float]: ...
    def local_weights(self, dst: int | None = None) -> dict[str, torch.Tensor]: ...
    def load_local_weights(self, weights: Mapping[str, torch.Tensor]) -> None: ...
    def ps_rows_left_out(self) -> contextlib.AbstractContextManager[None]: ...


class LocalSet:
    """The local modules of several hybrid collections, read and written as one (see
    :class:`~.local.LocalEmbeddingBags` for each method)."""

    def __init__(self, locals_: Sequence[LocalEmbeddingBags]) -> None:
        self.members = list(locals_)

    def optimizer_pieces(self, dst: int | None = None) -> dict[tuple[str, str, tuple[int, ...]], torch.Tensor]:
        out: dict[tuple[str, str, tuple[int, ...]], torch.Tensor] = {}
        for local in self.members:  # each a collective when sharded, in one order on every trainer
            out |= local.optimizer_pieces(dst)
        return out

    def load_optimizer_pieces(self, saved: Mapping[tuple[str, str, tuple[int, ...]], torch.Tensor]) -> None:
        for local in self.members:
            local.load_optimizer_pieces(saved)

    def load_optimizer_tables(self, whole: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        for local in self.members:
            local.load_optimizer_tables(whole)

    def initial_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for local in self.members:
            yield from local.initial_weights()

    def parameters(self) -> Iterator[nn.Parameter]:
        for local in self.members:
            yield from local.parameters()

    def buffers(self) -> Iterator[torch.Tensor]:
        for local in self.members:
            yield from local.buffers()

    def tbes(self) -> Iterator[nn.Module]:
        for local in self.members:
            yield from local.tbes()


class HybridSet:
    """A model's hybrid collections driven as one by a training run.

    Args:
        collections: The model's hybrid collections (a bag one and a sequence one at most), sharing one PS client
            and one staleness ``K``.

    Raises:
        ValueError: None, or collections of different staleness.
    """

    def __init__(self, collections: Sequence[HybridTables]) -> None:
        if not collections or len({c.max_staleness for c in collections}) != 1:
            raise ValueError("a HybridSet needs collections of one staleness K")
        self.collections = list(collections)
        self.max_staleness = self.collections[0].max_staleness
        # The PS step protocol runs in this order on every trainer (K = 0's collectives pair up).
        self._remote = [c for c in self.collections if c.remote is not None]
        members = [c.local for c in self.collections if c.local is not None]
        self.local: LocalSet | None = LocalSet(members) if members else None

    @property
    def ps(self) -> Any:
        """The servers' client, None where no table is on them."""
        return next((c.ps for c in self.collections if c.ps is not None), None)

    @property
    def ps_tables(self) -> list[Any]:
        return [t for c in self.collections for t in c.ps_tables]

    @property
    def local_tables(self) -> list[Any]:
        return [t for c in self.collections for t in c.local_tables]

    def table_configs(self) -> list[Any]:
        return [t for c in self.collections for t in c.table_configs()]

    def prefetch(self, features: Any, *, block: bool = True) -> bool:
        """Request a coming batch's PS rows from every collection, or from none: without ``block``, only when every
        one can send now (:meth:`~.hybrid_tables.HybridTables.can_prefetch`), so the batch is never half-requested
        and a look-ahead never waits."""
        if not block and not all(c.can_prefetch() for c in self._remote):
            return False
        return all(c.prefetch(features, block=True) for c in self._remote)

    def flush(self) -> None:
        for collection in self.collections:
            collection.flush()

    def release(self) -> None:
        """Give up the collections' hold on their PS tables (:meth:`.hybrid_tables.HybridTables.release`)."""
        for collection in self._remote:
            collection.release()

    def ps_time_ms(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for collection in self.collections:
            for label, ms in collection.ps_time_ms().items():
                total[label] = total.get(label, 0.0) + ms
        return total

    @property
    def staleness(self) -> int:
        return max(c.staleness for c in self.collections)

    @property
    def staleness_max_seen(self) -> int:
        return max(c.staleness_max_seen for c in self.collections)

    @property
    def pending_pushes(self) -> int:
        return max(c.pending_pushes for c in self.collections)

    def local_weights(self, dst: int | None = None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for collection in self.collections:
            out |= collection.local_weights(dst)
        return out

    def load_local_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        local = {c.name for c in self.local_tables}
        unknown = sorted(set(weights) - local)
        if unknown:
            raise PlannerError(f"load_local_weights: {unknown[0]!r} is not a local table; local: {sorted(local)}")
        for collection in self.collections:
            own = {c.name for c in collection.local_tables}
            collection.load_local_weights({name: w for name, w in weights.items() if name in own})

    @contextlib.contextmanager
    def ps_rows_left_out(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for collection in self.collections:
                stack.enter_context(collection.ps_rows_left_out())
            yield
