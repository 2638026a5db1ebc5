"""What a trainer runs: the model's DLRM or DLRM_DCN over a
:class:`~persia_planner.modules.embedding.hybrid.HybridEmbeddingBagCollection`, its optimizers, and the step loop that
reads up to ``K`` batches ahead and asks the hybrid module to prefetch their PS rows whenever the staleness bound allows
it without waiting, so lookups travel while earlier batches compute and gradient pushes never block the step.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from persia_planner.kinds import Mode
from persia_planner.model.dense import ArchKind, DenseArch
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.data.batch import Batch, as_batches
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
from persia_planner.modules.embedding.model_parallel import (
    data_parallel_tables,
    dense_parameters,
    hybrids_of,
    sparse_torch_optimizer,
)
from persia_planner.modules.step_breakdown import PS_PUSH, PS_WAIT, StepProfiler
from persia_planner.modules.train.config import (
    DenseOptimizer,
    TrainConfig,
    sparse_eps_of,
    sparse_optimizer_of,
    trainer_batch_size,
)
from persia_planner.modules.train.lr_schedule import ScheduledRates
from persia_planner.modules.train.run_inputs import dense_arch, dlrm_embedding_dim
from persia_planner.placement.shards import TablePlacement, server_store_rows

if TYPE_CHECKING:
    from persia_planner.modules.embedding.hybrid_set import HybridSet, TrainedTables
    from persia_planner.modules.train.job import Job

__all__ = [
    "StepStats",
    "TrainLoop",
    "add_dropout",
    "build_job_model",
    "build_model",
    "dense_state_dict",
    "load_dense_state_dict",
    "make_optimizer",
    "schedule_steps",
    "scheduled_optimizer",
    "sequence_model",
    "sparse_optimizer",
    "torchrec_model",
]


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
    arch: DenseArch | None = None,
    device: torch.device | None = None,
    local_device: torch.device | None = None,
    capacity: Mapping[str, int] | None = None,
    ssd_dir: str | None = None,
) -> tuple[nn.Module, TrainedTables]:
    """TorchRec's ``DLRM`` or ``DLRM_DCN`` (``arch``, default the model's ``dense:``, :attr:`.DenseSpec.built_arch`)
    over ``spec``'s tables with a :class:`HybridEmbeddingBagCollection` (one line differs from plain TorchRec); a
    model with sequence tables: :class:`~persia_planner.modules.train.din.DIN` over that collection (of its pooled
    tables) and a :class:`~persia_planner.modules.embedding.sequence_hybrid.HybridEmbeddingCollection` (of its
    sequence tables), driven as one :class:`~persia_planner.modules.embedding.hybrid_set.HybridSet`.
    Returns ``(model, tables)``; shard it with :func:`persia_planner.modules.embedding.model_parallel.distribute`.

    Each server's store of a PS table gets the rows the plan sized it for (each shard's ``store_rows``: the rows of
    its largest bucket plus the hash's allowance), or ``capacity[table]`` where given (``--ps-capacity unbounded``).
    A table on a server tier with a cache (``TierSpec.cached``: the ``ssd`` tier) keeps its ``backing_rows`` in the
    tier's backing memory (the servers' disks, their files in ``ssd_dir``) under that cache; each table's store is
    its tier's (``TierSpec.store``).

    Raises:
        PlannerError: The tables do not share one embedding dim (DLRM's interaction needs it).
    """
    from persia_planner.plan.torchrec_export import to_embedding_bag_configs

    dim = dlrm_embedding_dim(spec)
    # Each server's store: the rows the plan sized it for (plan.json's store_rows, room for the hash's imbalance
    # included); on a tier with a cache, the cache's, over its backing rows. A plan written before plan.json recorded
    # them gets what the plan charged.
    given = capacity or {}
    remote = [t for t in spec.tables if tables is not None and tables[t.name].mode is Mode.ASYNC]
    capacity, backing = {}, {}
    for t in remote:
        placement = tables[t.name]  # type: ignore[index]
        shard = placement.shards[0]
        store, back = (
            (shard.store_rows, shard.backing_rows)
            if shard.store_rows is not None
            else server_store_rows(t.rows, ps_servers, placement.tier, shard.cache_fraction or 0.0)
        )
        if back:  # --ps-capacity widens the backing rows; the cache stays the plan's
            capacity[t.name], backing[t.name] = store, max(given.get(t.name, 0), back)
        else:
            capacity[t.name] = given.get(t.name, store)
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        ps=ps,
        optimizer=optimizer,
        staleness=staleness,
        ps_capacity=capacity,
        ps_backing=backing,
        ps_store_dir=ssd_dir,
        seed=seed,
        device=device,
        local_device=local_device,
    )
    arch = arch or spec.dense.built_arch
    if not any(t.sequence for t in spec.tables):
        # DLRM reads the pooled embeddings by key
        hybrid = HybridEmbeddingBagCollection(to_embedding_bag_configs(spec), tables, keep_order=False, **common)
        return torchrec_model(hybrid, arch, dim), hybrid
    return sequence_model(spec, tables, arch, dim, common)


def sequence_model(
    spec: ModelSpec,
    tables: dict[str, TablePlacement] | None,
    arch: DenseArch,
    dim: int,
    collections: Mapping[str, Any],
) -> tuple[nn.Module, HybridSet]:
    """:func:`build_model` of a model with sequence tables: DIN over a bag collection of its pooled tables (if any)
    and a sequence collection of the others, each given its tables' placements and ``collections``' arguments."""
    from persia_planner.modules.embedding.hybrid_set import HybridSet
    from persia_planner.modules.embedding.sequence_hybrid import HybridEmbeddingCollection
    from persia_planner.modules.train.din import DIN
    from persia_planner.plan.torchrec_export import to_embedding_bag_configs, to_embedding_configs

    def placed(sequence: bool) -> dict[str, TablePlacement] | None:
        if tables is None:
            return None
        return {t.name: tables[t.name] for t in spec.tables if t.sequence is sequence}

    bag_configs = to_embedding_bag_configs(spec)
    bags = None
    if bag_configs:
        bags = HybridEmbeddingBagCollection(bag_configs, placed(False), keep_order=False, **collections)
    sequences = HybridEmbeddingCollection(to_embedding_configs(spec), placed(True), **collections)
    pooled = [c.name for c in bag_configs]
    longest = {t.name: t.max_sequence_length for t in spec.tables if t.sequence and t.max_sequence_length}
    candidates = {t.name: t.candidate for t in spec.tables if t.candidate}
    keys = [t.name for t in spec.tables if t.sequence]
    model = DIN(bags, sequences, arch, dim, pooled, keys, longest, candidates)
    return model, HybridSet([c for c in (bags, sequences) if c is not None])


def build_job_model(
    job: Job,
    client: Any,
    optimizer: SparseOptimizer,
    *,
    device: torch.device | None = None,
    capacity: Mapping[str, int] | None = None,
) -> tuple[nn.Module, TrainedTables]:
    """:func:`build_model` as every trainer of ``job`` builds it: the run's staleness (0 in sync mode), seed, server
    count and dense arch, its PS tables through ``client``, and its local tables on the meta device, for
    ``DistributedModelParallel`` to allocate the shards this trainer holds."""
    cfg = job.cfg
    return build_model(
        job.spec,
        job.tables,
        ps=client,
        optimizer=optimizer,
        staleness=cfg.effective_staleness,
        seed=cfg.seed,
        ps_servers=job.servers,
        arch=dense_arch(job.spec, cfg),
        device=device,
        local_device=torch.device("meta"),
        capacity=capacity,
        ssd_dir=cfg.ssd_dir,
    )


def torchrec_model(embeddings: nn.Module, arch: DenseArch, dim: int) -> nn.Module:
    """TorchRec's ``DLRM`` or ``DLRM_DCN`` as ``arch`` describes it, over ``embeddings`` (an
    ``EmbeddingBagCollection`` or a :class:`HybridEmbeddingBagCollection`) whose tables all have ``dim`` columns,
    with the arch's dropout (:func:`add_dropout`)."""
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    sizes: dict[str, Any] = {
        "embedding_bag_collection": embeddings,
        "dense_in_features": arch.num_dense,
        "dense_arch_layer_sizes": [*arch.bottom, dim],
        "over_arch_layer_sizes": list(arch.over),
    }
    if arch.kind is ArchKind.DCN:
        model = DLRM_DCN(**sizes, dcn_num_layers=arch.dcn_layers, dcn_low_rank_dim=arch.dcn_low_rank)
    else:
        model = DLRM(**sizes)
    if arch.dropout:
        add_dropout(model, arch.dropout)
    return model


