"""TorchRec's sharder protocol for :class:`~.hybrid.HybridEmbeddingBagCollection` and
:class:`~.sequence_hybrid.HybridEmbeddingCollection`.

``DistributedModelParallel(model, plan=to_sharding_plan(plan, model, topology),
sharders=[HybridEmbeddingBagCollectionSharder()])`` shards a user's own model as TorchRec users write it: the plan's
entry for the collection's path (:func:`persia_planner.plan.torchrec_export.to_sharding_plan` finds it) reaches
:meth:`HybridEmbeddingBagCollectionSharder.shard`, which shards the collection's local tables with TorchRec's own
``EmbeddingBagCollectionSharder`` (fbgemm's kernels with the collection's sparse optimizer fused in), gives them the
collection's seeded initialisation, and leaves the parameter-server tables where they are: on the servers, which
every trainer reaches through its client. DMP's DDP wraps the rest of the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import BaseEmbeddingSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, ShardingEnv

from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection
from persia_planner.modules.embedding.hybrid_tables import HybridTables
from persia_planner.modules.embedding.row_decay import decay_fused_rows
from persia_planner.modules.embedding.sequence_hybrid import HybridEmbeddingCollection

__all__ = ["HybridEmbeddingBagCollectionSharder", "HybridEmbeddingCollectionSharder", "shard_local"]


class HybridEmbeddingBagCollectionSharder(BaseEmbeddingSharder[HybridEmbeddingBagCollection]):
    """Shards a :class:`~.hybrid.HybridEmbeddingBagCollection` in ``DistributedModelParallel``.

    Args:
        fused_params: fbgemm's keyword arguments for the local tables (TorchRec's ``fused_params``); None: the
            collection's own sparse optimizers (:meth:`~.sparse_optimizer.SparseOptimizer.fbgemm`; a table of its
            ``table_optimizers`` gets its own, as TorchRec's per-parameter fused params), the ones its PS tables train
            with.
        qcomm_codecs_registry: TorchRec's quantized-communication codecs for the local tables' all-to-alls.
    """

    def __init__(self, fused_params: dict[str, Any] | None = None, qcomm_codecs_registry: Any = None) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)

    def shard(
        self,
        module: HybridEmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> HybridEmbeddingBagCollection:
        """Shard ``module``'s local tables as ``params`` says (in place); returns ``module``.

        Raises:
            PlannerError: A local table fbgemm's kernels cannot run, or an optimizer they lack on ``device``.
        """
        inner = EmbeddingBagCollectionSharder
        return shard_local(
            module, inner, self.fused_params, self.qcomm_codecs_registry, params, env, device, module_fqn
        )

    def shardable_parameters(self, module: HybridEmbeddingBagCollection) -> dict[str, nn.Parameter]:
        """The local tables' weights, by table name (what TorchRec's planner may shard)."""
        if module.local is None:
            return {}
        return EmbeddingBagCollectionSharder().shardable_parameters(module.local.ebc)

    @property
    def module_type(self) -> type[HybridEmbeddingBagCollection]:
        return HybridEmbeddingBagCollection


class HybridEmbeddingCollectionSharder(BaseEmbeddingSharder[HybridEmbeddingCollection]):
    """Shards a :class:`~.sequence_hybrid.HybridEmbeddingCollection` in ``DistributedModelParallel``: its local tables
    with TorchRec's ``EmbeddingCollectionSharder`` (and its sharding types), its PS tables left on the servers.

    Args:
        fused_params: fbgemm's keyword arguments for the local tables; None: the collection's own sparse optimizers.
        qcomm_codecs_registry: TorchRec's quantized-communication codecs for the local tables' all-to-alls.
    """

    def __init__(self, fused_params: dict[str, Any] | None = None, qcomm_codecs_registry: Any = None) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)

    def shard(
        self,
        module: HybridEmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> HybridEmbeddingCollection:
        """Shard ``module``'s local tables as ``params`` says (in place); returns ``module``.

        Raises:
            PlannerError: A local table fbgemm's kernels cannot run, or an optimizer they lack on ``device``.
        """
        inner = EmbeddingCollectionSharder
        return shard_local(
            module, inner, self.fused_params, self.qcomm_codecs_registry, params, env, device, module_fqn
        )

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TorchRec's ``EmbeddingCollectionSharder``'s: no table-row-wise or table-column-wise for sequences."""
        return EmbeddingCollectionSharder().sharding_types(compute_device_type)

    def shardable_parameters(self, module: HybridEmbeddingCollection) -> dict[str, nn.Parameter]:
        """The local tables' weights, by table name (what TorchRec's planner may shard)."""
        if module.local is None:
            return {}
        return EmbeddingCollectionSharder().shardable_parameters(module.local.ec)

    @property
    def module_type(self) -> type[HybridEmbeddingCollection]:
        return HybridEmbeddingCollection


def shard_local(
    module: HybridTables,
    inner_sharder: type[BaseEmbeddingSharder[Any]],
    fused_params: dict[str, Any] | None,
    qcomm_codecs_registry: Any,
    params: dict[str, ParameterSharding],
    env: ShardingEnv,
    device: torch.device | None,
    module_fqn: str | None,
) -> Any:
    """Shard the local tables of ``module`` (either hybrid collection) with TorchRec's ``inner_sharder`` of their
    collection, in place, with the collection's sparse optimizers fused in (``fused_params`` None) and its seeded
    initialisation; the PS tables stay on the servers. Returns ``module``.

    Raises:
        PlannerError: A local table fbgemm's kernels cannot run, or an optimizer they lack on ``device``.
    """
    local = module.local
    if local is None:  # every table is on the servers: nothing for DMP
        return module
    local.check_shardable()
    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    fused = fused_params if fused_params is not None else module.optimizer.fbgemm(cuda)
    tables = getattr(local.collection, module.KEY_PREFIX)  # TorchRec's ModuleDict of the tables
    for config in local.configs:  # per-table optimizers, as TorchRec's per-parameter fused params
        chosen = module.table_optimizers[config.name]
        if fused_params is None and chosen != module.optimizer:
            weight = tables[config.name].weight
            weight._optimizer_kwargs = [chosen.fbgemm(cuda)]  # type: ignore[attr-defined]
            weight._optimizer_classes = [None]  # type: ignore[attr-defined]
    inner = inner_sharder(fused_params=fused, qcomm_codecs_registry=qcomm_codecs_registry)
    own = f"local.{local.COLLECTION}"
    path = f"{module_fqn}.{own}" if module_fqn else own
    local.set_collection(inner.shard(local.collection, params, env, device, path))
    local.group = env.process_group
    # The same full tables on every trainer, sliced to its shards: as the unsharded collection starts.
    local.reset_parameters()
    # The servers' decay of the rows a step updates, on the fused tables too (fbgemm's CPU kernels have none).
    decay_fused_rows(local.tbes(), {c.name: module.table_optimizers[c.name].weight_decay for c in local.configs})
    return module
