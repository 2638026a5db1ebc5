"""How a run must execute a plan, and what TorchRec or fbgemm would run differently (refused before training).

:func:`planned_execution` is the map a run compares with what it built (``modules/distributed.executed_plan``);
:func:`check_executable` refuses, before any process starts, a plan that TorchRec or fbgemm would silently run
differently on the trainers' devices. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.kinds import Sharding
from persia_planner.model.pooling import sequence_shardings
from persia_planner.model.qcomms import FP32_COMMS, QComms
from persia_planner.model.specs import DType, ModelSpec, Optimizer
from persia_planner.plan.torchrec_export import PlanLike, tables_of, torchrec_shardings
from persia_planner.topology.graph import Topology

__all__ = ["check_executable", "planned_execution"]


def planned_execution(plan: PlanLike, model: ModelSpec, topology: Topology) -> dict[str, dict[str, Any]]:
    """How a run must execute ``plan``, table by table, in the terms a run reports what it executed.

    Returns:
        ``{table: {"sharding", "kernel", "ranks", "dtype", "comms"}}`` (TorchRec's sharding type, compute kernel,
        ranks in shard order, the weights' torch dtype and the ``{"forward", "backward"}`` torch dtypes its pooled
        output travels in: ``model.qcomms``, none for a data-parallel replica) for local tables,
        ``{table: {"servers": [...]}}`` for parameter-server tables, in model order.
    """
    dtypes = model.table_dtypes
    qcomms = model.qcomms or FP32_COMMS
    travels = {"forward": qcomms.forward.torch_name, "backward": qcomms.backward.torch_name}
    local = {
        e.table: {
            "sharding": e.sharding_type,
            "kernel": e.compute_kernel,
            "ranks": e.ranks,
            "dtype": dtypes[e.table].torch_name,
            **({"comms": travels} if e.sharding_type != Sharding.DATA_PARALLEL.value else {}),
        }
        for e in torchrec_shardings(plan, model, topology)
    }
    tables = tables_of(plan)
    out = {}
    for t in model.tables:
        if t.name in local:
            out[t.name] = local[t.name]
        else:
            out[t.name] = {"servers": sorted({s.device for s in tables[t.name].shards})}
    return out


def check_executable(
    plan: PlanLike,
    device_type: str,
    *,
    dtype: DType | Mapping[str, DType] = DType.FP32,
    optimizer: Optimizer = Optimizer.SGD,
    qcomms: QComms | None = None,
) -> None:
    """Refuse a plan that TorchRec and fbgemm would not run as written on trainers of ``device_type``.

    - On CPU TorchRec runs the ``fused_uvm`` and ``fused_uvm_caching`` kernels (tiers ``ddr``, ``hbm_cache``) as
      plain host memory with the ``fused`` kernel: the plan would be silently changed.
    - fbgemm's CPU kernels have no bfloat16 tables, and no fused Adam.
    - Data-parallel tables are not fused: TorchRec leaves them to a ``torch.optim`` optimizer, whose state has the
      weights' dtype; an Adagrad-type or Adam state in fp16/bf16 underflows and the run diverges.
    - fbgemm's CPU dense kernel pools a data-parallel sequence table's rows (``sequence_shardings``).
    - gloo has no bf16 collectives: TorchRec's codecs would fall back to fp16 and torch's bf16 DDP hook refuses.

    Args:
        plan: The plan (or its ``tables``).
        device_type: ``cpu`` or ``cuda``.
        dtype: The tables' weight dtype: one for all, or one per table name (:attr:`.ModelSpec.table_dtypes`).
        optimizer: The sparse optimizer of the local tables.
        qcomms: The precisions of the trainers' collectives (None: float32).

    Raises:
        PlannerError: Kind ``unsupported``, naming the first such table and the fix.
    """
    local = {name: p for name, p in tables_of(plan).items() if p.sharding is not Sharding.PS_HASH}
    if device_type != "cuda" and qcomms is not None and DType.BF16 in (qcomms.forward, qcomms.backward):
        raise PlannerError(
            f"the plan's collectives run in {qcomms}, and gloo (CPU trainers) has no bfloat16 collectives",
            kind=ErrorKind.UNSUPPORTED,
            fixes=("plan with 'persia plan --qcomms fp16' (or auto, which narrows to fp16 on CPU)", "train on GPUs"),
        )
    for name, p in local.items():
        if p.sequence and p.sharding not in sequence_shardings(cpu=device_type != "cuda"):
            raise PlannerError(
                f"table {name!r} is a sequence table planned {p.sharding.value}, and fbgemm's CPU dense kernel "
                "pools a data-parallel replica's rows (one per sample, not one per id)",
                kind=ErrorKind.UNSUPPORTED,
                fixes=("plan for these CPU trainers: persia plan leaves sequence tables off data_parallel there",
                       "train on GPUs"),
            )  # fmt: skip
        table_dtype = dtype.get(name, DType.FP32) if isinstance(dtype, Mapping) else dtype
        tiers = {s.tier for s in p.shards}
        bad = {t for t in tiers if t.spec.unified_memory}
        if device_type != "cuda" and bad:
            tier = sorted(bad)[0]
            raise PlannerError(
                f"table {name!r} is planned on tier {tier.value} (TorchRec kernel {tier.spec.torchrec_kernel}), which "
                "needs CUDA unified memory; these trainers have no GPU",
                kind=ErrorKind.UNSUPPORTED,
                fixes=(
                    "plan for CPU trainers without ddr/hbm_cache tiers (a topology whose devices hold the local "
                    "tables in hbm)",
                    "train on GPUs",
                ),
            )
        if device_type != "cuda" and table_dtype is DType.BF16:
            raise PlannerError(
                f"table {name!r}: fbgemm's CPU kernels have no bfloat16 tables (embedding_dtype: bf16)",
                kind=ErrorKind.UNSUPPORTED,
                fixes=("use embedding_dtype: fp16 or fp32", "train on GPUs"),
            )
        if device_type != "cuda" and optimizer is Optimizer.ADAM:  # HybridEmbeddingBagCollection refuses it too
            raise PlannerError(
                f"table {name!r} is a local table, and fbgemm's CPU kernels have no fused adam",
                kind=ErrorKind.UNSUPPORTED,
                fixes=("use the rowwise_adagrad, adagrad or sgd sparse optimizer", "train on GPUs"),
            )
        if p.sharding is Sharding.DATA_PARALLEL and table_dtype is not DType.FP32 and optimizer is not Optimizer.SGD:
            raise PlannerError(
                f"table {name!r} is data_parallel in {table_dtype.value}: TorchRec updates replicas with a torch.optim "
                f"{optimizer.value} whose state would be {table_dtype.value} too, and it underflows",
                kind=ErrorKind.UNSUPPORTED,
                fixes=(
                    "use embedding_dtype: fp32",
                    "plan the table with a fused sharding (table_wise, row_wise, ...)",
                    "use the sgd sparse optimizer",
                ),
            )
