"""The plan's parameter-server tables: looked up and trained over RPC with bounded staleness K (Persia).

Bags and sequences alike: a bag table's rows are pooled per sample, a sequence table's (``pooled=False``, the
``EmbeddingCollection`` of :mod:`.sequence_hybrid`) returned one per id; the servers see the same lookups and pushes.

:class:`RemoteEmbeddingBags` is the asynchronous half of :class:`~.hybrid.HybridEmbeddingBagCollection`. ``forward``
looks the ids up through the :class:`~.ps.client.PsClient` (or takes rows :meth:`~RemoteEmbeddingBags.prefetch` ed
earlier), pools them with ``index_add`` and registers a gradient hook on the looked-up rows that pushes their
gradient without blocking (with ``K = 0`` and several trainers it stashes it for the step's gathered update).

Bounded staleness: the rows of batch ``j`` are requested only once the pushes of every batch ``<= j - 1 - K`` were
acknowledged, so a batch misses at most the updates of its ``K`` predecessors. With ``K = 0`` and several trainers
the step is exactly synchronous, as TorchRec's EBC under DDP: the trainers all-gather their PS gradients at the next
:meth:`~RemoteEmbeddingBags.prefetch` or :meth:`~RemoteEmbeddingBags.flush` (so both are collectives then: every
trainer calls them at the same point, and the last step's update is sent by ``flush``), each pushes the ids it owns
(``id mod trainers``) once with the summed (averaged) gradient, and every push is acknowledged by every trainer (a
barrier) before the next lookup. So each id gets one update per step whatever the optimizer, and a run is
reproducible. With ``K > 0`` each trainer pushes its own gradients without waiting, as Persia does.
:attr:`RemoteEmbeddingBags.staleness` is the gauge: how many earlier batches had unacknowledged pushes when the
current batch's rows were requested.

Weighted features: each id's row is scaled by the batch's per-id weight before its ``index_add``, so the servers
receive ``weight * grad`` summed per id.

Learning rates: :attr:`RemoteEmbeddingBags.optimizer` is the tables' ``KeyedOptimizer``
(:class:`~.ps_optimizer.PsTableOptimizer`); a training forward reads each table's param group, and the batch's push
carries those hyper-parameters to the servers. A forward without autograd (``torch.no_grad()``) in train mode
completes its batch at once, with no push: the next batch goes on as after a backward.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType, data_type_to_dtype
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.modules.embedding.local import int64_ids
from persia_planner.modules.embedding.ps_optimizer import PsTableOptimizer
from persia_planner.modules.ps import optim as ps_optim
from persia_planner.modules.ps.policies import Uniform
from persia_planner.modules.ps.protocol import MEMORY_STORE, TableConfig
from persia_planner.modules.step_breakdown import PS_PUSH, PS_WAIT, Stopwatch

if TYPE_CHECKING:  # pragma: no cover
    from torch.futures import Future

    from persia_planner.modules.ps.client import PsClient

__all__ = ["RemoteEmbeddingBags", "StalenessError", "unpack_rows"]


class StalenessError(PlannerError):
    """The bounded-staleness protocol was violated by the caller (e.g. a batch prefetched too far ahead)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind=ErrorKind.INPUT)


@dataclass
class _PsBatch:
    """The parameter-server half of one batch: its index, and per PS table the ids and the future of their rows."""

    index: int
    kjt: KeyedJaggedTensor
    ids: dict[str, torch.Tensor]
    rows: dict[str, Future]
    staleness: int


