"""Storage engine of one embedding parameter server table: a capacity-bounded map from uint64 id to a row.

The store keeps its own id -> slot index rather than TorchRec's managed-collision modules or fbgemm's hash ops: those
are collision managers and caches for a fixed-size TBE, not an exact, on-demand key-value store with eviction on CPU
([decision 0017](../../docs/decisions/0017-ps-store-own-index.md)).

The own design: rows live in preallocated tensors and the occupied slots are always the prefix ``[0, len)`` (evicting
moves the rows above the new end into the holes below it, so no free list is needed); ids are found through an exact
open-addressing hash index (:class:`.index.HashIndex`, no collisions). Per row: a 16-byte record (id 8 + last access
4 + count 4: confirming the id and recording the access touch one cache line) + index 16 + dirty flag 1 B on top of
the weights and the optimizer state: dim 64 + row-wise Adagrad = 293 B against 260 B raw.

Weights are kept in the table's dtype (``weight_dtype``: the plan's ``embedding_dtype``), so a float16 table's rows
take half the bytes; the optimizer state stays float32. An update reads the rows widened to float32, steps, and
rounds the new rows back to nearest (what ``Tensor.half()`` does); the update then changes a weight only where it
exceeds half a unit in its last place (about ``|w| / 2048`` in float16).

The planner restates this layout (``persia_planner.placement.memory``: ``ps_store_bytes``, the index load factor, the
capacity limit, the capacity ``persia train`` gives each server) to charge each server what its stores take; the store
takes its default load factor and the limit from there, and ``tests/test_memory.py`` checks
:meth:`EmbeddingStore.arrays` and a filled store's resident memory against it.

LRU/LFU victims are chosen exactly (:func:`.eviction.choose_victims`: ``kthvalue`` over the occupied slots), which reads
every row: on a full table the store therefore evicts a chunk of ``eviction_chunk * capacity`` rows (default 1/64) at
once, so that pass runs once per chunk of inserts, not in every batch. Ids looked up in the same batch are never
evicted. How a new row starts and which rows go are the table's policies (:mod:`.policies`); how a row learns is its
optimizer (:mod:`.optim`).

Incremental dumps (for serving replicas, see :mod:`.deltas`) use a dirty mask: one bool per slot (1 B/row,
allocated zeroed), set when a row is inserted or its weights are updated and cleared by
:meth:`EmbeddingStore.take_dirty`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from persia_planner.modules.ps import kernels
from persia_planner.modules.ps.eviction import EvictionLog, choose_victims
from persia_planner.modules.ps.index import HashIndex, as_ids, table_empty
from persia_planner.modules.ps.optim import RowOptimizer
from persia_planner.modules.ps.policies import Eviction, Normal, Uniform
from persia_planner.modules.ps.row_seed import RowSeed
from persia_planner.placement.memory import PS_INDEX_LOAD_FACTOR, PS_MAX_CAPACITY

__all__ = ["WEIGHT_DTYPES", "EmbeddingStore"]

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes a store keeps its rows in (the plan's ``embedding_dtype``: fp32, fp16, bf16)."""

