"""Check a hybrid run against plain TorchRec: with staleness 0 the losses must match step by step.

:func:`compare_with_torchrec` trains, in the same trainer processes and on the same batches, the hybrid DLRM
(:func:`persia_planner.modules.train.loop.build_job_model`, sharded by
:func:`persia_planner.modules.embedding.model_parallel.distribute`: local tables sharded by the plan in TorchRec's
``DistributedModelParallel``, PS tables on the parameter servers, dense part under DDP) and
a reference: TorchRec's ``DLRM`` over a plain ``EmbeddingBagCollection`` holding every table, the whole model under
``DistributedDataParallel``. The reference starts from the hybrid's initial weights (local tables and dense layers
copied; PS rows read from the servers). Dense layers use SGD; embedding tables SGD or row-wise Adagrad (TorchRec's
``RowWiseAdagrad`` on the reference, fbgemm's fused one on local tables, the servers' on PS tables: one formula).
With K = 0 hybrid training is then the same algorithm: each step's embedding gradient is the trainers' average,
applied once per id (the trainers gather their PS gradients and push each id once; see
:mod:`persia_planner.modules.embedding.hybrid`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import PlannerError
from persia_planner.kinds import Mode
from persia_planner.model.specs import ModelSpec, Optimizer, with_run_options
from persia_planner.modules.data.batch import Batch
from persia_planner.modules.data.synthetic import SyntheticClicks, Teacher
from persia_planner.modules.embedding.hybrid import SparseOptimizer
from persia_planner.modules.embedding.model_parallel import distribute, sparse_torch_optimizer
from persia_planner.modules.train.config import TrainMode
from persia_planner.modules.train.job import Job, trainer_group
from persia_planner.modules.train.loop import build_job_model, dense_state_dict, make_optimizer, torchrec_model
from persia_planner.modules.train.run_model import run_config
from persia_planner.placement.shards import TablePlacement
from persia_planner.topology.graph import Topology

__all__ = ["compare_with_torchrec", "in_range"]


def in_range(batch: Batch, spec: ModelSpec) -> Batch:
    """The batch with every id reduced modulo its table's rows, so that a plain EmbeddingBagCollection accepts it
    and a PS table's id ``i`` is the reference's row ``i``."""
    kjt = batch.sparse
    keys = kjt.keys()
    rows = torch.tensor([spec.table(k).rows for k in keys], dtype=torch.int64)
    per_key = kjt.lengths().view(len(keys), -1).sum(1)
    values = torch.remainder(kjt.values(), rows.repeat_interleave(per_key))
    sparse = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    return Batch(batch.dense, sparse, batch.labels, batch.teacher_prob)


def _worker(j: int, client: Any, job: Job) -> dict[str, list[float]]:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from persia_planner.plan.torchrec_export import to_embedding_bag_configs

    cfg = job.cfg
    # nodes_from_topology=False: TorchRec takes its nodes from the environment here, as this check always has.
    with trainer_group(j, job, nodes_from_topology=False):
        spec = job.spec
        sparse = SparseOptimizer(cfg.sparse_optimizer, learning_rate=cfg.sparse_lr, eps=_EPS)
        model, hybrid = build_job_model(job, client, sparse, device=torch.device("cpu"))
        hyb_net = distribute(model, job.tables, job.topology)
        dim = spec.tables[0].dim
        reference = torchrec_model(
            EmbeddingBagCollection(tables=to_embedding_bag_configs(spec)), spec.dense.built_arch, dim
        )
        # Same starting point: the hybrid's dense layers and local tables, and the PS rows as the servers hold them.
        _missing, unexpected = reference.load_state_dict(dense_state_dict(model), strict=False)
        assert not unexpected, unexpected
        bags = reference.sparse_arch.embedding_bag_collection.embedding_bags
        start: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, weight in hybrid.local_weights().items():
                bags[name].weight.copy_(weight)
            ps_names = [n for n, p in job.tables.items() if p.mode is Mode.ASYNC]
            for turn in range(job.trainers):  # one trainer at a time: the first admits and initialises the rows
                if turn == j:
                    for name in ps_names:
                        bags[name].weight.copy_(client.lookup(name, torch.arange(spec.table(name).rows)))
                dist.barrier()
            start = {name: bag.weight.detach().clone() for name, bag in bags.items()}
        ref_ddp = nn.parallel.DistributedDataParallel(reference)
        ref_opt = _reference_optimizer(reference, job)
        hyb_opt = make_optimizer(model, cfg, sparse)  # dense: SGD at the same learning rate
        teacher = Teacher(features=tuple(t.name for t in spec.tables), rows={t.name: t.rows for t in spec.tables})
        assert cfg.batch_size is not None
        data = SyntheticClicks(teacher, batch_size=cfg.batch_size, num_batches=cfg.steps * job.trainers, seed=cfg.seed)
        loss_fn = nn.BCEWithLogitsLoss()
        out: dict[str, list[float]] = {"hybrid": [], "reference": []}
        batches = [in_range(data.batch(step * job.trainers + j), spec) for step in range(cfg.steps)]
        prefetched = 0
        for step, batch in enumerate(batches):
            # As TrainLoop does: request the PS rows of up to K coming batches when the bound allows it.
            while prefetched < min(cfg.steps, step + cfg.staleness + 1):
                if not hybrid.prefetch(batches[prefetched].sparse, block=prefetched == step):
                    break
                prefetched += 1
            for key, net, opt in (("hybrid", hyb_net, hyb_opt), ("reference", ref_ddp, ref_opt)):
                loss = loss_fn(net(batch.dense, batch.sparse).squeeze(-1), batch.labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                out[key].append(float(loss.detach()))
        hybrid.flush()
        dist.barrier()
        # Every table's rows after training, the hybrid's (local shards gathered; PS rows as the servers hold them)
        # against the reference's: a loss can match while the embeddings moved differently.
        trained = hybrid.local_weights()
        trained |= {n: client.lookup(n, torch.arange(spec.table(n).rows), train=False) for n in ps_names}
        by_table = {n: float((trained[n] - bags[n].weight.detach()).abs().max()) for n in trained}
        out["weight_diff"] = [max(by_table.values())]
        out["worst_table"] = [max(by_table, key=by_table.get)]
        out["weight_moved"] = [min(float((trained[n] - start[n]).abs().max()) for n in trained)]
        return out


_EPS = 1e-8


def _reference_optimizer(reference: nn.Module, job: Job) -> Any:
    """SGD on the dense layers; the job's sparse optimizer (SGD or TorchRec's row-wise Adagrad) on the tables."""
    kind, lr = job.cfg.sparse_optimizer, job.cfg.sparse_lr
    if kind is Optimizer.SGD:
        return torch.optim.SGD(reference.parameters(), lr=lr)
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    tables = {n: p for n, p in reference.named_parameters() if "embedding_bags" in n}
    dense = {n: p for n, p in reference.named_parameters() if n not in tables}
    return CombinedOptimizer(
        [
            KeyedOptimizerWrapper(tables, lambda ps: sparse_torch_optimizer(kind, ps, lr=lr, eps=_EPS)),
            KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=lr)),
        ]
    )


def compare_with_torchrec(
    spec: ModelSpec,
    tables: dict[str, TablePlacement],
    topology: Topology,
    *,
    steps: int = 50,
    trainers: int = 2,
    servers: int = 1,
    batch_size: int = 256,
    learning_rate: float = 0.05,
    sparse_optimizer: Optimizer | str = Optimizer.SGD,
    seed: int = 0,
    staleness: int = 0,
) -> dict[str, Any]:
    """Train hybrid (K = 0) and TorchRec ``EmbeddingBagCollection`` + DDP side by side on the same batches.

    Args:
        spec: The model (every table's ids are reduced modulo its rows so the reference can hold it).
        tables: The plan's placements (PS tables go to ``servers`` parameter servers).
        topology: The plan's topology (one trainer per device).
        steps: Training steps.
        trainers: Trainer processes (both models run in each).
        servers: Parameter-server processes.
        batch_size: Samples per trainer and step.
        learning_rate: Learning rate of every parameter, sparse and dense.
        sparse_optimizer: ``sgd`` or ``rowwise_adagrad`` for the embedding tables (dense layers: SGD).
        seed: Seed of the model and the data.
        staleness: The hybrid's K (only K = 0 is expected to match; larger K shows how far asynchrony drifts).

    Returns:
        ``{"hybrid": [[loss per step] per trainer], "reference": [...], "max_abs_diff": float, "max_weight_diff":
        float, "worst_table": str, "min_weight_moved": float}``: the largest loss difference, the largest
        difference of any table's rows after training (and its table), and how far the least-moved table moved (0:
        a table did not train).
    """
    from persia_planner.modules.launcher.launch import local_cluster

    if sparse_optimizer not in (Optimizer.SGD, Optimizer.ROWWISE_ADAGRAD):  # StrEnum: "sgd" counts too
        raise PlannerError(f"sparse_optimizer must be sgd or rowwise_adagrad, got {sparse_optimizer!r}")
    cfg = run_config(
        with_run_options(spec, staleness=staleness),
        mode=TrainMode.HYBRID,  # the hybrid's own path even at K = 0: that is what is compared
        steps=steps,
        batch_size=batch_size,
        trainers=trainers,
        sparse_lr=learning_rate,
        sparse_optimizer=Optimizer(sparse_optimizer),
        dense_lr=learning_rate,
        dense_optimizer="sgd",
        seed=seed,
        progress=False,
    )
    job = Job(cfg, spec, dict(tables), topology, servers, trainers)
    results = local_cluster(servers, trainers, _worker, job, timeout_s=60.0, run_timeout_s=1800)
    hybrid = [r["hybrid"] for r in results]
    reference = [r["reference"] for r in results]
    diff = max(abs(a - b) for h, r in zip(hybrid, reference, strict=True) for a, b in zip(h, r, strict=True))
    return {
        "hybrid": hybrid,
        "reference": reference,
        "max_abs_diff": diff,
        "max_weight_diff": max(r["weight_diff"][0] for r in results),
        "worst_table": max(results, key=lambda r: r["weight_diff"][0])["worst_table"][0],
        "min_weight_moved": min(r["weight_moved"][0] for r in results),
    }
