"""Hybrid training of a TorchRec DLRM from a plan: the engine behind ``persia train``.

Roles: parameter-server processes hold the plan's ``ps`` tables; trainer processes run a TorchRec ``DLRM`` whose
``EmbeddingBagCollection`` is a :class:`~.hybrid.HybridEmbeddingBagCollection` and whose dense part is wrapped in
``DistributedDataParallel`` (gloo on CPU, nccl on CUDA). Sparse and dense optimizers are separate: the sparse one is
fused into fbgemm (local tables) or applied by the servers (PS tables); the dense one is a ``torch.optim`` optimizer
over the dense parameters only.

:func:`train_local` spawns the servers and trainers on this machine (:func:`.ps.launch.local_cluster`);
:func:`train_torchrun` is the same job under ``torchrun`` on several machines: some processes of every node serve,
the others train (:func:`torchrun_role`). Each trainer reads its own share of the data: batch ``b`` of the stream
goes to trainer ``b mod trainers``.

The step loop (:class:`TrainLoop`) reads up to ``K`` batches ahead and asks the hybrid module to prefetch their PS
rows whenever the staleness bound allows it without waiting, so lookups travel while earlier batches compute and
gradient pushes never block the step.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from persia_planner.errors import PlannerError
from persia_planner.execution import check_executable, planned_execution
from persia_planner.memory import ps_capacity
from persia_planner.placement import Mode, TablePlacement
from persia_planner.specs import DLRM_BOTTOM, DLRM_TOP, ModelSpec
from persia_planner.topology import Topology

from .breakdown import PS_PUSH, PS_WAIT, StepProfiler
from .config import (
    DenseOptimizer,
    TrainConfig,
    check_before_start,
    check_resume_exists,
    criteo_files,
    criteo_path,
    data_identity,
    dlrm_embedding_dim,
    sparse_optimizer_of,
)
from .data.criteo import NUM_INTEGER, Batch, CriteoReader
from .data.synthetic import SyntheticClicks, Teacher
from .distributed import (
    check_trainers,
    data_parallel_tables,
    dense_parameters,
    distribute,
    executed_plan,
    hybrid_of,
    quiet_trainer,
    sparse_torch_optimizer,
)
from .hybrid import HybridEmbeddingBagCollection, SparseOptimizer
from .ps.launch import trainers_store

__all__ = [
    "TrainConfig",
    "TrainLoop",
    "build_model",
    "dense_state_dict",
    "make_optimizer",
    "teacher_for",
    "torchrun_role",
    "train_local",
    "train_torchrun",
]

_EVAL_SEED_OFFSET = 1_000_003


# ---- the model -----------------------------------------------------------------------------------------------


def build_model(
    spec: ModelSpec,
    tables: dict[str, TablePlacement] | None,
    *,
    ps: Any = None,
    optimizer: SparseOptimizer | None = None,
    staleness: int = 0,
    seed: int = 0,
    ps_servers: int = 1,
    num_dense: int = NUM_INTEGER,
    device: torch.device | None = None,
    local_device: torch.device | None = None,
) -> tuple[nn.Module, HybridEmbeddingBagCollection]:
    """A TorchRec ``DLRM`` over ``spec``'s tables with a :class:`HybridEmbeddingBagCollection` (one line differs
    from plain TorchRec). Returns ``(model, hybrid)``; shard it with :func:`.distributed.distribute`.

    Raises:
        PlannerError: The tables do not share one embedding dim (DLRM's interaction needs it).
    """
    from torchrec.models.dlrm import DLRM

    from persia_planner.export import to_embedding_bag_configs

    dim = dlrm_embedding_dim(spec)
    # Each server's store: the capacity the planner charged it for (room for the hash's imbalance).
    capacity = {
        t.name: int(ps_capacity(-(-t.rows // ps_servers)))
        for t in spec.tables
        if tables is not None and tables[t.name].mode is Mode.ASYNC
    }
    torch.manual_seed(seed)
    hybrid = HybridEmbeddingBagCollection(
        to_embedding_bag_configs(spec),
        tables,
        ps=ps,
        optimizer=optimizer,
        staleness=staleness,
        ps_capacity=capacity,
        seed=seed,
        device=device,
        local_device=local_device,
        keep_order=False,  # DLRM reads the pooled embeddings by key
    )
    model = DLRM(
        embedding_bag_collection=hybrid,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=[*DLRM_BOTTOM, dim],
        over_arch_layer_sizes=list(DLRM_TOP),
    )
    return model, hybrid


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state without its :class:`HybridEmbeddingBagCollection` (detached, not copied)."""
    path, _ = hybrid_of(model)
    prefix = f"{path}." if path else ""
    return {k: v.detach() for k, v in model.state_dict().items() if not (prefix and k.startswith(prefix))}


def make_optimizer(model: nn.Module, cfg: TrainConfig, sparse: SparseOptimizer) -> Any:
    """The optimizer a step calls: the dense one over the dense parameters, the sparse one over local tables that
    fbgemm does not update in its fused backward (data-parallel replicas). Fused tables need none."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    def dense_opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if cfg.dense_optimizer is DenseOptimizer.SGD:
            return torch.optim.SGD(params, lr=cfg.dense_lr)
        return torch.optim.Adagrad(params, lr=cfg.dense_lr)

    def sparse_opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return sparse_torch_optimizer(sparse.kind, params, lr=sparse.learning_rate, eps=sparse.eps)

    parts = [(dense_parameters(model), dense_opt), (data_parallel_tables(model), sparse_opt)]
    return CombinedOptimizer([KeyedOptimizerWrapper(p, make) for p, make in parts if p])


# ---- the step loop -------------------------------------------------------------------------------------------


@dataclass
class StepStats:
    """What one step measured."""

    loss: float
    step_ms: float
    staleness: int
    samples: int
    data_ms: float = 0.0
    ps_wait_ms: float = 0.0
    push_ms: float = 0.0


class TrainLoop:
    """Runs training steps with PS rows prefetched up to ``K`` batches ahead.

    Args:
        model: The model to call (e.g. DDP-wrapped); ``model(dense, sparse)`` returns logits ``[B, 1]``.
        hybrid: Its hybrid embedding collection (for prefetch and the staleness gauge).
        optimizer: The dense optimizer.
        device: Where the model computes (batches are moved there); default CPU.
        profiler: Profiles a window of steps for the step-time breakdown (see :mod:`.breakdown`).
    """

    def __init__(
        self,
        model: nn.Module,
        hybrid: HybridEmbeddingBagCollection,
        optimizer: torch.optim.Optimizer,
        device: torch.device | None = None,
        profiler: StepProfiler | None = None,
    ):
        self.model, self.hybrid, self.optimizer = model, hybrid, optimizer
        self.device = device or torch.device("cpu")
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.profiler = profiler

    def _to_device(self, batch: Batch) -> Batch:
        # Moved once, when read: the module matches a forward to its prefetch by the KJT's identity.
        if self.device.type == "cpu":
            return batch
        return Batch(batch.dense.to(self.device), batch.sparse.to(self.device), batch.labels.to(self.device))

    def run(self, batches: Iterator[Batch]) -> Iterator[StepStats]:
        """Train on every batch of ``batches``; yields one :class:`StepStats` per step."""
        ahead: collections.deque[tuple[Batch, bool]] = collections.deque()
        window = self.hybrid.max_staleness + 1
        exhausted = False
        self.model.train()
        index = 0
        while True:
            fetch = time.perf_counter()
            while not exhausted and len(ahead) < window:
                nxt = next(batches, None)
                if nxt is None:
                    exhausted = True
                else:
                    ahead.append((self._to_device(nxt), False))
            if not ahead:
                return
            start = time.perf_counter()
            ps_before = self.hybrid.ps_time_ms()
            with self.profiler.step(index) if self.profiler else contextlib.nullcontext():
                # Prefetch what the bound allows without waiting; the current batch (first) may wait: that wait is
                # part of the step (K = 0 waits for every trainer's update here).
                for k, (b, sent) in enumerate(ahead):
                    if sent:
                        continue
                    if not self.hybrid.prefetch(b.sparse, block=(k == 0)):
                        break
                    ahead[k] = (b, True)
                batch, _ = ahead.popleft()
                logits = self.model(batch.dense, batch.sparse).squeeze(-1)
                loss = self.loss_fn(logits, batch.labels)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                loss_value = float(loss.detach())
            index += 1
            end = time.perf_counter()
            ps_after = self.hybrid.ps_time_ms()

            def spent(label: str, after: dict[str, float] = ps_after, before: dict[str, float] = ps_before) -> float:
                return after.get(label, 0.0) - before.get(label, 0.0)

            yield StepStats(
                loss_value,
                (end - start) * 1e3,
                self.hybrid.staleness,
                batch.size,
                (start - fetch) * 1e3,
                spent(PS_WAIT),
                spent(PS_PUSH),
            )


# ---- data ----------------------------------------------------------------------------------------------------


def teacher_for(spec: ModelSpec, cfg: TrainConfig) -> Teacher:
    """The synthetic data's hidden teacher for ``spec``: one feature per table, ids drawn from
    ``teacher_rows_scale`` of each table's rows."""
    rows = {t.name: max(1, int(t.rows * cfg.teacher_rows_scale)) for t in spec.tables}
    return Teacher(features=tuple(t.name for t in spec.tables), rows=rows, seed=cfg.seed)


def _stream(spec: ModelSpec, cfg: TrainConfig, batch_size: int, *, eval_: bool, skip: int = 0) -> Iterator[Batch]:
    """This trainer's batches: global batch ``b`` of the stream goes to trainer ``b mod trainers``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    count = cfg.eval_batches if eval_ else cfg.steps
    if cfg.data == "synthetic":
        seed = cfg.seed + (_EVAL_SEED_OFFSET if eval_ else 0)
        # The synthetic held-out set is fixed (its own seed): a resumed run evaluates on the same samples.
        start = 0 if eval_ else skip
        data = SyntheticClicks(
            teacher_for(spec, cfg),
            batch_size=batch_size,
            num_batches=(start + count) * world,
            seed=seed,
            pooling={t.name: t.pooling_factor for t in spec.tables},  # the ids per sample the plan was priced for
        )
        for step in range(start, start + count):
            yield data.batch(step * world + rank)
        return
    path = criteo_path(cfg.data)
    assert path is not None  # TrainConfig accepts synthetic or criteo:PATH only
    reader = CriteoReader(criteo_files(path), batch_size=batch_size, num_workers=0, drop_last=True)
    # Training takes global batches [skip, steps) of the files, evaluation the eval_batches after the training ones.
    first = ((skip + cfg.steps) if eval_ else skip) * world  # eval: the batches right after this run's training
    last = first + count * world
    for b, batch in enumerate(reader):
        if b >= last:
            return
        if b >= first and (b - first) % world == rank:
            yield batch


def _lockstep(batches: Iterator[Batch]) -> Iterator[Batch]:
    """Stop every trainer at the same step when one runs out of data (collectives must match)."""
    for batch in batches:
        if dist.is_initialized():
            flag = torch.ones(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item() == 0:
                return
        yield batch
    if dist.is_initialized():
        flag = torch.zeros(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)


# ---- evaluation ----------------------------------------------------------------------------------------------


def _evaluate(model: nn.Module, batches: Iterator[Batch], device: torch.device | None = None) -> dict[str, float]:
    """AUC (torchmetrics), log loss and teacher AUC over every trainer's eval batches."""
    from torchmetrics.functional.classification import binary_auroc

    model.eval()
    preds, labels, probs = [], [], []
    with torch.no_grad():
        for b in _lockstep(batches):  # sharded tables answer in collectives: every trainer runs as many batches
            sparse = b.sparse if device is None or device.type == "cpu" else b.sparse.to(device)
            dense = b.dense if device is None else b.dense.to(device)
            preds.append(torch.sigmoid(model(dense, sparse).squeeze(-1)).cpu())
            labels.append(b.labels)
            if b.teacher_prob is not None:
                probs.append(b.teacher_prob)
    model.train()
    # A trainer may have no eval batch (a short Criteo file): it still joins the gathers, with nothing.
    p = torch.cat(preds) if preds else torch.empty(0)
    y = torch.cat(labels) if labels else torch.empty(0)
    t = torch.cat(probs) if probs else torch.empty(0)
    if dist.is_initialized():
        p, y, t = (_gather_1d(x) for x in (p, y, t))
    if y.numel() == 0:
        raise PlannerError(
            "no evaluation samples: the data ends before the held-out batches",
            fixes=("use more data, or fewer --steps / --eval-batches",),
        )
    out = {
        "auc": float(binary_auroc(p, y.long())),
        "eval_loss": float(nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y)),
        "eval_samples": int(y.numel()),
    }
    if t.numel():
        out["teacher_auc"] = float(binary_auroc(t, y.long()))  # the same AUC as data.teacher_auc, on these samples
    return out


