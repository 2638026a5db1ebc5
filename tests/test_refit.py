"""Refitting the cost model from runs: the factors' maths, the profile's ``refit:`` section, a run's fitted profile and
``persia calibrate --from-runs``."""

import dataclasses
import json

import numpy as np
import pytest
import yaml
from test_profile import raw_profile
from typer.testing import CliRunner

from persia_planner import Planner, SearchConfig, load_model, load_topology
from persia_planner.bound import lower_bound
from persia_planner.cli.app import app
from persia_planner.cost.analytic import CostModel
from persia_planner.cost.refit import (
    PS_BOUND_SHARE,
    SUMMARY_A2A_KEY,
    SYNC_TERMS,
    RunTerms,
    predicted_a2a_by_sharding,
    predicted_terms,
    refit,
    refitted_profile,
)
from persia_planner.errors import PlannerError, SpecError
from persia_planner.model.specs import with_run_options
from persia_planner.modules.train.run_refit import (
    FITTED_FACTORS,
    FITTED_PROFILE,
    PlanPrediction,
    write_fitted_profile,
)
from persia_planner.modules.train.terminal import refit_rows
from persia_planner.paths import DEFAULT_MODEL
from persia_planner.search import GreedyLocalSearch
from persia_planner.topology.cost_constants import REFIT_SHARDINGS, SCALE_RANGE, SCALED_TERMS
from persia_planner.topology.graph import Topology
from persia_planner.topology.profile import HardwareProfile

TRUE = {"embedding": 1.5, "all_to_all": 2.0, "dense": 0.8, "all_reduce": 1.25, "ps": 1.3}


def predicted(seed: int) -> dict[str, float]:
    """One plan's five terms (ms, every factor 1): plans differ in how their step divides."""
    rng = np.random.default_rng(seed)
    return {t: float(v) for t, v in zip(SCALED_TERMS, rng.uniform(1.0, 30.0, len(SCALED_TERMS)), strict=True)}


def run_of(pred, *, lumped: bool, staleness: int = 0, factors=TRUE, plan: str = "p", with_ps: bool = True):
    """The run a model with ``factors`` predicts exactly, measured as ``persia train`` measures it."""
    true = {t: factors[t] * pred[t] for t in SCALED_TERMS}
    sync = sum(true[t] for t in SYNC_TERMS)
    step = sync + true["ps"] if staleness == 0 else max(sync, true["ps"])
    measured = {"sync": sync} if lumped else {t: true[t] for t in SYNC_TERMS}
    if with_ps:
        measured["ps"] = true["ps"] if staleness == 0 else step - sync
    return RunTerms(f"run-{plan}", plan, staleness, step, measured, pred)


# ---- the maths ------------------------------------------------------------------------------------------------------
def test_profiled_runs_of_several_plans_give_each_factor_exactly():
    found = refit([run_of(predicted(seed), lumped=False, plan=f"p{seed}") for seed in range(3)])
    assert found.factors == pytest.approx(TRUE)
    assert found.not_separable == () and found.clamped == () and found.notes == ()


def test_a_profiled_run_measures_its_all_to_all_and_dense_parts_together():
    # the model prices TorchRec's input distribution in the dense part's fixed time, the profile in its all-to-all
    found = refit([run_of(predicted(0), lumped=False)])
    assert found.not_separable == ("all_to_all", "dense")
    assert {t: found.factors[t] for t in ("embedding", "all_reduce", "ps")} == pytest.approx(
        {t: TRUE[t] for t in ("embedding", "all_reduce", "ps")}
    )
    pair = [r for r in found.rows if r.term in ("all_to_all", "dense")]
    assert sum(r.refitted_ms for r in pair) == pytest.approx(sum(r.measured_ms for r in pair))
    assert found.factors["all_to_all"] == pytest.approx(found.factors["dense"])  # their priors' ratio kept (1 each)


