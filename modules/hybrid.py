"""``HybridEmbeddingBagCollection``: a drop-in ``EmbeddingBagCollection`` that executes a plan (Persia's hybrid).

Tables the plan keeps local (``hbm``, ``ddr``, ``hbm_cache``) train **synchronously** in one fbgemm
``SplitTableBatchedEmbeddingBagsCodegen`` with its fused optimizer (CPU: host memory; CUDA: device / managed /
managed-caching memory per the plan's tier). Tables on the ``ps`` tier live on the embedding parameter servers and
train **asynchronously** with bounded staleness ``K`` (Persia's ``embedding_staleness``).

Local tables across trainers. Every trainer holds the local tables and applies one identical update per step: the
forward all-gathers the local features' ids of every trainer and pools the global batch, the backward all-gathers
the pooled-output gradients, so the fused optimizer sees the global batch's gradient (averaged over trainers like
DDP's dense gradients). Replicas therefore stay bit-identical and K = 0 equals a single-process
``EmbeddingBagCollection`` + DDP reference. (The plan's model-parallel split of local tables over devices is what
TorchRec's ``DistributedModelParallel`` executes from :func:`persia_planner.export.to_sharding_plan`; this module
replicates them, which suits the small local tables of a hybrid plan: the large ones are on the PS tier.)

Parameter-server tables. ``forward`` looks the ids up through the :class:`~.ps.client.PsClient` (or takes rows
:meth:`prefetch` ed earlier), pools them with ``index_add`` and registers a gradient hook on the looked-up rows that
pushes their gradient without blocking (with ``K = 0`` and several trainers it stashes it for the step's gathered
update). Bounded staleness: the rows of batch ``j`` are requested only once the
pushes of every batch ``<= j - 1 - K`` were acknowledged, so a batch misses at most the updates of its ``K``
predecessors. With ``K = 0`` and several trainers the step is exactly synchronous, as TorchRec's EBC under DDP: the
trainers all-gather their PS gradients at the next :meth:`~HybridEmbeddingBagCollection.prefetch` or
:meth:`~HybridEmbeddingBagCollection.flush` (so both are collectives then: every trainer calls them at the same point,
and the last step's update is sent by ``flush``), each pushes the ids it owns (``id mod trainers``) once with the
summed (averaged) gradient, and every push is acknowledged by every trainer (a barrier) before the next lookup. So
each id gets one update per step whatever the optimizer (Adagrad's accumulator sees the step's gradient, not one push
per trainer), and a run is reproducible. With ``K > 0`` each trainer pushes its own gradients without waiting, as
Persia does. :attr:`HybridEmbeddingBagCollection.staleness` is the gauge: how many earlier batches had
unacknowledged pushes when the current batch's rows were requested.

Ids: a local table maps ids into its rows with ``id mod num_embeddings`` (a no-op for ids already in range), so raw
64-bit feature ids work on both paths and the plan may move a table between tiers without touching the data.

Weighted features (``is_weighted=True``, as TorchRec's ``EmbeddingBagCollection``): each id's row is scaled by the
batch's per-id weight (``KeyedJaggedTensor.weights()``) before the sum, and its gradient by the same weight. Local
tables pass the weights to fbgemm's kernel (``per_sample_weights``; gathered with the ids across trainers), PS tables
scale the looked-up rows before their ``index_add``, so the servers receive ``weight * grad`` summed per id.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.placement import Mode, TablePlacement, Tier
from persia_planner.plan import Plan
from persia_planner.specs import Optimizer

from .ps import optim as ps_optim
from .ps.server import TableConfig
from .ps.store import Uniform

if TYPE_CHECKING:  # pragma: no cover
    from torch.futures import Future

    from .ps.client import PsClient

__all__ = ["HybridEmbeddingBagCollection", "SparseOptimizer", "StalenessError"]


class StalenessError(PlannerError):
    """The bounded-staleness protocol was violated by the caller (e.g. a batch prefetched too far ahead)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind=ErrorKind.INPUT)


