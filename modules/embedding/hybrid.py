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

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from persia_planner.errors import PlannerError
from persia_planner.modules.embedding.hybrid_tables import HybridTables, managed_collisions_refused
from persia_planner.modules.embedding.remote import StalenessError
from persia_planner.modules.embedding.sparse_optimizer import SparseOptimizer
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from persia_planner.modules.ps.client import PsClient

__all__ = ["HybridEmbeddingBagCollection", "SparseOptimizer", "StalenessError"]


class HybridEmbeddingBagCollection(EmbeddingBagCollectionInterface, HybridTables, FusedOptimizerModule):
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
        sequences = [c.name for c in tables if not hasattr(c, "pooling")]
        if sequences:
            raise PlannerError(
                f"tables {sequences[:3]} are EmbeddingConfig (sequences, one row per id); an EmbeddingBagCollection "
                "pools EmbeddingBagConfig tables",
                fixes=("hold them in a HybridEmbeddingCollection (persia_planner.modules.embedding.sequence_hybrid)",),
            )
        mean = [c.name for c in tables if c.pooling == PoolingType.MEAN]
        if is_weighted and mean:
            # torch's EmbeddingBag (what TorchRec's weighted EBC runs) defines per-sample weights for sum alone.
            raise PlannerError(
                f"tables {mean[:3]} use mean pooling, but weighted features are defined for sum pooling only",
                fixes=("use PoolingType.SUM for weighted features", "is_weighted=False"),
            )
        super().__init__(
            tables,
            plan,
            ps=ps,
            optimizer=optimizer,
            table_optimizers=table_optimizers,
            staleness=staleness,
            process_group=process_group,
            device=device,
            local_device=local_device,
            ps_capacity=ps_capacity,
            ps_backing=ps_backing,
            ps_store_dir=ps_store_dir,
            ps_init=ps_init,
            seed=seed,
            is_weighted=is_weighted,
        )
        self.keep_order = bool(keep_order)
        names_by_table = self.names_by_table
        self._features = [n for c in self._configs for n in names_by_table[c.name]]
        self._dims = [c.embedding_dim for c in self._configs for _ in c.feature_names]

    # ---- TorchRec's interface ------------------------------------------------------------------------------------

    def is_weighted(self) -> bool:
        """Whether rows are pooled with the batch's per-id weights (``EmbeddingBagCollection.is_weighted()``)."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, as ``EmbeddingBagCollection.embedding_bag_configs()`` (TorchRec models read them)."""
        return list(self._configs)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """Refused: what TorchRec's managed-collision wrappers ask of a collection they do not know as their own.

        Raises:
            PlannerError: Always, in one line: the parameter-server tier already takes unbounded ids, and how a
                managed-collision config maps to a ``ps`` table.
        """
        raise managed_collisions_refused(type(self).__name__)

    @property
    def embedding_bags(self) -> nn.ModuleDict:
        """The local tables by name, as ``EmbeddingBagCollection.embedding_bags`` (each with its ``weight``;
        TorchRec's sharded holders once DMP sharded them). The parameter-server tables are not modules here: their
        rows live on the servers."""
        if self.local is None:
            return nn.ModuleDict()
        return self.local.ebc.embedding_bags

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``features``: a ``KeyedTensor`` with one ``[B, dim]`` value per feature (per
        ``feature@table`` where a feature feeds several tables)."""
        if torch.jit.is_scripting():  # the local tables alone: the servers' tables answer over RPC, in Python
            return self._local_only(features)
        return self._forward_python(features)

    @torch.jit.unused
    def _forward_python(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if not is_fx_symbolic_tracing():
            self.check_batch(features)
            self.zero_fused_grads()
        # Traced, the PS tables are one call of their module (a leaf of TorchRec's pipeline tracer, which leaves every
        # module without a sharded one inside untraced) and the join one call of a wrapped function.
        local = self.local(features) if self.local is not None else None
        pooled = self.remote(features) if self.remote is not None else None
        return join_pooled(local, pooled, self._features, self._dims, self.local_renames, self.keep_order)

    def _local_only(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self.remote is not None or self.local is None:
            _refuse_scripting()
        assert self.local is not None  # TorchScript refines the Optional here
        return self.local(features)


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


# fx writes a traced graph's signature from forward's annotations, which `from __future__ import annotations` leaves
# as strings that TorchScript cannot resolve in the generated code: the classes themselves.
HybridEmbeddingBagCollection.forward.__annotations__.update(features=KeyedJaggedTensor, **{"return": KeyedTensor})
