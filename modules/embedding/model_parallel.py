"""Shard a model holding a :class:`~.hybrid.HybridEmbeddingBagCollection` as its plan says, and report what runs.

:func:`distribute` hands the model to TorchRec's ``DistributedModelParallel`` with the plan's exported
``ShardingPlan`` (:func:`persia_planner.plan.torchrec_export.to_sharding_plan`) for the collection's local tables,
the collection's sharder (:class:`~.sharder.HybridEmbeddingBagCollectionSharder`: TorchRec's
``EmbeddingBagCollectionSharder`` with the sparse optimizer fused into fbgemm), and DMP's DDP around the dense
part, as a TorchRec user would write it. :func:`executed_plan` reads back, from the built modules, how every table
runs, in the terms of :func:`persia_planner.plan.executability.planned_execution`, so a run can show that it executed
its plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from persia_planner.errors import PlannerError
from persia_planner.model.qcomms import QComms
from persia_planner.model.specs import DType, ModelSpec, Optimizer
from persia_planner.modules.embedding.hybrid_tables import HybridTables, managed_collisions_refused
from persia_planner.modules.embedding.row_decay import decay_before_step
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.executability import check_executable
from persia_planner.plan.torchrec_export import to_sharding_plan, torch_optimizer
from persia_planner.topology.graph import Topology

__all__ = [
    "check_trainers",
    "compress_dense_gradients",
    "data_parallel_tables",
    "dense_all_reduce_dtype",
    "dense_parameters",
    "distribute",
    "executed_plan",
    "hybrid_of",
    "hybrids_of",
    "qcomm_codecs",
    "quiet_trainer",
    "sparse_torch_optimizer",
]


def hybrids_of(model: nn.Module) -> list[tuple[str, HybridTables]]:
    """The model's hybrid collections (:class:`~.hybrid.HybridEmbeddingBagCollection`,
    :class:`~.sequence_hybrid.HybridEmbeddingCollection`)
    with their paths (DMP or DDP wrappers looked through), at most one of each kind.

    Raises:
        PlannerError: None, two of a kind, or one inside TorchRec's managed-collision wrapper (see
            :func:`~.hybrid_tables.managed_collisions_refused`).
    """
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    found = [(p, m) for p, m in model.named_modules() if isinstance(m, HybridTables)]
    wrapped = [p for p, m in model.named_modules() if isinstance(m, BaseManagedCollisionEmbeddingCollection)]
    for path, m in found:
        if any(path.startswith(f"{w}.") for w in wrapped):
            raise managed_collisions_refused(type(m).__name__)
    kinds = [type(m).__name__ for _, m in found]
    twice = next((k for k in kinds if kinds.count(k) > 1), None)
    if not found or twice is not None:
        held = f"{kinds.count(twice)} {twice}s" if twice else "none"
        raise PlannerError(
            "the model must hold one HybridEmbeddingBagCollection and/or one HybridEmbeddingCollection, it holds "
            + held,
            fixes=("hold every table of a kind in one collection",),
        )
    return found


def hybrid_of(model: nn.Module) -> tuple[str, HybridTables]:
    """The model's one hybrid collection and its path (DMP or DDP wrappers looked through).

    Raises:
        PlannerError: None or several.
    """
    found = hybrids_of(model)
    if len(found) != 1:
        raise PlannerError(f"the model must hold exactly one hybrid collection, it holds {len(found)}")
    return found[0]


def quiet_trainer() -> None:
    """Silence what torch, TorchRec and fbgemm print in every trainer at every run and that says nothing to a user:
    gloo-group deprecations, fx-tracing notes, TorchRec's DDP arguments and its per data-parallel table "caching
    params will be ignored", fbgemm's dense kernel's autograd registration."""
    import logging
    import warnings

    for message in ("You are using a Backend", ".*broadcast_buffers", ".*autograd kernel was not registered"):
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger("torchrec").setLevel(logging.ERROR)


