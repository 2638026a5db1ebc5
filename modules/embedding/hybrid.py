"""``HybridEmbeddingBagCollection``: a drop-in ``EmbeddingBagCollection`` that executes a plan (Persia's hybrid).

It composes two parts, each in its own module:

- :class:`~.local.LocalEmbeddingBags`: the tables the plan keeps local (``hbm``, ``ddr``, ``hbm_cache``) in a TorchRec
  ``EmbeddingBagCollection``, which :func:`persia_planner.modules.embedding.model_parallel.distribute` hands to
  ``DistributedModelParallel`` with the plan's exported ``ShardingPlan``: every sharding type of the plan, fbgemm's
  fused kernels and optimizers, TorchRec's all-to-alls. They train **synchronously**.
- :class:`~.remote.RemoteEmbeddingBags`: the ``ps`` tables, on the embedding parameter servers, trained
  **asynchronously** with bounded staleness ``K`` (Persia's ``embedding_staleness``).

Both train with the tables' :class:`~.sparse_optimizer.SparseOptimizer` (re-exported here, the collection's argument):
fbgemm's fused optimizer for the local tables, the servers' row optimizer for the PS tables.

The dense network around it trains under DDP (as DMP wraps it). With ``K = 0`` a step equals a single-process
``EmbeddingBagCollection`` + DDP reference: local gradients are averaged over the trainers as DDP averages dense
ones, and the PS tables get one gathered update per step (see :mod:`.remote`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from persia_planner.errors import PlannerError
from persia_planner.kinds import Mode
from persia_planner.modules.embedding.local import LocalEmbeddingBags
from persia_planner.modules.embedding.remote import RemoteEmbeddingBags, StalenessError
from persia_planner.modules.embedding.sparse_optimizer import SparseOptimizer
from persia_planner.modules.embedding.state_keys import own_keys, torchrec_keys
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.plan import Plan
from persia_planner.plan.validation import require_same_tables

if TYPE_CHECKING:  # pragma: no cover
    from persia_planner.modules.ps.client import PsClient

__all__ = ["HybridEmbeddingBagCollection", "SparseOptimizer", "StalenessError"]


class HybridEmbeddingBagCollection(EmbeddingBagCollectionInterface, FusedOptimizerModule):
    """``EmbeddingBagCollection`` whose tables train where a plan put them: locally (sync) or on the PS (async).

    Same inputs and outputs as TorchRec's ``EmbeddingBagCollection``: a ``KeyedJaggedTensor`` (keys may come in any
    order; unknown keys are ignored) in, a ``KeyedTensor`` with one ``[B, dim]`` value per feature (in table order,
    then each table's ``feature_names``) out. Swap it into a TorchRec DLRM with
    ``DLRM(embedding_bag_collection=HybridEmbeddingBagCollection(tables, plan, ps=client), ...)``, then shard the model
    with :func:`~persia_planner.modules.embedding.model_parallel.distribute` (``DistributedModelParallel`` with the
    plan's ``ShardingPlan``).

    Args:
        tables: The tables, as for ``EmbeddingBagCollection`` (sum or mean pooling).
        plan: A :class:`~persia_planner.plan.plan.Plan` (or its ``tables`` mapping) placing every table; ``None`` keeps
            every table local.
        ps: Client of the parameter servers; required when the plan puts any table on the ``ps`` tier.
        optimizer: Sparse optimizer of every table (local: fbgemm fused once sharded; PS: applied by the servers).
        table_optimizers: Per table name, its own sparse optimizer instead of ``optimizer`` (TorchRec's per-table
            fused params: local tables get theirs in fbgemm once sharded, PS tables on the servers).
        staleness: Bounded staleness ``K`` of the PS tables (0 = synchronous).
        process_group: Group of the trainers for the PS tables' synchronous updates (default: a gloo group of the
            default group's ranks when initialised, else one trainer).
        device: The collection's device, as TorchRec's: where the unsharded local tables are built and PS outputs
            are returned (default: torch's default device, CPU unless a ``with torch.device(...)`` block says
            otherwise).
        local_device: Where the unsharded local collection is built, when not ``device`` (``meta``: only DMP's
            shards are allocated).
        ps_capacity: Rows per server and PS table (default: the table's ``num_embeddings``, all ids fit); a table on
            a tier with a cache (``TierSpec.cached``, the ``ssd`` tier): its cache's rows.
        ps_backing: Per PS table on a tier with a cache, the rows each server keeps in the tier's backing memory
            (the ``ssd`` tier's disk); default 0: as many as the cache. Each PS table's store is its tier's
            (``TierSpec.store``).
        ps_store_dir: Where the servers put their stores' files (None: their temporary directory).
        ps_init: Initialiser of new PS rows (default: uniform in ``+-sqrt(1 / num_embeddings)``, like TorchRec).
        seed: Seed of the local tables' initialisation and of the PS tables' row initialisers.
        is_weighted: Pool ``weight * row`` with the batch's per-id weights (TorchRec's ``is_weighted``; sum pooling
            only, as in TorchRec). Unweighted collections ignore weights a batch carries, as TorchRec's do.
        keep_order: Return the keys in config order (the drop-in default). ``False`` returns them as the engines
            give them (the local tables grouped as TorchRec's sharded collection gives them, then the PS tables),
            which saves one copy of the pooled output forward and backward; for models that read the output by key,
            as TorchRec's ``DLRM`` does.

    Raises:
        PlannerError: The plan misses a table or names an unknown one, PS tables without a client, an optimizer
            fbgemm's kernels lack for local tables, or weights with mean pooling.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        plan: Plan | Mapping[str, TablePlacement] | None = None,
        *,
        ps: PsClient | None = None,
        optimizer: SparseOptimizer | None = None,
        table_optimizers: Mapping[str, SparseOptimizer] | None = None,
        staleness: int = 0,
        process_group: Any = None,
        device: torch.device | None = None,
        local_device: torch.device | str | None = None,
        ps_capacity: int | Mapping[str, int] | None = None,
        ps_backing: Mapping[str, int] | None = None,
        ps_store_dir: str | None = None,
        ps_init: Any = None,
        seed: int = 0,
        is_weighted: bool = False,
        keep_order: bool = True,
    ) -> None:
        super().__init__()
        if not tables:
            raise PlannerError("HybridEmbeddingBagCollection needs at least one table")
        mean = [c.name for c in tables if c.pooling == PoolingType.MEAN]
        if is_weighted and mean:
            # torch's EmbeddingBag (what TorchRec's weighted EBC runs) defines per-sample weights for sum alone.
            raise PlannerError(
                f"tables {mean[:3]} use mean pooling, but weighted features are defined for sum pooling only",
                fixes=("use PoolingType.SUM for weighted features", "is_weighted=False"),
            )
        if staleness < 0:
            raise PlannerError(f"staleness must be >= 0, got {staleness}", fixes=("use 0 for synchronous training",))
        names = [c.name for c in tables]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:  # a ValueError, as TorchRec's collection raises
            raise ValueError(f"HybridEmbeddingBagCollection: table name {duplicate!r} is used twice")
        self._is_weighted = bool(is_weighted)
        self.keep_order = bool(keep_order)
        self._configs = list(tables)
        self.optimizer = optimizer or SparseOptimizer()
        unknown = sorted(set(table_optimizers or {}) - set(names))
        if unknown:
            raise PlannerError(f"table_optimizers names {unknown[:3]}, which are not tables of the collection")
        self.table_optimizers = {n: (table_optimizers or {}).get(n, self.optimizer) for n in names}
        self.max_staleness = int(staleness)
        self.device = torch.device(device) if device is not None else torch.get_default_device()
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
                fixes=("pass ps=connect(...) (persia_planner.modules.ps.client)", "plan without a ps tier"),
            )
        self.ps = ps if self.ps_tables else None
        # TorchRec's output keys: a feature's name, or "feature@table" where the feature feeds several tables.
        names_by_table = dict(zip(names, get_embedding_names_by_table(self._configs), strict=True))
        self._features = [n for c in self._configs for n in names_by_table[c.name]]
        self._dims = [c.embedding_dim for c in self._configs for _ in c.feature_names]
        self._inputs = list(dict.fromkeys(f for c in self._configs for f in c.feature_names))
        # The local collection names its keys among its own tables: a feature it shares with a PS table is "f" there.
        own = get_embedding_names_by_table(self.local_tables) if self.local_tables else []
        renames = [
            (mine, names_by_table[c.name][k])
            for c, theirs in zip(self.local_tables, own, strict=True)
            for k, mine in enumerate(theirs)
        ]
        # None to rename, usually: the join then skips the renaming (it runs every step).
        self._renames = renames if any(mine != theirs for mine, theirs in renames) else []
        self.local: LocalEmbeddingBags | None = None
        if self.local_tables:
            for c in self.local_tables:  # refuses what fbgemm's fused kernels lack, now
                self.table_optimizers[c.name].fbgemm(self.device.type == "cuda")
            built_on = torch.device(local_device) if local_device is not None else self.device
            self.local = LocalEmbeddingBags(self.local_tables, is_weighted=is_weighted, device=built_on, seed=seed)
        self.remote: RemoteEmbeddingBags | None = None
        if self.ps is not None:
            group = process_group
            if group is None and dist.is_available() and dist.is_initialized():
                group = dist.new_group(backend="gloo")  # ids and gradients of the K = 0 update live on CPU
            self.remote = RemoteEmbeddingBags(
                self.ps_tables,
                self.ps,
                optimizer={c.name: self.table_optimizers[c.name].ps() for c in self.ps_tables},
                staleness=staleness,
                process_group=group,
                device=self.device,
                capacity=ps_capacity,
                stores={c.name: placements[c.name].tier.spec.store for c in self.ps_tables},
                backing=ps_backing,
                store_dir=ps_store_dir,
                init=ps_init,
                seed=seed,
                is_weighted=is_weighted,
                check=self._check_batch,
                output_names={c.name: names_by_table[c.name] for c in self.ps_tables},
            )
        # TorchRec's state_dict keys, embedding_bags.<table>.weight, for every table: local ones wherever they are
        # held, PS ones read from (and loaded into) the servers.
        self.ps_rows_in_state_dict = True
        self.register_state_dict_post_hook(torchrec_keys)
        self.register_load_state_dict_pre_hook(own_keys)

    # ---- TorchRec's interface ------------------------------------------------------------------------------------

    # Properties TorchScript must not compile (they read the servers' client or the sharded module).
    __jit_unused_properties__ = (
        "embedding_bags",
        "staleness",
        "staleness_max_seen",
        "pending_pushes",
        "fused_optimizer",
    )

    def is_weighted(self) -> bool:
        """Whether rows are pooled with the batch's per-id weights (``EmbeddingBagCollection.is_weighted()``)."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, as ``EmbeddingBagCollection.embedding_bag_configs()`` (TorchRec models read them)."""
        return list(self._configs)

    @property
    def embedding_bags(self) -> nn.ModuleDict:
        """The local tables by name, as ``EmbeddingBagCollection.embedding_bags`` (each with its ``weight``;
        TorchRec's sharded holders once DMP sharded them). The parameter-server tables are not modules here: their
        rows live on the servers."""
        if self.local is None:
            return nn.ModuleDict()
        return self.local.ebc.embedding_bags

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """TorchRec's ``KeyedOptimizer`` of every table whose optimizer is not the caller's: the local tables' fused
        (fbgemm) optimizers once DMP sharded them, and the PS tables' (one param group per table,
        :class:`~.ps_optimizer.PsTableOptimizer`), under TorchRec's keys ``embedding_bags.<table>.weight``. DMP
        collects it into ``dmp.fused_optimizer`` (the collection is a ``FusedOptimizerModule``), so an LR scheduler
        over that optimizer, or a param group's ``lr`` set by hand, moves local and PS tables alike from the next
        training forward on; its ``state_dict()`` reads the PS tables' optimizer state from the servers. Unsharded
        local tables are plain parameters, trained by the caller's optimizer, and not in it."""
        parts: list[tuple[str, KeyedOptimizer]] = []
        if self.local is not None and self.local.sharded:
            parts.append(("", self.local.ebc.fused_optimizer))
        if self.remote is not None:
            parts.append(("", self.remote.optimizer))
        return CombinedOptimizer(parts)

    @contextlib.contextmanager
    def ps_rows_left_out(self) -> Iterator[None]:
        """In the block, ``state_dict()`` leaves the PS tables out (it reads every row of them from the servers
        otherwise, as TorchRec's full tables): for the dense state, or checkpoints that save the servers' own way."""
        before, self.ps_rows_in_state_dict = self.ps_rows_in_state_dict, False
        try:
            yield
        finally:
            self.ps_rows_in_state_dict = before

    def reset_parameters(self) -> None:
        """The local tables' initialisation again (TorchRec's default, seeded); the servers initialise a PS row when
        its id is first seen."""
        if self.local is not None:
            self.local.reset_parameters()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``features``: a ``KeyedTensor`` with one ``[B, dim]`` value per feature (per
        ``feature@table`` where a feature feeds several tables)."""
        if torch.jit.is_scripting():  # the local tables alone: the servers' tables answer over RPC, in Python
            return self._local_only(features)
        return self._forward_python(features)

    @torch.jit.unused
    def _forward_python(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if not is_fx_symbolic_tracing():
            self._check_batch(features)
            if self.training and self.local is not None and self.local.sharded:
                # fbgemm takes its fused optimizers' param-group rates when they zero_grad() (only that): the local
                # tables follow a schedule from this forward on, as the PS tables' pushes do, whether or not the
                # caller steps the fused optimizer.
                self.local.ebc.fused_optimizer.zero_grad()
        # Traced, the PS tables are one call of their module (a leaf of TorchRec's pipeline tracer, which leaves every
        # module without a sharded one inside untraced) and the join one call of a wrapped function.
        local = self.local(features) if self.local is not None else None
        pooled = self.remote(features) if self.remote is not None else None
        return join_pooled(local, pooled, self._features, self._dims, self._renames, self.keep_order)

    def _local_only(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self.remote is not None or self.local is None:
            _refuse_scripting()
        assert self.local is not None  # TorchScript refines the Optional here
        return self.local(features)

    # ---- the PS step protocol --------------------------------------------------------------------------------------

    def prefetch(self, features: KeyedJaggedTensor, *, block: bool = True) -> bool:
        """Request the PS rows of a coming batch now (see :meth:`.remote.RemoteEmbeddingBags.prefetch`).

        Returns:
            True if the request was sent (or there are no PS tables), False if ``block=False`` and it would wait.
        """
        return True if self.remote is None else self.remote.prefetch(features, block=block)

    def ps_time_ms(self) -> dict[str, float]:
        """Milliseconds spent so far waiting on the parameter servers and sending pushes, by label
        (:data:`persia_planner.modules.step_breakdown.PS_WAIT`, :data:`persia_planner.modules.step_breakdown.PS_PUSH`);
        empty without PS tables."""
        return self.remote.stopwatch.snapshot() if self.remote is not None else {}

    def flush(self) -> None:
        """Wait until every PS gradient push was acknowledged (with K = 0 and several trainers: a collective)."""
        if self.remote is not None:
            self.remote.flush()

    @property
    def staleness(self) -> int:
        """How many earlier batches had unacknowledged pushes when the current batch's PS rows were requested."""
        return self.remote.staleness if self.remote is not None else 0

    @property
    def staleness_max_seen(self) -> int:
        return self.remote.staleness_max_seen if self.remote is not None else 0

    @property
    def pending_pushes(self) -> int:
        """Batches whose gradient pushes are not acknowledged yet."""
        return self.remote.pending_pushes if self.remote is not None else 0

    # ---- local tables' state ------------------------------------------------------------------------------------

    def local_weights(self, dst: int | None = None) -> dict[str, torch.Tensor]:
        """The local tables' full weights, by table name (a collective once sharded; ``dst``: only that trainer
        gets them, the others ``{}``)."""
        if self.local is None:
            return {}
        return {k.split(".")[-2]: v for k, v in self.local.torchrec_state_dict(dst).items()}

    def load_local_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy ``weights`` (table name -> ``[rows, dim]``) into the local tables (e.g. from a checkpoint)."""
        names = {c.name for c in self.local_tables}
        unknown = sorted(set(weights) - names)
        if unknown:
            raise PlannerError(f"load_local_weights: {unknown[0]!r} is not a local table; local: {sorted(names)}")
        if self.local is not None:
            state = {f"embedding_bags.{k}.weight": v for k, v in weights.items()}
            self.local.load_torchrec_state_dict(state, strict=False)

    @torch.jit.unused
    def _check_batch(self, features: KeyedJaggedTensor) -> None:
        """One-line errors for a batch that lacks a feature of the tables or whose parts disagree."""
        present = set(features.keys())
        missing = [f for f in self._inputs if f not in present]
        if missing:
            raise PlannerError(
                f"features {missing[:3]} of the embedding tables are not keys of the KeyedJaggedTensor "
                f"(it has {list(features.keys())[:5]}...)",
                fixes=("build the batch with every feature of the tables",),
            )
        _check_kjt(features, weighted=self._is_weighted)


def _check_kjt(features: KeyedJaggedTensor, *, weighted: bool = False) -> None:
    """One-line errors for a KeyedJaggedTensor whose parts disagree (fbgemm and the PS would read past its ids), or
    that lacks the per-id weights a weighted collection pools with."""
    values, lengths = features.values(), features.lengths()
    if values.device.type == "meta":  # shapes only: nothing to read
        return
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
            fixes=("build it with weights= (one float per id)", "construct the collection with is_weighted=False"),
        )
    if not weights.is_floating_point() or tuple(weights.shape) != (values.numel(),):
        raise PlannerError(
            f"KeyedJaggedTensor weights are {weights.dtype} {tuple(weights.shape)}, expected floating point "
            f"[{values.numel()}] (one per id)",
            fixes=("give one float weight per value",),
        )


@torch.jit.unused
def _refuse_scripting() -> None:
    raise PlannerError(
        "HybridEmbeddingBagCollection with parameter-server tables cannot be scripted: their rows come over RPC",
        fixes=("script a collection of local tables", "fx-trace it instead (the PS tables stay one module call)"),
    )


@torch.fx.wrap
def join_pooled(
    local: KeyedTensor | None,
    pooled: dict[str, torch.Tensor] | None,
    keys: list[str],
    dims: list[int],
    local_keys: list[tuple[str, str]],
    keep_order: bool,
) -> KeyedTensor:
    """The collection's ``KeyedTensor`` from the local tables' (TorchRec's, grouped by rank once sharded) and the PS
    tables' pooled embeddings (by key), with TorchRec's ``keys`` and ``dims`` (config order) and the local
    collection's own key names mapped to them (``local_keys``: the renames, empty where there are none); without
    ``keep_order`` one concatenation at most, the keys as the engines give them. One call in a traced graph,
    scriptable."""
    if local is not None and len(local_keys) > 0:
        renames: dict[str, str] = {}
        for mine, theirs in local_keys:
            renames[mine] = theirs
        local = KeyedTensor(
            keys=[renames[k] for k in local.keys()],  # noqa: SIM118  (a KeyedTensor is no dict)
            length_per_key=local.length_per_key(),
            values=local.values(),
            key_dim=1,
        )
    pooled_keys: list[str] = []
    pooled_values: list[torch.Tensor] = []
    if pooled is not None:
        for key, value in pooled.items():
            pooled_keys.append(key)
            pooled_values.append(value)
    if not keep_order:
        if len(pooled_keys) == 0:
            assert local is not None
            return local
        local_keys_out: list[str] = []
        local_dims: list[int] = []
        values: list[torch.Tensor] = []
        if local is not None:
            local_keys_out, local_dims, values = local.keys(), local.length_per_key(), [local.values()]
        return KeyedTensor(
            keys=local_keys_out + pooled_keys,
            length_per_key=local_dims + [v.shape[1] for v in pooled_values],
            values=torch.cat(values + pooled_values, dim=1),
            key_dim=1,
        )
    parts: list[KeyedTensor] = []
    if local is not None:
        parts.append(local)
    if len(pooled_keys) > 0:
        widths = [v.shape[1] for v in pooled_values]
        parts.append(KeyedTensor(keys=pooled_keys, length_per_key=widths, values=torch.cat(pooled_values, dim=1)))
    if len(parts) == 1 and parts[0].keys() == keys:
        joined = parts[0].values()
    else:  # TorchRec's output is grouped by rank: one regroup (fbgemm's permute) puts every key in config order
        joined = KeyedTensor.regroup(parts, [keys])[0]
    return KeyedTensor(keys=list(keys), length_per_key=list(dims), values=joined, key_dim=1)


def _placements_of(
    plan: Plan | Mapping[str, TablePlacement] | None, configs: Sequence[EmbeddingBagConfig]
) -> dict[str, TablePlacement | None]:
    if plan is None:
        return {c.name: None for c in configs}
    tables = plan.tables if isinstance(plan, Plan) else plan
    require_same_tables(tables, (c.name for c in configs), holder="the collection")
    return {c.name: tables[c.name] for c in configs}


# fx writes a traced graph's signature from forward's annotations, which `from __future__ import annotations` leaves
# as strings that TorchScript cannot resolve in the generated code: the classes themselves.
HybridEmbeddingBagCollection.forward.__annotations__.update(features=KeyedJaggedTensor, **{"return": KeyedTensor})