def test_lumped_runs_of_several_plans_separate_every_factor():
    runs = [run_of(predicted(seed), lumped=True, plan=f"p{seed}") for seed in range(6)]
    found = refit(runs)
    assert found.factors == pytest.approx(TRUE)
    assert found.not_separable == ()
    steps = [r for r in found.rows if r.term == "step"]
    assert [r.refitted_ms for r in steps] == pytest.approx([r.measured_ms for r in steps])


def test_runs_of_one_plan_cannot_separate_the_lumped_sync_terms():
    pred = predicted(1)
    runs = [run_of(pred, lumped=True), run_of(pred, lumped=True)]
    prior = dict.fromkeys(SCALED_TERMS, 1.0) | {"dense": 2.0}
    found = refit(runs, prior)
    assert found.not_separable == SYNC_TERMS
    assert any(
        n.startswith("runs of one plan cannot separate embedding, all_to_all, dense, all_reduce") for n in found.notes
    )
    # the prior decides: their priors' ratios kept, the measured sync time met
    common = found.factors["embedding"]
    assert found.factors["dense"] == pytest.approx(2 * common)
    assert found.factors["all_to_all"] == pytest.approx(common) and found.factors["all_reduce"] == pytest.approx(common)
    sync = next(r for r in found.rows if r.term == "sync")
    assert sync.refitted_ms == pytest.approx(sync.measured_ms)
    assert found.factors["ps"] == pytest.approx(TRUE["ps"])  # measured alone: separable


def test_a_term_no_run_measured_keeps_its_prior():
    # Plans 0 and 1 divide their all-to-all and dense parts differently enough to tell them apart.
    found = refit([run_of(predicted(s), lumped=False, with_ps=False, plan=f"p{s}") for s in (0, 1)], {"ps": 1.7})
    assert found.factors["ps"] == 1.7
    assert found.not_separable == ("ps",)
    assert found.notes == ("no run measured ps: kept at the prior factor",)
    assert {t: found.factors[t] for t in SYNC_TERMS} == pytest.approx({t: TRUE[t] for t in SYNC_TERMS})


def test_factors_are_held_within_their_range():
    lo, hi = SCALE_RANGE
    factors = TRUE | {"embedding": 100.0, "ps": 0.001}
    found = refit([run_of(predicted(s), lumped=False, factors=factors, plan=f"p{s}") for s in (3, 4)])
    assert found.factors["embedding"] == hi and found.factors["ps"] == lo
    assert set(found.clamped) == {"embedding", "ps"}
    assert any("held at the edge of [0.05, 20]" in n for n in found.notes)
    assert found.factors["dense"] == pytest.approx(TRUE["dense"])


def test_at_positive_staleness_the_servers_count_only_where_the_step_waits_for_them():
    pred = predicted(4) | {"ps": 1.0}  # far below the sync work: hidden
    hidden = refit([run_of(pred, lumped=False, staleness=4)], {"ps": 1.1})
    assert hidden.factors["ps"] == 1.1 and "ps" in hidden.not_separable
    bound = predicted(4) | {"ps": 200.0}  # the step waits for the servers: the step is their time
    found = refit([run_of(bound, lumped=True, staleness=4, plan="a"), run_of(pred, lumped=False, plan="b")])
    assert found.factors["ps"] == pytest.approx(TRUE["ps"])


def test_at_positive_staleness_a_hidden_servers_wait_and_push_are_the_trainers_work():
    # persia train's default run: the servers' time hides, yet the trainer waits a little and pushes
    pred = predicted(6) | {"ps": 2.0}
    ps = 0.9
    run = RunTerms("r", "p", 4, 90.0 + ps, {"sync": 90.0, "ps": ps}, pred)
    assert ps < PS_BOUND_SHARE * run.step_ms
    found = refit([run], {"ps": 1.1})
    step = next(r for r in found.rows if r.term == "step")
    assert step.refitted_ms == pytest.approx(step.measured_ms)
    assert found.factors["ps"] == 1.1
    assert "the servers' time hid behind the trainers' work (K >= 1) in every run: ps kept at the prior" in found.notes


