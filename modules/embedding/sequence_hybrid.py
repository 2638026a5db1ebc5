"""``HybridEmbeddingCollection``: a drop-in ``EmbeddingCollection`` (sequence features, one row per id) that executes
a plan, as :class:`~.hybrid.HybridEmbeddingBagCollection` does for pooled bags.

The local tables are a TorchRec ``EmbeddingCollection`` (:class:`~.local_sequences.LocalEmbeddings`) that
``DistributedModelParallel`` shards with TorchRec's ``EmbeddingCollectionSharder`` and the plan's exported
``ShardingPlan`` (table-wise, row-wise, column-wise, data-parallel), trained **synchronously**; the ``ps`` tables are
looked up and updated on the parameter servers with the same bounded staleness ``K`` as bags
(:class:`~.remote.RemoteEmbeddingBags` without pooling: every id's row, each distinct id requested and pushed once per
batch), trained **asynchronously**. The output is TorchRec's: a ``JaggedTensor`` per feature whose values are its
ids' rows ``[ids, dim]`` (float32) and whose lengths are the samples'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollectionInterface
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from persia_planner.errors import PlannerError
from persia_planner.modules.embedding.hybrid_tables import HybridTables
from persia_planner.modules.embedding.local import LocalEmbeddingBags
from persia_planner.modules.embedding.local_sequences import LocalEmbeddings
from persia_planner.modules.embedding.sparse_optimizer import SparseOptimizer
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from persia_planner.modules.ps.client import PsClient

__all__ = ["HybridEmbeddingCollection", "join_sequences"]


class HybridEmbeddingCollection(EmbeddingCollectionInterface, HybridTables, FusedOptimizerModule):
    """``EmbeddingCollection`` whose tables train where a plan put them: locally (sync) or on the PS (async).

    Same inputs and outputs as TorchRec's ``EmbeddingCollection``: a ``KeyedJaggedTensor`` in (keys in any order;
    unknown keys ignored), ``Dict[str, JaggedTensor]`` out, one per feature (``feature@table`` where a feature feeds
    several tables), in table order. Shard a model holding it with
    :func:`~persia_planner.modules.embedding.model_parallel.distribute`. The PS step protocol (``prefetch``,
    ``flush``, ``staleness``), ``fused_optimizer`` and the weights' methods are those of
    :class:`~.hybrid.HybridEmbeddingBagCollection`, whose docstring describes the arguments they share.

    Args:
        tables: The tables, as for ``EmbeddingCollection`` (``EmbeddingConfig``, one ``embedding_dim`` for all).
        plan: A plan (or its ``tables`` mapping) placing every table; ``None`` keeps every table local.
        ps: Client of the parameter servers; required when the plan puts any table on the ``ps`` tier.
        optimizer: Sparse optimizer of every table.
        table_optimizers: Per table name, its own sparse optimizer.
        staleness: Bounded staleness ``K`` of the PS tables (0 = synchronous).
        process_group: Group of the trainers for the PS tables' synchronous updates.
        device: The collection's device (where the unsharded local tables are built and PS rows are returned).
        local_device: Where the unsharded local collection is built, when not ``device``.
        ps_capacity: Rows per server and PS table (see the bag collection).
        ps_backing: Per PS table on a tier with a cache, the rows of its backing memory.
        ps_store_dir: Where the servers put their stores' files.
        ps_init: Initialiser of new PS rows.
        seed: Seed of the local tables' initialisation and of the PS tables' row initialisers.
        need_indices: Give each output ``JaggedTensor`` the feature's ids as its ``weights`` (TorchRec's
            ``need_indices``).

    Raises:
        ValueError: Tables of different dims, or a name used twice (as TorchRec's collection raises).
        PlannerError: See :class:`~.hybrid_tables.HybridTables`.
    """

    POOLED: ClassVar[bool] = False
    KEY_PREFIX: ClassVar[str] = "embeddings"
    LOCAL: ClassVar[type[LocalEmbeddingBags]] = LocalEmbeddings

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
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
        need_indices: bool = False,
    ) -> None:
        pooled = [c.name for c in tables if hasattr(c, "pooling")]
        if pooled:
            raise PlannerError(
                f"tables {pooled[:3]} are EmbeddingBagConfig (pooled bags); an EmbeddingCollection takes "
                "EmbeddingConfig",
                fixes=("use HybridEmbeddingBagCollection for pooled tables",),
            )
        dims = sorted({c.embedding_dim for c in tables})
        if len(dims) > 1:  # TorchRec's EmbeddingCollection raises the same
            raise ValueError(f"HybridEmbeddingCollection: all tables must have one embedding_dim, got {dims}")
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
        )
        self._need_indices = bool(need_indices)
        self._embedding_dim = dims[0] if dims else -1
        self._keys = [n for c in self._configs for n in self.names_by_table[c.name]]
        # Which input feature each output key reads (its indices, with need_indices).
        self._feature_of = {
            n: f for c in self._configs for f, n in zip(c.feature_names, self.names_by_table[c.name], strict=True)
        }

    # ---- TorchRec's interface ------------------------------------------------------------------------------------

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The table configs, as ``EmbeddingCollection.embedding_configs()``."""
        return list(self._configs)

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        """The tables' one embedding dim."""
        return self._embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        """Each table's output keys, as ``EmbeddingCollection.embedding_names_by_table()``."""
        return [list(self.names_by_table[c.name]) for c in self._configs]

    @property
    def embeddings(self) -> nn.ModuleDict:
        """The local tables by name, as ``EmbeddingCollection.embeddings`` (TorchRec's sharded holders once DMP
        sharded them); the parameter-server tables' rows live on the servers."""
        if self.local is None:
            return nn.ModuleDict()
        return self.local.ec.embeddings

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Every id's row of ``features``, per feature: a ``JaggedTensor`` of ``[ids, dim]`` values."""
        if torch.jit.is_scripting():  # the local tables alone: the servers' tables answer over RPC, in Python
            return self._local_only(features)
        return self._forward_python(features)

    @torch.jit.unused
    def _forward_python(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if not is_fx_symbolic_tracing():
            self.check_batch(features)
            self.zero_fused_grads()
        local = self.local(features) if self.local is not None else None
        remote = self.remote(features) if self.remote is not None else None
        indices = features if self._need_indices else None
        return join_sequences(local, remote, self._keys, self.local_renames, self._feature_of, indices)

    def _local_only(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if self.remote is not None or self.local is None:
            _refuse_scripting()
        assert self.local is not None  # TorchScript refines the Optional here
        indices = features if self._need_indices else None
        return join_sequences(self.local(features), None, self._keys, self.local_renames, self._feature_of, indices)


@torch.jit.unused
def _refuse_scripting() -> None:
    raise PlannerError(
        "HybridEmbeddingCollection with parameter-server tables cannot be scripted: their rows come over RPC",
        fixes=("script a collection of local tables", "fx-trace it instead (the PS tables stay one module call)"),
    )


@torch.fx.wrap
def join_sequences(
    local: dict[str, JaggedTensor] | None,
    remote: dict[str, JaggedTensor] | None,
    keys: list[str],
    local_keys: list[tuple[str, str]],
    feature_of: dict[str, str],
    indices: KeyedJaggedTensor | None,
) -> dict[str, JaggedTensor]:
    """The collection's outputs in its key order (``keys``) from the local tables' (their own names mapped by
    ``local_keys``) and the PS tables'; with ``indices``, each output carries its feature's ids as ``weights``, as
    TorchRec's ``need_indices`` does. One call in a traced graph."""
    renames: dict[str, str] = {}
    for mine, theirs in local_keys:
        renames[mine] = theirs
    found: dict[str, JaggedTensor] = {}
    if local is not None:
        for key, value in local.items():
            found[renames.get(key, key)] = value
    if remote is not None:
        for key, value in remote.items():
            found[key] = value
    out: dict[str, JaggedTensor] = {}
    for k in keys:
        value = found[k]
        if indices is not None:
            value = JaggedTensor(
                values=value.values(), lengths=value.lengths(), weights=indices[feature_of[k]].values()
            )
        out[k] = value
    return out


# TorchScript's types of what the scripted forward reads (an empty list's own would be unknown), as types: it does
# not evaluate the string annotations `from __future__ import annotations` leaves.
HybridEmbeddingCollection.__annotations__.update(
    _keys=list[str], local_renames=list[tuple[str, str]], _feature_of=dict[str, str]
)
# fx writes a traced graph's signature from forward's annotations (see hybrid.py).
HybridEmbeddingCollection.forward.__annotations__.update(
    features=KeyedJaggedTensor, **{"return": dict[str, JaggedTensor]}
)
