"""Any nn.Module holding a HybridEmbeddingBagCollection trains with the runtime's parts (distribute, make_optimizer,
TrainLoop, evaluate, checkpoints), not only the DLRM persia train builds: here a two-tower model whose logits are
``[B]``, on one trainer with an all-local plan."""

from __future__ import annotations

import pytest
import torch
from plans import TOPO_1X1, local_placement
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.model.specs import Optimizer
from persia_planner.modules.data.criteo import Batch
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
from persia_planner.modules.embedding.model_parallel import dense_parameters, distribute
from persia_planner.modules.train.batch_stream import evaluate
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.job_checkpoints import new_lineage
from persia_planner.modules.train.loop import TrainLoop, dense_state_dict, make_optimizer
from persia_planner.modules.train.trainer_state import check_resume, load_trainer_state, save_checkpoint
from persia_planner.topology.graph import Topology

USER, ITEM = ("user", "age"), ("item", "shop")
ROWS, DIM, NUM_DENSE = 64, 8, 3
CONFIGS = [
    EmbeddingBagConfig(name=f, feature_names=[f], num_embeddings=ROWS, embedding_dim=DIM) for f in (*USER, *ITEM)
]
PLAN = {c.name: local_placement(ROWS, DIM) for c in CONFIGS}
TOPOLOGY = Topology.from_dict(TOPO_1X1)


class TwoTower(nn.Module):
    """A user tower over the dense features and the user's pooled embeddings, an item tower over the item's, and
    their dot product as the logit (shape ``[B]``, not DLRM's ``[B, 1]``)."""

    def __init__(self, embeddings: HybridEmbeddingBagCollection):
        super().__init__()
        self.embeddings = embeddings
        self.user = nn.Sequential(nn.Linear(NUM_DENSE + len(USER) * DIM, 16), nn.ReLU(), nn.Linear(16, 8))
        self.item = nn.Sequential(nn.Linear(len(ITEM) * DIM, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embeddings(sparse).to_dict()
        user = self.user(torch.cat([dense, *(pooled[f] for f in USER)], dim=1))
        item = self.item(torch.cat([pooled[f] for f in ITEM], dim=1))
        return (user * item).sum(dim=1)


def batches(seed: int, count: int, size: int = 128) -> list[Batch]:
    """Clicks when the user's and the item's ids fall in the same half of the table: only their embeddings tell."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, ROWS, (len(CONFIGS), size), generator=gen)
        labels = ((ids[0] < ROWS // 2) == (ids[2] < ROWS // 2)).float()
        kjt = KeyedJaggedTensor(
            keys=[c.name for c in CONFIGS], values=ids.reshape(-1), lengths=torch.ones(ids.numel(), dtype=torch.int64)
        )
        out.append(Batch(torch.randn(size, NUM_DENSE, generator=gen), kjt, labels))
    return out


def built(seed: int = 0) -> tuple[TwoTower, HybridEmbeddingBagCollection, nn.Module, object]:
    torch.manual_seed(seed)
    sparse = SparseOptimizer(Optimizer.ROWWISE_ADAGRAD, learning_rate=0.1)
    hybrid = HybridEmbeddingBagCollection(CONFIGS, PLAN, optimizer=sparse, local_device=torch.device("meta"))
    model = TwoTower(hybrid)
    dmp = distribute(model, PLAN, TOPOLOGY)
    opt = make_optimizer(model, TrainConfig(dense_optimizer="adam", dense_lr=0.01), sparse)
    return model, hybrid, dmp, opt


@pytest.mark.timeout(300)
def test_a_two_tower_model_trains_evaluates_and_resumes(one_trainer, tmp_path):
    model, hybrid, dmp, opt = built()
    assert set(dense_parameters(model)) == {n for n, _ in model.named_parameters() if not n.startswith("embeddings.")}
    stats = list(TrainLoop(dmp, hybrid, opt).run(iter(batches(1, 80))))
    losses = [s.loss for s in stats]
    assert len(losses) == 80 and sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.1, losses
    result = evaluate(dmp, iter(batches(2, 4)))
    assert result["auc"] > 0.8 and result["eval_samples"] == 4 * 128, result

    layout = {"trainers": 1, "batch_size": 128, "data": "two-tower", "seed": 0}
    save_checkpoint(
        tmp_path,
        80,
        model=model,
        hybrid=hybrid,
        opt=opt,
        client=None,
        layout=layout,
        lineage=new_lineage(),
        plan={},
        world={"trainers": 1, "servers": 0},
        keep=1,
    )
    assert not any(k.startswith("embeddings.") for k in dense_state_dict(model))
    again, hybrid_again, dmp_again, opt_again = built(seed=5)  # other initial weights, all replaced by the load
    ckpt, state = check_resume(tmp_path, with_ps=False)
    assert load_trainer_state(ckpt, state, again, hybrid_again, opt_again, layout) == 80
    probe = batches(3, 1)[0]
    with torch.no_grad():
        torch.testing.assert_close(dmp_again(probe.dense, probe.sparse), dmp(probe.dense, probe.sparse))
    # Both go on identically: the optimizers' states (Adam's moments, the fused row-wise Adagrad's) were restored.
    nxt = batches(4, 3)
    first = [s.loss for s in TrainLoop(dmp, hybrid, opt).run(iter(nxt))]
    second = [s.loss for s in TrainLoop(dmp_again, hybrid_again, opt_again).run(iter(nxt))]
    assert first == pytest.approx(second, rel=1e-5)


def test_the_runs_table_optimizer_carries_every_option_to_local_and_ps_tables():
    from persia_planner import load_model
    from persia_planner.modules.train.loop import sparse_optimizer
    from persia_planner.paths import DEFAULT_MODEL

    spec = load_model(DEFAULT_MODEL)
    cfg = TrainConfig(sparse_lr=0.2, sparse_weight_decay=0.5, sparse_optimizer="adagrad", sparse_eps=0.25)
    opt = sparse_optimizer(cfg, spec)
    assert (opt.kind, opt.learning_rate, opt.weight_decay, opt.eps) == (Optimizer.ADAGRAD, 0.2, 0.5, 0.25)
    assert (opt.ps().decoupled_weight_decay, opt.ps().eps) == (0.5, 0.25)  # the servers' row optimizer alike
    assert opt.fbgemm(on_cuda=False)["eps"] == 0.25
    # Without --sparse-eps, the optimizer's own default: Adagrad's starts a row's steps damped, Adam keeps 1e-8.
    assert sparse_optimizer(TrainConfig(), spec).eps == 1e-3
    assert sparse_optimizer(TrainConfig(sparse_optimizer="adam"), spec).eps == 1e-8
    # The drop-in's own default stays TorchRec's: a library user's model trains as it would under TorchRec.
    from persia_planner.modules.embedding.sparse_optimizer import SparseOptimizer

    assert SparseOptimizer().eps == 1e-8 and SparseOptimizer(Optimizer.ADAGRAD, eps=0.5).ps().eps == 0.5