def check_trainers(trainers: int, topology: Topology) -> None:
    """The trainers must be the topology's trainer devices: rank ``r`` runs what the plan put on ``gpus[r]``
    (under torchrun, :func:`persia_planner.topology.torchrun_nodes.process_role` checks the world instead).

    Args:
        trainers: The trainer count.
        topology: The plan's topology.

    Raises:
        PlannerError: Another count, naming both and the fix.
    """
    devices = len(topology.gpus)
    if trainers == devices:
        return
    raise PlannerError(
        f"--trainers is {trainers} but topology {topology.name!r} has {devices} trainer devices (the plan's ranks)",
        fixes=(f"use --trainers {devices}", "plan for a topology with one device per trainer"),
    )


def distribute(
    model: nn.Module,
    tables: Mapping[str, TablePlacement],
    topology: Topology,
    *,
    device: torch.device | None = None,
    process_group: Any = None,
    qcomms: QComms | None = None,
) -> nn.Module:
    """``DistributedModelParallel`` over ``model``: local tables sharded by the plan, dense part under DDP.

    Rank ``r`` of the trainers' group is ``topology.gpus[r]``, as in the plan. After sharding, the local tables are
    initialised as the unsharded collection would be (the same full tables on every trainer, sliced to its shards).

    Args:
        model: The model (any ``nn.Module`` holding one :class:`~.hybrid.HybridEmbeddingBagCollection` and/or one
            :class:`~.sequence_hybrid.HybridEmbeddingCollection`).
        tables: The plan's placements of the collection's tables.
        topology: The topology the plan was made for.
        device: This trainer's device (default CPU).
        process_group: The trainers' group (default: the default group).
        qcomms: The precisions of the trainers' collectives, as the plan records them (None: float32): the local
            tables' all-to-alls through TorchRec's quantized-communication codecs, the dense gradients' all-reduce
            through torch's fp16 / bf16 DDP compression hook.

    Returns:
        The ``DistributedModelParallel`` module (call it as the model).

    Raises:
        PlannerError: The group's size is not the topology's trainer count, a placement TorchRec cannot express,
            or one it would not run as written on ``device`` (see
            :func:`persia_planner.plan.executability.check_executable`).
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from persia_planner.modules.embedding.sharder import (
        HybridEmbeddingBagCollectionSharder,
        HybridEmbeddingCollectionSharder,
    )

    device = device or torch.device("cpu")
    group = process_group or dist.GroupMember.WORLD
    check_trainers(dist.get_world_size(group), topology)
    found = hybrids_of(model)
    bags = next((p for p, m in found if m.POOLED), None)
    sequences = next((p for p, m in found if not m.POOLED), None)
    # Table shapes and dtype come from the collections themselves: the plan must be the one made for them.
    spec = ModelSpec.from_torchrec([c for _, m in found for c in m.table_configs()], batch_size=1)
    optimizer = found[0][1].optimizer.kind
    check_executable(tables, device.type, dtype=spec.table_dtypes, optimizer=optimizer, qcomms=qcomms)
    sharding_plan = to_sharding_plan(
        tables, spec, topology, module_path=bags, sequence_module_path=sequences, device_type=device.type
    )
    # As a TorchRec user shards their own model: each collection's sharder takes its entry of the plan.
    codecs = qcomm_codecs(qcomms, device)
    sharders = [HybridEmbeddingBagCollectionSharder(qcomm_codecs_registry=codecs)]
    sharders.append(HybridEmbeddingCollectionSharder(qcomm_codecs_registry=codecs))  # type: ignore[arg-type]
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(group), device=device, plan=sharding_plan, sharders=sharders
    )
    if qcomms is not None and qcomms.backward is not DType.FP32:
        compress_dense_gradients(dmp, qcomms.backward, group)
    return dmp


def qcomm_codecs(qcomms: QComms | None, device: torch.device) -> dict[str, Any] | None:
    """TorchRec's codecs of the local tables' all-to-alls and reduce-scatters in ``qcomms`` (None: float32)."""
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    if qcomms is None or not qcomms.quantized:
        return None
    config = QCommsConfig(
        forward_precision=CommType(qcomms.forward.value), backward_precision=CommType(qcomms.backward.value)
    )
    return get_qcomm_codecs_registry(config, device=device)


def compress_dense_gradients(dmp: nn.Module, dtype: DType, group: Any) -> None:
    """Register torch's ``dtype`` compression hook on DMP's DDP around the dense part (the outermost DDP: the
    data-parallel tables' replicas keep their own), and mark it (:func:`dense_all_reduce_dtype`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = _dense_ddp(dmp)
    if ddp is None:  # no dense parameter: nothing is all-reduced
        return
    hook = default_hooks.fp16_compress_hook if dtype is DType.FP16 else default_hooks.bf16_compress_hook
    ddp.register_comm_hook(group, hook)
    ddp.persia_all_reduce_dtype = dtype.torch_name


def dense_all_reduce_dtype(dmp: nn.Module) -> str | None:
    """The torch dtype DMP's DDP all-reduces the dense gradients in (None: no DDP, nothing all-reduced)."""
    ddp = _dense_ddp(dmp)
    return None if ddp is None else getattr(ddp, "persia_all_reduce_dtype", "float32")


def _dense_ddp(dmp: nn.Module) -> nn.Module | None:
    """DMP's DDP around the dense part: the outermost one (modules() walks pre-order; replicas' own DDPs are inside)."""
    from torch.nn.parallel import DistributedDataParallel

    return next((m for m in dmp.modules() if isinstance(m, DistributedDataParallel)), None)


def data_parallel_tables(model: nn.Module) -> dict[str, nn.Parameter]:
    """Weights of local tables outside fbgemm's fused optimizers (data-parallel replicas; every table before
    sharding), by parameter name: TorchRec leaves their optimizer to the caller."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    replicas: dict[str, nn.Parameter] = {}
    for _, hybrid in hybrids_of(model):
        if hybrid.local is not None:
            replicas |= dict(in_backward_optimizer_filter(hybrid.local.named_parameters()))
    return replicas


def dense_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every trainable parameter outside the model's embedding collection (for the dense optimizer)."""
    sparse = {id(p) for _, hybrid in hybrids_of(model) for p in hybrid.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) not in sparse and p.requires_grad}


