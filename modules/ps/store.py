"""Storage engine of one embedding parameter server table: a capacity-bounded map from uint64 id to a row.

The store keeps its own id -> slot index rather than TorchRec's managed-collision modules or fbgemm's hash ops: those
are collision managers and caches for a fixed-size TBE, not an exact, on-demand key-value store with eviction on CPU
([decision 0017](../../docs/decisions/0017-ps-store-own-index.md)).

The rows live in :class:`.row_slots.RowSlots`: preallocated per-slot arrays whose occupied slots are always the
prefix ``[0, len)``, found through an exact hash index, with the dirty mask and eviction log of incremental dumps.

Weights are kept in the table's dtype (``weight_dtype``: the plan's ``embedding_dtype``), so a float16 table's rows
take half the bytes; the optimizer state stays float32. An update reads the rows widened to float32, steps, and
rounds the new rows back to nearest (what ``Tensor.half()`` does); the update then changes a weight only where it
exceeds half a unit in its last place (about ``|w| / 2048`` in float16).

The planner restates the layout (``persia_planner.placement.memory``: ``ps_store_bytes``, the index load factor, the
capacity limit, the capacity ``persia train`` gives each server) to charge each server what its stores take; the store
takes its default load factor and the limit from there, and ``tests/test_memory.py`` checks
:meth:`EmbeddingStore.arrays` and a filled store's resident memory against it.

LRU/LFU victims are chosen exactly (:func:`.eviction.choose_victims`: ``kthvalue`` over the occupied slots), which reads
every row: on a full table the store therefore evicts a chunk of ``eviction_chunk * capacity`` rows (default 1/64) at
once, so that pass runs once per chunk of inserts, not in every batch. Ids looked up in the same batch are never
evicted. How a new row starts and which rows go are the table's policies (:mod:`.policies`); how a row learns is its
optimizer (:mod:`.optim`).

Incremental dumps (for serving replicas, see :mod:`.deltas`): :meth:`EmbeddingStore.take_dirty` returns the rows
inserted or updated since the previous dump and the ids evicted since.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from persia_planner.modules.ps import kernels
from persia_planner.modules.ps.eviction import choose_victims
from persia_planner.modules.ps.index import as_ids
from persia_planner.modules.ps.new_rows import NewRows
from persia_planner.modules.ps.optim import RowOptimizer
from persia_planner.modules.ps.policies import Eviction, Normal, Uniform
from persia_planner.modules.ps.row_seed import RowSeed
from persia_planner.modules.ps.row_slots import RowSlots
from persia_planner.placement.memory import PS_INDEX_LOAD_FACTOR, PS_MAX_CAPACITY

__all__ = ["WEIGHT_DTYPES", "EmbeddingStore"]

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes a store keeps its rows in (the plan's ``embedding_dtype``: fp32, fp16, bf16)."""

_DEFAULT_INIT = Uniform(-0.01, 0.01)  # a frozen dataclass: safe to share as a default