SHARDINGS_TRUE = {"table_wise": 6.0, "row_wise": 2.5, "column_wise": 0.4}


def split_run(seed: int, *, lumped: bool, prior_a2a: float = 2.0) -> RunTerms:
    """A run whose all-to-all is split by sharding type (random shares, a fixed rest), measured as the model with
    :data:`TRUE` (its all-to-all fixed cost at ``prior_a2a``) and :data:`SHARDINGS_TRUE` predicts it."""
    pred = predicted(seed)
    rng = np.random.default_rng(100 + seed)
    shares = rng.dirichlet(np.ones(len(SHARDINGS_TRUE) + 1)) * pred["all_to_all"]
    split = dict(zip(SHARDINGS_TRUE, shares[1:], strict=True))
    true = {t: TRUE[t] * pred[t] for t in SCALED_TERMS}
    true["all_to_all"] = prior_a2a * (shares[0] + sum(SHARDINGS_TRUE[s] * ms for s, ms in split.items()))
    sync = sum(true[t] for t in SYNC_TERMS)
    measured = {"sync": sync} if lumped else {t: true[t] for t in SYNC_TERMS}
    measured["ps"] = true["ps"]
    return RunTerms(f"run-{seed}", f"p{seed}", 0, sync + true["ps"], measured, pred, predicted_a2a_by_sharding_ms=split)


@pytest.mark.parametrize("lumped", [False, True])
def test_runs_split_by_sharding_type_give_each_types_factor(lumped):
    runs = [split_run(seed, lumped=lumped) for seed in range(8)]
    found = refit(runs, {"all_to_all": 2.0})
    assert found.sharding_factors == pytest.approx(SHARDINGS_TRUE)
    assert {t: found.factors[t] for t in SCALED_TERMS if t != "all_to_all"} == pytest.approx(
        {t: TRUE[t] for t in SCALED_TERMS if t != "all_to_all"}
    )
    # the all-to-alls' fixed cost keeps its prior: the exchanges carry the term's refit
    assert found.factors["all_to_all"] == 2.0
    assert "all_to_all: its fixed cost kept at the prior factor, each sharding type's exchange refitted" in found.notes
    steps = [r for r in found.rows if r.term == "step"]
    assert [r.refitted_ms for r in steps] == pytest.approx([r.measured_ms for r in steps])
    assert found.constants()["row_wise_scale"] == pytest.approx(2.5)
    assert set(found.sharding_factors) <= set(REFIT_SHARDINGS)


def test_a_sharding_types_factor_is_held_within_its_range():
    runs = [split_run(seed, lumped=False) for seed in range(8)]
    extra = [100 * r.predicted_a2a_by_sharding_ms["row_wise"] for r in runs]  # row-wise 100x slower than it is
    wild = [
        dataclasses.replace(
            r, step_ms=r.step_ms + x, measured_ms=r.measured_ms | {"all_to_all": r.measured_ms["all_to_all"] + x}
        )
        for r, x in zip(runs, extra, strict=True)
    ]
    found = refit(wild, {"all_to_all": 2.0})
    assert found.sharding_factors["row_wise"] == SCALE_RANGE[1]
    assert "all_to_all.row_wise" in found.clamped