@dataclass(frozen=True)
class SparseOptimizer:
    """The sparse optimizer of every embedding table, local (fbgemm fused) and remote (PS) alike.

    Attributes:
        kind: ``sgd``, ``adagrad``, ``rowwise_adagrad`` or ``adam`` (adam: PS tables only; fbgemm has no CPU adam).
        learning_rate: Step size.
        eps: Adagrad / Adam epsilon.
        beta1: Adam first-moment decay.
        beta2: Adam second-moment decay.
    """

    kind: Optimizer = Optimizer.ROWWISE_ADAGRAD
    learning_rate: float = 0.05
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Optimizer(self.kind))
        if not self.learning_rate > 0:
            raise PlannerError(f"sparse optimizer: learning_rate must be > 0, got {self.learning_rate}")

    def fbgemm(self, on_cuda: bool) -> dict[str, Any]:
        """Keyword arguments of ``SplitTableBatchedEmbeddingBagsCodegen`` for this optimizer."""
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        kinds = {
            Optimizer.SGD: EmbOptimType.EXACT_SGD,
            Optimizer.ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
            Optimizer.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            Optimizer.ADAM: EmbOptimType.ADAM,
        }
        if self.kind is Optimizer.ADAM and not on_cuda:
            raise PlannerError(
                "sparse optimizer adam: fbgemm has no CPU adam for local tables",
                fixes=("use rowwise_adagrad, adagrad or sgd", "or place the tables on the ps tier"),
            )
        return {
            "optimizer": kinds[self.kind],
            "learning_rate": self.learning_rate,
            "eps": self.eps,
            "beta1": self.beta1,
            "beta2": self.beta2,
        }

    def ps(self) -> ps_optim.RowOptimizer:
        """The same optimizer as the parameter servers apply it."""
        if self.kind is Optimizer.SGD:
            return ps_optim.SGD(lr=self.learning_rate)
        if self.kind is Optimizer.ADAGRAD:
            return ps_optim.Adagrad(lr=self.learning_rate, eps=self.eps)
        if self.kind is Optimizer.ROWWISE_ADAGRAD:
            return ps_optim.RowWiseAdagrad(lr=self.learning_rate, eps=self.eps)
        return ps_optim.Adam(lr=self.learning_rate, betas=(self.beta1, self.beta2), eps=self.eps)


