"""``persia calibrate``: microbenchmarks of this machine, written as a hardware profile the planner reads.

Each benchmark measures one engine the runtime executes, the way the runtime calls it (fbgemm's TBE with its fused
optimizer, gloo collectives between local processes, torch.distributed.rpc to a parameter server, the server's
store, the dense MLP). The profile keeps the raw points; :mod:`persia_planner.topology.profile` (torch-free) fits the
cost model's figures from them, so a profile can be re-fitted without measuring again.

Each measurement repeats until its calls agree (:mod:`persia_planner.modules.tools.noise`); one that does not within
its bounds is kept and named in the profile's ``noise:`` section. The ``machine:`` section says where and when the
profile was measured (the host's name, the device kind, the topology host it is for), which a topology checks.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from persia_planner.modules.data.criteo_format import NUM_INTEGER
from persia_planner.modules.tools.calibration_sizes import MiB, Sizes
from persia_planner.modules.tools.noise import NoiseLog, Timer
from persia_planner.topology.profile import PROFILE_FORMAT

__all__ = [
    "BENCHMARKS",
    "HOST_BENCHMARKS",
    "PHASES",
    "Sizes",
    "calibrate",
    "device_kind",
    "machine_section",
    "measure_collectives",
    "measure_rpc",
]

HOT_ROWS = 1024  # a table that stays in the CPU's caches


def _once_s(fn: Callable[[], Any]) -> float:
    """Seconds of one call (a measurement that changes what it measures, or takes seconds: not repeated)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_backward_s(
    timer: Timer, point: str, tbe: Any, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor, repeats: int
) -> float:
    """Median seconds of the fused backward alone, each after an untimed forward (a difference of two medians can
    come out near zero or negative on a noisy machine)."""

    def backward_s() -> float:
        out = tbe(ids, offsets)
        start = time.perf_counter()
        out.backward(grad)
        return time.perf_counter() - start

    backward_s()  # warms up
    return timer.median_sample_s(point, backward_s, repeats)


# ---- this process --------------------------------------------------------------------------------------------------