def test_at_positive_staleness_pushes_without_a_wait_are_the_trainers_work():
    # the trainer pushes for 30 ms of its 100 ms step but hardly waits for rows: its servers kept up
    pred = predicted(7) | {"ps": 40.0}
    run = RunTerms("r", "p", 4, 100.0, {"sync": 69.0, "ps": 31.0}, pred, ps_wait_ms=1.0)
    found = refit([run], {"ps": 1.0})
    sync = next(r for r in found.rows if r.term == "sync")
    assert sync.measured_ms == 100.0 and sync.refitted_ms == pytest.approx(100.0)
    assert "ps" in found.not_separable and found.factors["ps"] == 1.0
    # where the same run waited for its rows, the step is the servers' time and the pushes stay the trainer's work
    waited = RunTerms("r", "p", 4, 100.0, {"sync": 69.0, "ps": 31.0}, pred, ps_wait_ms=25.0)
    found = refit([waited])
    assert next(r for r in found.rows if r.term == "sync").measured_ms == 69.0 + 6.0
    assert found.factors["ps"] == pytest.approx(100.0 / 40.0)


def test_servers_that_kept_up_bound_the_ps_factor():
    # a K = 0 run says the servers take 3x their prediction; a K = 4 run of another plan, whose trainers did not
    # wait, says they took at most its 50 ms step: 2.5x its 20 ms
    k0 = run_of(predicted(9), lumped=True, factors=TRUE | {"ps": 3.0}, plan="a")
    k4 = RunTerms("b", "b", 4, 50.0, {"sync": 49.0, "ps": 1.0}, predicted(10) | {"ps": 20.0}, ps_wait_ms=0.5)
    found = refit([k0, k4])
    assert found.factors["ps"] == pytest.approx(2.5)
    assert any(n.startswith("ps held at 2.5: at K >= 1 runs whose trainers did not wait") for n in found.notes)
    assert "ps" not in found.clamped


def test_from_summary_reads_each_breakdown_persia_train_writes():
    pred = predicted(5)
    profiled = {"step_ms": 40.0, "staleness": 0, "step_breakdown_ms": {"data": 3, **dict.fromkeys(SYNC_TERMS, 10.0)}}
    assert RunTerms.from_summary(profiled, pred, "a").measured_ms == dict.fromkeys(SYNC_TERMS, 10.0)
    with_ps = {"step_ms": 40.0, "staleness": 4, "step_breakdown_ms": {"ps_wait": 5.0, "push": 2.0, "other": 33.0}}
    run = RunTerms.from_summary(with_ps | {"plan_id": "abc"}, pred, "b")
    assert run.measured_ms == {"sync": 33.0, "ps": 7.0} and run.plan_id == "abc" and run.staleness == 4
    bare = {"step_ms": 40.0, "staleness": 0, "step_breakdown_ms": {"data": 3.0}}
    assert RunTerms.from_summary(bare, pred, "c").measured_ms == {"sync": 40.0}
    # without a plan id, one plan's runs are known by the terms it predicts
    assert RunTerms.from_summary(bare, pred, "c").plan_id == RunTerms.from_summary(profiled, pred, "a").plan_id
    with pytest.raises(PlannerError, match=r"^d: not a persia train summary"):
        RunTerms.from_summary({"auc": 0.7}, pred, "d")
    assert run.ps_wait_ms == 5.0 and RunTerms.from_summary(profiled, pred, "a").ps_wait_ms is None
    # the all-to-all's split by sharding type: from the summary, or given; unknown types and zeros left out
    split = {"row_wise": 2.0, "grid": 1.0, "table_wise": 0.0}
    assert RunTerms.from_summary(with_ps | {SUMMARY_A2A_KEY: split}, pred, "b").predicted_a2a_by_sharding_ms == {
        "row_wise": 2.0
    }
    assert RunTerms.from_summary(with_ps, pred, "b", {}).predicted_a2a_by_sharding_ms == {}
    assert RunTerms.from_summary(with_ps, pred, "b").predicted_a2a_by_sharding_ms is None


