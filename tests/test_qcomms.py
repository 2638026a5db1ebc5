"""Quantized communication as a plan decision (``persia_planner/model/qcomms.py``): read, priced, chosen, recorded."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from persia_planner import load_model, load_topology, plan
from persia_planner.cost.analytic import CostModel
from persia_planner.errors import PlannerError, SpecError
from persia_planner.model.qcomms import FP32_COMMS, QComms, qcomms_candidates
from persia_planner.model.specs import DType, ModelSpec, with_run_options
from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY, EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, EXAMPLES
from persia_planner.plan.executability import check_executable, planned_execution
from persia_planner.plan.plan import Plan
from persia_planner.planner import QCOMMS_MIN_GAIN
from persia_planner.topology.graph import Topology

FP16_BF16 = QComms(DType.FP16, DType.BF16)


def example_topology(nic: str) -> Topology:
    """The bundled 2x4-GPU example with its trainer hosts' NICs at ``nic``."""
    data = yaml.safe_load(EXAMPLE_TOPOLOGY.read_text())
    data["hosts"][0]["nic_bandwidth"] = nic
    return Topology.from_dict(data, base_dir=EXAMPLES)


def test_model_yaml_reads_auto_a_dtype_or_both_directions():
    base = {"batch_size": 8, "tables": [{"name": "a", "rows": 10, "dim": 4}]}
    assert ModelSpec.from_dict(base).qcomms is None  # auto: the planner chooses
    assert ModelSpec.from_dict({**base, "qcomms": "fp16"}).qcomms == QComms(DType.FP16, DType.FP16)
    spec = ModelSpec.from_dict({**base, "qcomms": {"forward": "fp16", "backward": "bfloat16"}})
    assert spec.qcomms == FP16_BF16 and ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match=r"m\.yaml: qcomms: must be auto, a dtype \(fp16\) or \{forward: fp16"):
        ModelSpec.from_dict({**base, "qcomms": {"forward": "fp16", "sideways": "fp16"}}, "m.yaml")
    assert with_run_options(spec, qcomms="auto").qcomms is None
    assert with_run_options(spec, qcomms="fp32").qcomms == FP32_COMMS
    with pytest.raises(PlannerError, match=r"--qcomms must be one of fp32 \(float32\), fp16 .* got 'fp8'"):
        with_run_options(spec, qcomms="fp16,fp8")


def test_narrowed_collectives_halve_the_exchange_and_pay_the_codec():
    """fp16 output halves a shard's all-to-all bytes and adds four conversions of each value (two per direction);
    bf16 gradients halve the dense all-reduce and add its two conversions."""
    model, topology = load_model(EXAMPLE_MODEL), example_topology("25GB/s")
    wide = CostModel(dataclasses.replace(model, qcomms=FP32_COMMS), topology)
    narrow = CostModel(dataclasses.replace(model, qcomms=FP16_BF16), topology)
    table = model.tables[0]
    assert wide.output_exchange(table, 64) == (model.batch_size * 64 * 4, 0.0)
    assert narrow.output_exchange(table, 64) == (model.batch_size * 64 * 2, 4.0 * model.batch_size * 64)
    forward_only = CostModel(dataclasses.replace(model, qcomms=QComms(DType.FP16, DType.FP32)), topology)
    assert forward_only.output_exchange(table, 64) == (model.batch_size * 64 * 3, 2.0 * model.batch_size * 64)
    assert narrow.dense_grad_bytes == wide.dense_grad_bytes / 2
    codec = 2 * model.dense.parameters * narrow.codec_ms_per_value
    assert narrow.dense_ms == pytest.approx(wide.dense_ms + codec)


@pytest.mark.parametrize("where", ["gpus", "cpus"])
def test_the_planner_narrows_the_collectives_only_where_it_pays(where):
    """Left to it, the planner narrows the L4 example's collectives (fp16 output, bf16 gradients) and keeps float32
    on this machine's loopback CPU trainers, where converting costs more than the bytes saved; either way the plan
    records what it chose and is priced (and bounded) for it."""
    if where == "gpus":
        model, topology, expected = load_model(EXAMPLE_MODEL), example_topology("25GB/s"), FP16_BF16
    else:
        model, topology, expected = load_model(DEFAULT_MODEL), load_topology(DEFAULT_TOPOLOGY), FP32_COMMS
    assert model.qcomms is None
    chosen = plan(model, topology)
    assert chosen.qcomms == expected
    priced = CostModel(chosen.priced_model(model), topology)
    assert priced.evaluate(chosen.tables)[0].step_ms == pytest.approx(chosen.step_ms)
    assert chosen.lower_bound_ms <= chosen.step_ms * (1 + 1e-9)
    fp32 = CostModel(dataclasses.replace(model, qcomms=FP32_COMMS), topology).evaluate(chosen.tables)[0].step_ms
    if expected.quantized:
        assert chosen.step_ms <= fp32 * (1 - QCOMMS_MIN_GAIN)
    else:  # a named choice is kept as named, even where it does not pay
        forced = plan(with_run_options(model, qcomms="fp16"), topology)
        assert forced.qcomms == QComms(DType.FP16, DType.FP16)
        assert forced.step_ms > chosen.step_ms * (1 - QCOMMS_MIN_GAIN)
        assert plan(with_run_options(model, qcomms="fp32"), topology) == chosen
    again = Plan.from_dict(chosen.to_dict())
    assert again.qcomms == chosen.qcomms and again.tables == chosen.tables
    # Chosen by the planner, and said so (a re-plan under --adapt may choose again); a named choice is not.
    assert chosen.qcomms_chosen and again.qcomms_chosen and chosen.to_dict()["qcomms_chosen"] is True
    named = plan(with_run_options(model, qcomms="fp16"), topology)
    assert not named.qcomms_chosen and "qcomms_chosen" not in named.to_dict()