class RemoteEmbeddingBags(nn.Module):
    """The ``ps`` tables of a plan, trained by the parameter servers with bounded staleness ``K``.

    Args:
        tables: The PS tables' configs (sum or mean pooling).
        ps: Client of the parameter servers (the tables are registered with them here).
        optimizer: The servers' row optimizer: one for every table, or one per table name.
        staleness: Bounded staleness ``K`` (0 = synchronous).
        process_group: Group of the trainers (gloo: it carries ids and gradients on CPU); None: one trainer.
        device: Where pooled outputs are returned.
        capacity: Rows per server and table (default: the table's ``num_embeddings``, all ids fit); a table whose
            store caches a backing memory: the cache's rows.
        stores: Per table, the factory of its store on the servers (:class:`TableConfig`'s ``store``: its tier's
            ``TierSpec.store``); default: the servers' DDR (:data:`~persia_planner.modules.ps.protocol.MEMORY_STORE`).
        backing: Per table, the rows each server keeps in its store's backing memory (:class:`TableConfig`'s
            ``backing_rows``: the ``ssd`` tier's disk); default 0, every row in ``capacity``.
        store_dir: Where the servers put their stores' files (None: their temporary directory).
        init: Initialiser of new rows (default: uniform in ``+-sqrt(1 / num_embeddings)``, like TorchRec).
        seed: Seed of the servers' row initialisers.
        is_weighted: Pool ``weight * row`` with the batch's per-id weights.
        check: Called with a batch before any of its rows is requested (the collection's input checks).
        output_names: Per table, the output key of each of its features (TorchRec's ``feature@table`` where a
            feature feeds several tables); default: the feature names.
        pooled: Pool each sample's rows (bags: ``EmbeddingBagConfig`` tables); False: return every id's row, as a
            ``JaggedTensor`` per feature (sequences: ``EmbeddingConfig`` tables, TorchRec's ``EmbeddingCollection``).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        ps: PsClient,
        *,
        optimizer: ps_optim.RowOptimizer | Mapping[str, ps_optim.RowOptimizer],
        staleness: int = 0,
        process_group: Any = None,
        device: torch.device | None = None,
        capacity: int | Mapping[str, int] | None = None,
        stores: Mapping[str, str] | None = None,
        backing: Mapping[str, int] | None = None,
        store_dir: str | None = None,
        init: Any = None,
        seed: int = 0,
        is_weighted: bool = False,
        check: Callable[[KeyedJaggedTensor], None] | None = None,
        output_names: Mapping[str, Sequence[str]] | None = None,
        pooled: bool = True,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.ps = ps
        self.max_staleness = int(staleness)
        self.group = process_group
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.device = device or torch.device("cpu")
        self._is_weighted = bool(is_weighted)
        self.pooled = bool(pooled)
        self._check_batch = check or (lambda _features: None)
        # PS state: batches whose rows were requested, and pushes not yet acknowledged, per batch index.
        self._ps_features = {c.name: list(c.feature_names) for c in self.tables}
        names = output_names or {}
        self._output_names = {c.name: list(names.get(c.name, c.feature_names)) for c in self.tables}
        self._ps_dims = {c.name: c.embedding_dim for c in self.tables}
        self._queue: collections.deque[_PsBatch] = collections.deque()
        self._pushes: dict[int, list[Future]] = {}
        # K = 0 with several trainers: per batch, per PS table, this trainer's (ids, gradients, the step's row optimizer
        # where not the table's own) until every trainer
        # gathers them in _push_synchronously (a collective, so only at points every trainer reaches).
        self._stashed: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor, ps_optim.RowOptimizer | None]]] = {}
        self._done_through = -1  # every batch <= this has all its pushes acknowledged
        self._next_index = 0  # index of the next batch whose rows are requested
        self._backward_through = -1  # every batch <= this went through backward (its pushes exist)
        self.staleness = 0
        self.staleness_max_seen = 0
        # Milliseconds this trainer waited on the servers (PS_WAIT) and spent sending pushes (PS_PUSH), summed.
        self.stopwatch = Stopwatch()
        optimizers = {c.name: optimizer[c.name] if isinstance(optimizer, Mapping) else optimizer for c in self.tables}
        _claim(ps, self)
        for c in self.tables:
            rows = capacity.get(c.name, c.num_embeddings) if isinstance(capacity, Mapping) else capacity
            bound = (1.0 / c.num_embeddings) ** 0.5
            self.ps.register(
                TableConfig(
                    name=c.name,
                    dim=c.embedding_dim,
                    capacity=int(rows or c.num_embeddings),
                    optimizer=optimizers[c.name],
                    init=init or Uniform(-bound, bound),
                    seed=seed,
                    # the servers keep the rows in the table's dtype (fp16 halves their memory)
                    weight_dtype=data_type_to_dtype(c.data_type),
                    store=(stores or {}).get(c.name, MEMORY_STORE),
                    backing_rows=int((backing or {}).get(c.name, 0)),
                    store_dir=store_dir,
                )
            )
        # The tables' KeyedOptimizer: its param groups' rates travel with each batch's push.
        prefix = "embedding_bags" if self.pooled else "embeddings"  # TorchRec's keys of each kind of collection
        self.optimizer = PsTableOptimizer(self.tables, ps, optimizers, key_prefix=prefix)

    # ---- the step protocol -------------------------------------------------------------------------------------

    def prefetch(self, features: KeyedJaggedTensor, *, block: bool = True) -> bool:
        """Request the PS rows of a coming batch now, so that they arrive while earlier batches compute.

        Batches must later go through :meth:`forward` in the order they were prefetched. The rows of batch ``j``
        may be requested only once the pushes of batches ``<= j - 1 - K`` were acknowledged.

        Args:
            features: The coming batch's features.
            block: Wait for those pushes if needed; with ``False`` return ``False`` instead of waiting. With
                ``K = 0`` and several trainers the call always blocks: it is a collective (it sends the previous
                step's gathered update and ends in a barrier), so every trainer makes it at the same point.

        Returns:
            True if the request was sent (or in eval mode), False if ``block=False`` and it would wait.

        Raises:
            StalenessError: The batch is more than ``K`` batches ahead of the last backward pass.
        """
        if not self.training:
            return True
        self._check_batch(features)  # before any request: TrainLoop prefetches a batch before its forward
        if self._synchronous:
            block = True  # K = 0 ends in a barrier of the trainers: every rank must reach it, never skip it
        j = self._next_index
        needed = j - 1 - self.max_staleness
        if needed > self._backward_through:
            if not block:
                return False
            raise StalenessError(
                f"cannot prefetch batch {j}: with staleness {self.max_staleness} it needs the gradients of batch "
                f"{needed}, which has not run backward yet (prefetch at most K batches ahead; if it did run "
                "backward, every PS table's pooled output must reach the loss, or its gradient hook never fires)"
            )
        if self._synchronous:
            with self.stopwatch.range(PS_PUSH):
                self._push_synchronously()
        with self.stopwatch.range(PS_WAIT):
            if not self._wait_pushes_through(needed, block):
                return False
            if self._synchronous:
                # K = 0: every trainer's pushes must be applied before anyone reads; ours are, so wait for the others.
                dist.barrier(group=self.group)
        staleness = max(0, (j - 1) - self._done_through)
        ids = self._ps_ids(features)
        rows = {t: self.ps.lookup_async(t, v, train=True) for t, v in ids.items()}
        self._queue.append(_PsBatch(j, features, ids, rows, staleness))
        self._next_index += 1
        return True

    def can_prefetch(self) -> bool:
        """Whether :meth:`prefetch` of the next batch would send its request now, without waiting (always in eval
        mode and with K = 0 and several trainers, where it is a collective that blocks)."""
        if not self.training or self._synchronous:
            return True
        needed = self._next_index - 1 - self.max_staleness
        return needed <= self._backward_through and self._wait_pushes_through(needed, False)

    def flush(self) -> None:
        """Wait until every gradient push was acknowledged by the servers.

        With ``K = 0`` and several trainers this sends the last step's synchronous update first and ends in a
        barrier, so that on return every trainer's pushes are applied (a checkpoint taken next holds them all): a
        collective, which every trainer calls at the same point.
        """
        if self._synchronous:
            self._push_synchronously()
        self._wait_pushes_through(self._backward_through, True)
        self.ps.flush()
        if self._synchronous:
            dist.barrier(group=self.group)

    def release(self) -> None:
        """Give up this collection's hold on its tables on the client: another collection may register them from now
        on (a migration's next model, built while this one may still be referenced). Call it once this one is
        flushed and trains no more; its tables' rows stay on the servers until ``client.drop``."""
        _release(self.ps, self)

    @property
    def pending_pushes(self) -> int:
        """Batches whose gradient pushes are not acknowledged yet."""
        self._wait_pushes_through(-1, False)  # refresh the counters without waiting
        return max(0, self._backward_through - self._done_through)

    def _ps_ids(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """Per PS table the ids of its features, concatenated in ``feature_names`` order, as int64 (uint64 ids as
        their bit patterns): the K = 0 update gathers them as 8-byte values, whatever the batch's id dtype."""
        return {
            t: int64_ids(torch.cat([features[f].values() for f in names]).cpu())
            for t, names in self._ps_features.items()
        }

    def forward(self, features: KeyedJaggedTensor) -> dict[str, Any]:
        """Pooled ``[B, dim]`` embeddings of the PS features (unpooled: a ``JaggedTensor`` of their ids' rows), by
        output key (``output_names``)."""
        batch = features.stride()
        if not self.training:
            self._wait_for_eval()
            return self._pool(
                features, batch, {t: self.ps.lookup(t, v, train=False) for t, v in self._ps_ids(features).items()}
            )
        if not self._queue:
            self.prefetch(features)
        item = self._queue.popleft()
        if item.kjt is not features:
            raise StalenessError(
                f"forward got a different batch than the next prefetched one (batch {item.index}); "
                "call forward on batches in the order they were prefetched"
            )
        self.staleness = item.staleness
        self.staleness_max_seen = max(self.staleness_max_seen, item.staleness)
        if not torch.is_grad_enabled():
            # No backward will come: the batch is complete now, without a push (K = 0 with several trainers: an
            # empty share of the step's gathered update, so that the trainers' collectives still pair up).
            with self.stopwatch.range(PS_WAIT):
                rows = {t: f.wait() for t, f in item.rows.items()}
            if self._synchronous:
                self._stashed.setdefault(item.index, {})
            else:
                self._pushes.setdefault(item.index, [])
            self._backward_through = max(self._backward_through, item.index)
            return self._pool(features, batch, rows)
        with self.stopwatch.range(PS_WAIT):
            rows = {t: f.wait().requires_grad_(True) for t, f in item.rows.items()}
        scale = 1.0 / self.world_size
        # This step's hyper-parameters (a schedule's current rate): they travel with its push, however late it goes.
        hyper = {t: self.optimizer.row_optimizer(t) for t in rows}
        pushes = self._pushes.setdefault(item.index, [])
        stash = self._stashed.setdefault(item.index, {}) if self._synchronous else None
        expected = len(rows)
        # The hooks hold the index and ids, never the item: its row futures hold the very tensors the hooks hang on,
        # and a cycle through a torch Future is one Python's collector cannot see (every step's rows and batch leaked).
        index, ids = item.index, item.ids

        def hook_for(table: str) -> Any:
            def push(grad: torch.Tensor) -> None:
                g = grad * scale if scale != 1.0 else grad
                if stash is not None:
                    # Pushed by _push_synchronously, with every trainer's. A second backward through the same
                    # forward (multi-task losses, retain_graph) adds to it, as the local tables and K > 0 apply both.
                    before = stash.get(table)
                    stash[table] = (ids[table], g if before is None else before[1] + g, hyper[table])
                else:
                    with self.stopwatch.range(PS_PUSH):
                        pushes.append(self.ps.push_gradients_async(table, ids[table], g, optimizer=hyper[table]))
                if len(pushes if stash is None else stash) == expected:
                    self._backward_through = max(self._backward_through, index)

            return push

        for t, r in rows.items():
            r.register_hook(hook_for(t))
        return self._pool(features, batch, rows)

    def _pool(self, features: KeyedJaggedTensor, batch: int, rows: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        keys = features.keys()
        lengths_all = features.lengths().to(torch.int64).cpu().view(len(keys), batch)
        if not self.pooled:
            return self._sequences(features, lengths_all, rows)
        pooled = {}
        for c in self.tables:
            names = c.feature_names
            lengths = torch.stack([lengths_all[keys.index(f)] for f in names])  # [F_t, B]
            bag = torch.repeat_interleave(torch.arange(len(names) * batch), lengths.reshape(-1))
            per_id = rows[c.name]
            if self._is_weighted:  # autograd then hands the servers weight * grad for each id
                weights = torch.cat([features[f].weights() for f in names]).cpu().to(per_id.dtype)
                per_id = per_id * weights.unsqueeze(1)
            sums = torch.zeros(len(names) * batch, c.embedding_dim).index_add(0, bag, per_id)
            if c.pooling == PoolingType.MEAN:
                sums = sums / lengths.reshape(-1, 1).clamp(min=1)
            for k, name in enumerate(self._output_names[c.name]):
                pooled[name] = sums[k * batch : (k + 1) * batch].to(self.device)
        return pooled

    def _sequences(
        self, features: KeyedJaggedTensor, lengths_all: torch.Tensor, rows: Mapping[str, torch.Tensor]
    ) -> dict[str, JaggedTensor]:
        """Every id's row, per feature: its slice of its table's rows (looked up for the table's features' ids in
        ``feature_names`` order) with the feature's lengths, as TorchRec's ``EmbeddingCollection`` returns them."""
        keys = features.keys()
        out = {}
        for c in self.tables:
            start = 0
            for name, output in zip(c.feature_names, self._output_names[c.name], strict=True):
                lengths = lengths_all[keys.index(name)]
                end = start + int(lengths.sum())
                values = rows[c.name][start:end].to(self.device)
                out[output] = JaggedTensor(values=values, lengths=lengths.to(self.device))
                start = end
        return out

    # ------------------------------------------------------------------------------------------ staleness

    @property
    def _synchronous(self) -> bool:
        """K = 0 with several trainers: one summed update per step (see the module docstring)."""
        return self.max_staleness == 0 and self.world_size > 1

    def _push_synchronously(self) -> None:
        """Push the stashed steps' gradients as one update per step: every trainer's ids and gradients are gathered
        (in trainer order, so the sums are the same on every run) and each trainer sends the ids it owns."""
        for index in sorted(i for i in self._stashed if i <= self._backward_through):
            stash = self._stashed.pop(index)
            futures = self._pushes.setdefault(index, [])
            for table in sorted(self._ps_features):  # every table, in one order on every trainer: gathers pair up
                if table in stash:
                    ids, grads, hyper = stash[table]
                else:  # no gradient reached this table here; the other trainers still gather it
                    ids, grads = torch.empty(0, dtype=torch.int64), torch.empty(0, self._ps_dims[table])
                    hyper = self.optimizer.row_optimizer(table)  # every trainer's group holds the same values
                # Sum each trainer's duplicates first (fewer rows to gather), then trainer 0's sum + trainer 1's
                # + ...: with two trainers the order in which DDP's all-reduce adds their dense gradients.
                uniq, inverse = torch.unique(ids, return_inverse=True)
                sums = torch.zeros(uniq.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)
                all_ids, all_sums = self._gather_rows(uniq, sums)
                mine = torch.remainder(all_ids, self.world_size) == self.rank
                futures.append(self.ps.push_gradients_async(table, all_ids[mine], all_sums[mine], optimizer=hyper))

    def _gather_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every trainer's ``ids [n]`` and float32 ``grads [n, dim]``, concatenated in trainer order."""
        # One gather of [the id's 64 bits as two float32 | its gradient]: gloo copies bytes, so the ids survive.
        pack = torch.cat([ids.contiguous().view(torch.float32).view(-1, 2), grads.to(torch.float32)], dim=1)
        count = torch.tensor([pack.shape[0]], dtype=torch.int64)
        counts = [torch.empty_like(count) for _ in range(self.world_size)]
        dist.all_gather(counts, count, group=self.group)
        sizes = [int(c) for c in counts]
        if max(sizes) != pack.shape[0]:
            pack = torch.cat([pack, pack.new_zeros(max(sizes) - pack.shape[0], pack.shape[1])])
        packs = [torch.empty_like(pack) for _ in sizes]
        dist.all_gather(packs, pack, group=self.group)
        return unpack_rows(torch.cat([p[:n] for p, n in zip(packs, sizes, strict=True)]))

    def _wait_for_eval(self) -> None:
        """Before an eval lookup: the pushes of every batch but the last K that ran backward must be applied, the
        bound training reads under (K = 0: an eval right after a step sees that step's update, as with an EBC)."""
        needed = self._backward_through - self.max_staleness
        unsent = sorted(i for i in self._stashed if i <= needed)
        if unsent:
            raise StalenessError(
                f"cannot evaluate: with staleness 0 and {self.world_size} trainers the update of batch {unsent[0]} "
                "is sent by a collective that has not run yet; call flush() on every trainer before eval()"
            )
        self._wait_pushes_through(needed, True)

    def _wait_pushes_through(self, index: int, block: bool) -> bool:
        """Advance ``_done_through`` over acknowledged batches; wait (if ``block``) until it reaches ``index``."""
        while self._done_through < self._backward_through:
            nxt = self._done_through + 1
            if nxt in self._stashed:
                break  # its synchronous update is not sent yet (only collectives send it)
            futures = self._pushes.get(nxt, [])
            if not all(f.done() for f in futures) and (nxt > index or not block):
                break
            for f in futures:
                f.wait()  # raises the push's error (a dead server) here, in the training loop
            self._pushes.pop(nxt, None)
            self._done_through = nxt
        return self._done_through >= index


# Per client, the live collection holding each of its tables: a second one would train the first one's rows.
_HOLDERS: weakref.WeakKeyDictionary[Any, dict[str, weakref.ref[RemoteEmbeddingBags]]] = weakref.WeakKeyDictionary()


def _claim(ps: PsClient, holder: RemoteEmbeddingBags) -> None:
    """Record ``holder`` as the collection of its tables on ``ps``.

    Raises:
        PlannerError: Another live collection on ``ps`` holds one of them (its rows are trained, and the new one
            would go on from them silently); checked before anything is registered.
    """
    held = _HOLDERS.setdefault(ps, {})
    for c in holder.tables:
        other = held.get(c.name)
        if other is not None and other() is not None and ps.registered(c.name):
            raise PlannerError(
                f"PS table {c.name!r} is already registered on this client by another HybridEmbeddingBagCollection, "
                "whose trained rows a second one would share",
                fixes=(
                    "use the first collection",
                    f"drop the table first (client.drop({c.name!r})) to start it from fresh rows",
                    "name the table differently",
                ),
            )
    for c in holder.tables:
        held[c.name] = weakref.ref(holder)


def _release(ps: PsClient, holder: RemoteEmbeddingBags) -> None:
    """Forget ``holder`` as the collection of its tables on ``ps`` (those another collection holds stay held)."""
    held = _HOLDERS.get(ps, {})
    for c in holder.tables:
        if c.name in held and held[c.name]() is holder:
            del held[c.name]


def unpack_rows(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered float32 rows ``[n, 2 + dim]`` of [an id's 64 bits | its gradient] -> ids ``[n]``, grads ``[n, dim]``."""
    if full.shape[0] == 0:  # no trainer had an id of this table: an empty view's stride cannot be reinterpreted
        return torch.empty(0, dtype=torch.int64), full[:, 2:]
    return full[:, :2].contiguous().view(torch.int64).view(-1), full[:, 2:]