# ---- the profile ----------------------------------------------------------------------------------------------------
def test_a_refitted_profile_round_trips_and_plans_with_its_factors(tmp_path):
    runs = [run_of(predicted(seed), lumped=False, plan="q" if seed else "p") for seed in range(2)]
    found = refit(runs)
    content = refitted_profile(raw_profile(), found, runs)
    text = yaml.safe_dump(content)
    profile = HardwareProfile.from_dict(yaml.safe_load(text))
    assert profile.refit_factors == pytest.approx(TRUE)
    assert profile.fitted_constants()["ps_scale"] == pytest.approx(TRUE["ps"])
    assert content["refit"]["runs"][0]["plan"] == "p" and content["refit"]["not_separable"] == []
    (tmp_path / "fitted.yaml").write_text(text)
    hosts = [{"name": "trainer", "ddr": "8GiB", "profile": "fitted.yaml", "cpus": {"count": 2, "memory": "4MiB"}}]
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump({"hosts": hosts}))
    assert load_topology(tmp_path / "topology.yaml").constants.term_scales() == pytest.approx(TRUE)
    # topology.yaml's constants: still win
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump({"hosts": hosts, "constants": {"dense_scale": 3.0}}))
    assert load_topology(tmp_path / "topology.yaml").constants.dense_scale == 3.0
    assert HardwareProfile.from_dict(raw_profile()).refit_factors == {}


@pytest.mark.parametrize(
    ("factors", "words"),
    [
        ({"embeding": 1.0}, "profile.yaml: refit.factors.embeding: is no step term"),
        ({"ps": 0.0}, "profile.yaml: refit.factors.ps: must be in [0.05, 20], got 0"),
        ({"ps": "x"}, "profile.yaml: refit.factors.ps"),
    ],
)
def test_a_bad_refit_section_is_one_line(factors, words):
    with pytest.raises(SpecError) as err:
        HardwareProfile.from_dict(raw_profile() | {"refit": {"factors": factors}})
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_a_refitted_profile_carries_its_sharding_factors():
    runs = [split_run(seed, lumped=False) for seed in range(8)]
    found = refit(runs, {"all_to_all": 2.0})
    earlier = {"factors": {"ps": 2.0}, "sharding_factors": {"table_column_wise": 3.0, "row_wise": 9.0}}
    content = refitted_profile(raw_profile() | {"refit": earlier}, found, runs)
    profile = HardwareProfile.from_dict(yaml.safe_load(yaml.safe_dump(content)))
    # the types these runs used refitted, the others' factors kept
    assert profile.refit_sharding_factors == pytest.approx(SHARDINGS_TRUE | {"table_column_wise": 3.0})
    assert profile.fitted_constants()["row_wise_scale"] == pytest.approx(2.5)
    assert HardwareProfile.from_dict(raw_profile()).refit_sharding_factors == {}


@pytest.mark.parametrize(
    ("shardings", "words"),
    [
        ({"grid": 1.0}, "profile.yaml: refit.sharding_factors.grid: is no sharding type with an exchange"),
        ({"data_parallel": 1.0}, "profile.yaml: refit.sharding_factors.data_parallel: is no sharding type with an"),
        ({"row_wise": 50}, "profile.yaml: refit.sharding_factors.row_wise: must be in [0.05, 20], got 50"),
        ([1.0], "profile.yaml: refit.sharding_factors"),
    ],
)
def test_a_bad_sharding_factor_is_one_line(shardings, words):
    with pytest.raises(SpecError) as err:
        HardwareProfile.from_dict(raw_profile() | {"refit": {"factors": {}, "sharding_factors": shardings}})
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


# ---- a run's refit --------------------------------------------------------------------------------------------------
TRAINER = {"name": "trainer", "ddr": "8GiB", "profile": "cpu.yaml", "cpus": {"count": 2, "memory": "4MiB"}}
SERVER = {"name": "ps", "count": 2, "role": "parameter_server", "ddr": "2GiB", "profile": "cpu.yaml"}


