"""The tier contract: a tier module of its own (its tier, any memory of its own and its runtime's store), loaded the
way a user's plugin is (``PERSIA_PLANNER_TIERS``), is read from topology.yaml and model.yaml, planned, priced,
bounded, validated, exported, written to plan.json and read back, executed by the job's own processes and
checkpointed, with no line of the pipeline naming it.

Each module of :data:`PLUGINS` (under ``tests/tier_plugins/``) is held to all of it; adding a tier is adding its file
and its line here.
"""

from __future__ import annotations

import math
import shutil

import pytest
import yaml

from persia_planner import CostModel, ModelSpec, Plan, Topology, plan, validate
from persia_planner.bound import lower_bound
from persia_planner.errors import PlannerError
from persia_planner.modules.train import TrainConfig, train_local
from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY
from persia_planner.plan.torchrec_export import torchrec_shardings
from persia_planner.tiers import Holder, Loaded, Memory, Tier, plugged

PLUGINS: tuple[str, ...] = ("tier_plugins.pmem",)  # the modules' names, as PERSIA_PLANNER_TIERS takes them

TABLE = "c20"  # the bundled model's table the tests hold to the plugin's tier


@pytest.fixture(params=PLUGINS)
def plugin(request: pytest.FixtureRequest):
    with plugged(request.param) as loaded:
        assert loaded.tiers, f"{request.param} registers no tier"
        yield loaded


def _own_memories(loaded: Loaded) -> list[Memory]:
    """The memories the module brought that topology.yaml sizes with ``memories:``."""
    return [m for m in loaded.memories if m.spec.capacity is None]


def topology(loaded: Loaded, size: str = "1GiB") -> Topology:
    """The bundled local cluster, each host given ``size`` of every memory the plugin brought for its kind."""
    data = yaml.safe_load(DEFAULT_TOPOLOGY.read_text())
    for host in data["hosts"]:
        holder = Holder.SERVER if host.get("role") == "parameter_server" else Holder.HOST
        own = {m.value: size for m in _own_memories(loaded) if m.spec.holder is holder}
        if own:
            host["memories"] = own
    return Topology.from_dict(data, base_dir=DEFAULT_TOPOLOGY.parent)


def held_to(tier: Tier) -> ModelSpec:
    data = yaml.safe_load(DEFAULT_MODEL.read_text())
    next(t for t in data["tables"] if t["name"] == TABLE)["constraints"] = {"tiers": [tier.value]}
    return ModelSpec.from_dict(data)


def test_a_plugged_tier_is_planned_priced_bounded_validated_exported_and_written(plugin: Loaded):
    (tier,) = plugin.tiers
    spec, topo = held_to(tier), topology(plugin)
    the_plan = plan(spec, topo)
    placement = the_plan.tables[TABLE]
    assert placement.tier is tier and validate(the_plan, spec, topo) == []
    # its memories are charged on the devices that hold them, and plan.json reports them
    for memory in (tier.spec.rows_in, tier.spec.cache_in):
        if memory is None:
            continue
        used = {s.device: the_plan.devices[s.device].bytes_of(memory.spec.usage_key) for s in placement.shards}
        assert all(b > 0 for b in used.values()), used
    again = Plan.from_dict(the_plan.to_dict())
    assert again.tables[TABLE] == placement

    def held(p: Plan) -> dict:
        return {name: (u.hbm_bytes, u.ddr_bytes, u.other_bytes) for name, u in p.devices.items()}

    assert held(again) == held(the_plan)
    # priced, and the bound stays below the price
    estimate, _ = CostModel(spec, topo).evaluate(the_plan.tables)
    assert math.isfinite(estimate.step_ms) and estimate.step_ms > 0
    assert lower_bound(CostModel(spec, topo)).value_ms <= estimate.step_ms * (1 + 1e-9)
    # exported: TorchRec runs it with its kernel, or leaves it to the servers
    exported = {s.table: s for s in torchrec_shardings(the_plan, spec, topo)}
    if tier.spec.torchrec_kernel is None:
        assert TABLE not in exported
    else:
        assert exported[TABLE].compute_kernel == tier.spec.torchrec_kernel


def test_a_plugged_tier_without_its_memory_is_refused_in_one_line(plugin: Loaded):
    (tier,) = plugin.tiers
    own = _own_memories(plugin)
    if not own:
        pytest.skip("the tier brings no memory of its own")
    bare = Topology.from_dict(yaml.safe_load(DEFAULT_TOPOLOGY.read_text()), base_dir=DEFAULT_TOPOLOGY.parent)
    with pytest.raises(PlannerError, match=f"memories: {{{own[0].value}: SIZE}}"):
        plan(held_to(tier), bare)
    tiny = topology(plugin, size="1KiB")
    with pytest.raises(PlannerError, match=own[0].spec.short_name):
        plan(held_to(tier), tiny)


@pytest.mark.processes
def test_a_plugged_tier_trains_on_its_own_store_and_resumes_exactly(plugin: Loaded, tmp_path):
    (tier,) = plugin.tiers
    spec, topo = held_to(tier), topology(plugin)
    tables = dict(plan(spec, topo).tables)

    def run(**options) -> dict:
        # K = 0: reproducible, so a resumed run must match the whole one bit for bit
        cfg = TrainConfig(
            progress=False, eval_batches=2, batch_size=256, mode="sync", trainers=2, teacher_rows_scale=1.0, **options
        )
        return train_local(cfg, spec, tables, servers=len(topo.servers), topology=topo)

    whole = run(steps=6, checkpoint=str(tmp_path / "whole"), checkpoint_every=3, keep=3)
    if tier.spec.store is not None:
        # the job's server processes loaded the plugin and ran the table on the store its tier names
        module = tier.spec.store.split(":")[0]
        ran = {s["stores"][TABLE] for s in whole["ps_servers"]}
        assert len(ran) == 1 and ran.pop().startswith(module + ":"), whole["ps_servers"]
    shutil.copytree(tmp_path / "whole" / "step-000000003", tmp_path / "step-000000003")
    rest = run(steps=6, checkpoint=str(tmp_path), resume=True)
    assert rest["first_step"] == 3 and rest["last_step"] == 6
    assert [h["loss"] for h in rest["history"]] == [h["loss"] for h in whole["history"][3:]]
    assert rest["auc"] == whole["auc"]
