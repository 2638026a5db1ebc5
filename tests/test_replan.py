"""Re-planning from a job's measured step (persia_planner.replan)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from persia_planner import ModelSpec, Topology, load_model, load_topology, plan
from persia_planner.cost.refit import RunTerms, predicted_terms
from persia_planner.kinds import Sharding
from persia_planner.model.constraints import TableConstraints
from persia_planner.replan import MIN_GAIN, Reason, decide, pinned, tables_moved
from persia_planner.tiers import Tier

EXAMPLES = Path(__file__).resolve().parents[1] / "persia_planner" / "examples"


def _topology(ps_gbps: float, tmp_path: Path) -> Topology:
    """Two one-trainer CPU hosts with little memory and two parameter servers behind ``ps_gbps`` NICs."""
    text = f"""name: replan
hosts:
  - name: trainer
    count: 2
    ddr: 8GiB
    nic_bandwidth: 0.0125GB/s
    profile: {EXAMPLES / "profiles" / "cpu-2core.yaml"}
    cpus: {{count: 1, memory: 12MiB}}
  - name: ps
    count: 2
    role: parameter_server
    ddr: 2GiB
    nic_bandwidth: {ps_gbps}GB/s
    profile: {EXAMPLES / "profiles" / "cpu-2core.yaml"}
network:
  latency: 50us
"""
    path = tmp_path / f"replan-{ps_gbps}.yaml"
    path.write_text(text)
    return load_topology(path)


@pytest.fixture
def model() -> ModelSpec:
    return dataclasses.replace(load_model(EXAMPLES / "dlrm_small.yaml"), staleness=4)


def _measured(model: ModelSpec, topology: Topology, tables, scale: dict[str, float]) -> RunTerms:
    """A window whose every term is the model's prediction times ``scale`` (1 where not named)."""
    predicted = predicted_terms(model, topology, tables)
    measured = {term: ms * scale.get(term, 1.0) for term, ms in predicted.items()}
    return RunTerms("window", "plan", model.staleness, sum(measured.values()), measured, predicted)


def test_a_window_as_predicted_keeps_the_plan(model: ModelSpec, tmp_path: Path) -> None:
    topology = _topology(10.0, tmp_path)
    tables = dict(plan(model, topology, improve_time_s=0.5).tables)
    decision = decide(
        model, topology, tables, _measured(model, topology, tables, {}), threshold=0.1, steps_left=10_000,
        migration_s=1.0,
    )  # fmt: skip
    assert not decision.migrate
    assert decision.reason in (Reason.WITHIN, Reason.SAME_PLAN)
    assert decision.tables is None


def test_slow_servers_move_tables_off_them(model: ModelSpec, tmp_path: Path) -> None:
    """A plan made for fast server NICs whose PS terms measure 20x slower re-plans with fewer tables on the servers,
    predicted faster under the refitted model."""
    topology = _topology(10.0, tmp_path)
    tables = dict(plan(model, topology, improve_time_s=0.5).tables)
    remote = [n for n, p in tables.items() if any(s.tier is Tier.PS for s in p.shards)]
    if not remote:
        pytest.skip("the fast-NIC plan puts no table on the servers")
    decision = decide(
        model, topology, tables, _measured(model, topology, tables, {"ps": 20.0}), threshold=0.1,
        steps_left=100_000, migration_s=1.0,
    )  # fmt: skip
    assert decision.refit.factors["ps"] > 5.0
    assert decision.off_by > 0.1
    if decision.migrate:
        assert decision.reason == Reason.FASTER
        assert decision.predicted_new_ms < decision.predicted_old_ms * (1 - MIN_GAIN)
        assert tables_moved(tables, decision.tables)
        moved_remote = [n for n, p in decision.tables.items() if any(s.tier is Tier.PS for s in p.shards)]
        assert len(moved_remote) < len(remote)
    else:
        assert decision.reason in (Reason.SAME_PLAN, Reason.TOO_COSTLY)


def test_a_migration_dearer_than_its_gain_is_not_made(model: ModelSpec, tmp_path: Path) -> None:
    topology = _topology(10.0, tmp_path)
    tables = dict(plan(model, topology, improve_time_s=0.5).tables)
    decision = decide(
        model, topology, tables, _measured(model, topology, tables, {"ps": 20.0, "embedding": 3.0}),
        threshold=0.1, steps_left=1, migration_s=3600.0,
    )  # fmt: skip
    assert not decision.migrate
    assert decision.reason in (Reason.TOO_COSTLY, Reason.SAME_PLAN)


def test_a_pinned_model_is_never_replanned(model: ModelSpec, tmp_path: Path) -> None:
    one = TableConstraints(frozenset({Sharding.TABLE_WISE}), frozenset({Tier.HBM}), frozenset({"trainer0/cpu0"}))
    small = tuple(dataclasses.replace(t, constraints=one) for t in model.tables if t.rows <= 3_000)
    roomy = dataclasses.replace(model, tables=small)  # every table on the first trainer, whole
    assert pinned(roomy) and not pinned(model)
    anywhere = TableConstraints(frozenset({Sharding.TABLE_WISE}), frozenset({Tier.HBM}))
    assert not pinned(
        dataclasses.replace(roomy, tables=tuple(dataclasses.replace(t, constraints=anywhere) for t in small))
    )
    topology = _topology(10.0, tmp_path)
    tables = dict(plan(roomy, topology, improve_time_s=0.5).tables)
    decision = decide(
        roomy, topology, tables, _measured(roomy, topology, tables, {"dense": 3.0}), threshold=0.1,
        steps_left=100_000, migration_s=0.0,
    )  # fmt: skip
    assert (decision.migrate, decision.reason) == (False, Reason.PINNED)


def test_a_re_plan_narrows_the_collectives_where_the_plan_chose_them(model: ModelSpec, tmp_path: Path) -> None:
    """A float32 plan whose all-to-all over 100 Mbit/s NICs measures 3x its prediction: where the plan chose its
    collectives, the re-plan narrows them to fp16 (as ``persia plan`` would under the refitted model); where the
    model names float32, they stay, and only the tables may move."""
    from persia_planner.model.qcomms import FP32_COMMS, QComms
    from persia_planner.model.specs import DType

    topology = _topology(10.0, tmp_path)
    wide = dataclasses.replace(model, qcomms=FP32_COMMS)
    tables = dict(plan(wide, topology, improve_time_s=0.5).tables)
    window = _measured(wide, topology, tables, {"all_to_all": 3.0})
    options = {"threshold": 0.1, "steps_left": 100_000, "migration_s": 1.0}
    chosen = decide(wide, topology, tables, window, choose_qcomms=True, **options)
    assert chosen.migrate and chosen.reason == Reason.FASTER
    assert chosen.qcomms == QComms(DType.FP16, DType.FP16)
    assert chosen.predicted_new_ms < chosen.predicted_old_ms * (1 - MIN_GAIN)
    named = decide(wide, topology, tables, window, **options)
    assert (named.qcomms or FP32_COMMS) == FP32_COMMS  # the model's collectives stay; at most the tables move
    assert not named.migrate or tables_moved(tables, named.tables)