def cpu_topology(folder, profile: str = "cpu.yaml", with_profile: bool = True) -> Topology:
    (folder / "cpu.yaml").write_text(yaml.safe_dump(raw_profile()))
    if with_profile:
        hosts = [TRAINER | {"profile": profile}, SERVER | {"profile": profile}]
    else:
        plain = {"ddr_bandwidth": "10GB/s", "nic_bandwidth": "1GB/s"}
        cpus = {"count": 2, "memory": "4MiB", "bandwidth": "3GB/s", "tflops": 0.1, "link_bandwidth": "1GB/s"}
        hosts = [{"name": "trainer", "ddr": "8GiB", **plain, "cpus": cpus}, {**SERVER, **plain}]
        del hosts[1]["profile"]
    (folder / "topology.yaml").write_text(
        yaml.safe_dump({"name": "cpu", "hosts": hosts, "network": {"latency": "200us"}})
    )
    return load_topology(folder / "topology.yaml")


def summary_of(prediction: PlanPrediction, factors=TRUE) -> dict:
    """What persia train's summary holds for a K = 0 run with parameter-server tables, measured as ``factors``
    predict it."""
    pred = prediction.unscaled_ms
    sync = sum(factors[t] * pred[t] for t in SYNC_TERMS)
    ps = factors["ps"] * pred["ps"]
    summary = {"step_ms": sync + ps, "staleness": 0}
    summary["step_breakdown_ms"] = {"data": 2.0, "ps_wait": 0.8 * ps, "push": 0.2 * ps, "other": sync}
    prediction.add_to(summary)
    return summary


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refit")
    topology = cpu_topology(folder)
    model = with_run_options(load_model(DEFAULT_MODEL), staleness=0)
    plan = Planner(GreedyLocalSearch(SearchConfig(seed=0, improve_time_s=0.2))).plan(model, topology)
    return folder, model, topology, plan


def test_a_runs_fitted_profile_predicts_the_run(planned, tmp_path):
    folder, model, topology, plan = planned
    assert plan.remote_tables()  # the servers' part is measured
    prediction = PlanPrediction.of(model, topology, plan)
    assert prediction.profile_source == str(folder / "cpu.yaml")
    assert prediction.factors == dict.fromkeys((*TRUE, *REFIT_SHARDINGS), 1.0)
    assert summary_of(prediction)[SUMMARY_A2A_KEY] == prediction.a2a_by_sharding_ms
    summary = summary_of(prediction)
    written = write_fitted_profile(tmp_path, summary, prediction.unscaled_ms, prediction.profile_source)
    assert written == tmp_path / FITTED_PROFILE
    assert written.read_text().startswith("# persia calibrate: refitted from the persia train run in ")
    refitted = cpu_topology(tmp_path, FITTED_PROFILE)
    step = CostModel(plan.priced_model(model), refitted).evaluate(plan.tables)[0].step_ms
    assert step == pytest.approx(summary["step_ms"], rel=0.01)
    # the plan priced under the fitted profile reports its factors: its next run's prior
    assert PlanPrediction.of(model, refitted, plan).factors["ps"] == pytest.approx(TRUE["ps"])
    rows = refit_rows({"refit": [{"term": "ps", "predicted_ms": 1.0, "measured_ms": None, "refitted_ms": 2.0}]})
    assert rows[1] == ("  ps", "1.0 / - / 2.0")


def test_a_run_without_a_profile_gets_its_factors_as_constants(tmp_path):
    topology = cpu_topology(tmp_path, with_profile=False)
    model = with_run_options(load_model(DEFAULT_MODEL), staleness=0)
    plan = Planner(GreedyLocalSearch(SearchConfig(seed=0, improve_time_s=0.2))).plan(model, topology)
    prediction = PlanPrediction.of(model, topology, plan)
    assert prediction.profile_source is None
    written = write_fitted_profile(tmp_path, summary_of(prediction), prediction.unscaled_ms, None)
    assert written == tmp_path / FITTED_FACTORS
    content = yaml.safe_load(written.read_text())
    scaled = topology.with_constants(content["constants"])
    assert scaled.constants.ps_scale == pytest.approx(TRUE["ps"])
    assert write_fitted_profile(tmp_path, {"step_ms": 0.0}, prediction.unscaled_ms, None) is None
    again = write_fitted_profile(tmp_path, summary_of(prediction), prediction.unscaled_ms, None)
    assert again == written  # the run's own file, replaced at the next checkpoint