def test_a_loose_bound_does_not_hide_a_narrowing_that_pays(tmp_path):
    """CPU trainers behind 100 Mbit/s NICs, priced with factors refitted on such a cluster: float32's bound (GPU
    work) sits far under its plan, and under fp16 too, yet fp16 halves the exchange that makes the plan's step. The
    planner searches fp16 because its bound is 5% below float32's plan, not float32's bound, and keeps it."""
    path = tmp_path / "slow-trainers.yaml"
    path.write_text(f"""name: slow-trainers
constants: {{embedding_scale: 1.72, dense_scale: 0.55, all_reduce_scale: 0.05, table_wise_scale: 1.8}}
hosts:
  - name: trainer
    count: 2
    ddr: 8GiB
    nic_bandwidth: 0.0125GB/s
    profile: {EXAMPLES / "profiles" / "cpu-2core.yaml"}
    cpus: {{count: 1, memory: 40MiB}}
  - name: ps
    count: 2
    role: parameter_server
    ddr: 2GiB
    nic_bandwidth: 0.00375GB/s
    profile: {EXAMPLES / "profiles" / "cpu-2core.yaml"}
network:
  latency: 50us
""")
    topology = load_topology(path)
    model = dataclasses.replace(load_model(DEFAULT_MODEL), staleness=4)
    chosen = plan(model, topology)
    wide = plan(with_run_options(model, qcomms="fp32"), topology)
    assert chosen.lower_bound_ms < wide.step_ms * 0.5  # the bound is loose
    assert chosen.qcomms == QComms(DType.FP16, DType.FP16)
    assert chosen.step_ms <= wide.step_ms * (1 - QCOMMS_MIN_GAIN)


def test_cpu_trainers_narrow_to_fp16_and_refuse_bf16_collectives():
    """gloo has no bf16 collectives: the planner's CPU candidate is fp16 both ways, and a bf16 plan is refused on CPU
    before anything starts."""
    assert qcomms_candidates(cuda=False)[1] == QComms(DType.FP16, DType.FP16)
    assert qcomms_candidates(cuda=True)[1] == FP16_BF16
    model, topology = load_model(EXAMPLE_MODEL), example_topology("2GB/s")
    chosen = plan(model, topology)
    with pytest.raises(PlannerError, match=r"collectives run in fp16 forward, bf16 backward, and gloo .* no bfloat16"):
        check_executable(chosen, "cpu", qcomms=chosen.qcomms)
    check_executable(chosen, "cuda", qcomms=chosen.qcomms)
    execution = planned_execution(chosen, chosen.priced_model(model), topology)
    local = [e for e in execution.values() if "sharding" in e]
    assert local and all(
        e.get("comms") == ({"forward": "float16", "backward": "bfloat16"} if e["sharding"] != "data_parallel" else None)
        for e in local
    )


def test_a_bound_at_another_bounds_weighting_is_a_bound_and_its_own_weighting_gives_it_back():
    """The planner's probe of a narrowed candidate (``bound_at``): one weighting, never above the candidate's full
    bound, and exactly a bound's value at its own weighting."""
    from persia_planner.bound import bound_at, lower_bound

    model, topology = load_model(EXAMPLE_MODEL), example_topology("25GB/s")
    wide = CostModel(dataclasses.replace(model, qcomms=FP32_COMMS), topology)
    narrow = CostModel(dataclasses.replace(model, qcomms=FP16_BF16), topology)
    wide_bound, narrow_bound = lower_bound(wide), lower_bound(narrow)
    assert bound_at(wide, wide_bound) == pytest.approx(wide_bound.value_ms)
    probe = bound_at(narrow, wide_bound)
    assert probe is not None and probe <= narrow_bound.value_ms * (1 + 1e-9)
    assert probe < wide_bound.value_ms * (1 - QCOMMS_MIN_GAIN)  # so the planner searches the narrowed candidate