class _ShardOfGlobal(torch.autograd.Function):
    """This trainer's rows of the global-batch output; the backward all-gathers every trainer's gradient."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, sizes: list[int], rank: int, group: Any, scale: float) -> torch.Tensor:
        ctx.sizes, ctx.rank, ctx.group, ctx.scale = sizes, rank, group, scale
        start = sum(sizes[:rank])
        return out[start : start + sizes[rank]].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        sizes, widest = ctx.sizes, max(ctx.sizes)
        # The trainers' group is gloo (CPU tensors) on every machine: it also carries the ids, which live on CPU.
        mine = grad.detach().cpu().contiguous()
        if widest != mine.shape[0]:  # only a short final batch needs padding to the common shape
            mine = torch.cat([mine, mine.new_zeros(widest - mine.shape[0], mine.shape[1])])
        gathered = [torch.empty_like(mine) for _ in sizes]
        dist.all_gather(gathered, mine, group=ctx.group)
        full = torch.cat([g[:n] for g, n in zip(gathered, sizes, strict=True)])
        if ctx.scale != 1.0:
            full.mul_(ctx.scale)
        full = full.to(grad.device)
        return full, None, None, None, None


@dataclass
class _PsBatch:
    """The parameter-server half of one batch: its index, and per PS table the ids and the future of their rows."""

    index: int
    kjt: KeyedJaggedTensor
    ids: dict[str, torch.Tensor]
    rows: dict[str, Future]
    staleness: int


class HybridEmbeddingBagCollection(nn.Module):
    """``EmbeddingBagCollection`` whose tables train where a plan put them: locally (sync) or on the PS (async).

    Same inputs and outputs as TorchRec's ``EmbeddingBagCollection``: a ``KeyedJaggedTensor`` (keys may come in any
    order; unknown keys are ignored) in, a ``KeyedTensor`` with one ``[B, dim]`` value per feature (in table order,
    then each table's ``feature_names``) out. Swap it into a TorchRec DLRM with
    ``DLRM(embedding_bag_collection=HybridEmbeddingBagCollection(tables, plan, ps=client), ...)``.

    Args:
        tables: The tables, as for ``EmbeddingBagCollection`` (sum or mean pooling).
        plan: A :class:`~persia_planner.plan.Plan` (or its ``tables`` mapping) placing every table; ``None`` keeps
            every table local.
        ps: Client of the parameter servers; required when the plan puts any table on the ``ps`` tier.
        optimizer: Sparse optimizer of every table (local: fbgemm fused; PS: applied by the servers).
        staleness: Bounded staleness ``K`` of the PS tables (0 = synchronous).
        process_group: Group of the trainers (default: the default group when initialised, else one trainer).
        device: Where local tables live and outputs are returned (default: CUDA if available, else CPU).
        ps_capacity: Rows per server and PS table (default: the table's ``num_embeddings``, all ids fit).
        ps_init: Initialiser of new PS rows (default: uniform in ``+-sqrt(1 / num_embeddings)``, like TorchRec).
        seed: Seed of the local tables' initialisation and of the PS tables' row initialisers.
        is_weighted: Pool ``weight * row`` with the batch's per-id weights (TorchRec's ``is_weighted``; sum pooling
            only, as in TorchRec). Unweighted collections ignore weights a batch carries, as TorchRec's do.

    Raises:
        PlannerError: The plan misses a table or names an unknown one, PS tables without a client, an optimizer
            the local kernel does not support, or weights with mean pooling.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        plan: Plan | Mapping[str, TablePlacement] | None = None,
        *,
        ps: PsClient | None = None,
        optimizer: SparseOptimizer | None = None,
        staleness: int = 0,
        process_group: Any = None,
        device: torch.device | None = None,
        ps_capacity: int | Mapping[str, int] | None = None,
        ps_init: Any = None,
        seed: int = 0,
        is_weighted: bool = False,
    ) -> None:
        super().__init__()
        if not tables:
            raise PlannerError("HybridEmbeddingBagCollection needs at least one table")
        mean = [c.name for c in tables if c.pooling == PoolingType.MEAN]
        if is_weighted and mean:
            # torch's EmbeddingBag (what TorchRec's weighted EBC runs) defines per-sample weights for sum alone.
            raise PlannerError(
                f"tables {mean[:3]} use mean pooling, but weighted features are defined for sum pooling only",
                fixes=("use PoolingType.SUM for weighted features", "or is_weighted=False"),
            )
        self._is_weighted = bool(is_weighted)
        if staleness < 0:
            raise PlannerError(f"staleness must be >= 0, got {staleness}", fixes=("use 0 for synchronous training",))
        self._configs = list(tables)
        self.optimizer = optimizer or SparseOptimizer()
        self.max_staleness = int(staleness)
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        placements = _placements_of(plan, self._configs)
        self.ps_tables = [
            c for c in self._configs if placements.get(c.name) is not None and placements[c.name].mode is Mode.ASYNC
        ]
        ps_names = {c.name for c in self.ps_tables}
        self.local_tables = [c for c in self._configs if c.name not in ps_names]
        if self.ps_tables and ps is None:
            raise PlannerError(
                f"tables {[c.name for c in self.ps_tables]} are on the ps tier but no parameter-server client "
                "was given",
                fixes=("pass ps=connect(...) (persia_planner.modules.ps.client)", "or plan without a ps tier"),
            )
        self.ps = ps if self.ps_tables else None
        self._features = [f for c in self._configs for f in c.feature_names]
        if len(set(self._features)) != len(self._features):
            raise PlannerError("HybridEmbeddingBagCollection: a feature name is used by two tables")
        self._dims = [c.embedding_dim for c in self._configs for _ in c.feature_names]

        self.group = process_group
        if self.group is None and dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")  # ids and pooled gradients; see _ShardOfGlobal
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0

        self._local_features = [f for c in self.local_tables for f in c.feature_names]
        self._local_rows = torch.tensor(
            [c.num_embeddings for c in self.local_tables for _ in c.feature_names], dtype=torch.int64
        )
        odd = [c.name for c in self.local_tables if c.embedding_dim % 4]
        if odd:
            raise PlannerError(
                f"local tables {odd[:3]} have an embedding_dim that is not a multiple of 4, which fbgemm's "
                "table-batched embedding kernels require",
                fixes=("round embedding_dim up to a multiple of 4", "or place these tables on the ps tier"),
            )
        self.tbe = self._make_tbe(placements, seed) if self.local_tables else None

        # PS state: batches whose rows were requested, and pushes not yet acknowledged, per batch index.
        self._ps_features = {c.name: list(c.feature_names) for c in self.ps_tables}
        self._ps_dims = {c.name: c.embedding_dim for c in self.ps_tables}
        self._queue: collections.deque[_PsBatch] = collections.deque()
        self._pushes: dict[int, list[Future]] = {}
        # K = 0 with several trainers: per batch, per PS table, this trainer's (ids, gradients) until every trainer
        # gathers them in _push_synchronously (a collective, so only at points every trainer reaches).
        self._stashed: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._done_through = -1  # every batch <= this has all its pushes acknowledged
        self._next_index = 0  # index of the next batch whose rows are requested
        self._backward_through = -1  # every batch <= this went through backward (its pushes exist)
        self.staleness = 0
        self.staleness_max_seen = 0
        if self.ps is not None:
            for c in self.ps_tables:
                if isinstance(ps_capacity, Mapping):
                    capacity = ps_capacity.get(c.name, c.num_embeddings)
                else:
                    capacity = ps_capacity or c.num_embeddings
                bound = (1.0 / c.num_embeddings) ** 0.5
                self.ps.register(
                    TableConfig(
                        name=c.name,
                        dim=c.embedding_dim,
                        capacity=int(capacity),
                        optimizer=self.optimizer.ps(),
                        init=ps_init or Uniform(-bound, bound),
                        seed=seed,
                    )
                )

    # ------------------------------------------------------------------------------------------ construction

    def _make_tbe(self, placements: Mapping[str, TablePlacement | None], seed: int) -> nn.Module:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        on_cuda = self.device.type == "cuda"
        location = {
            Tier.HBM: EmbeddingLocation.DEVICE,
            Tier.DDR: EmbeddingLocation.MANAGED,
            Tier.HBM_CACHE: EmbeddingLocation.MANAGED_CACHING,
        }
        specs, cache_factors = [], []
        for c in self.local_tables:
            p = placements.get(c.name)
            tier = p.tier if p is not None else Tier.HBM
            if on_cuda:
                specs.append((c.num_embeddings, c.embedding_dim, location[tier], ComputeDevice.CUDA))
                if tier is Tier.HBM_CACHE and p is not None:
                    cache_factors.append(p.shards[0].cache_fraction or 0.2)
            else:
                specs.append((c.num_embeddings, c.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU))
        pooling = {c.pooling for c in self.local_tables}
        if len(pooling) > 1:
            raise PlannerError("local tables mix sum and mean pooling; use one pooling for all local tables")
        # fbgemm's CPU row-wise Adagrad needs each table's features to be contiguous: they are (table order).
        feature_table_map = [t for t, c in enumerate(self.local_tables) for _ in c.feature_names]
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=specs,
            feature_table_map=feature_table_map,
            pooling_mode=PoolingMode.MEAN if pooling == {PoolingType.MEAN} else PoolingMode.SUM,
            device=self.device,
            cache_load_factor=max(cache_factors, default=0.2),
            **self.optimizer.fbgemm(on_cuda),
        )
        # TorchRec's EmbeddingBagCollection default: uniform(+-sqrt(1 / num_embeddings)); seeded, same on every rank.
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for c, weight in zip(self.local_tables, tbe.split_embedding_weights(), strict=True):
                bound = (1.0 / c.num_embeddings) ** 0.5
                weight.copy_(torch.empty(weight.shape).uniform_(-bound, bound, generator=gen))
        return tbe

    # ------------------------------------------------------------------------------------------- public API

    def is_weighted(self) -> bool:
        """Whether rows are pooled with the batch's per-id weights (``EmbeddingBagCollection.is_weighted()``)."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, as ``EmbeddingBagCollection.embedding_bag_configs()`` (TorchRec models read them)."""
        return list(self._configs)

    def local_weights(self) -> dict[str, torch.Tensor]:
        """The local tables' weights (views into the fused kernel's storage), by table name."""
        if self.tbe is None:
            return {}
        self.tbe.flush()  # an HBM cache (MANAGED_CACHING) writes its updated rows back first
        return dict(zip([c.name for c in self.local_tables], self.tbe.split_embedding_weights(), strict=True))

    def load_local_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy ``weights`` (table name -> ``[rows, dim]``) into the local tables (e.g. from a checkpoint)."""
        mine = self.local_weights()
        for name, value in weights.items():
            if name not in mine:
                raise PlannerError(f"load_local_weights: {name!r} is not a local table; local: {sorted(mine)}")
            if tuple(value.shape) != tuple(mine[name].shape):
                raise PlannerError(
                    f"load_local_weights: table {name!r} has shape {tuple(mine[name].shape)}, got {tuple(value.shape)}"
                )
            with torch.no_grad():
                mine[name].copy_(value)
        self._reset_cache()

    def _reset_cache(self) -> None:
        # Rows cached in HBM would shadow what was just written to the backing store.
        if self.tbe is not None and hasattr(self.tbe, "reset_cache_states"):
            self.tbe.reset_cache_states()

    def local_optimizer_states(self) -> list[list[torch.Tensor]]:
        """Copies of the fused optimizer's state of every local table (for checkpoints)."""
        if self.tbe is None:
            return []
        self.tbe.flush()
        return [[s.detach().clone() for s in table] for table in self.tbe.split_optimizer_states()]

    def load_local_optimizer_states(self, states: Sequence[Sequence[torch.Tensor]]) -> None:
        """Restore :meth:`local_optimizer_states`."""
        if self.tbe is None:
            return
        mine = self.tbe.split_optimizer_states()
        if len(mine) != len(states):
            raise PlannerError(f"optimizer state for {len(states)} local tables, this collection has {len(mine)}")
        # Checked before anything is copied: another sparse optimizer keeps state of other shapes (Adagrad: one value
        # per weight, row-wise Adagrad: one per row), and a half-restored state must not train on.
        for config, dst_table, src_table in zip(self.local_tables, mine, states, strict=True):
            have = [tuple(t.shape) for t in src_table]
            want = [tuple(t.shape) for t in dst_table]
            if have != want:
                raise PlannerError(
                    f"optimizer state of local table {config.name!r} has shapes {have}, this collection's "
                    f"{self.optimizer.kind.value} needs {want} (saved with another sparse optimizer?)",
                    fixes=("resume with the sparse optimizer the checkpoint was trained with", "or train from scratch"),
                )
        with torch.no_grad():
            for dst_table, src_table in zip(mine, states, strict=True):
                for dst, src in zip(dst_table, src_table, strict=True):
                    dst.copy_(src)
        self._reset_cache()

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
            True if the request was sent (or there are no PS tables), False if ``block=False`` and it would wait.

        Raises:
            StalenessError: The batch is more than ``K`` batches ahead of the last backward pass.
        """
        if self.ps is None or not self.training:
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
            self._push_synchronously()
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

    def flush(self) -> None:
        """Wait until every gradient push was acknowledged by the servers.

        With ``K = 0`` and several trainers this sends the last step's synchronous update first and ends in a
        barrier, so that on return every trainer's pushes are applied (a checkpoint taken next holds them all): a
        collective, which every trainer calls at the same point.
        """
        if self._synchronous:
            self._push_synchronously()
        self._wait_pushes_through(self._backward_through, True)
        if self.ps is not None:
            self.ps.flush()
        if self._synchronous:
            dist.barrier(group=self.group)

    @property
    def pending_pushes(self) -> int:
        """Batches whose gradient pushes are not acknowledged yet."""
        self._wait_pushes_through(-1, False)  # refresh the counters without waiting
        return max(0, self._backward_through - self._done_through)

    # -------------------------------------------------------------------------------------------- forward

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``features``: a ``KeyedTensor`` with one ``[B, dim]`` value per feature."""
        batch = features.stride()
        self._check_batch(features)
        pooled: dict[str, torch.Tensor] = {}
        if self.tbe is not None:
            pooled.update(self._local_forward(features, batch))
        if self.ps is not None:
            pooled.update(self._ps_forward(features, batch))
        values = torch.cat([pooled[f] for f in self._features], dim=1)
        return KeyedTensor(keys=list(self._features), length_per_key=list(self._dims), values=values, key_dim=1)

    def _check_batch(self, features: KeyedJaggedTensor) -> None:
        """One-line errors for a batch that lacks a feature of the tables or whose parts disagree."""
        present = set(features.keys())
        missing = [f for f in self._features if f not in present]
        if missing:
            raise PlannerError(
                f"features {missing[:3]} of the embedding tables are not keys of the KeyedJaggedTensor "
                f"(it has {list(features.keys())[:5]}...)",
                fixes=("build the batch with every feature of the tables",),
            )
        _check_kjt(features, weighted=self._is_weighted)

    def _local_forward(self, features: KeyedJaggedTensor, batch: int) -> dict[str, torch.Tensor]:
        keys = features.keys()
        carried = features.weights_or_none()
        # fbgemm's permute has no uint64 kernel (the same bits as int64 do) and moves any weights along, bfloat16 ones
        # included, which it has no kernel for either: an unweighted collection drops them, a weighted one widens them.
        weights = carried.to(torch.float32) if self._is_weighted and carried is not None else None
        ids = features.values()
        if ids.dtype == torch.uint64 or carried is not weights:
            ids = ids.view(torch.int64) if ids.dtype == torch.uint64 else ids
            features = KeyedJaggedTensor(keys=keys, values=ids, lengths=features.lengths(), weights=weights)
        kjt = features.permute([keys.index(f) for f in self._local_features])
        if weights is not None:
            weights = kjt.weights().cpu()
        n_features = len(self._local_features)
        lengths = kjt.lengths().to(torch.int64).cpu()
        values = kjt.values().cpu().to(torch.int64)  # int32 ids widened for the remainder by int64 row counts
        per_feature = lengths.view(n_features, batch).sum(1)
        # Map raw ids into the table's rows (a no-op for ids already below num_embeddings).
        values = torch.remainder(values, self._local_rows.repeat_interleave(per_feature))
        distributed = self.world_size > 1 and self.training  # eval: each trainer scores its own batch
        if distributed and weights is not None and weights.requires_grad:
            raise PlannerError(
                "learnable per-id weights (weights that require grad) cannot train local tables across trainers: "
                "the trainers' all-gather of the weights has no backward",
                fixes=("place the weighted tables on the ps tier", "or pass the weights detached"),
            )
        if distributed:
            lengths, values, sizes, weights = self._gather_global(
                lengths.view(n_features, batch), values, per_feature, weights
            )
        else:
            sizes = [batch]
            lengths = lengths.view(n_features, batch)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
        out = self.tbe(
            values.to(self.device),
            offsets.to(self.device),
            per_sample_weights=None if weights is None else weights.to(self.device),
        )
        if distributed:
            scale = 1.0 / self.world_size
            out = _ShardOfGlobal.apply(out, sizes, self.rank, self.group, scale)
        return dict(
            zip(self._local_features, out.split([self._dim_of(f) for f in self._local_features], 1), strict=True)
        )

    def _gather_global(
        self, lengths: torch.Tensor, values: torch.Tensor, per_feature: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor | None]:
        """Every trainer's ids (and their weights, if any), laid out as one global batch: feature-major, then
        trainer, then sample."""
        n_features, batch = lengths.shape
        meta = torch.tensor([batch, values.numel()], dtype=torch.int64)
        metas = [torch.empty_like(meta) for _ in range(self.world_size)]
        dist.all_gather(metas, meta, group=self.group)
        sizes = [int(m[0]) for m in metas]
        counts = [int(m[1]) for m in metas]
        widest_b, widest_n = max(sizes), max(counts)
        # One gather for lengths and ids together: [lengths padded to widest_b | ids padded to widest_n].
        pack = torch.zeros(n_features * widest_b + widest_n, dtype=torch.int64)
        pack[: n_features * widest_b].view(n_features, widest_b)[:, :batch] = lengths
        pack[n_features * widest_b : n_features * widest_b + values.numel()] = values
        packs = [torch.empty_like(pack) for _ in sizes]
        dist.all_gather(packs, pack, group=self.group)
        all_l = [p[: n_features * widest_b].view(n_features, widest_b) for p in packs]
        all_v = [p[n_features * widest_b :] for p in packs]
        lengths_r = [lr[:, :b] for lr, b in zip(all_l, sizes, strict=True)]
        values_r = [vr[:n] for vr, n in zip(all_v, counts, strict=True)]
        # Stable sort of every id by (feature, trainer) gives the feature-major global layout in one permutation.
        keys = torch.cat(
            [
                torch.repeat_interleave(torch.arange(n_features) * self.world_size + r, lr.sum(1))
                for r, lr in enumerate(lengths_r)
            ]
        )
        order = torch.argsort(keys, stable=True)
        gathered_weights = None
        if weights is not None:  # float32, so a gather of its own (the ids' pack is int64)
            padded = torch.zeros(widest_n, dtype=torch.float32)
            padded[: weights.numel()] = weights
            all_w = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(all_w, padded, group=self.group)
            gathered_weights = torch.cat([w[:n] for w, n in zip(all_w, counts, strict=True)])[order]
        return torch.cat(lengths_r, dim=1), torch.cat(values_r)[order], sizes, gathered_weights

    def _dim_of(self, feature: str) -> int:
        return self._dims[self._features.index(feature)]

    def _ps_ids(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """Per PS table the ids of its features, concatenated in ``feature_names`` order, as int64 (uint64 ids as
        their bit patterns): the K = 0 update gathers them as 8-byte values, whatever the batch's id dtype."""
        return {
            t: _int64_ids(torch.cat([features[f].values() for f in names]).cpu())
            for t, names in self._ps_features.items()
        }

    def _ps_forward(self, features: KeyedJaggedTensor, batch: int) -> dict[str, torch.Tensor]:
        assert self.ps is not None
        if not self.training:
            self._wait_for_eval()
            return self._pool_ps(
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
        rows = {t: f.wait().requires_grad_(True) for t, f in item.rows.items()}
        scale = 1.0 / self.world_size
        pushes = self._pushes.setdefault(item.index, [])
        stash = self._stashed.setdefault(item.index, {}) if self._synchronous else None
        expected = len(rows)

        def hook_for(table: str) -> Any:
            def push(grad: torch.Tensor) -> None:
                g = grad * scale if scale != 1.0 else grad
                if stash is not None:
                    # Pushed by _push_synchronously, with every trainer's. A second backward through the same
                    # forward (multi-task losses, retain_graph) adds to it, as the local tables and K > 0 apply both.
                    before = stash.get(table)
                    stash[table] = (item.ids[table], g if before is None else before[1] + g)
                else:
                    pushes.append(self.ps.push_gradients_async(table, item.ids[table], g))
                if len(pushes if stash is None else stash) == expected:
                    self._backward_through = max(self._backward_through, item.index)

            return push

        for t, r in rows.items():
            r.register_hook(hook_for(t))
        return self._pool_ps(features, batch, rows)

    def _pool_ps(
        self, features: KeyedJaggedTensor, batch: int, rows: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        keys = features.keys()
        lengths_all = features.lengths().to(torch.int64).cpu().view(len(keys), batch)
        pooled = {}
        for c in self.ps_tables:
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
            for k, name in enumerate(names):
                pooled[name] = sums[k * batch : (k + 1) * batch].to(self.device)
        return pooled

    # ------------------------------------------------------------------------------------------ staleness

    @property
    def _synchronous(self) -> bool:
        """K = 0 with several trainers: one summed update per step (see the module docstring)."""
        return self.max_staleness == 0 and self.world_size > 1 and self.ps is not None

    def _push_synchronously(self) -> None:
        """Push the stashed steps' gradients as one update per step: every trainer's ids and gradients are gathered
        (in trainer order, so the sums are the same on every run) and each trainer sends the ids it owns."""
        assert self.ps is not None
        for index in sorted(i for i in self._stashed if i <= self._backward_through):
            stash = self._stashed.pop(index)
            futures = self._pushes.setdefault(index, [])
            for table in sorted(self._ps_features):  # every table, in one order on every trainer: gathers pair up
                if table in stash:
                    ids, grads = stash[table]
                else:  # no gradient reached this table here; the other trainers still gather it
                    ids, grads = torch.empty(0, dtype=torch.int64), torch.empty(0, self._ps_dims[table])
                # Sum each trainer's duplicates first (fewer rows to gather), then trainer 0's sum + trainer 1's
                # + ...: with two trainers the order in which DDP's all-reduce adds their dense gradients.
                uniq, inverse = torch.unique(ids, return_inverse=True)
                sums = torch.zeros(uniq.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)
                all_ids, all_sums = self._gather_rows(uniq, sums)
                mine = torch.remainder(all_ids, self.world_size) == self.rank
                futures.append(self.ps.push_gradients_async(table, all_ids[mine], all_sums[mine]))

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
        return _unpack_rows(torch.cat([p[:n] for p, n in zip(packs, sizes, strict=True)]))

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


def _int64_ids(values: torch.Tensor) -> torch.Tensor:
    """Feature ids as int64: uint64 as the same bit patterns (what the servers hash), narrower integers widened."""
    if values.dtype == torch.int64:
        return values
    if values.dtype == torch.uint64:
        return values.view(torch.int64)
    return values.to(torch.int64)


def _unpack_rows(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered float32 rows ``[n, 2 + dim]`` of [an id's 64 bits | its gradient] -> ids ``[n]``, grads ``[n, dim]``."""
    if full.shape[0] == 0:  # no trainer had an id of this table: an empty view's stride cannot be reinterpreted
        return torch.empty(0, dtype=torch.int64), full[:, 2:]
    return full[:, :2].contiguous().view(torch.int64).view(-1), full[:, 2:]


def _check_kjt(features: KeyedJaggedTensor, *, weighted: bool = False) -> None:
    """One-line errors for a KeyedJaggedTensor whose parts disagree (fbgemm and the PS would read past its ids), or
    that lacks the per-id weights a weighted collection pools with."""
    values, lengths = features.values(), features.lengths()
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise PlannerError(
            f"KeyedJaggedTensor values must be integer ids, got {values.dtype}",
            fixes=("pass int64 feature ids (hash strings to int64 first)",),
        )
    expected = len(features.keys()) * features.stride()
    if lengths.dim() != 1 or lengths.numel() != expected:
        raise PlannerError(
            f"KeyedJaggedTensor lengths has shape {tuple(lengths.shape)}, expected [{expected}] "
            f"({len(features.keys())} keys x batch {features.stride()})",
            fixes=("give one length per key and sample, key-major",),
        )
    if lengths.numel() and int(lengths.min()) < 0:
        raise PlannerError("KeyedJaggedTensor lengths must be >= 0", fixes=("check how the batch's lengths are built",))
    total = int(lengths.sum())
    if total != values.numel():
        raise PlannerError(
            f"KeyedJaggedTensor lengths sum to {total} but it holds {values.numel()} values",
            fixes=("make sum(lengths) equal len(values)",),
        )
    if not weighted:
        return
    weights = features.weights_or_none()
    if weights is None:
        raise PlannerError(
            "the collection is weighted (is_weighted=True) but the KeyedJaggedTensor has no weights",
            fixes=("build it with weights= (one float per id)", "or construct the collection with is_weighted=False"),
        )
    if not weights.is_floating_point() or tuple(weights.shape) != (values.numel(),):
        raise PlannerError(
            f"KeyedJaggedTensor weights are {weights.dtype} {tuple(weights.shape)}, expected floating point "
            f"[{values.numel()}] (one per id)",
            fixes=("give one float weight per value",),
        )


def _placements_of(
    plan: Plan | Mapping[str, TablePlacement] | None, configs: Sequence[EmbeddingBagConfig]
) -> dict[str, TablePlacement | None]:
    if plan is None:
        return {c.name: None for c in configs}
    tables = plan.tables if isinstance(plan, Plan) else plan
    names = {c.name for c in configs}
    missing = [c.name for c in configs if c.name not in tables]
    if missing:
        raise PlannerError(
            f"the plan has no placement for tables {missing[:3]}",
            fixes=("plan this model (persia plan MODEL TOPOLOGY) and pass that plan",),
        )
    unknown = sorted(set(tables) - names)
    if unknown:
        raise PlannerError(
            f"the plan places tables {unknown[:3]} that are not in the collection",
            fixes=("pass the plan made for this model",),
        )
    return {c.name: tables[c.name] for c in configs}