def test_a_users_file_of_the_fitted_name_is_never_replaced(tmp_path):
    topology = cpu_topology(tmp_path, with_profile=False)
    model = with_run_options(load_model(DEFAULT_MODEL), staleness=0)
    plan = Planner(GreedyLocalSearch(SearchConfig(seed=0, improve_time_s=0.2))).plan(model, topology)
    prediction = PlanPrediction.of(model, topology, plan)
    mine = tmp_path / FITTED_FACTORS
    mine.write_text("constants: {ps_scale: 3}  # my own\n")
    with pytest.raises(PlannerError, match="is not refitted cost-model factors"):
        write_fitted_profile(tmp_path, summary_of(prediction), prediction.unscaled_ms, None)
    assert mine.read_text() == "constants: {ps_scale: 3}  # my own\n"


def test_the_all_to_all_split_adds_up_to_the_predicted_term(planned):
    _, model, topology, plan = planned
    priced = plan.priced_model(model)
    terms = predicted_terms(priced, topology, plan.tables)
    split = predicted_a2a_by_sharding(priced, topology, plan.tables)
    assert split and set(split) <= {p.sharding.value for p in plan.tables.values()}
    assert sum(split.values()) + CostModel(priced, topology).a2a_fixed_ms == pytest.approx(terms["all_to_all"])
    # a type's factor multiplies its exchange; the run's terms are still read with every factor 1
    sharding, ms = next(iter(split.items()))
    scaled = topology.with_constants({f"{sharding}_scale": 3.0})
    est = CostModel(priced, scaled).evaluate(plan.tables)[0]
    assert est.per_gpu["a2a"].max() >= terms["all_to_all"] + 2 * ms - 1e-9
    assert predicted_terms(priced, scaled, plan.tables) == terms
    assert predicted_a2a_by_sharding(priced, scaled, plan.tables) == split


def test_the_bound_stays_below_plans_under_refitted_factors(planned):
    _, model, topology, _ = planned
    for term in (*SCALED_TERMS, "table_wise", "row_wise"):
        for factor in (0.1, 8.0):
            scaled = topology.with_constants({f"{term}_scale": factor})
            found = Planner(GreedyLocalSearch(SearchConfig(seed=0, improve_time_s=0.1))).plan(model, scaled)
            assert lower_bound(CostModel(model, scaled)).value_ms <= found.step_ms * (1 + 1e-9), (term, factor)


# ---- persia calibrate --from-runs -----------------------------------------------------------------------------------
def calibrate(*args):
    return CliRunner().invoke(app, ["calibrate", "--from-runs", *[str(a) for a in args]], prog_name="persia")


def test_from_runs_fits_one_profile_from_several_runs(planned, tmp_path):
    _, model, topology, plan = planned
    prediction = PlanPrediction.of(model, topology, plan)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary_of(prediction)))
    out = tmp_path / "fitted.yaml"
    result = calibrate(tmp_path / "a", tmp_path / "b", "--out", out)
    assert result.exit_code == 0, result.output
    assert "runs of one plan cannot separate embedding, dense, all_reduce" in result.stdout
    profile = HardwareProfile.from_dict(yaml.safe_load(out.read_text()))
    assert profile.refit_factors["ps"] == pytest.approx(TRUE["ps"])
    assert out.read_text().startswith("# persia calibrate: refitted from 2 persia train run(s)")


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: None, "no such folder"),
        (lambda d: d.mkdir(), "no summary.json there"),
        (lambda d: (d.mkdir(), (d / "summary.json").write_text("{")), "cannot read it (not JSON)"),
        (lambda d: (d.mkdir(), (d / "summary.json").write_text('{"auc": 1}')), "not a persia train summary"),
    ],
)
def test_from_runs_refuses_a_folder_that_is_no_run_in_one_line(tmp_path, make, words):
    make(tmp_path / "run")
    result = calibrate(tmp_path / "run", "--out", tmp_path / "fitted.yaml")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --from-runs {tmp_path / 'run'}") and words in lines[0]
    assert not (tmp_path / "fitted.yaml").exists()


