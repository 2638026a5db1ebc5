"""Bytes per device as the planner charges them and as the built modules allocate them (issue 28).

The planner charges every device what its shards take (:func:`predicted_bytes`: ``CostModel.evaluate``'s memory
vector, from the layouts in :mod:`persia_planner.placement.memory`). :func:`allocated_bytes` builds the modules as
``persia train`` does (:func:`.train.build_model`, :func:`persia_planner.modules.embedding.model_parallel.distribute`,
:func:`.train.make_optimizer`) in trainer processes with fresh parameter servers beside them, and measures what they
hold:

* a trainer: the bytes of every tensor its local tables keep (:func:`rank_bytes`: weights, fbgemm's optimizer state
  and index buffers, the ``torch.optim`` state and gradients of data-parallel replicas), each storage once;
* a parameter server: how much its process's resident memory grows from before the tables were registered to after
  its stores were filled to their capacity (what a server under pressure holds, and what the plan charges), with
  the stores' own account of their arrays (``EmbeddingStore.resident_bytes``) beside it as a cross-check.

:func:`compare` pairs the two per device and :func:`memory_error` reduces a few configurations
(:func:`default_cases`) to the largest ``|predicted / allocated - 1|``, the ``memory_max_abs_error`` of
``benchmarks/cost_model.py``. Everything runs on CPU (gloo), so the local tables are the ``hbm`` tier of CPU trainer
devices; the ``ddr`` and ``hbm_cache`` tiers need CUDA and are checked against fbgemm's own layout code in
``tests/test_memory.py`` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Mode, Sharding
from persia_planner.model.specs import DType, ModelSpec, Optimizer, TableSpec
from persia_planner.placement.memory import ps_server_capacity
from persia_planner.placement.shards import TablePlacement
from persia_planner.search import Option, build_placement
from persia_planner.tiers import tiers_of
from persia_planner.topology.graph import Topology

if TYPE_CHECKING:  # pragma: no cover
    from persia_planner.modules.train.job import Job

__all__ = [
    "Case",
    "DeviceBytes",
    "allocated_bytes",
    "compare",
    "cpu_topology",
    "default_cases",
    "fill_ids",
    "memory_error",
    "placed",
    "predicted_bytes",
    "rank_bytes",
]

FILL_CHUNK = 65_536
"""Ids per lookup when the servers' shares are filled (the size of a large training batch's distinct ids)."""


@dataclass(frozen=True)
class DeviceBytes:
    """One device's bytes: what the planner charges and what the built modules hold.

    Attributes:
        device: A trainer device (``trainer0/cpu1``) or a parameter server (``ps0``), as in the topology.
        predicted: The planner's bytes (``CostModel`` memory vector).
        allocated: Measured: a trainer's tensor bytes, a server's resident-memory growth.
        accounted: A server's stores' own account of their arrays (``EmbeddingStore.resident_bytes``); a trainer's
            equals ``allocated``.
    """

    device: str
    predicted: int
    allocated: int
    accounted: int

    @property
    def error(self) -> float:
        """``predicted / allocated - 1`` (0 when both are 0)."""
        if self.allocated == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return self.predicted / self.allocated - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "predicted": self.predicted,
            "allocated": self.allocated,
            "accounted": self.accounted,
            "error": self.error,
        }


# ---- the planner's side -----------------------------------------------------------------------------------------


def predicted_bytes(spec: ModelSpec, tables: Mapping[str, TablePlacement], topology: Topology) -> dict[str, int]:
    """The planner's bytes per device of a placement: each trainer device's own memory (HBM; a CPU trainer's budget),
    each trainer host's DDR where its ``ddr`` / ``hbm_cache`` shards put any, each parameter server's DDR.

    Args:
        spec: The model.
        tables: The plan's placements (``Plan.tables``).
        topology: The topology the plan was made for.
    """
    cost = CostModel(spec, topology)
    _, mem = cost.evaluate(tables)
    lay = cost.layout
    out = {gpu.name: int(mem[lay.hbm.start + g]) for g, gpu in enumerate(topology.gpus)}
    out |= {h.name: int(mem[lay.ddr.start + i]) for i, h in enumerate(topology.trainers) if mem[lay.ddr.start + i]}
    out |= {s.name: int(mem[lay.ps_mem.start + p]) for p, s in enumerate(topology.servers)}
    return out


# ---- the runtime's side -----------------------------------------------------------------------------------------


def _storages(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one allocation count once; meta ones not at all)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta" or t.is_sparse:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def rank_bytes(model: nn.Module, optimizer: Any = None) -> dict[str, int]:
    """Bytes this trainer's local tables hold, read from the built modules (call it on every trainer of a run).

    Args:
        model: The trainer's model (DMP-wrapped or not) holding one ``HybridEmbeddingBagCollection``.
        optimizer: The run's optimizer (:func:`.train.make_optimizer`), for the state of the tables it updates
            (data-parallel replicas); fbgemm keeps the fused tables' state in its own buffers.

    Returns:
        ``{"modules": the tables' tensors (weights, fbgemm's optimizer state, caches and indexes), "optimizer": the
        ``torch.optim`` state, "gradients": the gradients the tables hold, "total": the sum}``, in bytes. Views
        of one allocation count once (TorchRec's per-table weights are views of fbgemm's), except gradients:
        DDP's are views of its buckets, which hold the dense gradients too, so each counts its own bytes.
    """
    from persia_planner.modules.embedding.model_parallel import hybrid_of

    _, hybrid = hybrid_of(model)
    if hybrid.local is None:
        return {"modules": 0, "optimizer": 0, "gradients": 0, "total": 0}
    params = list(hybrid.local.parameters())
    modules = params + list(hybrid.local.buffers())
    for tbe in hybrid.local.tbes():
        modules += list(tbe.parameters()) + list(tbe.buffers())
    owned = {id(p) for p in params}
    state = []
    if optimizer is not None:
        for param, values in optimizer.state.items():
            if id(param) in owned:
                state += [v for v in values.values() if isinstance(v, torch.Tensor)]
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    out = {"modules": _storages(modules), "optimizer": _storages(state), "gradients": grads}
    return out | {"total": sum(out.values())}


def fill_ids(table: str, need: Sequence[int], n_servers: int) -> torch.Tensor:
    """``need[i]`` ids for server ``i`` of ``n_servers`` for each ``i``: the first non-negative integers that hash to
    it (``server_of``). The synthetic data's ids are hashed 63-bit values, so these small ones are new to the stores.
    """
    from persia_planner.modules.ps.sharding import server_of

    chosen = [torch.empty(0, dtype=torch.int64)]
    taken = [0] * n_servers
    for start in range(0, 2**62, FILL_CHUNK * n_servers):
        if all(t >= n for t, n in zip(taken, need, strict=True)):
            break
        ids = torch.arange(start, start + FILL_CHUNK * n_servers, dtype=torch.int64)
        owner = server_of(table, ids, n_servers)
        for i in range(n_servers):
            mine = ids[owner == i][: max(need[i] - taken[i], 0)]
            taken[i] += len(mine)
            chosen.append(mine)
    return torch.cat(chosen)


def _fill(client: Any, job: Job, rank: int, world: int) -> None:
    """Fill every server's store of every PS table to its capacity, as a server under pressure fills it (what the
    plan charges, ``memory.ps_bytes``): trainer ``rank`` of ``world`` inserts every world-th chunk of the ids."""
    held: list[Any] = [client.memory() if rank == 0 else None]
    dist.broadcast_object_list(held, src=0)  # every trainer picks the same ids
    for table in job.spec.tables:
        if job.tables[table.name].mode is not Mode.ASYNC:
            continue
        capacity = ps_server_capacity(table.rows, job.servers)
        need = [capacity - server["tables"][table.name]["rows"] for server in held[0]]
        ids = fill_ids(table.name, need, job.servers)
        for start in range(rank * FILL_CHUNK, len(ids), world * FILL_CHUNK):
            client.lookup(table.name, ids[start : start + FILL_CHUNK], train=True)


def _measure_trainer(j: int, client: Any, job: Job) -> dict[str, Any] | None:
    """Trainer ``j`` of :func:`allocated_bytes` (run by :func:`.launcher.launch.local_cluster`): builds the modules as
    ``persia train`` does, measures its own bytes and, on trainer 0, the servers' memory growth."""
    from persia_planner.modules.data.synthetic import SyntheticClicks
    from persia_planner.modules.embedding.hybrid import SparseOptimizer
    from persia_planner.modules.embedding.model_parallel import distribute
    from persia_planner.modules.train.batch_stream import teacher_for
    from persia_planner.modules.train.job import trainer_group
    from persia_planner.modules.train.loop import TrainLoop, build_model, make_optimizer
    from persia_planner.modules.train.ps_usage import warm_up

    with trainer_group(j, job):  # TorchRec's nodes are the topology's hosts, as persia train tells it
        before = None
        if client is not None:
            warm_up(client, max(t.dim for t in job.spec.tables), FILL_CHUNK, drop=False)  # every trainer warms up
            dist.barrier()  # every trainer's first requests are served before the baseline
            before = client.memory() if j == 0 else None
            dist.barrier()
        cfg = job.cfg
        sparse = SparseOptimizer(cfg.sparse_optimizer)
        model, hybrid = build_model(
            job.spec,
            job.tables,
            ps=client,
            optimizer=sparse,
            ps_servers=job.servers,
            local_device=torch.device("meta"),  # only this trainer's shards are allocated, by DMP
        )
        dmp = distribute(model, job.tables, job.topology)
        opt = make_optimizer(model, cfg, sparse)
        # Two steps, as a run takes them: the optimizer's state and the replicas' gradients exist only after one.
        data = SyntheticClicks(teacher_for(job.spec, cfg), batch_size=8, num_batches=2 * job.trainers, seed=j)
        for _ in TrainLoop(dmp, hybrid, opt).run(data.batch(b * job.trainers + j) for b in range(2)):
            pass
        hybrid.flush()
        mine = rank_bytes(dmp, opt)
        everyone: list[Any] = [None] * job.trainers
        dist.all_gather_object(everyone, mine)
        after = None
        if client is not None:
            _fill(client, job, j, job.trainers)
            dist.barrier()  # every trainer's share is in
            after = client.memory() if j == 0 else None
        if j != 0:
            return None
        return {"trainers": everyone, "before": before or [], "after": after or []}