def sparse_torch_optimizer(
    kind: Optimizer, params: list[nn.Parameter], *, lr: float, eps: float, weight_decay: float = 0.0
) -> Any:
    """The sparse optimizer as a ``torch.optim`` optimizer
    (:func:`persia_planner.plan.torchrec_export.torch_optimizer`), for tables outside fbgemm's fused kernels
    (data-parallel replicas), with the collection's decoupled ``weight_decay`` on the rows each step updates
    (:func:`.row_decay.decay_before_step`)."""
    extra = {} if kind is Optimizer.SGD else {"eps": eps}
    optimizer = torch_optimizer(kind)(params, lr=lr, **extra)
    decay_before_step(optimizer, weight_decay)
    return optimizer


def executed_plan(model: nn.Module, topology: Topology | None = None) -> dict[str, dict[str, Any]]:
    """How every table of the model's collection runs, read from the built modules (a collective when sharded).

    Args:
        model: The model (DMP-wrapped or not).
        topology: The plan's topology: server ``i`` of the client is reported as its ``i``-th parameter-server
            host (plan.json's name); without it, or with another server count, as the RPC name ``ps{i}``.

    Returns:
        ``{table: {"sharding", "kernel", "ranks"}}`` for local tables and ``{table: {"servers": [...]}}`` for the
        parameter-server ones (the servers the client spreads the table over).
    """
    out: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    for _, hybrid in hybrids_of(model):
        order += [c.name for c in hybrid.table_configs()]
        if hybrid.local is not None:
            out.update({name: table.to_dict() for name, table in hybrid.local.executed().items()})
        if hybrid.ps is not None:
            servers = list(hybrid.ps.servers)
            if topology is not None and len(topology.servers) == len(servers):
                servers = [host.name for host in topology.servers]
            servers = sorted(servers)
            out.update({c.name: {"servers": servers} for c in hybrid.ps_tables})
    return {name: out[name] for name in order}