def _gather_1d(x: torch.Tensor) -> torch.Tensor:
    n = torch.tensor([x.numel()])
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    widest = int(max(s.item() for s in sizes))
    padded = torch.zeros(widest, dtype=x.dtype)
    padded[: x.numel()] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)])


# ---- checkpoints ---------------------------------------------------------------------------------------------


def _local_state(hybrid: HybridEmbeddingBagCollection) -> dict[str, Any]:
    """The local tables' full weights and every trainer's fused-optimizer state, on trainer 0 (collectives: every
    trainer calls it; the others get empty maps)."""
    return {
        "local": {k: v.detach().clone() for k, v in hybrid.local_weights(dst=0).items()},
        "local_optimizer": hybrid.local.optimizer_pieces(dst=0) if hybrid.local is not None else {},
    }


def _save_trainer_state(
    path: Path,
    step: int,
    model: nn.Module,
    local: dict[str, Any],
    opt: Any,
    ps_version: int | None,
    layout: dict[str, Any],
) -> None:
    state = {
        "step": step,
        **layout,  # trainers, per-trainer batch size, data, seed: what `step` points at in the data stream
        "ps_version": ps_version,  # the PS checkpoint version saved with this state (see check_resume)
        "dense": {k: v.clone() for k, v in dense_state_dict(model).items()},
        "dense_optimizer": opt.state_dict(),
        **local,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_resume(directory: Path, with_ps: bool) -> dict[str, Any]:
    """The trainer state in ``directory``, after checking that it and the PS checkpoint belong together.

    ``client.save`` commits the PS version before ``trainer.pt`` is replaced, so a crash between the two leaves a
    newer PS version than the trainer state: resuming from that pair would replay updates onto rows that have them.

    Raises:
        PlannerError: No checkpoint, or a mismatched pair.
    """
    from .ps.checkpoint import read_latest

    path = check_resume_exists(directory)
    try:
        state = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as err:  # a truncated or foreign file: torch raises RuntimeError, pickle errors, EOFError...
        raise PlannerError(
            f"--resume: {path} is not a readable trainer checkpoint ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'})",
            fixes=("resume from another checkpoint directory", "train from scratch without --resume"),
        ) from None
    if not isinstance(state, dict) or not {"step", "dense", "local"} <= state.keys():
        raise PlannerError(
            f"--resume: {path} is not a trainer checkpoint of persia train (it lacks step/dense/local)",
            fixes=("resume from another checkpoint directory", "train from scratch without --resume"),
        )
    if not isinstance(state.get("local_optimizer"), dict):
        raise PlannerError(
            f"--resume: {path} was written by an earlier version of persia train (its local tables' optimizer "
            "state is not per shard)",
            fixes=("train from scratch without --resume",),
        )
    if with_ps:
        latest = read_latest(directory / "ps")
        have = latest["version"] if latest else None
        if have is None or have != state.get("ps_version"):
            raise PlannerError(
                f"--resume: {directory} holds trainer state for PS version {state.get('ps_version')} but the "
                f"parameter-server checkpoint is at version {have} (a save was interrupted?)",
                fixes=("resume from another checkpoint directory", "train from scratch without --resume"),
            )
    return state


def _data_layout(cfg: TrainConfig, spec: ModelSpec, trainers: int) -> dict[str, Any]:
    """What a step of the data stream is: the trainer count, the per-trainer batch size, the data and the seed
    (synthetic data: the teacher that labels the samples, and the samples) (saved, then checked on resume)."""
    return {
        "trainers": trainers,
        "batch_size": cfg.batch_size or max(1, spec.batch_size // trainers),
        "data": data_identity(cfg.data),
        "seed": cfg.seed,
    }


def _check_layout(path: Path, state: dict[str, Any], layout: dict[str, Any]) -> None:
    """Refuse to resume ``state`` (read from ``path``) with another data layout.

    A resumed run skips ``step`` global batches of trainers x batch_size samples: with another layout it would
    train on samples the checkpoint has seen, or skip some; with other data or another seed it would go on with
    another task. (Checkpoints from before these checks lack the keys.)
    """
    changed = {k: (state[k], v) for k, v in layout.items() if k in state and state[k] != v}
    if changed:
        what = ", ".join(f"{k} {was} (now {now})" for k, (was, now) in changed.items())
        raise PlannerError(
            f"--resume: checkpoint {path} was trained with {what}; resuming would replay or skip training data",
            fixes=(
                "resume with the --trainers, --batch-size, --data and --seed of the checkpointed run",
                "train from scratch",
            ),
        )


def _load_trainer_state(
    directory: Path, model: nn.Module, hybrid: HybridEmbeddingBagCollection, opt: Any, layout: dict[str, Any]
) -> int:
    path = directory / "trainer.pt"
    state = check_resume(directory, hybrid.ps is not None)
    _check_layout(path, state, layout)  # again: under torchrun no launcher checked it before the processes started
    own = model.state_dict()
    reshaped = [k for k, v in state["dense"].items() if k in own and tuple(own[k].shape) != tuple(v.shape)]
    if reshaped:
        k = reshaped[0]
        raise PlannerError(
            f"--resume: checkpoint {path} holds {k} of shape {tuple(state['dense'][k].shape)}, this model's is "
            f"{tuple(own[k].shape)} (saved with another model.yaml?)",
            fixes=("resume with the model the checkpoint was trained with", "train from scratch without --resume"),
        )
    _missing, unexpected = model.load_state_dict(state["dense"], strict=False)
    if unexpected:
        raise PlannerError(f"--resume: checkpoint {path} holds parameters {unexpected[:3]} this model lacks")
    opt.init_state()  # a zero-gradient step: every state exists (Adam creates its own at the first step) to load into
    opt.load_state_dict(state["dense_optimizer"])
    hybrid.load_local_weights(state["local"])
    if hybrid.local is not None:
        hybrid.local.load_optimizer_pieces(state["local_optimizer"])
    return int(state["step"])


# ---- one trainer ---------------------------------------------------------------------------------------------


@dataclass
class _Job:
    """What every trainer gets (picklable)."""

    cfg: TrainConfig
    spec: ModelSpec
    tables: dict[str, TablePlacement]
    topology: Topology
    servers: int
    trainers: int
    extra: dict[str, Any] = field(default_factory=dict)


def _trainer(j: int, client: Any, job: _Job) -> dict[str, Any] | None:
    """Body of trainer ``j`` (also under torchrun); returns the summary on trainer 0."""
    quiet_trainer()
    torch.set_num_threads(1)
    # The trainers' group rendezvous in the job's store (torchrun's agent or local_cluster's), under a prefix. gloo
    # carries the CPU collectives (ids, lockstep, metrics); on CUDA nccl carries TorchRec's all-to-alls and DDP's.
    timeout = datetime.timedelta(seconds=300)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=trainers_store(), rank=j, world_size=job.trainers, timeout=timeout)
    try:
        return _train(j, client, job)
    finally:
        dist.destroy_process_group()


def _train(j: int, client: Any, job: _Job) -> dict[str, Any] | None:
    cfg, spec = job.cfg, job.spec
    layout = _data_layout(cfg, spec, job.trainers)
    batch_size = layout["batch_size"]
    sparse_opt = SparseOptimizer(sparse_optimizer_of(cfg, spec), learning_rate=cfg.sparse_lr)
    # TorchRec groups ranks into nodes by LOCAL_WORLD_SIZE / LOCAL_RANK (table-row-wise and grid shardings); under
    # torchrun they count the server processes too. The plan's nodes are the topology's hosts: say so.
    per_host = len(job.topology.trainers[0].gpus)
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(per_host), str(j % per_host)
    device = torch.device("cpu")
    if torch.cuda.is_available():  # trainer j is GPU j % per_host of its host, as in the plan
        device = torch.device("cuda", (j % per_host) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model, hybrid = build_model(
        spec,
        job.tables,
        ps=client,
        optimizer=sparse_opt,
        staleness=cfg.effective_staleness,
        seed=cfg.seed,
        ps_servers=job.servers,
        device=device,
        local_device=torch.device("meta"),  # only the shards this trainer holds are allocated, by DMP
    )
    dmp = distribute(model, job.tables, job.topology, device=device)
    executed = executed_plan(model, job.topology)
    opt = make_optimizer(model, cfg, sparse_opt)
    start_step = 0
    ckpt = Path(cfg.checkpoint) if cfg.checkpoint else None
    if cfg.resume and ckpt is not None:
        start_step = _load_trainer_state(ckpt, model, hybrid, opt, layout)
        if j == 0 and hybrid.ps is not None:
            client.load(ckpt / "ps")
        dist.barrier()

    history: list[dict[str, Any]] = []
    losses: list[float] = []
    step_ms: list[float] = []
    # Every trainer profiles the same window (a profiled trainer is slower: the others would wait in collectives).
    # Not with PS tables: a trainer crashed (SIGSEGV) under torch.profiler with RPCs in flight (decision 0014).
    warmup = min(10, cfg.steps // 4)
    profiler = None
    if cfg.steps >= 4 and hybrid.ps is None:
        profiler = StepProfiler(warmup, min(10, max(1, cfg.steps // 4)))
    data_ms: list[float] = []
    ps_ms: dict[str, list[float]] = {"ps_wait": [], "push": []}
    loop = TrainLoop(dmp, hybrid, opt, device, profiler)
    progress = _progress(cfg) if (j == 0 and cfg.progress) else None
    task = progress.add_task("train", total=cfg.steps, loss=float("nan"), rate=0.0, stale=0) if progress else None
    t0 = time.perf_counter()
    eval_s = 0.0
    samples = excluded_samples = excluded_steps = 0
    step = start_step
    try:
        if progress:
            progress.start()
        batches = _stream(spec, cfg, batch_size, eval_=False, skip=start_step)
        if cfg.data != "synthetic":  # every trainer gets exactly cfg.steps synthetic batches: no count to agree on
            batches = _lockstep(batches)
        for stats in loop.run(batches):
            step += 1
            losses.append(stats.loss)
            step_ms.append(stats.step_ms)
            data_ms.append(stats.data_ms)
            ps_ms["ps_wait"].append(stats.ps_wait_ms)
            ps_ms["push"].append(stats.push_ms)
            samples += stats.samples * job.trainers
            index = step - start_step - 1
            if profiler is not None and profiler.start <= index < profiler.start + profiler.count:
                # The breakdown's profiled steps run slower: they are measurement, not training throughput.
                eval_s += (stats.step_ms + stats.data_ms) / 1e3
                excluded_samples += stats.samples * job.trainers
                excluded_steps += 1
            rate = (samples - excluded_samples) / max(1e-9, time.perf_counter() - t0 - eval_s)
            history.append({"step": step, "loss": stats.loss, "samples": samples, "staleness": stats.staleness})
            if progress:
                progress.update(task, advance=1, loss=_ema(losses), rate=rate, stale=stats.staleness)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < start_step + cfg.steps:
                eval_started = time.perf_counter()
                hybrid.flush()
                dist.barrier()  # every trainer's pushes are applied before anyone evaluates
                history[-1].update(_evaluate(dmp, _stream(spec, cfg, batch_size, eval_=True, skip=start_step), device))
                eval_s += time.perf_counter() - eval_started
        hybrid.flush()
        # Training throughput: the evaluations along the way (they would halve it at eval_every=1) and the profiled
        # steps are not training.
        elapsed = time.perf_counter() - t0 - eval_s
    finally:
        if progress:
            progress.stop()
    dist.barrier()  # every trainer's pushes are applied before the checkpoint and the evaluation
    if ckpt is not None:  # before the evaluation: an evaluation that fails (e.g. no held-out data left) loses nothing
        local = _local_state(hybrid)  # gathers every trainer's shards
        if j == 0:
            # keep=2: this version and the one before; every run into the directory would otherwise add a full copy
            version = client.save(ckpt / "ps", keep=2) if hybrid.ps is not None else None
            _save_trainer_state(ckpt / "trainer.pt", step, model, local, opt, version, layout)
        dist.barrier()
    result = _evaluate(dmp, _stream(spec, cfg, batch_size, eval_=True, skip=start_step), device)
    if history:
        history[-1].update(result)
    if j != 0:
        return None
    tail = losses[-max(1, len(losses) // 10) :]
    steps_done = step - start_step
    timed = _unprofiled(step_ms, profiler)
    breakdown = {"data": _median(_unprofiled(data_ms, profiler))}
    if profiler is not None and profiler.shares is not None:
        breakdown |= {term: share * _median(timed) for term, share in profiler.shares.items()}
    elif hybrid.ps is not None:  # not profiled (decision 0014): the PS terms are timed directly, the rest together
        breakdown |= {term: _median(_unprofiled(xs, profiler)) for term, xs in ps_ms.items()}
        breakdown["other"] = max(0.0, _median(timed) - breakdown["ps_wait"] - breakdown["push"])
    return {
        **result,
        "teacher_auc": result.get("teacher_auc"),
        "loss": sum(tail) / len(tail) if tail else float("nan"),
        "samples_per_s": (samples - excluded_samples) / elapsed if elapsed > 0 else 0.0,
        "step_ms": _median(timed),
        "step_breakdown_ms": breakdown,
        "wall_step_ms": elapsed * 1e3 / max(1, steps_done - excluded_steps),
        "batch_size": batch_size * job.trainers,
        "steps": steps_done,
        "first_step": start_step,
        "staleness": cfg.effective_staleness,
        "staleness_max_seen": hybrid.staleness_max_seen,
        "mode": cfg.mode.value,
        "trainers": job.trainers,
        "servers": job.servers if hybrid.ps is not None else 0,
        "ps_tables": [c.name for c in hybrid.ps_tables],
        "local_tables": [c.name for c in hybrid.local_tables],
        "executed_plan": executed,
        "executed_matches_plan": executed == planned_execution(job.tables, spec, job.topology),
        "ps_delay_ms": cfg.ps_delay_ms,
        "ps_wire": cfg.ps_wire.value,
        "data": cfg.data,
        "seed": cfg.seed,
        "history": history,
    }


def _unprofiled(xs: list[float], profiler: StepProfiler | None) -> list[float]:
    """The steps after warm-up, without the profiled ones (the profiler's overhead inflates them)."""
    if profiler is None:
        return xs
    kept = xs[profiler.start + profiler.count :]
    return kept or xs


def _median(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[len(s) // 2]


def _ema(xs: list[float], window: int = 20) -> float:
    tail = xs[-window:]
    return sum(tail) / len(tail)


def _progress(cfg: TrainConfig) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]train[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[rate]:,.0f} samples/s"),
        TextColumn("staleness {task.fields[stale]}" + f"/{cfg.effective_staleness}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )


# A trainer's PS request timeout, on one machine and under torchrun alike: checkpoint saves and loads of large
# tables are requests too, and take far longer than the client's 10 s default for lookups.
PS_REQUEST_TIMEOUT_S = 60.0


# ---- launchers -----------------------------------------------------------------------------------------------


def _check_plan_runs(cfg: TrainConfig, spec: ModelSpec, tables: dict[str, TablePlacement], topology: Topology) -> None:
    """Before any process starts: the trainers are the plan's ranks, and TorchRec runs every table as planned."""
    check_trainers(cfg.trainers, topology)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_executable(tables, device, dtype=spec.embedding_dtype, optimizer=sparse_optimizer_of(cfg, spec))


def train_local(
    cfg: TrainConfig,
    spec: ModelSpec,
    tables: dict[str, TablePlacement],
    *,
    servers: int,
    topology: Topology,
    run_timeout_s: float = 3600,
) -> dict[str, Any]:
    """Run ``servers`` PS processes and ``cfg.trainers`` trainers on this machine; returns trainer 0's summary.

    ``topology`` is the one the plan was made for: trainer ``r`` runs what the plan put on ``topology.gpus[r]``.
    """
    from .ps.launch import local_cluster

    has_ps = any(p.mode is Mode.ASYNC for p in tables.values())
    check_before_start(cfg, spec, with_ps=has_ps)
    _check_plan_runs(cfg, spec, tables, topology)
    if cfg.resume and cfg.checkpoint:  # here, before any process starts
        path = Path(cfg.checkpoint)
        _check_layout(path / "trainer.pt", check_resume(path, has_ps), _data_layout(cfg, spec, cfg.trainers))
    job = _Job(cfg, spec, dict(tables), topology, servers if has_ps else 0, cfg.trainers)
    results = local_cluster(
        job.servers,
        cfg.trainers,
        _trainer,
        job,
        delay_ms=cfg.ps_delay_ms,
        wire_dtype=cfg.ps_wire_dtype,
        timeout_s=PS_REQUEST_TIMEOUT_S,
        run_timeout_s=run_timeout_s,
    )
    return results[0]


def torchrun_role(servers: int, environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """This torchrun process's role: ``("server", i)`` serves as ``ps{i}``, ``("trainer", j)`` trains as rank ``j``.

    The servers are spread over the nodes: with ``N`` nodes of ``L`` processes each and ``servers`` a multiple of
    ``N``, the first ``servers / N`` local ranks of every node serve and the rest train (one node: ranks
    ``< servers`` serve, as before). Otherwise global ranks ``< servers`` serve. Server and trainer indices follow
    node order, so trainer ``j`` is ``topology.gpus[j]`` whatever the layout.
    """
    env = os.environ if environ is None else environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local, per_node = int(env.get("LOCAL_RANK", rank)), int(env.get("LOCAL_WORLD_SIZE", world))
    nodes = world // per_node if per_node and world % per_node == 0 else 1
    if nodes > 1 and servers % nodes == 0 and per_node > servers // nodes:
        node, serving = rank // per_node, servers // nodes
        if local < serving:
            return "server", node * serving + local
        return "trainer", node * (per_node - serving) + local - serving
    return ("server", rank) if rank < servers else ("trainer", rank - servers)


def train_torchrun(
    cfg: TrainConfig, spec: ModelSpec, tables: dict[str, TablePlacement], *, servers: int, topology: Topology
) -> Any:
    """The same job under ``torchrun``, on one node or several: some processes serve the PS tables, the others
    train (:func:`torchrun_role`).

    RPC and the trainers' gloo group both rendezvous in torchrun's store at ``MASTER_ADDR:MASTER_PORT``.
    Returns the summary on the first trainer, None elsewhere.
    """
    from .ps import server as ps_server
    from .ps.protocol import server_name
    from .ps.trainer import joined

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world <= servers:
        raise PlannerError(f"torchrun world size {world} leaves no trainer after {servers} parameter servers")
    check_before_start(cfg, spec, with_ps=any(p.mode is Mode.ASYNC for p in tables.values()))
    cfg = replace(cfg, trainers=world - servers)
    check_trainers(cfg.trainers, topology, torchrun_servers=servers)
    role, index = torchrun_role(servers)
    if role == "server":
        ps_server.serve(rank, world, name=server_name(index))
        return None
    _check_plan_runs(cfg, spec, tables, topology)  # the trainers' hardware is checked where they run
    job = _Job(cfg, spec, dict(tables), topology, servers, world - servers)
    # joined: a failed step leaves at once; a server lost at the end is named within the peer timeout, not awaited.
    with joined(
        f"trainer{index}",
        rank,
        world,
        timeout_s=PS_REQUEST_TIMEOUT_S,
        delay_ms=cfg.ps_delay_ms,
        wire_dtype=cfg.ps_wire_dtype,
    ) as client:
        return _trainer(index, client, job)


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary table's rows (metric, value)."""
    rows = [
        ("AUC", f"{result['auc']:.4f}"),
        ("teacher AUC (best possible)", f"{result['teacher_auc']:.4f}" if result.get("teacher_auc") else "-"),
        ("train loss (last 10%)", f"{result['loss']:.4f}"),
        ("eval log loss", f"{result['eval_loss']:.4f}"),
        ("samples/s", f"{result['samples_per_s']:,.0f}"),
        ("step ms (median, after warm-up)", f"{result['step_ms']:.1f}"),
        (
            "  of which (ms)",
            ", ".join(f"{k} {v:.1f}" for k, v in result.get("step_breakdown_ms", {}).items() if k != "data") or "-",
        ),
        ("data ms per step (not in the step)", f"{result.get('step_breakdown_ms', {}).get('data', 0.0):.1f}"),
        ("global batch x steps", f"{result['batch_size']} x {result['steps']}"),
        ("staleness K (max seen)", f"{result['staleness']} ({result['staleness_max_seen']})"),
        ("trainers / PS servers", f"{result['trainers']} / {result['servers']}"),
        ("PS wire dtype", result["ps_wire"]),
        ("PS tables (async)", ", ".join(result["ps_tables"]) or "-"),
        ("local tables (sync)", f"{len(result['local_tables'])}"),
        ("executed as planned", "yes" if result.get("executed_matches_plan") else "no"),
    ]
    return rows