def allocated_bytes(
    spec: ModelSpec,
    tables: Mapping[str, TablePlacement],
    topology: Topology,
    *,
    sparse_optimizer: Optimizer | None = None,
    run_timeout_s: float = 600.0,
) -> dict[str, dict[str, int]]:
    """Build the plan's modules in ``len(topology.gpus)`` trainers and ``len(topology.servers)`` fresh servers on
    this machine, fill the servers' stores to their capacity, and measure each device.

    Args:
        spec: The model (one embedding dim for all tables: the modules are ``persia train``'s DLRM).
        tables: The plan's placements.
        topology: The plan's topology (trainer ``r`` is ``topology.gpus[r]``, server ``i`` is ``servers[i]``).
        sparse_optimizer: The sparse optimizer (default: the one the tables name).
        run_timeout_s: Give up (naming the process) after this long.

    Returns:
        ``{device: {"allocated": bytes, "accounted": bytes, ...}}``: a trainer's :func:`rank_bytes` (``allocated``
        is its total), a server's resident-memory growth (``allocated``), its stores' own account (``accounted``)
        and the rows it holds.
    """
    from persia_planner.modules.launcher.launch import local_cluster
    from persia_planner.modules.train.config import TrainConfig, sparse_optimizer_of
    from persia_planner.modules.train.job import Job

    has_ps = any(p.mode is Mode.ASYNC for p in tables.values())
    servers = len(topology.servers) if has_ps else 0
    optimizer = sparse_optimizer or sparse_optimizer_of(TrainConfig(), spec)
    cfg = TrainConfig(trainers=len(topology.gpus), sparse_optimizer=optimizer)
    job = Job(cfg, spec, dict(tables), topology, servers, len(topology.gpus))
    result = local_cluster(servers, len(topology.gpus), _measure_trainer, job, run_timeout_s=run_timeout_s)[0]
    out: dict[str, dict[str, int]] = {}
    for gpu, measured in zip(topology.gpus, result["trainers"], strict=True):
        out[gpu.name] = {"allocated": measured["total"], "accounted": measured["total"], **measured}
    for server, before, after in zip(topology.servers[:servers], result["before"], result["after"], strict=True):
        out[server.name] = {
            "allocated": after["resident_bytes"] - before["resident_bytes"],
            "accounted": after["store_bytes"] - before["store_bytes"],
            "rows": _rows(after) - _rows(before),
        }
    return out