def memory(sizes: Sizes, timer: Timer) -> dict[str, Any]:
    """Stream copy bandwidth (read + write) and random row gathers from a table larger than the caches."""
    n = sizes.memory_bytes // 4
    src, dst = torch.rand(n), torch.empty(n)
    stream = 2 * sizes.memory_bytes / timer.median_s("stream copy", lambda: dst.copy_(src), sizes.repeats)
    gather = []
    for row_bytes in sizes.row_bytes:
        table = src.view(-1, row_bytes // 4)
        ids = torch.randint(table.shape[0], (min(table.shape[0], 1 << 18),))
        seconds = timer.median_s(
            f"gather {row_bytes} B rows", lambda t=table, i=ids: torch.index_select(t, 0, i), sizes.repeats
        )
        gather.append({"row_bytes": row_bytes, "bytes_per_s": len(ids) * row_bytes / seconds})
    # A quantized collective's codec (TorchRec's fp16 encode and decode, a DDP fp16 hook): one conversion each way.
    narrow = src.half()
    both = timer.median_s("fp32 <-> fp16", lambda: (src.half(), narrow.float()), sizes.repeats)
    return {"stream_bytes_per_s": stream, "gather": gather, "codec_values_per_s": 2 * n / both}


def embedding(sizes: Sizes, timer: Timer) -> list[dict[str, Any]]:
    """fbgemm TBE on this CPU: forward and fused backward (gradient + optimizer) rows per second, where a row is
    one looked-up id, by optimizer, dim and pooling factor."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from persia_planner.modules.embedding.hybrid import SparseOptimizer

    points = []
    for optimizer in sizes.optimizers:
        for dim in sizes.dims:
            # A table larger than the caches (every id a distinct row, a miss) and one that stays in them (ids
            # repeat): the fit separates the cost per id from the cost per distinct row.
            for rows in (max(1024, sizes.memory_bytes // (dim * 4)), HOT_ROWS):
                tbe = SplitTableBatchedEmbeddingBagsCodegen(
                    [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                    **SparseOptimizer(optimizer, learning_rate=0.01).fbgemm(on_cuda=False),
                )
                for pooling in sizes.poolings:
                    ids = torch.randint(rows, (sizes.batch * pooling,))
                    offsets = torch.arange(0, sizes.batch * pooling + 1, pooling)
                    grad = torch.ones(sizes.batch, dim)
                    point = f"{optimizer} dim {dim} pooling {pooling} {rows} rows"
                    forward = timer.median_s(f"forward {point}", lambda t=tbe, i=ids, o=offsets: t(i, o), sizes.repeats)
                    backward = _median_backward_s(timer, f"backward {point}", tbe, ids, offsets, grad, sizes.repeats)
                    looked_up = sizes.batch * pooling
                    points.append(
                        {
                            "optimizer": optimizer,
                            "dim": dim,
                            "pooling": pooling,
                            "rows": rows,
                            "unique_share": torch.unique(ids).numel() / looked_up,
                            "forward_rows_per_s": looked_up / forward,
                            "backward_rows_per_s": looked_up / max(backward, 1e-9),
                        }
                    )
                del tbe
    return points


def dense(sizes: Sizes, timer: Timer) -> dict[str, Any]:
    """Dense forward + backward FLOPs per second of a wide MLP (the peak), and steps of the DLRM dense network as
    ``persia train`` runs it (TorchRec's bottom MLP, interaction and top MLP, the loss and the dense Adagrad) over
    feature counts, dims and batches."""
    from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

    from persia_planner.model.specs import DLRM_BOTTOM, DLRM_TOP, DenseSpec

    width = 512
    mlp = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    x = torch.rand(sizes.batch, width)

    def step() -> None:
        mlp.zero_grad()
        mlp(x).sum().backward()

    seconds = timer.median_s(f"wide MLP batch {sizes.batch}", step, sizes.repeats)
    flops = 3 * 2 * 2 * width * width * sizes.batch  # two layers; forward 2*in*out per sample, backward twice that
    points = []
    for features, dim in sizes.dlrm_shapes:
        arches = torch.nn.ModuleList(
            [
                DenseArch(NUM_INTEGER, [*DLRM_BOTTOM, dim]),
                InteractionArch(features),
                OverArch(dim + (features + 1) * features // 2, list(DLRM_TOP)),
            ]
        )
        optimizer = torch.optim.Adagrad(arches.parameters(), lr=0.01)
        for batch in sizes.dlrm_batches:
            dense_x = torch.rand(batch, NUM_INTEGER)
            sparse = torch.rand(batch, features, dim, requires_grad=True)
            labels = torch.randint(2, (batch,)).float()

            def dlrm_step(a=arches, o=optimizer, d=dense_x, s=sparse, y=labels) -> None:
                o.zero_grad()
                logits = a[2](a[1](a[0](d), s)).squeeze(-1)
                torch.nn.functional.binary_cross_entropy_with_logits(logits, y).backward()
                o.step()

            points.append(
                {
                    "features": features,
                    "dim": dim,
                    "batch": batch,
                    "flops_per_sample": DenseSpec.dlrm(NUM_INTEGER, dim, features).flops_per_sample,
                    "seconds": timer.median_s(f"DLRM {features} x {dim} batch {batch}", dlrm_step, sizes.repeats),
                }
            )
    return {"flops_per_s": flops / seconds, "width": width, "batch": sizes.batch, "dlrm": points}


def ps_store(sizes: Sizes, timer: Timer) -> dict[str, Any]:
    """The parameter server's store in this process: lookup (probe + admit) and update rows per second, and the
    de-duplication that every request pays (``torch.unique``)."""
    from persia_planner.modules.ps.optim import RowWiseAdagrad
    from persia_planner.modules.ps.store import EmbeddingStore

    dim, batch = 16, sizes.batch * 8
    capacity = max(batch * 4, sizes.memory_bytes // (dim * 4 + 64))
    store = EmbeddingStore(dim, capacity, RowWiseAdagrad(lr=0.01))
    ids = torch.randint(capacity // 2, (batch,))
    admit = _once_s(lambda: store.lookup(torch.randint(1 << 40, (batch,))))  # new rows each time: not repeated
    store.lookup(ids)
    lookup = timer.median_s("lookup", lambda: store.lookup(ids), sizes.repeats)
    grads = torch.rand(batch, dim)
    update = timer.median_s("update", lambda: store.update(ids, grads), sizes.repeats)
    unique = timer.median_s("unique", lambda: torch.unique(ids, return_inverse=True), sizes.repeats)
    return {
        "dim": dim,
        "lookup_rows_per_s": batch / lookup,
        "admit_rows_per_s": batch / admit,
        "update_rows_per_s": batch / update,
        "unique_ids_per_s": batch / unique,
    }


def disk(sizes: Sizes, timer: Timer, directory: str | None = None) -> dict[str, Any]:
    """The local disk as the ``ssd`` tier reads and writes it (:class:`.row_file.RowFile`: ``O_DIRECT``, 4 KiB
    blocks): blocks read and written a second at random (one block a record, so a write needs no read), and the
    sequential rates of filling and reading the whole file. The file goes where a server's would by default (the
    temporary directory) and is removed."""
    from persia_planner.modules.ps.row_file import BLOCK_BYTES, RowFile

    directory = directory or tempfile.gettempdir()
    dim = (BLOCK_BYTES - 4) // 4  # weights and one state value fill a block: a record is a block
    rows = sizes.disk_bytes // BLOCK_BYTES
    path = Path(directory) / f"persia-calibrate.{os.getpid()}.{uuid.uuid4().hex[:12]}.rows"  # new: never replaced
    file = RowFile(path, rows, dim, torch.float32, 1)
    try:
        chunk = max(1, (16 * MiB) // BLOCK_BYTES)
        weights, state = torch.rand(chunk, dim), torch.rand(chunk, 1)
        file.write(torch.arange(1), weights[:1], state[:1])  # numba compiles the loops on their first call
        file.read(torch.arange(1))

        def fill() -> None:
            for start in range(0, rows, chunk):
                slots = torch.arange(start, min(start + chunk, rows))
                file.write(slots, weights[: slots.numel()], state[: slots.numel()])
            file.sync()

        fill_s = _once_s(fill)  # the whole file, sequentially: seconds, and the OS's caches change after it
        starts = range(0, rows, chunk)

        def read_all() -> None:
            for start in starts:
                file.read(torch.arange(start, min(start + chunk, rows)))

        read_all()
        read_all_s = _once_s(read_all)
        n = min(rows, sizes.disk_ios)
        generator = torch.Generator().manual_seed(0)
        random_read_s = timer.median_s(
            "random reads", lambda: file.read(torch.randperm(rows, generator=generator)[:n]), sizes.repeats
        )
        some = torch.randperm(rows, generator=generator)[:n]
        new_weights, new_state = torch.rand(n, dim), torch.rand(n, 1)

        def random_writes() -> None:
            file.write(some, new_weights, new_state)
            file.sync()

        random_write_s = timer.median_s("random writes", random_writes, sizes.repeats)
    finally:
        file.close()
    return {
        "path": str(directory),
        "read_iops": n / random_read_s,
        "write_iops": n / random_write_s,
        "read_bytes_per_s": rows * BLOCK_BYTES / read_all_s,
        "write_bytes_per_s": rows * BLOCK_BYTES / fill_s,
    }


# ---- between processes ---------------------------------------------------------------------------------------------


def _collectives_worker(rank: int, port: int, sizes: Sizes, out: str) -> None:
    import torch.distributed as dist

    from persia_planner.modules.launcher.launch import use_hosted_store
    from persia_planner.modules.launcher.lifecycle import exit_now

    torch.set_num_threads(1)
    use_hosted_store(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    noise: list[dict[str, Any]] = []
    result = measure_collectives(sizes, Timer(sizes.quiet, noise))
    if rank == 0:
        Path(out).write_text(json.dumps({**result, "noise": noise}))
    dist.destroy_process_group()
    exit_now()


def measure_collectives(sizes: Sizes, timer: Timer, group: Any = None) -> dict[str, list[dict[str, float]]]:
    """gloo all-to-all and all-reduce among the processes of ``group`` (None: the default group), each of which
    calls this: seconds per call by message size (``all_to_all``, ``all_reduce``: ``{bytes, seconds}`` points).

    Every process must make the same calls: the group's first process decides when a measurement stops and tells
    the others."""
    import torch.distributed as dist

    first = 0 if group is None else dist.get_global_rank(group, 0)

    def first_s_verdict(stop: bool) -> bool:
        verdict = torch.tensor([int(stop)])
        dist.broadcast(verdict, src=first, group=group)
        return bool(verdict.item())

    result: dict[str, list[dict[str, float]]] = {"all_to_all": [], "all_reduce": []}
    for n_bytes in sizes.message_bytes:
        x = torch.rand(n_bytes // 4)
        y = torch.empty_like(x)
        for name, op in (
            ("all_to_all", lambda a=x, b=y: dist.all_to_all_single(b, a, group=group)),
            ("all_reduce", lambda a=x: dist.all_reduce(a, group=group)),
        ):
            dist.barrier(group=group)
            seconds = timer.median_s(f"{name} {n_bytes} B", op, sizes.repeats * 2, warmup=2, agree=first_s_verdict)
            result[name].append({"bytes": n_bytes, "seconds": seconds})
    dist.barrier(group=group)
    return result


def collectives(sizes: Sizes, timer: Timer) -> dict[str, Any]:
    """gloo all-to-all and all-reduce between two local processes: seconds per call by message size."""
    import torch.multiprocessing as mp

    from persia_planner.modules.launcher.launch import hosted_store

    with tempfile.TemporaryDirectory() as tmp, hosted_store(120.0) as port:
        out = str(Path(tmp) / "collectives.json")
        mp.spawn(_collectives_worker, args=(port, sizes, out), nprocs=2, join=True)
        result = json.loads(Path(out).read_text())
        timer.records.extend(result.pop("noise"))
        return {"backend": "gloo", "processes": 2, **result}


def _rpc_trainer(j: int, client: Any, sizes: Sizes) -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    timer = Timer(sizes.quiet, [])
    return measure_rpc(client, sizes, timer), timer.records


def measure_rpc(client: Any, sizes: Sizes, timer: Timer) -> list[dict[str, float]]:
    """Lookups and gradient pushes of ``client`` (a :class:`~persia_planner.modules.ps.client.PsClient`) to its
    servers, by request size: ``{rows, dim, lookup_seconds, push_seconds}`` points (a table ``calibrate`` is
    registered on them)."""
    from persia_planner.modules.ps.protocol import TableConfig

    dim = 16
    client.register(TableConfig("calibrate", dim, capacity=max(sizes.rpc_rows) * 2))
    points = []
    for rows in sizes.rpc_rows:
        ids = torch.arange(rows)
        client.lookup("calibrate", ids)  # admits them: the timed calls find every row
        grads = torch.rand(rows, dim)
        lookup = timer.median_s(f"lookup {rows} rows", lambda i=ids: client.lookup("calibrate", i), sizes.repeats * 2)
        push = timer.median_s(
            f"push {rows} rows", lambda i=ids, g=grads: client.push_gradients("calibrate", i, g), sizes.repeats * 2
        )
        points.append({"rows": rows, "dim": dim, "lookup_seconds": lookup, "push_seconds": push})
    return points


def rpc(sizes: Sizes, timer: Timer) -> dict[str, Any]:
    """torch.distributed.rpc to one parameter-server process, as the runtime calls it: a lookup (ids out, rows
    back) and a gradient push, by request size (one row gives the round trip)."""
    from persia_planner.modules.launcher.launch import local_cluster

    points, noise = local_cluster(1, 1, _rpc_trainer, sizes, timeout_s=60.0)[0]
    timer.records.extend(noise)
    return {"dim": points[0]["dim"], "requests": points}


# ---- the whole run -------------------------------------------------------------------------------------------------

BENCHMARKS: dict[str, Callable[[Sizes, Timer], Any]] = {
    "memory": memory,
    "embedding": embedding,
    "dense": dense,
    "ps_store": ps_store,
    "disk": disk,
    "collectives": collectives,
    "rpc": rpc,
}
# The benchmarks that measure this host alone (the others measure between processes).
HOST_BENCHMARKS = ("memory", "embedding", "dense", "ps_store", "disk")
# The benchmarks above, then whole training steps (:mod:`persia_planner.modules.tools.step_calibration`: they need the
# others' results).
PHASES = (*BENCHMARKS, "step")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def device_kind() -> str:
    """The device kind of this machine, as a profile records it: the first CUDA device's name, else ``cpu``."""
    if torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    return "cpu"


def calibrate(
    quick: bool = False,
    on_done: Callable[[str, float], None] | None = None,
    sizes: Sizes | None = None,
    topology_host: str | None = None,
) -> dict[str, Any]:
    """Run every benchmark; returns the profile (the YAML's content).

    Args:
        quick: Fewer, smaller measurements.
        on_done: Called with each benchmark's name and its seconds, as it finishes (a progress display).
        sizes: What to measure (default: :meth:`Sizes.of` ``quick``).
        topology_host: The topology's host (class) this profile is for, recorded in ``machine:`` (a topology
            refuses it on another host).
    """
    sizes = sizes or Sizes.of(quick)
    torch.set_num_threads(1)  # as one trainer process runs
    profile: dict[str, Any] = {"format": PROFILE_FORMAT, "machine": machine_section(quick, topology_host)}
    noise = NoiseLog(sizes.quiet)
    for name, bench in BENCHMARKS.items():
        started = time.perf_counter()
        profile[name] = bench(sizes, noise.timer(name))
        if on_done is not None:
            on_done(name, time.perf_counter() - started)
    from persia_planner.modules.tools.step_calibration import calibrate_step

    started = time.perf_counter()
    timer = noise.timer("step")
    profile["step"] = calibrate_step(profile, sizes.step_steps, sizes.step_runs, timer, budget_s=sizes.step_budget_s)
    if on_done is not None:
        on_done("step", time.perf_counter() - started)
    profile["noise"] = noise.section()
    return profile


def machine_section(quick: bool, topology_host: str | None = None) -> dict[str, Any]:
    """The profile's ``machine:`` section for this process's host: what measures (platform, CPUs, library
    versions), when (now), where (host name, device kind) and for which topology host (class)."""
    machine: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": str(torch.__version__),
        "fbgemm_gpu": _version("fbgemm-gpu-cpu") or _version("fbgemm-gpu"),
        "torchrec": _version("torchrec"),
        "measured": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "hostname": socket.gethostname(),
        "device": device_kind(),
    }
    if topology_host is not None:
        machine["topology_host"] = topology_host
    return machine