def test_run_folders_need_from_runs(tmp_path):
    result = CliRunner().invoke(app, ["calibrate", str(tmp_path)], prog_name="persia")
    assert result.exit_code == 2 and "run folders are given only with --from-runs" in result.stderr


def test_two_runs_of_nearly_one_plan_scale_their_terms_together():
    """Two lumped runs whose plans divide the step almost alike, measured with a few percent of noise: the second
    direction they see is noise, so the sync terms share one factor (fitted along it, factors went to the range's
    ends: embedding 15, dense 0.05, on the namespace cluster)."""
    pred = predicted(0)
    near = {t: v * (1.0 + 0.002 * i) for i, (t, v) in enumerate(pred.items())}
    runs = [run_of(pred, lumped=True, plan="a"), run_of(near, lumped=True, plan="b")]
    noisy = [
        dataclasses.replace(r, step_ms=r.step_ms * k, measured_ms={t: v * k for t, v in r.measured_ms.items()})
        for r, k in zip(runs, (1.03, 0.98), strict=True)
    ]
    found = refit(noisy)
    sync = [found.factors[t] for t in SYNC_TERMS]
    assert max(sync) / min(sync) == pytest.approx(1.0, abs=1e-4)  # the priors' ratios, not the noise's
    assert 0.5 < sync[0] < 3.0
    assert set(SYNC_TERMS) <= set(found.not_separable)


def test_a_small_term_measured_alone_holds_its_factor_beside_a_lumped_run_of_another_plan():
    """The namespace cluster's two calibration runs (ms, rounded): an all-local column-wise plan, profiled, and a
    table-wise plan with two tables on the servers (K = 4), whose sync work is measured whole. Weighed as shares of
    the step, the 2 ms embedding term was pulled to 15x by the lumped run; the table-wise and column-wise exchanges
    and the dense part, which the two runs see only as two sums, were scaled together, missing both runs by 40%."""
    local = RunTerms(
        "local", "cw", 4, 333.3,
        {"embedding": 4.7, "all_to_all": 210.4, "dense": 117.5, "all_reduce": 0.7, "ps": 0.0},
        {"embedding": 2.1, "all_to_all": 531.2, "dense": 30.0, "all_reduce": 13.6, "ps": 0.0},
        predicted_a2a_by_sharding_ms={"column_wise": 529.0},
    )  # fmt: skip
    lumped = RunTerms(
        "lumped", "tw", 4, 250.7, {"sync": 248.2, "ps": 2.5},
        {"embedding": 10.7, "all_to_all": 111.3, "dense": 30.1, "all_reduce": 6.0, "ps": 33.1},
        predicted_a2a_by_sharding_ms={"table_wise": 109.0},
    )  # fmt: skip
    found = refit([local, lumped])
    assert found.factors["embedding"] == pytest.approx(4.7 / 2.1, rel=0.02)
    assert found.factors["all_reduce"] == pytest.approx(0.7 / 13.6, rel=0.02)
    steps = {r.source: r for r in found.rows if r.term == "step"}
    assert steps["local"].refitted_ms == pytest.approx(333.3, rel=0.02)
    assert steps["lumped"].refitted_ms == pytest.approx(250.7, rel=0.02)
    assert found.sharding_factors["table_wise"] > 1.0 > found.sharding_factors["column_wise"]