def _rows(memory: Mapping[str, Any]) -> int:
    return sum(t["rows"] for t in memory["tables"].values())


def compare(
    spec: ModelSpec,
    tables: Mapping[str, TablePlacement],
    topology: Topology,
    *,
    sparse_optimizer: Optimizer | None = None,
) -> dict[str, DeviceBytes]:
    """:func:`predicted_bytes` and :func:`allocated_bytes` of a placement, per device that holds any bytes."""
    predicted = predicted_bytes(spec, tables, topology)
    allocated = allocated_bytes(spec, tables, topology, sparse_optimizer=sparse_optimizer)
    out = {}
    for device, planned in predicted.items():
        measured = allocated.get(device, {"allocated": 0, "accounted": 0})
        if planned or measured["allocated"]:
            out[device] = DeviceBytes(device, planned, measured["allocated"], measured["accounted"])
    return out


# ---- configurations ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One configuration to measure: a model, its placements and their topology."""

    name: str
    spec: ModelSpec
    tables: dict[str, TablePlacement]
    topology: Topology


def cpu_topology(trainers: int = 2, servers: int = 0) -> Topology:
    """One host of ``trainers`` CPU trainer devices (1 GiB each) and ``servers`` parameter servers: this machine as
    :func:`allocated_bytes` runs it (the rates only matter to the step time, not to the bytes)."""
    cpus = {"count": trainers, "memory": "1GiB", "bandwidth": "10GB/s", "tflops": 0.5}
    hosts: list[dict[str, Any]] = [
        {"name": "trainer", "ddr": "8GiB", "ddr_bandwidth": "10GB/s", "nic_bandwidth": "10GB/s", "cpus": cpus}
    ]
    if servers:
        hosts.append(
            {"name": "ps", "count": servers, "role": "parameter_server", "ddr": "4GiB"}
            | {"ddr_bandwidth": "10GB/s", "nic_bandwidth": "1GB/s"}
        )
    return Topology.from_dict({"name": f"cpu-{trainers}x{servers}ps", "hosts": hosts})


