"""--lr-schedule: the factors at given steps, the option's one-line errors, the rates of the dense optimizer and
of the tables (local; PS where TorchRec's fused optimizer holds them) on the schedule, and a resume going on with it."""

from __future__ import annotations

import math

import pytest
import torch
from local_and_ps import near_and_far
from plans import TOPO_1X1, local_placement
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import PlannerError
from persia_planner.model.specs import Optimizer
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
from persia_planner.modules.embedding.model_parallel import distribute
from persia_planner.modules.launcher.launch import local_cluster
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.lr_schedule import Decay, LrSchedule, ScheduledRates
from persia_planner.topology.graph import Topology


def test_the_factor_of_each_step():
    warm = LrSchedule.parse("warmup=4")
    assert [warm.factor(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = LrSchedule.parse("cosine")
    assert [cosine.factor(s, 10) for s in (0, 5, 10, 20)] == pytest.approx([1.0, 0.5, 0.0, 0.0], abs=1e-12)
    both = LrSchedule.parse("warmup=2,decay=linear,min=0.1")
    assert both == LrSchedule(2, Decay.LINEAR, 0.1)
    # after the warmup the decay spans the remaining 8 of 10 steps: step 6 is half-way, 0.1 + 0.9 * 0.5
    assert [both.factor(s, 10) for s in (0, 1, 2, 6)] == pytest.approx([0.5, 1.0, 1.0, 0.55], abs=1e-12)
    assert LrSchedule.parse("warmup=100,decay=cosine").factor(55, 1000) == pytest.approx(0.56)
    half = LrSchedule(0, Decay.COSINE, 0.2).factor(25, 100)
    assert half == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert LrSchedule.parse(" Constant ") == LrSchedule() and LrSchedule.parse("").factor(10**6) == 1.0


@pytest.mark.parametrize("text", ["constant", "warmup=500", "decay=cosine", "warmup=5,decay=linear,min=0.25"])
def test_the_text_reads_back(text):
    assert str(LrSchedule.parse(text)) == text
    assert LrSchedule.parse(str(LrSchedule.parse(text))) == LrSchedule.parse(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("exponential", "'exponential' is not warmup=STEPS"),
        ("warmup=ten", "warmup=ten is not a whole number"),
        ("warmup=-3", "warmup must be a step count"),
        ("decay=step", "decay=step is not cosine, linear or none"),
        ("cosine,min=2", "min must be a share of the base rate in"),
        ("min=0.1", "min is where a decay ends, but no decay is given"),
        ("warmup=1,warmup=2", "warmup is given twice"),
    ],
)
def test_a_bad_schedule_is_one_line_naming_the_option(text, message):
    with pytest.raises(PlannerError, match=message) as err:
        TrainConfig(lr_schedule=text)
    assert str(err.value).startswith("--lr-schedule") and "\n" not in str(err.value).split(" (fix")[0]


def test_a_decay_needs_the_total_and_the_config_reads_the_options():
    with pytest.raises(PlannerError, match="a decay needs the run's total steps"):
        LrSchedule.parse("cosine").factor(3)
    cfg = TrainConfig(lr_schedule="warmup=3,cosine", sparse_weight_decay=1e-4)
    assert cfg.lr_schedule == LrSchedule(3, Decay.COSINE) and cfg.sparse_weight_decay == 1e-4
    with pytest.raises(PlannerError, match=r"--sparse-weight-decay must be in \[0, 1 / --sparse-lr\) = \[0, 10\)"):
        TrainConfig(sparse_weight_decay=10.0)
    with pytest.raises(PlannerError, match="--sparse-weight-decay"):
        TrainConfig(sparse_weight_decay=-1.0)
    for eps in (float("nan"), -1e-3, 2.0):
        with pytest.raises(PlannerError, match=r"--sparse-eps must be in \[0, 1\], got"):
            TrainConfig(sparse_eps=eps)


ROWS, DIM = 12, 4
IDS = torch.tensor([1, 4, 4, 7])


def batch(keys: list[str]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=keys, values=IDS.repeat(len(keys)), lengths=torch.tensor([1, 2, 0, 1] * len(keys)))


def test_a_local_tables_rate_and_the_dense_rate_follow_the_schedule(one_trainer):
    configs = [EmbeddingBagConfig(name="near", feature_names=["a"], num_embeddings=ROWS, embedding_dim=DIM)]
    plan = {"near": local_placement(ROWS, DIM)}
    sparse = SparseOptimizer(Optimizer.SGD, learning_rate=0.5)
    hybrid = HybridEmbeddingBagCollection(configs, plan, optimizer=sparse, local_device=torch.device("meta"))
    net = distribute(hybrid, plan, Topology.from_dict(TOPO_1X1))
    dense = torch.nn.Parameter(torch.ones(DIM))
    dense_opt = KeyedOptimizerWrapper({"dense": dense}, lambda ps: torch.optim.SGD(ps, lr=0.2))
    stepped = CombinedOptimizer([("dense", dense_opt), ("tables", net.fused_optimizer)])
    schedule = LrSchedule.parse("warmup=2,decay=linear")
    rates = ScheduledRates(stepped, schedule, total_steps=6)
    tbe = next(iter(hybrid.local.tbes()))
    for step in range(6):
        factor = schedule.factor(step, 6)
        assert rates.rates() == pytest.approx([0.2 * factor, 0.5 * factor], rel=1e-6)
        before, upstream = hybrid.local_weights()["near"].clone(), dense.detach().clone()
        stepped.zero_grad()
        out = net(batch(["a"])).values()
        (out * dense).sum().backward()
        stepped.step()
        assert tbe.get_learning_rate() == pytest.approx(0.5 * factor, rel=1e-6)
        moved = hybrid.local_weights()["near"] - before  # SGD: the rate times the gradient (row 4 read twice)
        expected = -0.5 * factor * torch.tensor([0, 1, 0, 0, 2, 0, 0, 1, 0, 0, 0, 0.0]).unsqueeze(1) * upstream
        torch.testing.assert_close(moved, expected, rtol=0, atol=1e-6)
        rates.step()
    assert rates.job_step == 6 and rates.rates() == pytest.approx([0.0, 0.0], abs=1e-9)


def test_a_resumed_schedule_goes_on_from_the_jobs_step():
    """The factors are the job step's: a scheduler built at step 3 (a resume) gives the rates of an unbroken one."""
    schedule = LrSchedule.parse("warmup=2,decay=cosine,min=0.1")

    def rates_from(step: int, count: int) -> list[float]:
        param = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([param], lr=0.3)
        rates = ScheduledRates(opt, schedule, total_steps=8, step=step)
        seen = []
        for _ in range(count):
            seen.append(rates.rates()[0])
            opt.step()
            rates.step()
        return seen

    whole = rates_from(0, 8)
    assert rates_from(3, 5) == whole[3:]
    assert whole[0] == pytest.approx(0.15) and whole[-1] == pytest.approx(0.3 * schedule.factor(7, 8))


# ---- a local and a PS table on one schedule ---------------------------------------------------------------------


def _scheduled_local_and_ps(j: int, client) -> dict[str, object]:
    import datetime

    import torch.distributed as dist

    from persia_planner.modules.launcher.launch import trainers_store

    dist.init_process_group("gloo", store=trainers_store(), rank=j, world_size=1, timeout=datetime.timedelta(60))
    try:
        hybrid, net, start = near_and_far(client, SparseOptimizer(Optimizer.SGD, learning_rate=0.5), ROWS, DIM)
        # The PS table is a param group of TorchRec's fused optimizer: the schedule reaches it too.
        ps_grouped = any("far" in key for key in net.fused_optimizer.params)
        rates = ScheduledRates(net.fused_optimizer, LrSchedule.parse("warmup=4"), total_steps=None)
        for _ in range(3):
            out = net(batch(["a", "b"])).values()
            out.sum().backward()
            net.fused_optimizer.step()
            rates.step()
        hybrid.flush()
        near = hybrid.local_weights()["near"]
        far = client.read_rows("far", torch.arange(ROWS))
        return {
            "ps_grouped": ps_grouped,
            "near_moved": (start - near)[4].tolist(),
            "far_minus_near": float((far - near).abs().max()),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_schedule_on_the_fused_optimizer_moves_a_local_table_and_a_ps_table_alike():
    (result,) = local_cluster(1, 1, _scheduled_local_and_ps, timeout_s=30.0)
    # row 4 is read twice a step, SGD at 0.5 x (0.25, 0.5, 0.75): 2 * 0.5 * 1.5 = 1.5 over the three steps
    assert result["near_moved"] == pytest.approx([1.5] * DIM, rel=1e-6), result
    assert result["ps_grouped"] and result["far_minus_near"] <= 1e-6, result


# ---- persia train: the schedule and the decay through a resume ------------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_a_resumed_job_goes_on_with_the_schedule_and_the_decay_exactly(tmp_path):
    import shutil

    from persia_planner import load_model, load_topology, plan
    from persia_planner.modules.train import train_local
    from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY

    spec, topology = load_model(DEFAULT_MODEL), load_topology(DEFAULT_TOPOLOGY)
    tables = dict(plan(spec, topology).tables)
    common = {
        "batch_size": 128,
        "mode": "sync",
        "trainers": 2,
        "progress": False,
        "eval_batches": 1,
        "lr_schedule": "warmup=2,decay=linear,min=0.5",
        "sparse_weight_decay": 0.01,
    }

    def run(**options) -> dict:
        cfg = TrainConfig(**(common | options))
        return train_local(cfg, spec, tables, servers=len(topology.servers), topology=topology)

    whole = run(steps=6, checkpoint=str(tmp_path / "whole"), checkpoint_every=3, keep=3)
    assert whole["hyper_parameters"]["lr_schedule"] == "warmup=2,decay=linear,min=0.5"
    assert whole["hyper_parameters"]["sparse_weight_decay"] == 0.01 and whole["ps_tables"]
    shutil.copytree(tmp_path / "whole" / "step-000000003", tmp_path / "step-000000003")
    rest = run(steps=6, checkpoint=str(tmp_path), resume=True)
    assert rest["first_step"] == 3 and rest["last_step"] == 6
    assert [h["loss"] for h in rest["history"]] == [h["loss"] for h in whole["history"][3:]]  # bit-exact
    # The schedule and the decay acted (the warmup halves the first update): without them the second step differs.
    plain = run(steps=2, **{"lr_schedule": "constant", "sparse_weight_decay": 0.0})
    assert plain["history"][0]["loss"] == whole["history"][0]["loss"]
    assert plain["history"][1]["loss"] != whole["history"][1]["loss"]
