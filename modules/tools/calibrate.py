"""``persia calibrate``: microbenchmarks of this machine, written as a hardware profile the planner reads.

Each benchmark measures one engine the runtime executes, the way the runtime calls it (fbgemm's TBE with its fused
optimizer, gloo collectives between local processes, torch.distributed.rpc to a parameter server, the server's
store, the dense MLP). The profile keeps the raw points; :mod:`persia_planner.topology.profile` (torch-free) fits the
cost model's figures from them, so a profile can be re-fitted without measuring again.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from persia_planner.modules.data.criteo_format import NUM_INTEGER
from persia_planner.topology.profile import PROFILE_FORMAT

__all__ = ["BENCHMARKS", "PHASES", "Sizes", "calibrate"]

MiB = 1024**2
HOT_ROWS = 1024  # a table that stays in the CPU's caches


@dataclass(frozen=True)
class Sizes:
    """How much each benchmark measures (``quick`` for CI and a first look, the full one for planning)."""

    memory_bytes: int
    row_bytes: tuple[int, ...]
    dims: tuple[int, ...]
    poolings: tuple[int, ...]
    optimizers: tuple[str, ...]
    message_bytes: tuple[int, ...]
    rpc_rows: tuple[int, ...]
    repeats: int
    batch: int
    dlrm_shapes: tuple[tuple[int, int], ...]  # (sparse features, embedding dim) of the DLRM dense steps
    dlrm_batches: tuple[int, ...]
    step_steps: int  # steps of each small training job (:mod:`persia_planner.modules.tools.step_calibration`)
    disk_bytes: int = 256 * MiB  # the file the disk's rates are measured on
    disk_ios: int = 4096  # blocks read or written at random per measurement

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            return cls(
                memory_bytes=64 * MiB,
                row_bytes=(64, 256, 1024),
                dims=(16, 64),
                poolings=(1, 8),
                optimizers=("sgd", "rowwise_adagrad"),
                message_bytes=(1024, 64 * 1024, 1 * MiB, 4 * MiB),
                rpc_rows=(1, 1024, 16384),
                repeats=5,
                batch=2048,
                dlrm_shapes=((8, 16), (26, 16), (26, 64)),
                dlrm_batches=(256, 2048),
                step_steps=40,
                disk_bytes=128 * MiB,
                disk_ios=2048,
            )
        return cls(
            memory_bytes=256 * MiB,
            row_bytes=(64, 128, 256, 512, 1024),
            dims=(16, 32, 64, 128),
            poolings=(1, 4, 16),
            optimizers=("sgd", "rowwise_adagrad", "adagrad"),
            message_bytes=(1024, 16 * 1024, 256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB),
            rpc_rows=(1, 256, 4096, 32768),
            repeats=9,
            batch=4096,
            dlrm_shapes=((4, 16), (8, 16), (13, 32), (26, 16), (26, 64), (40, 32)),
            dlrm_batches=(128, 1024, 4096),
            step_steps=80,
            disk_bytes=1024 * MiB,
            disk_ios=8192,
        )


def _median_s(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _median_backward_s(tbe: Any, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor, repeats: int) -> float:
    """Median seconds of the fused backward alone, each after an untimed forward (a difference of two medians can
    come out near zero or negative on a noisy machine)."""
    times = []
    for k in range(repeats + 1):
        out = tbe(ids, offsets)
        start = time.perf_counter()
        out.backward(grad)
        if k:  # the first one warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- this process --------------------------------------------------------------------------------------------------


def memory(sizes: Sizes) -> dict[str, Any]:
    """Stream copy bandwidth (read + write) and random row gathers from a table larger than the caches."""
    n = sizes.memory_bytes // 4
    src, dst = torch.rand(n), torch.empty(n)
    stream = 2 * sizes.memory_bytes / _median_s(lambda: dst.copy_(src), sizes.repeats)
    gather = []
    for row_bytes in sizes.row_bytes:
        table = src.view(-1, row_bytes // 4)
        ids = torch.randint(table.shape[0], (min(table.shape[0], 1 << 18),))
        seconds = _median_s(lambda t=table, i=ids: torch.index_select(t, 0, i), sizes.repeats)
        gather.append({"row_bytes": row_bytes, "bytes_per_s": len(ids) * row_bytes / seconds})
    # A quantized collective's codec (TorchRec's fp16 encode and decode, a DDP fp16 hook): one conversion each way.
    narrow = src.half()
    both = _median_s(lambda: (src.half(), narrow.float()), sizes.repeats)
    return {"stream_bytes_per_s": stream, "gather": gather, "codec_values_per_s": 2 * n / both}


def embedding(sizes: Sizes) -> list[dict[str, Any]]:
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
                    forward = _median_s(lambda t=tbe, i=ids, o=offsets: t(i, o), sizes.repeats)
                    backward = _median_backward_s(tbe, ids, offsets, grad, sizes.repeats)
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


def dense(sizes: Sizes) -> dict[str, Any]:
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

    seconds = _median_s(step, sizes.repeats)
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
                    "seconds": _median_s(dlrm_step, sizes.repeats),
                }
            )
    return {"flops_per_s": flops / seconds, "width": width, "batch": sizes.batch, "dlrm": points}


def ps_store(sizes: Sizes) -> dict[str, Any]:
    """The parameter server's store in this process: lookup (probe + admit) and update rows per second, and the
    de-duplication that every request pays (``torch.unique``)."""
    from persia_planner.modules.ps.optim import RowWiseAdagrad
    from persia_planner.modules.ps.store import EmbeddingStore

    dim, batch = 16, sizes.batch * 8
    capacity = max(batch * 4, sizes.memory_bytes // (dim * 4 + 64))
    store = EmbeddingStore(dim, capacity, RowWiseAdagrad(lr=0.01))
    ids = torch.randint(capacity // 2, (batch,))
    admit = _median_s(lambda: store.lookup(torch.randint(1 << 40, (batch,))), 1, warmup=0)
    store.lookup(ids)
    lookup = _median_s(lambda: store.lookup(ids), sizes.repeats)
    grads = torch.rand(batch, dim)
    update = _median_s(lambda: store.update(ids, grads), sizes.repeats)
    unique = _median_s(lambda: torch.unique(ids, return_inverse=True), sizes.repeats)
    return {
        "dim": dim,
        "lookup_rows_per_s": batch / lookup,
        "admit_rows_per_s": batch / admit,
        "update_rows_per_s": batch / update,
        "unique_ids_per_s": batch / unique,
    }


def disk(sizes: Sizes, directory: str | None = None) -> dict[str, Any]:
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

        fill_s = _median_s(fill, 1, warmup=0)
        starts = range(0, rows, chunk)
        read_all_s = _median_s(lambda: [file.read(torch.arange(s, min(s + chunk, rows))) for s in starts], 1)
        n = min(rows, sizes.disk_ios)
        generator = torch.Generator().manual_seed(0)
        random_read_s = _median_s(lambda: file.read(torch.randperm(rows, generator=generator)[:n]), sizes.repeats)
        some = torch.randperm(rows, generator=generator)[:n]
        new_weights, new_state = torch.rand(n, dim), torch.rand(n, 1)

        def random_writes() -> None:
            file.write(some, new_weights, new_state)
            file.sync()

        random_write_s = _median_s(random_writes, sizes.repeats)
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

    from persia_planner.modules.ps.launch import use_hosted_store
    from persia_planner.modules.ps.lifecycle import exit_now

    torch.set_num_threads(1)
    use_hosted_store(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    result: dict[str, list[dict[str, float]]] = {"all_to_all": [], "all_reduce": []}
    for n_bytes in sizes.message_bytes:
        x = torch.rand(n_bytes // 4)
        y = torch.empty_like(x)
        for name, op in (
            ("all_to_all", lambda a=x, b=y: dist.all_to_all_single(b, a)),
            ("all_reduce", lambda a=x: dist.all_reduce(a)),
        ):
            dist.barrier()
            result[name].append({"bytes": n_bytes, "seconds": _median_s(op, sizes.repeats * 2, warmup=2)})
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
    exit_now()


def collectives(sizes: Sizes) -> dict[str, Any]:
    """gloo all-to-all and all-reduce between two local processes: seconds per call by message size."""
    import torch.multiprocessing as mp

    from persia_planner.modules.ps.launch import hosted_store

    with tempfile.TemporaryDirectory() as tmp, hosted_store(120.0) as port:
        out = str(Path(tmp) / "collectives.json")
        mp.spawn(_collectives_worker, args=(port, sizes, out), nprocs=2, join=True)
        return {"backend": "gloo", "processes": 2, **json.loads(Path(out).read_text())}


def _rpc_trainer(j: int, client: Any, sizes: Sizes) -> list[dict[str, float]]:
    from persia_planner.modules.ps.protocol import TableConfig

    dim = 16
    client.register(TableConfig("calibrate", dim, capacity=max(sizes.rpc_rows) * 2))
    points = []
    for rows in sizes.rpc_rows:
        ids = torch.arange(rows)
        client.lookup("calibrate", ids)  # admits them: the timed calls find every row
        grads = torch.rand(rows, dim)
        lookup = _median_s(lambda i=ids: client.lookup("calibrate", i), sizes.repeats * 2)
        push = _median_s(lambda i=ids, g=grads: client.push_gradients("calibrate", i, g), sizes.repeats * 2)
        points.append({"rows": rows, "dim": dim, "lookup_seconds": lookup, "push_seconds": push})
    return points


def rpc(sizes: Sizes) -> dict[str, Any]:
    """torch.distributed.rpc to one parameter-server process, as the runtime calls it: a lookup (ids out, rows
    back) and a gradient push, by request size (one row gives the round trip)."""
    from persia_planner.modules.ps.launch import local_cluster

    points = local_cluster(1, 1, _rpc_trainer, sizes, timeout_s=60.0)[0]
    return {"dim": points[0]["dim"], "requests": points}


# ---- the whole run -------------------------------------------------------------------------------------------------

BENCHMARKS: dict[str, Callable[[Sizes], Any]] = {
    "memory": memory,
    "embedding": embedding,
    "dense": dense,
    "ps_store": ps_store,
    "disk": disk,
    "collectives": collectives,
    "rpc": rpc,
}
# The benchmarks above, then whole training steps (:mod:`persia_planner.modules.tools.step_calibration`: they need the
# others' results).
PHASES = (*BENCHMARKS, "step")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def calibrate(
    quick: bool = False, on_done: Callable[[str, float], None] | None = None, sizes: Sizes | None = None
) -> dict[str, Any]:
    """Run every benchmark; returns the profile (the YAML's content).

    Args:
        quick: Fewer, smaller measurements.
        on_done: Called with each benchmark's name and its seconds, as it finishes (a progress display).
        sizes: What to measure (default: :meth:`Sizes.of` ``quick``).
    """
    sizes = sizes or Sizes.of(quick)
    torch.set_num_threads(1)  # as one trainer process runs
    profile: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": str(torch.__version__),
            "fbgemm_gpu": _version("fbgemm-gpu-cpu") or _version("fbgemm-gpu"),
            "torchrec": _version("torchrec"),
            "measured": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "quick": quick,
        },
    }
    for name, bench in BENCHMARKS.items():
        started = time.perf_counter()
        profile[name] = bench(sizes)
        if on_done is not None:
            on_done(name, time.perf_counter() - started)
    from persia_planner.modules.tools.step_calibration import calibrate_step

    started = time.perf_counter()
    profile["step"] = calibrate_step(profile, sizes.step_steps)
    if on_done is not None:
        on_done("step", time.perf_counter() - started)
    return profile