def placed(
    name: str, spec: ModelSpec, topology: Topology, shardings: Mapping[str, tuple[Sharding, Sequence[int]]]
) -> Case:
    """A :class:`Case` whose tables are placed as given: ``{table: (sharding, trainer device indices)}`` (ignored
    for ``ps_hash``: one bucket per server), each on the fastest tier its sharding runs on (``hbm``, ``ps``), shaped
    by the planner's own :func:`persia_planner.search.build_placement`."""
    cost = CostModel(spec, topology)
    tables = {}
    for table in spec.tables:
        sharding, devices = shardings[table.name]
        tier = min(tiers_of(sharding), key=lambda t: t.spec.speed_rank)
        tables[table.name] = build_placement(cost, table, Option(sharding, tier), list(devices))
    return Case(name, spec, tables, topology)


def default_cases() -> list[Case]:
    """The configurations :func:`memory_error` measures by default (each a few tens of seconds on 2 cores):

    * ``hybrid``: two CPU trainers and two servers, row-wise Adagrad, float32: a table of every sharding type
      TorchRec runs on CPU and two PS tables, one of them float16 and large enough (about 230 MB per server) that
      a server's resident memory is measured to well within its constant noise (code pages, heap, huge-page
      rounding);
    * ``fp16_sgd``: two CPU trainers, float16 tables trained by SGD, a data-parallel one among them (its DDP
      gradient is float16 too).
    """
    both = (0, 1)
    spec = ModelSpec(
        "memory-hybrid",
        256,
        (
            TableSpec("tw0", 30_000, 64),
            TableSpec("tw1", 20_000, 64),
            TableSpec("rw", 40_000, 64),
            TableSpec("cw", 30_000, 64),
            TableSpec("twrw", 30_001, 64),
            TableSpec("tcw", 25_000, 64),
            TableSpec("dp", 20_000, 64),
            TableSpec("ps_big", 2_000_000, 64, embedding_dtype=DType.FP16),  # the stores keep it in fp16
            TableSpec("ps_small", 200_000, 64),
        ),
    )
    hybrid = placed(
        "hybrid",
        spec,
        cpu_topology(2, 2),
        {
            "tw0": (Sharding.TABLE_WISE, (0,)),
            "tw1": (Sharding.TABLE_WISE, (1,)),
            "rw": (Sharding.ROW_WISE, both),
            "cw": (Sharding.COLUMN_WISE, both),
            "twrw": (Sharding.TABLE_ROW_WISE, both),
            "tcw": (Sharding.TABLE_COLUMN_WISE, both),
            "dp": (Sharding.DATA_PARALLEL, both),
            "ps_big": (Sharding.PS_HASH, ()),
            "ps_small": (Sharding.PS_HASH, ()),
        },
    )
    sgd = Optimizer.SGD
    half = ModelSpec(
        "memory-fp16-sgd",
        256,
        (
            TableSpec("tw", 60_000, 32, optimizer=sgd),
            TableSpec("rw", 80_001, 32, optimizer=sgd),
            TableSpec("cw", 50_000, 32, optimizer=sgd),
            TableSpec("dp", 40_000, 32, optimizer=sgd),
        ),
        embedding_dtype=DType.FP16,
    )
    fp16 = placed(
        "fp16_sgd",
        half,
        cpu_topology(2, 0),
        {
            "tw": (Sharding.TABLE_WISE, (1,)),
            "rw": (Sharding.ROW_WISE, both),
            "cw": (Sharding.COLUMN_WISE, both),
            "dp": (Sharding.DATA_PARALLEL, both),
        },
    )
    return [hybrid, fp16]


def memory_error(cases: Sequence[Case] | None = None) -> dict[str, Any]:
    """The planner's bytes against the built modules' on each case (:func:`compare`).

    Args:
        cases: The configurations (default :func:`default_cases`).

    Returns:
        ``{"memory_max_abs_error": max over cases and devices of |predicted / allocated - 1|, "cases": {case:
        {device: DeviceBytes.to_dict()}}}``.
    """
    per_case = {c.name: compare(c.spec, c.tables, c.topology) for c in cases or default_cases()}
    worst = max((abs(d.error) for devices in per_case.values() for d in devices.values()), default=0.0)
    return {
        "memory_max_abs_error": worst,
        "cases": {name: {k: d.to_dict() for k, d in devices.items()} for name, devices in per_case.items()},
    }