def add_dropout(model: nn.Module, p: float) -> None:
    """Dropout with probability ``p`` on the output of the hidden layers of a TorchRec ``DLRM``'s (or
    ``DLRM_DCN``'s) bottom MLP (all but its last layer, the dense embedding the interaction reads) and over arch
    (its MLP: every layer but the final logit), in training mode only.

    Forward hooks on TorchRec's ``Perceptron`` layers, so the model's parameters and ``state_dict`` keys stay
    TorchRec's own (checkpoints of runs with and without dropout load alike).
    """
    from torchrec.modules.mlp import Perceptron

    def dropped(layer: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(output, p, training=layer.training)

    bottom = [m for m in model.dense_arch.modules() if isinstance(m, Perceptron)]
    over = [m for m in model.over_arch.modules() if isinstance(m, Perceptron)]
    for layer in bottom[:-1] + over:
        layer.register_forward_hook(dropped)


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state without its hybrid collections (detached, not copied)."""
    found = hybrids_of(model)
    prefixes = tuple(f"{path}." for path, _ in found if path)
    with contextlib.ExitStack() as stack:
        for _, hybrid in found:  # the servers' rows are not read for nothing
            stack.enter_context(hybrid.ps_rows_left_out())
        state = model.state_dict()
    return {k: v.detach() for k, v in state.items() if not (prefixes and k.startswith(prefixes))}


def load_dense_state_dict(model: nn.Module, dense: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load ``dense`` (:func:`dense_state_dict`'s) into ``model``, its hybrid collections as they are; returns
    ``load_state_dict``'s ``(missing, unexpected)`` keys.

    The collections' own state goes in with it, unchanged: TorchRec's sharded sequence collection asks for every
    table's key when anything is loaded into a model holding it.
    """
    found = hybrids_of(model)
    prefixes = tuple(f"{path}." for path, _ in found if path)
    with contextlib.ExitStack() as stack:
        for _, hybrid in found:  # their local tables only: the servers' rows stay on the servers
            stack.enter_context(hybrid.ps_rows_left_out())
        current = {k: v for k, v in model.state_dict(keep_vars=True).items() if prefixes and k.startswith(prefixes)}
        missing, unexpected = model.load_state_dict({**current, **dense}, strict=False)
    return list(missing), list(unexpected)


def sparse_optimizer(cfg: TrainConfig, spec: ModelSpec) -> SparseOptimizer:
    """The tables' optimizer of a run of ``spec`` under ``cfg``: its kind (:func:`.config.sparse_optimizer_of`),
    learning rate, decoupled weight decay and epsilon (:func:`.config.sparse_eps_of`), the same
    on the local and the PS tables."""
    return SparseOptimizer(
        sparse_optimizer_of(cfg, spec),
        learning_rate=cfg.sparse_lr,
        weight_decay=cfg.sparse_weight_decay,
        **({} if (eps := sparse_eps_of(cfg, spec)) is None else {"eps": eps}),
    )


def make_optimizer(model: nn.Module, cfg: TrainConfig, sparse: SparseOptimizer) -> Any:
    """The optimizer a step calls: the dense one over the dense parameters, the sparse one over local tables that
    fbgemm does not update in its fused backward (data-parallel replicas). Fused tables need none."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    def dense_opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        kind = {
            DenseOptimizer.SGD: torch.optim.SGD,
            DenseOptimizer.ADAGRAD: torch.optim.Adagrad,
            DenseOptimizer.ADAM: torch.optim.Adam,
        }[cfg.dense_optimizer]
        return kind(params, lr=cfg.dense_lr)

    def sparse_opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return sparse_torch_optimizer(
            sparse.kind, params, lr=sparse.learning_rate, eps=sparse.eps, weight_decay=sparse.weight_decay
        )

    parts = [(dense_parameters(model), dense_opt), (data_parallel_tables(model), sparse_opt)]
    return CombinedOptimizer([KeyedOptimizerWrapper(p, make) for p, make in parts if p])


def scheduled_optimizer(
    cfg: TrainConfig, spec: ModelSpec, trainers: int, opt: Any, dmp: nn.Module, step: int, target_step: int | None
) -> tuple[Any, ScheduledRates]:
    """The optimizer a trainer's steps call, and ``cfg.lr_schedule`` over it from the job's step ``step``.

    It is TorchRec's ``CombinedOptimizer`` of ``opt`` (:func:`make_optimizer`'s) and ``dmp.fused_optimizer`` (the
    tables TorchRec's optimizer reaches), as TorchRec's examples step them: one ``LambdaLR`` over it moves the dense
    rates and every table's alike. ``target_step``: the job's last step when ``--steps`` sets it.
    """
    from torchrec.optim.keyed import CombinedOptimizer

    stepped = CombinedOptimizer([("dense", opt), ("tables", dmp.fused_optimizer)])
    total = schedule_steps(cfg, spec, trainers, target_step)
    return stepped, ScheduledRates(stepped, cfg.lr_schedule, total, step)


def schedule_steps(cfg: TrainConfig, spec: ModelSpec, trainers: int, target_step: int | None) -> int | None:
    """The job's steps, where a learning-rate decay ends: ``target_step``, at most (data files) the epochs' steps at
    the counted rows; the same whatever step a resumed run starts from (None: neither is known)."""
    known = [target_step] if target_step is not None else []
    if cfg.data_rows:
        known.append(cfg.passes * (cfg.data_rows // (trainers * trainer_batch_size(cfg, spec, trainers))))
    return max(1, min(known)) if known else None


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
        profiler: Profiles a window of steps for the step-time breakdown (see
            :mod:`persia_planner.modules.step_breakdown`).
    """

    def __init__(
        self,
        model: nn.Module,
        hybrid: TrainedTables,
        optimizer: torch.optim.Optimizer,
        device: torch.device | None = None,
        profiler: StepProfiler | None = None,
    ):
        self.model, self.hybrid, self.optimizer = model, hybrid, optimizer
        self.device = device or torch.device("cpu")
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.profiler = profiler

    def scoring_model(self) -> nn.Module:
        """The model to evaluate with between steps: the one it trains."""
        return self.model

    def _to_device(self, batch: Batch) -> Batch:
        # Moved once, when read: the module matches a forward to its prefetch by the KJT's identity.
        if self.device.type == "cpu":
            return batch
        return Batch(batch.dense.to(self.device), batch.sparse.to(self.device), batch.labels.to(self.device))

    def run(self, batches: Iterable[Any]) -> Iterator[StepStats]:
        """Train on every batch of ``batches`` (ours, or TorchRec's ``Batch`` es: :func:`.data.batch.as_batch`);
        yields one :class:`StepStats` per step."""
        batches = as_batches(batches)
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