_INT32_MAX = 2**31 - 1
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
    * ``lookup(ids, train=False)``: read-only. Misses return zero rows; nothing is inserted, no LRU/LFU metadata
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

        # One 16-byte record per slot: its id, the training lookup batch of its last access, its access count
        # (saturating at int32 max). A lookup's probe reads the id and records the access in the same cache line,
        # instead of three lines of three arrays, one random read per id instead of three. Views give the three columns.
        self._records = table_empty(capacity, 2, dtype=torch.int64)
        self._ids = self._records[:, 0]
        self._last = self._records.view(torch.int32)[:, 2]
        self._count = self._records.view(torch.int32)[:, 3]
        self.weight_dtype = weight_dtype
        self._weights = table_empty(capacity, dim, dtype=weight_dtype)
        self._state = table_empty(capacity, self.state_width, dtype=torch.float32)
        # Rows inserted or updated since the last take_dirty(). Keyed by slot, not id: a slot that is evicted and
        # handed to a new id is dirty for the new id, so an evicted id never shows up in a dump.
        self._dirty = torch.zeros(capacity, dtype=torch.bool)
        self._index = HashIndex(capacity, index_load_factor, self._ids)
        self._n = 0
        self._step = 0  # training lookup batches so far; int32 is ample (2**31 batches)
        self._metrics = dict.fromkeys(("lookups", "misses", "inserts", "not_admitted", "evictions", "updates"), 0)
        # Ids evicted since the last take_dirty(), for the deltas' removals; it runs from the first take_dirty(),
        # state_dict() or load_state_dict() on: a store never dumped, checkpointed nor loaded keeps no log.
        self._evicted = EvictionLog(capacity, self._index)
        # A table that came from trainers' local rows (plan migration): new ids start from them (see seed).
        self._seed: RowSeed | None = None

    # ----------------------------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        return self._n

    @property
    def step(self) -> int:
        """Training lookup batches so far (the LRU clock)."""
        return self._step

    def held_rows(self) -> dict[str, torch.Tensor]:
        """The ``ids``, ``weights`` and optimizer ``state`` of the rows held: views of the occupied slots, valid until
        the store next changes (no copy, unlike :meth:`state_dict`, and no side effect)."""
        n = self._n
        return {"ids": self._ids[:n], "weights": self._weights[:n], "state": self._state[:n]}

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool tensor of ``ids``' shape: which ids have a row. Read-only."""
        flat = as_ids(ids)
        slots, _ = self._index.find(flat)
        return (slots >= 0).reshape(ids.shape)

    def arrays(self) -> dict[str, torch.Tensor]:
        """Every array the store allocates, by role: the per-slot ``records``, ``weights``, ``state`` and ``dirty``
        (``capacity`` rows each, resident as rows are inserted) and the hash ``index`` (written whole at creation).

        The planner charges a server these bytes (``persia_planner.placement.memory.ps_store_bytes``);
        ``tests/test_memory.py`` holds the two together.
        """
        return {
            "records": self._records,
            "weights": self._weights,
            "state": self._state,
            "dirty": self._dirty,
            "index": self._index.buckets,
        }

    def resident_bytes(self) -> int:
        """Bytes of :meth:`arrays` that hold data: the per-slot arrays up to the rows held (occupied slots are
        always the prefix ``[0, len)``), the dirty mask and the hash index whole (both written at creation).

        Untouched capacity costs no resident memory (see ``_table_empty``), so this is the store's own account of
        what a server's resident memory grows by (``persia_planner.modules.tools.memory_audit`` sets the two side by
        side).
        """
        held = 0
        for role, array in self.arrays().items():
            nbytes = array.numel() * array.element_size()
            held += nbytes if role in ("dirty", "index") else nbytes * self._n // self.capacity
        return held

    def metrics(self) -> dict[str, int]:
        """Counters since construction: rows, capacity, lookups (ids, with repeats), misses (distinct per batch),
        inserts, not_admitted, evictions, updates (distinct rows updated)."""
        return {"rows": self._n, "capacity": self.capacity, **self._metrics}

    # ------------------------------------------------------------------------------------------------- seed

    def seed(self, weights: torch.Tensor | None, state: torch.Tensor | None = None) -> None:
        """Start every id the store does not hold from row ``id mod len(weights)`` of ``weights`` (and of the
        optimizer ``state``, ``[len(weights), state_width]``, where given; else a new row's state), instead of
        ``init`` (:class:`.row_seed.RowSeed`). ``weights=None`` removes the seed.

        Raises:
            ValueError: ``weights`` is not ``[rows, dim]`` or ``state`` not ``[rows, state_width]``.
        """
        self._seed = None if weights is None else RowSeed.of(weights, state, self.dim, self.state_width)

    def seeded(self) -> dict[str, torch.Tensor] | None:
        """The seed (:meth:`seed`: ``weights`` and maybe ``state``), or None."""
        return None if self._seed is None else self._seed.to_dict()

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
            slots, _ = self._index.find(uniq, touch=(self._last, self._count, self._step, counts))
        else:
            slots, _ = self._index.find(uniq)
        hit = slots >= 0
        n_hit = int(hit.sum())
        self._metrics["misses"] += uniq.numel() - n_hit
        if train and n_hit < uniq.numel():
            self._admit(uniq, torch.ones_like(uniq) if counts is None else counts, slots, hit)
        rows = kernels.rows_in(self._weights, slots, inverse, dtype)  # ids not held (slot -1): zero rows
        if not train and self._seed is not None and n_hit < uniq.numel():
            # A seeded table answers an id it never trained as the local table it came from did (as read() does):
            # an evaluation right after a migration scores the same function.
            missing = slots < 0 if inverse is None else (slots < 0).index_select(0, inverse)
            seeded = self._seed.rows_of(flat[missing])[0].to(self.weight_dtype)
            rows[missing] = seeded.to(rows.dtype)
        return rows.reshape(*ids.shape, self.dim)

    @torch.no_grad()
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` ``[*ids.shape, dim]`` without any side effect: a held id's row as it is, any other id's
        as its initial value (``init.rows_for``, which a training lookup would insert; zeros without ``init_seed``)."""
        flat = as_ids(ids)
        slots, _ = self._index.find(flat)
        rows = kernels.take_rows(self._weights, slots).float()
        missing = slots < 0
        if self._seed is not None and bool(missing.any()):
            # As a training lookup would insert them: the seed's rows, rounded to the table's dtype.
            rows[missing] = self._seed.rows_of(flat[missing])[0].to(self.weight_dtype).float()
        elif self.init_seed is not None and bool(missing.any()):
            rows[missing] = self.init.rows_for(flat[missing], self.dim, self.init_seed)
        return rows.reshape(*ids.shape, self.dim)

    @torch.no_grad()
    def assign(self, ids: torch.Tensor, weights: torch.Tensor) -> int:
        """Set the rows of the distinct ``ids`` to ``weights`` ``[len(ids), dim]``, inserting the ids not held (all of
        them, evicting by the policy when full) with a new row's optimizer state; returns the rows written (fewer
        only when the ids outnumber the capacity)."""
        flat = as_ids(ids)
        weights = weights.reshape(flat.numel(), self.dim).to(self.weight_dtype)
        slots, _ = self._index.find(flat)
        hit = slots >= 0
        if not bool(hit.all()):
            self._admit(flat, torch.ones_like(flat), slots, hit, everyone=True)
        written = slots >= 0
        slots, weights = slots[written], weights[written]
        self._weights.index_copy_(0, slots, weights)
        self._state.index_copy_(0, slots, self.optimizer.init_state(slots.numel(), self.dim))
        self._dirty[slots] = True
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
        kept_slots, _ = self._index.find(kept, touch=(self._last, self._count, self._step, None))
        kept_slots = kept_slots[kept_slots >= 0]
        uniq = torch.cat([self._ids.index_select(0, kept_slots), flat])
        slots = torch.cat([kept_slots, torch.full((flat.numel(),), -1, dtype=torch.int64)])
        hit = slots >= 0
        self._admit(uniq, torch.ones_like(uniq), slots, hit, everyone=True)
        new = slots[kept_slots.numel() :]
        inserted = new >= 0
        at = new[inserted]
        self._weights.index_copy_(0, at, weights[inserted].to(self.weight_dtype))
        self._state.index_copy_(0, at, state[inserted].to(torch.float32))
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
        if k > self.capacity - self._n:
            self._evict(k - (self.capacity - self._n), slots, hit)
        new_slots = torch.arange(self._n, self._n + k)
        self._n += k
        new_ids = uniq[miss]
        self._ids.index_copy_(0, new_slots, new_ids)
        seeded, seeded_state = self._seed.rows_of(new_ids) if self._seed is not None else (None, None)
        if seeded is not None:
            rows = seeded
        elif self.init_seed is None:
            rows = self.init.sample(k, self.dim, self._generator)
        else:
            rows = self.init.rows_for(new_ids, self.dim, self.init_seed)
        self._weights.index_copy_(0, new_slots, rows.to(self.weight_dtype))
        state = seeded_state if seeded_state is not None else self.optimizer.init_state(k, self.dim)
        self._state.index_copy_(0, new_slots, state)
        self._last[new_slots] = self._step
        self._count[new_slots] = counts[miss].clamp(max=_INT32_MAX).int()
        self._dirty[new_slots] = True
        if self._index.needs_rebuild(self._n):
            self._index.rebuild(self._n)  # clears the tombstones and indexes the new ids with the rest
        else:
            self._index.insert(new_ids, new_slots)
        slots[miss] = new_slots
        self._metrics["inserts"] += k

    def _evict(self, needed: int, slots: torch.Tensor, hit: torch.Tensor) -> None:
        """Remove at least ``needed`` rows by the eviction policy, never the batch's hits (``slots[hit]``).

        Evicts ``max(needed, ceil(eviction_chunk * capacity))`` rows at once (capped by the rows not in the batch):
        choosing victims reads every row, so the chunk makes that pass once per chunk of inserts, not once per
        batch. Then the rows above the new end are moved into the holes below it, so the occupied slots stay the
        prefix ``[0, len)``; the index and the batch's ``slots`` follow the moved rows.
        """
        live = self._n
        protected = slots[hit]
        n_victims = min(max(needed, math.ceil(self.eviction_chunk * self.capacity)), live - protected.numel())
        victims = choose_victims(self.eviction, self._last[:live], self._count[:live], protected, n_victims)
        _, buckets = self._index.find(self._ids[victims])
        self._index.remove_buckets(buckets)
        if self._evicted.running:
            self._evicted.add(self._ids.index_select(0, victims))
        if self.on_evict is not None:
            self.on_evict(
                self._ids.index_select(0, victims), self._weights.index_select(0, victims),
                self._state.index_select(0, victims),
            )  # fmt: skip
        end = live - n_victims
        # Holes below the new end are filled by the survivors above it (the two sets have the same size).
        holes = victims[victims < end]
        above = torch.ones(n_victims, dtype=torch.bool)
        above[victims[victims >= end] - end] = False
        movers = torch.arange(end, live)[above]
        if movers.numel():
            _, mover_buckets = self._index.find(self._ids[movers])
            for rows in (self._records, self._weights, self._state, self._dirty):
                rows.index_copy_(0, holes, rows.index_select(0, movers))
            self._index.repoint(mover_buckets, holes)
            # The batch's hits that moved: map old slot -> new slot through the movers (ascending by construction).
            at = torch.searchsorted(movers, slots).clamp_(max=movers.numel() - 1)
            moved = movers[at] == slots
            slots[moved] = holes[at[moved]]
        self._dirty[end:live] = False
        self._n = end
        self._metrics["evictions"] += n_victims

    # ------------------------------------------------------------------------------------------------ update

    @torch.no_grad()
    def update(self, ids: torch.Tensor, grads: torch.Tensor, *, distinct: bool = False) -> int:
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
        """
        flat = as_ids(ids)
        grads = grads.reshape(flat.numel(), self.dim).to(torch.float32)
        if distinct:
            uniq, summed = flat, grads
        else:
            uniq, inverse = torch.unique(flat, return_inverse=True)
            summed = torch.zeros(uniq.numel(), self.dim, dtype=torch.float32).index_add_(0, inverse, grads)
        slots, _ = self._index.find(uniq)
        held = slots >= 0
        if not bool(held.all()):  # usually every pushed id is still held: skip two copies of the batch then
            slots, summed = slots[held], summed[held]
        new_w, new_state = self.optimizer.step(
            self._weights.index_select(0, slots).float(), self._state.index_select(0, slots), summed
        )
        if self.clip is not None:
            new_w.clamp_(-self.clip, self.clip)
        self._weights.index_copy_(0, slots, new_w.to(self.weight_dtype))
        self._state.index_copy_(0, slots, new_state)
        self._dirty[slots] = True
        self._metrics["updates"] += slots.numel()
        return slots.numel()

    # -------------------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The occupied rows only (copies): ids, weights (in :attr:`weight_dtype`), optimizer state, LRU/LFU metadata
        and the step counter.

        Starts the eviction log if it is not running yet: a replica may start from these rows, so the next
        :meth:`take_dirty` must list what is evicted from here on.
        """
        self._evicted.start()
        n = self._n
        return {
            "ids": self._ids[:n].clone(),
            "weights": self._weights[:n].clone(),
            "state": self._state[:n].clone(),
            "last_access": self._last[:n].clone(),
            "count": self._count[:n].clone(),
            "step": self._step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents by ``state`` (from :meth:`state_dict`; capacity may differ but must hold the rows).

        Hyper-parameters, the generator and the metrics are the constructor's, not the checkpoint's; so is the
        weight dtype (rows saved in another are converted: a float32 checkpoint loads into a float16 store rounded).

        Raises:
            ValueError: See :meth:`check_state_dict`; the store is unchanged then.
        """
        self.check_state_dict(state)
        ids = as_ids(state["ids"])
        n = ids.numel()
        self._ids[:n] = ids
        self._weights[:n] = state["weights"]
        self._state[:n] = state["state"]
        self._last[:n] = state.get("last_access", torch.zeros(n, dtype=torch.int32))
        self._count[:n] = state.get("count", torch.zeros(n, dtype=torch.int32))
        self._step = int(state.get("step", 0))
        self._n = n
        self._index.rebuild(n)
        # The loaded rows are the new base a replica starts from, so nothing is dirty or removed relative to it.
        self._dirty.zero_()
        # ... and a replica may start from them, so evictions from here on are logged for the next dump.
        self._evicted.restart()

    def check_state_dict(self, state: dict[str, Any], *, rows_held: int | None = None) -> None:
        """Raise ``ValueError`` if :meth:`load_state_dict` would refuse ``state`` (more rows than the capacity, another
        dim or optimizer state width, repeated ids); changes nothing. ``rows_held``: the rows a store built on this one
        holds in its place (a disk tier's), instead of the capacity."""
        ids = as_ids(state["ids"])
        n = ids.numel()
        if n > (self.capacity if rows_held is None else rows_held):
            raise ValueError(f"checkpoint has {n} rows, capacity is {self.capacity}")
        if tuple(state["weights"].shape) != (n, self.dim):
            raise ValueError(f"weights shape {tuple(state['weights'].shape)} != ({n}, {self.dim})")
        if tuple(state["state"].shape) != (n, self.state_width):
            raise ValueError(f"optimizer state shape {tuple(state['state'].shape)} != ({n}, {self.state_width})")
        for key in ("last_access", "count"):  # optional (older checkpoints); checked so a load cannot fail halfway
            if key in state:
                value = state[key]
                if tuple(value.shape) != (n,) or value.dtype.is_floating_point or value.dtype == torch.bool:
                    got = f"{value.dtype} {tuple(value.shape)}"
                    raise ValueError(f"{key} must be an integer tensor of shape ({n},), got {got}")
        if torch.unique(ids).numel() != n:
            raise ValueError("checkpoint ids are not distinct")

    # -------------------------------------------------------------------------------------- incremental dumps

    def dirty_rows(self) -> int:
        """How many rows :meth:`take_dirty` would return now."""
        return int(self._dirty[: self._n].sum())

    def take_dirty(self, *, with_state: bool = False) -> dict[str, torch.Tensor]:
        """Rows inserted or updated since the previous call (or construction / :meth:`load_state_dict`), as copies,
        and the ids evicted since then that the store no longer holds.

        Clears the dirty mask and the eviction log. Lookup hits that only refresh LRU/LFU metadata do not make a row
        dirty; an evicted id is never among the rows (its slot now belongs to another id).

        Evictions are logged from the first call, :meth:`state_dict` or :meth:`load_state_dict` on, within a bound
        (:class:`.eviction.EvictionLog`); past it the next call says so (``removals_complete`` false).

        Args:
            with_state: Also return the optimizer state of the rows (needed to resume training, not to serve).

        Returns:
            ``{"ids": int64 [k], "weights": [k, dim] (the weight dtype), "removed": int64 [r], "removals_complete":
            bool []}`` plus ``"state": [k, state_width]`` if asked. ``removed`` is sorted and disjoint from ``ids``.
        """
        slots = self._dirty[: self._n].nonzero().squeeze(1)
        out = {"ids": self._ids.index_select(0, slots), "weights": self._weights.index_select(0, slots)}
        if with_state:
            out["state"] = self._state.index_select(0, slots)
        out["removed"], complete = self._evicted.take()
        out["removals_complete"] = torch.tensor(complete)
        self._dirty[slots] = False
        return out

    def mark_dirty(
        self, ids: torch.Tensor, removed: torch.Tensor | None = None, *, removals_complete: bool = True
    ) -> int:
        """Mark the held rows of ``ids`` dirty again and log ``removed`` as evicted again (e.g. after a dump that
        failed to write, so the next dump still carries both); returns rows marked.

        ``removals_complete=False`` (what the failed :meth:`take_dirty` said) marks the log incomplete again, so
        the next dump does not claim a full list of removals it never had.
        """
        slots, _ = self._index.find(as_ids(ids))
        slots = slots[slots >= 0]
        self._dirty[slots] = True
        self._evicted.put_back(removed, complete=removals_complete)
        return slots.numel()