class EmbeddingStore:
    """One table of an embedding PS: a capacity-bounded map from uint64 id to ``weights[dim]`` + optimizer state.

    All per-row data is preallocated (like ``torch.empty``, on huge pages where large: untouched capacity costs no
    resident memory) and every operation is vectorised over the batch. Ids are int64 tensors carrying the uint64 bit
    pattern (or uint64).

    Semantics:

    * ``lookup(ids, train=True)``: present ids return their row and refresh LRU time / LFU count (each occurrence
      counts once). Missing ids are admitted with ``admission_probability`` (a Bernoulli draw per distinct missing
      id per batch, from the store's seeded generator), initialised from ``init`` with zero optimizer state
      (the optimizer's ``init_state``; a seeded store: row ``id mod rows`` of its :meth:`EmbeddingStore.seed`), and
      inserted; when the table is full they take the slots of LRU/LFU victims.
      Ids of the current batch are never victims; if a batch has more distinct new ids than the table can hold
      besides its own hits, the excess is not admitted. Ids not admitted return a **zero row** (not an initialised
      one: a row the server does not keep must not pretend to be a trained value) and their gradients are ignored.
    * ``lookup(ids, train=False)``: read-only. Misses return the row a training lookup would insert
      (:class:`.new_rows.NewRows`; zeros without ``init_seed`` or a seed); nothing is inserted, no LRU/LFU metadata
      changes.
    * ``update(ids, grads)``: gradients of duplicate ids are summed, the optimizer is applied once per distinct id
      that is still held, then weights are clipped to ``[-clip, clip]`` if ``clip`` is set. Ids not held (never
      admitted, or evicted since their lookup) are ignored. Updates do not count as accesses.

    Args:
        dim: Embedding width.
        capacity: Maximum number of rows, at most ``persia_planner.placement.memory.PS_MAX_CAPACITY`` (2**40 - 2: the
            index keeps 40-bit slot numbers), which caps the rows of one table on one server.
        optimizer: The sparse optimizer applied by :meth:`update`.
        init: Initialiser of new rows.
        eviction: ``"lru"`` or ``"lfu"``.
        admission_probability: Probability that a new id is inserted on a training lookup.
        clip: If set, weights are clamped to ``[-clip, clip]`` after every update.
        seed: Seed of the admission draws (deterministic for a given call sequence).
        init_seed: If set, a new row's initial value depends only on ``(init_seed, id)`` (``init.rows_for``), so
            every server, arrival order and resumed run initialises an id alike; if None, rows are drawn from the
            seeded generator in insertion order.
        index_load_factor: Live rows per hash bucket at full capacity (index costs ``8 / load_factor`` B/row); the
            default is the planner's (``persia_planner.placement.memory.PS_INDEX_LOAD_FACTOR``), whose bytes it charges.
        eviction_chunk: When a full table must make room, it evicts at least this fraction of its capacity at
            once (the policy's lowest-ranked rows, never the batch's own ids), so the O(rows) choice of victims
            runs once per that many inserts instead of once per batch. A full table then holds between
            ``capacity * (1 - eviction_chunk)`` and ``capacity`` rows. ``0``: evict exactly what each batch needs.
        weight_dtype: The dtype the rows are kept in: ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``
            (the optimizer state is float32 whatever it is).
        on_evict: Called with the ``(ids, weights, state)`` of the rows an eviction removes, before they go (a disk
            tier writes them back, :class:`.ssd_store.SsdStore`).
    """

    def __init__(
        self,
        dim: int,
        capacity: int,
        optimizer: RowOptimizer,
        *,
        init: Uniform | Normal = _DEFAULT_INIT,
        eviction: Eviction | str = Eviction.LRU,
        admission_probability: float = 1.0,
        clip: float | None = None,
        seed: int = 0,
        index_load_factor: float = PS_INDEX_LOAD_FACTOR,
        init_seed: int | None = None,
        eviction_chunk: float = 1 / 64,
        weight_dtype: torch.dtype = torch.float32,
        on_evict: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        if dim <= 0 or capacity <= 0:
            raise ValueError(f"dim and capacity must be positive, got dim={dim}, capacity={capacity}")
        if capacity > PS_MAX_CAPACITY:
            raise ValueError(f"capacity must be at most {PS_MAX_CAPACITY:,} (40-bit slot numbers), got {capacity:,}")
        if not 0.0 <= admission_probability <= 1.0:
            raise ValueError(f"admission_probability must be in [0, 1], got {admission_probability}")
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be positive, got {clip}")
        if not 0.0 < index_load_factor < 1.0:
            raise ValueError(f"index_load_factor must be in (0, 1), got {index_load_factor}")
        if not 0.0 <= eviction_chunk < 1.0:
            raise ValueError(f"eviction_chunk must be in [0, 1), got {eviction_chunk}")
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {weight_dtype}")
        self.dim = dim
        self.capacity = capacity
        self.optimizer = optimizer
        self.init = init
        self.eviction = Eviction(eviction)
        self.admission_probability = admission_probability
        self.clip = clip
        self.state_width = optimizer.state_width(dim)
        self._generator = torch.Generator().manual_seed(seed)
        self.init_seed = init_seed
        self.eviction_chunk = eviction_chunk
        self.on_evict = on_evict
        self.weight_dtype = weight_dtype
        self._rows = RowSlots(capacity, dim, self.state_width, weight_dtype, index_load_factor)
        self._step = 0  # training lookup batches so far; int32 is ample (2**31 batches)
        self._metrics = dict.fromkeys(("lookups", "misses", "inserts", "not_admitted", "evictions", "updates"), 0)
        # How ids not held start (a seeded table: from the trainers' local rows, see seed).
        self.new_rows = NewRows(dim, optimizer, init, init_seed, self._generator)

    # ----------------------------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def step(self) -> int:
        """Training lookup batches so far (the LRU clock)."""
        return self._step

    def held_rows(self) -> dict[str, torch.Tensor]:
        """The ``ids``, ``weights`` and optimizer ``state`` of the rows held: views of the occupied slots, valid until
        the store next changes (no copy, unlike :meth:`state_dict`, and no side effect)."""
        return self._rows.held()

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool tensor of ``ids``' shape: which ids have a row. Read-only."""
        return (self._rows.find(as_ids(ids)) >= 0).reshape(ids.shape)

    def arrays(self) -> dict[str, torch.Tensor]:
        """Every array the store allocates, by role (:meth:`.row_slots.RowSlots.arrays`): the planner charges a server
        these bytes (``persia_planner.placement.memory.ps_store_bytes``); ``tests/test_memory.py`` holds the two
        together."""
        return self._rows.arrays()

    def resident_bytes(self) -> int:
        """Bytes of :meth:`arrays` that hold data (:meth:`.row_slots.RowSlots.resident_bytes`)."""
        return self._rows.resident_bytes()

    def metrics(self) -> dict[str, int]:
        """Counters since construction: rows, capacity, lookups (ids, with repeats), misses (distinct per batch),
        inserts, not_admitted, evictions, updates (distinct rows updated)."""
        return {"rows": len(self._rows), "capacity": self.capacity, **self._metrics}

    def close(self) -> None:
        """Nothing to release: the rows are in memory (:meth:`.table_store.TableStore.close`)."""

    # ------------------------------------------------------------------------------------------------- seed

    def seed(self, weights: torch.Tensor | None, state: torch.Tensor | None = None) -> None:
        """Start every id the store does not hold from row ``id mod len(weights)`` of ``weights`` (and of the
        optimizer ``state``, ``[len(weights), state_width]``, where given; else a new row's state), instead of
        ``init`` (:class:`.row_seed.RowSeed`). ``weights=None`` removes the seed.

        Raises:
            ValueError: ``weights`` is not ``[rows, dim]`` or ``state`` not ``[rows, state_width]``.
        """
        self.new_rows.seed = None if weights is None else RowSeed.of(weights, state, self.dim, self.state_width)

    def seeded(self) -> dict[str, torch.Tensor] | None:
        """The seed (:meth:`seed`: ``weights`` and maybe ``state``), or None."""
        seed = self.new_rows.seed
        return None if seed is None else seed.to_dict()

    # ------------------------------------------------------------------------------------------------ lookup

    @torch.no_grad()
    def lookup(
        self, ids: torch.Tensor, *, train: bool = True, distinct: bool = False, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Rows of ``ids`` as float32 ``[*ids.shape, dim]`` (a copy). See the class docstring for the semantics.

        ``dtype=torch.float16`` returns them as float16 (what a float16 wire sends): as kept by a float16 store, else
        rounded (``rows.half()``) right after the gather (:func:`.kernels.take_rows_half`), with ``OverflowError`` if
        a row holds a value that float16 rounds to ``inf`` (``|w| >= 65520``, or ``inf`` itself), raised after the
        lookup's side effects (NaN passes as NaN).

        ``distinct=True`` promises that ``ids`` holds no repeats (the client de-duplicates every batch): the store then
        skips its own ``torch.unique`` and the gather back to the caller's order. Given in ascending order the result
        and every side effect are identical to the default path; in another order (the client sends ids in order of
        first occurrence) only the assignment of admission draws and new slots to the missing ids differs. Repeated ids
        with ``distinct=True`` are undefined behaviour (a repeated missing id could be inserted twice).
        """
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"lookup dtype must be torch.float32 or torch.float16, got {dtype}")
        flat = as_ids(ids)
        self._metrics["lookups"] += flat.numel()
        if distinct:
            uniq, inverse, counts = flat, None, None  # counts: one access per id
        else:
            uniq, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        if train:
            self._step += 1
            # The hits' recency and frequency are recorded by the probe itself.
            held = self._rows
            slots, _ = held.index.find(uniq, touch=(held.last, held.count, self._step, counts))
        else:
            slots = self._rows.find(uniq)
        hit = slots >= 0
        n_hit = int(hit.sum())
        self._metrics["misses"] += uniq.numel() - n_hit
        if train and n_hit < uniq.numel():
            self._admit(uniq, torch.ones_like(uniq) if counts is None else counts, slots, hit)
        rows = kernels.rows_in(self._rows.weights, slots, inverse, dtype)  # ids not held (slot -1): zero rows
        if not train and n_hit < uniq.numel():
            # An id never trained answers as the row a training lookup would insert (as read() and a state dict
            # do): the live model, its state dict and its export score alike (decision 0029).
            missing = slots < 0 if inverse is None else (slots < 0).index_select(0, inverse)
            initial = self.new_rows.initial(flat[missing])
            if initial is not None:  # rounded to the table's dtype, as the row a training lookup inserts
                rows[missing] = initial.to(self.weight_dtype).to(rows.dtype)
        return rows.reshape(*ids.shape, self.dim)

    @torch.no_grad()
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` ``[*ids.shape, dim]`` without any side effect: a held id's row as it is, any other id's
        as its initial value (``init.rows_for``, which a training lookup would insert; zeros without ``init_seed``)."""
        flat = as_ids(ids)
        slots = self._rows.find(flat)
        rows = kernels.take_rows(self._rows.weights, slots).float()
        missing = slots < 0
        initial = self.new_rows.initial(flat[missing]) if bool(missing.any()) else None
        if initial is not None:  # as a training lookup would insert them, rounded to the table's dtype
            rows[missing] = initial.to(self.weight_dtype).float()
        return rows.reshape(*ids.shape, self.dim)

    @torch.no_grad()
    def read_state(self, ids: torch.Tensor) -> torch.Tensor:
        """Optimizer state ``[len(ids), state_width]`` of the distinct ``ids`` without side effect: a held row's, any
        other's as a training lookup would start it (the seed's state, else the optimizer's ``init_state``)."""
        flat = as_ids(ids)
        slots = self._rows.find(flat)
        held = slots >= 0
        state = torch.empty(flat.numel(), self.state_width)
        state[held] = self._rows.state.index_select(0, slots[held])
        if not bool(held.all()):
            state[~held] = self.new_rows.state(flat[~held])
        return state

    @torch.no_grad()
    def assign_state(self, ids: torch.Tensor, state: torch.Tensor, start: int = 0) -> int:
        """Set columns ``[start, start + state.shape[1])`` of the optimizer state of the distinct ``ids`` (a TorchRec
        optimizer state dict loaded into the table), inserting the ids not held as a training lookup would; returns
        the rows written (fewer only when the ids outnumber the capacity)."""
        flat = as_ids(ids)
        state = state.reshape(flat.numel(), -1).to(torch.float32)
        if not 0 <= start <= start + state.shape[1] <= self.state_width:
            raise ValueError(
                f"state columns [{start}, {start + state.shape[1]}) are not within [0, {self.state_width})"
            )
        slots = self._rows.find(flat)
        hit = slots >= 0
        if not bool(hit.all()):
            self._admit(flat, torch.ones_like(flat), slots, hit, everyone=True)
        written = slots >= 0
        slots = slots[written]
        self._rows.state[slots, start : start + state.shape[1]] = state[written]
        self._rows.dirty[slots] = True
        return slots.numel()

    @torch.no_grad()
    def assign(self, ids: torch.Tensor, weights: torch.Tensor) -> int:
        """Set the rows of the distinct ``ids`` to ``weights`` ``[len(ids), dim]``, inserting the ids not held (all of
        them, evicting by the policy when full) with a new row's optimizer state; a held row keeps its optimizer
        state, as a TorchRec table's ``load_state_dict`` leaves its fused optimizer's (which :meth:`assign_state`
        sets). Returns the rows written (fewer only when the ids outnumber the capacity)."""
        flat = as_ids(ids)
        weights = weights.reshape(flat.numel(), self.dim).to(self.weight_dtype)
        slots = self._rows.find(flat)
        hit = slots >= 0
        if not bool(hit.all()):
            self._admit(flat, torch.ones_like(flat), slots, hit, everyone=True)
        written = slots >= 0
        slots, weights = slots[written], weights[written]
        self._rows.weights.index_copy_(0, slots, weights)
        self._rows.dirty[slots] = True
        return slots.numel()

    @torch.no_grad()
    def insert_rows(
        self, ids: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, *, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Insert the distinct ``ids``, none held, with their ``weights`` and optimizer ``state`` (rows coming back
        from a disk tier), evicting by the policy when full but never the held ids in ``keep``; returns which ids
        were inserted (all of them unless they and ``keep`` outnumber the capacity). A training access batch of its
        own: the kept rows and the new ones are its accesses (LRU victims are the rows not accessed lately)."""
        flat = as_ids(ids)
        kept = as_ids(keep) if keep is not None else flat[:0]
        self._step += 1
        rows = self._rows
        kept_slots, _ = rows.index.find(kept, touch=(rows.last, rows.count, self._step, None))
        kept_slots = kept_slots[kept_slots >= 0]
        uniq = torch.cat([rows.ids.index_select(0, kept_slots), flat])
        slots = torch.cat([kept_slots, torch.full((flat.numel(),), -1, dtype=torch.int64)])
        hit = slots >= 0
        self._admit(uniq, torch.ones_like(uniq), slots, hit, everyone=True)
        new = slots[kept_slots.numel() :]
        inserted = new >= 0
        at = new[inserted]
        rows.weights.index_copy_(0, at, weights[inserted].to(self.weight_dtype))
        rows.state.index_copy_(0, at, state[inserted].to(torch.float32))
        self._metrics["inserts"] -= int(at.numel())  # rows restored, not new ones
        return inserted

    def _admit(
        self,
        uniq: torch.Tensor,
        counts: torch.Tensor,
        slots: torch.Tensor,
        hit: torch.Tensor,
        *,
        everyone: bool = False,
    ) -> None:
        """Insert the admitted missing ids of a batch (``everyone``: all of them, whatever the admission
        probability), evicting if needed; writes their slots into ``slots`` (and re-points the batch's hits whose rows
        the eviction moved)."""
        miss = (~hit).nonzero().squeeze(1)
        if self.admission_probability < 1.0 and not everyone:
            draw = torch.rand(miss.numel(), generator=self._generator)
            miss = miss[draw < self.admission_probability]
        room = self.capacity - int(hit.sum())  # the batch's own hits stay
        miss = miss[:room]
        k = miss.numel()
        self._metrics["not_admitted"] += int((~hit).sum()) - k
        if k == 0:
            return
        free = self.capacity - len(self._rows)
        if k > free:
            self._evict(k - free, slots, hit)
        new_ids = uniq[miss]
        weights, state = self.new_rows.inserted(new_ids)
        new_slots = self._rows.append(new_ids, weights, state, self._step, counts[miss])
        slots[miss] = new_slots
        self._metrics["inserts"] += k

    def _evict(self, needed: int, slots: torch.Tensor, hit: torch.Tensor) -> None:
        """Remove at least ``needed`` rows by the eviction policy, never the batch's hits (``slots[hit]``).

        Evicts ``max(needed, ceil(eviction_chunk * capacity))`` rows at once (capped by the rows not in the batch):
        choosing victims reads every row, so the chunk makes that pass once per chunk of inserts, not once per
        batch. Then the rows above the new end are moved into the holes below it, so the occupied slots stay the
        prefix ``[0, len)``; the index and the batch's ``slots`` follow the moved rows.
        """
        rows, live = self._rows, len(self._rows)
        protected = slots[hit]
        n_victims = min(max(needed, math.ceil(self.eviction_chunk * self.capacity)), live - protected.numel())
        victims = choose_victims(self.eviction, rows.last[:live], rows.count[:live], protected, n_victims)
        if self.on_evict is not None:
            self.on_evict(
                rows.ids.index_select(0, victims), rows.weights.index_select(0, victims),
                rows.state.index_select(0, victims),
            )  # fmt: skip
        rows.remove(victims, slots)
        self._metrics["evictions"] += n_victims

    # ------------------------------------------------------------------------------------------------ update

    @torch.no_grad()
    def update(
        self, ids: torch.Tensor, grads: torch.Tensor, *, distinct: bool = False, optimizer: RowOptimizer | None = None
    ) -> int:
        """Apply the optimizer to the rows of ``ids`` with ``grads`` ``[*ids.shape, dim]``; returns rows updated.

        Gradients of any floating dtype are upcast to float32 before duplicates are summed, so the sum, the
        optimizer step and its state are float32 whatever dtype the gradients travelled in or the rows are kept in.

        Args:
            ids: int64 (uint64 bit patterns) or uint64.
            grads: ``[*ids.shape, dim]``.
            distinct: The caller promises that ``ids`` holds no repeats (the client sums duplicates before it
                pushes), so the store skips its ``torch.unique`` and the summation. The rows then end up
                identical to the default path's, except that a gradient of exactly ``-0.0`` is not turned into
                ``+0.0`` by the summation (it can flip the sign of a weight that is exactly zero; never a value).
                Repeated ids with ``distinct=True`` are undefined behaviour.
            optimizer: The hyper-parameters of this push (a schedule's current learning rate): the table's optimizer
                with other values (:meth:`step_optimizer` checks it); None: the table's own.
        """
        optimizer = self.step_optimizer(optimizer)
        flat = as_ids(ids)
        grads = grads.reshape(flat.numel(), self.dim).to(torch.float32)
        if distinct:
            uniq, summed = flat, grads
        else:
            uniq, inverse = torch.unique(flat, return_inverse=True)
            summed = torch.zeros(uniq.numel(), self.dim, dtype=torch.float32).index_add_(0, inverse, grads)
        slots = self._rows.find(uniq)
        held = slots >= 0
        if not bool(held.all()):  # usually every pushed id is still held: skip two copies of the batch then
            slots, summed = slots[held], summed[held]
        rows = self._rows
        new_w, new_state = optimizer.step(
            rows.weights.index_select(0, slots).float(), rows.state.index_select(0, slots), summed
        )
        if self.clip is not None:
            new_w.clamp_(-self.clip, self.clip)
        rows.weights.index_copy_(0, slots, new_w.to(self.weight_dtype))
        rows.state.index_copy_(0, slots, new_state)
        rows.dirty[slots] = True
        self._metrics["updates"] += slots.numel()
        return slots.numel()

    def step_optimizer(self, optimizer: RowOptimizer | None) -> RowOptimizer:
        """The optimizer a push steps with: ``optimizer`` (its hyper-parameters travel with the push) where given,
        else the table's own.

        Raises:
            ValueError: ``optimizer`` is another kind than the table's (its state would not fit).
        """
        if optimizer is None:
            return self.optimizer
        if type(optimizer) is not type(self.optimizer):
            raise ValueError(
                f"a push's optimizer is {type(optimizer).__name__}, the table's is {type(self.optimizer).__name__}"
            )
        return optimizer

    # -------------------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The occupied rows only (copies, :meth:`.row_slots.RowSlots.snapshot`): ids, weights (in
        :attr:`weight_dtype`), optimizer state, LRU/LFU metadata; and the step counter."""
        return {**self._rows.snapshot(), "step": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents by ``state`` (from :meth:`state_dict`; capacity may differ but must hold the rows).

        Hyper-parameters, the generator and the metrics are the constructor's, not the checkpoint's; so is the
        weight dtype (rows saved in another are converted: a float32 checkpoint loads into a float16 store rounded).

        Raises:
            ValueError: See :meth:`check_state_dict`; the store is unchanged then.
        """
        self._rows.restore(state)
        self._step = int(state.get("step", 0))

    def check_state_dict(self, state: dict[str, Any], *, rows_held: int | None = None) -> None:
        """Raise ``ValueError`` if :meth:`load_state_dict` would refuse ``state`` (more rows than the capacity, another
        dim or optimizer state width, repeated ids); changes nothing. ``rows_held``: the rows a store built on this one
        holds in its place (a disk tier's), instead of the capacity."""
        self._rows.check(state, rows_held=rows_held)

    # -------------------------------------------------------------------------------------- incremental dumps

    def dirty_rows(self) -> int:
        """How many rows :meth:`take_dirty` would return now."""
        return self._rows.dirty_rows()

    def take_dirty(self, *, with_state: bool = False) -> dict[str, torch.Tensor]:
        """Rows inserted or updated since the previous call, and the ids evicted since then that the store no longer
        holds; clears both (:meth:`.row_slots.RowSlots.take_dirty`)."""
        return self._rows.take_dirty(with_state=with_state)

    def mark_dirty(
        self, ids: torch.Tensor, removed: torch.Tensor | None = None, *, removals_complete: bool = True
    ) -> int:
        """Mark the held rows of ``ids`` dirty again and log ``removed`` as evicted again (a dump that failed to write:
        :meth:`.row_slots.RowSlots.mark_dirty`); returns rows marked."""
        return self._rows.mark_dirty(ids, removed, removals_complete=removals_complete)
