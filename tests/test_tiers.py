"""The tier registry: built-in tiers behave as the enum they replace, and a tier registered by a test (host memory
at half the UVM bandwidth) is read, planned, priced, bounded, validated, exported and written like a built-in one."""

import copy
import dataclasses
import pickle

import pytest
from plans import TOPO_1X1

from persia_planner import CostModel, ModelSpec, Plan, SpecError, Topology, plan, validate
from persia_planner.bound import lower_bound
from persia_planner.kinds import Sharding
from persia_planner.placement.shards import Shard, TablePlacement, tier_bytes
from persia_planner.plan.torchrec_export import torchrec_shardings
from persia_planner.tiers import Lookups, Memory, Tier, TierSpec, local_tiers, register, registered, tier_of_kernel

SLOW_DDR = TierSpec(
    name="slow_ddr",
    summary="host memory behind a slower link: half of UVM's bandwidth",
    rows_in=Memory.HOST,
    lookups=Lookups.UVM,
    shardings=frozenset(Sharding) - {Sharding.PS_HASH, Sharding.DATA_PARALLEL},
    speed_rank=5,
    torchrec_kernel="fused_uvm",
    bandwidth_share=0.5,
    promote_to="hbm",
)


def model_on(tiers: list[str]) -> ModelSpec:
    return ModelSpec.from_dict(
        {
            "batch_size": 4096,
            "tables": [
                {"name": "big", "rows": 2_000_000, "dim": 64, "pooling_factor": 8, "constraints": {"tiers": tiers}},
                {"name": "small", "rows": 10_000, "dim": 32, "pooling_factor": 2},
            ],
        }
    )


def test_the_built_in_tiers_keep_the_enum_behaviour():
    assert list(Tier) == [Tier.HBM, Tier.DDR, Tier.HBM_CACHE, Tier.PS, Tier.SSD]
    assert [t.value for t in Tier] == ["hbm", "ddr", "hbm_cache", "ps", "ssd"]
    assert Tier("hbm_cache") is Tier.HBM_CACHE and Tier(Tier.DDR) is Tier.DDR
    assert Tier.HBM == "hbm" and f"{Tier.PS}" == "ps" and Tier.HBM_CACHE.name == "HBM_CACHE"
    assert pickle.loads(pickle.dumps(Tier.DDR)) is Tier.DDR and copy.deepcopy(Tier.PS) is Tier.PS
    assert local_tiers() == (Tier.HBM, Tier.HBM_CACHE, Tier.DDR)
    assert tier_of_kernel() == {"fused": Tier.HBM, "fused_uvm": Tier.DDR, "fused_uvm_caching": Tier.HBM_CACHE,
                                "dense": Tier.HBM}  # fmt: skip
    with pytest.raises(ValueError, match="'nvme' is not a valid Tier"):
        Tier("nvme")


def test_a_descriptor_refuses_what_no_runtime_could_execute():
    with pytest.raises(ValueError, match="registered already"):
        register(dataclasses.replace(SLOW_DDR, name="ddr"))
    with pytest.raises(ValueError, match="bandwidth_share"):
        dataclasses.replace(SLOW_DDR, bandwidth_share=0.0)
    with pytest.raises(ValueError, match="names its compute kernel"):
        dataclasses.replace(SLOW_DDR, torchrec_kernel=None)


def test_a_registered_tier_is_planned_priced_validated_and_exported_like_a_built_in_one():
    topology = Topology.from_dict(TOPO_1X1)
    with registered(SLOW_DDR) as slow:
        assert Tier.SLOW_DDR is slow and list(Tier)[-1] is slow and local_tiers()[-1] is slow
        model = model_on(["slow_ddr"])
        assert model.tables[0].constraints.tiers == frozenset({slow})

        the_plan = plan(model, topology, improve_time_s=0.2)
        big = the_plan.tables["big"]
        assert {s.tier for s in big.shards} == {slow} and validate(the_plan, model, topology) == []
        # Its memory rule is host memory's: the rows in the trainer's DDR, only the row-wise state in HBM.
        hbm, ddr = tier_bytes(model.tables[0], slow, 2_000_000, 64, model.dtype_of(model.tables[0]))
        assert (hbm, ddr) == tier_bytes(model.tables[0], Tier.DDR, 2_000_000, 64, model.dtype_of(model.tables[0]))

        # Priced at half of UVM's bandwidth: slower than the same shards on ddr, and the bound stays below it.
        cost = CostModel(model, topology)
        on_ddr = {**the_plan.tables, "big": _on(big, Tier.DDR)}
        slow_ms, ddr_ms = cost.evaluate(the_plan.tables)[0].step_ms, cost.evaluate(on_ddr)[0].step_ms
        assert slow_ms > ddr_ms * 1.05
        assert lower_bound(cost).value_ms <= slow_ms * (1 + 1e-9)

        (exported,) = [s for s in torchrec_shardings(the_plan, model, topology) if s.table == "big"]
        assert exported.compute_kernel == "fused_uvm"
        # fused_uvm still reads back as the built-in tier that registered it first.
        assert tier_of_kernel()["fused_uvm"] is Tier.DDR

        # plan.json names it, and reads it back.
        again = Plan.from_dict(the_plan.to_dict())
        assert again.tables["big"].tier is slow

        # Validation holds it to its own rules: a GPU device, its sharding types.
        off = TablePlacement(Sharding.TABLE_WISE, (dataclasses.replace(big.shards[0], device="trainer0"),))
        assert any("is on tier slow_ddr but 'trainer0' is not a GPU" in p
                   for p in validate(_with(the_plan, off), model, topology))  # fmt: skip
    with pytest.raises(ValueError):
        Tier("slow_ddr")
    assert not hasattr(Tier, "SLOW_DDR") and list(Tier) == [Tier.HBM, Tier.DDR, Tier.HBM_CACHE, Tier.PS, Tier.SSD]
    with pytest.raises(SpecError, match=r"tiers\[0\]: unknown value 'slow_ddr'.*hbm \| ddr \| hbm_cache \| ps"):
        model_on(["slow_ddr"])


def _on(placement: TablePlacement, tier: Tier) -> TablePlacement:
    return TablePlacement(placement.sharding, tuple(dataclasses.replace(s, tier=tier) for s in placement.shards))


def _with(the_plan: Plan, big: TablePlacement) -> Plan:
    return dataclasses.replace(the_plan, tables={**the_plan.tables, "big": big})


def test_shards_of_a_registered_tier_are_shards():
    with registered(SLOW_DDR) as slow:
        shard = Shard("trainer0/gpu0", slow, (0, 8), 800, rows=(0, 100))
        assert shard.tier.spec.bandwidth_share == 0.5


NVM_MODULE = """
from persia_planner.kinds import Sharding
from persia_planner.tiers import Holder, Lookups, MemorySpec, Runtime, TierSpec, register, register_memory

NVM = register_memory(MemorySpec("nvm", Holder.SERVER, "PS NVM", "nvm_bytes"))
register(TierSpec("nvm", "a server's NVM", NVM, Lookups.SERVER, frozenset({Sharding.PS_HASH}), 6,
                  runtime=Runtime.PARAMETER_SERVER, store="persia_planner.modules.ps.table_store:memory_store"))
"""


def test_a_tier_module_is_loaded_from_the_environment_and_unloaded_whole(monkeypatch, tmp_path):
    from persia_planner.tiers import Memory, plugged
    from persia_planner.tiers.plugins import ENVIRONMENT, configured, load_configured

    (tmp_path / "nvm_tier.py").write_text(NVM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(ENVIRONMENT, " nvm_tier , ")
    assert configured()[0] == "nvm_tier"
    monkeypatch.setenv(ENVIRONMENT, "no_such_tier_module")
    with pytest.raises(SpecError, match=r"PERSIA_PLANNER_TIERS: no_such_tier_module: the tier module"):
        load_configured()
    monkeypatch.delenv(ENVIRONMENT)
    with plugged("nvm_tier") as loaded:
        assert [m.value for m in loaded.memories] == ["nvm"] and [t.value for t in loaded.tiers] == ["nvm"]
        assert list(Memory)[-1].spec.holder.value == "server" and Tier("nvm").spec.rows_in is loaded.memories[0]
        assert pickle.loads(pickle.dumps(loaded.memories[0])) is loaded.memories[0]
        import os

        assert os.environ[ENVIRONMENT] == "nvm_tier"  # the processes a job starts load it too
    assert "nvm" not in [m.value for m in Memory] and "nvm" not in [t.value for t in Tier]
    with pytest.raises(ValueError, match="'nvm' is not a valid Memory"):
        Memory("nvm")


def test_a_descriptor_refuses_memories_its_runtime_cannot_allocate():
    from persia_planner.tiers import Runtime

    with pytest.raises(ValueError, match="device or host memory"):
        dataclasses.replace(SLOW_DDR, rows_in=Memory.SERVER)
    with pytest.raises(ValueError, match="names its store as 'module:name'"):
        dataclasses.replace(SLOW_DDR, runtime=Runtime.PARAMETER_SERVER, torchrec_kernel=None)


def test_a_host_s_memories_must_be_registered_for_its_role():
    import yaml

    from persia_planner.paths import DEFAULT_TOPOLOGY

    data = yaml.safe_load(DEFAULT_TOPOLOGY.read_text())
    next(h for h in data["hosts"] if h.get("role") == "parameter_server")["memories"] = {"pmem": "1GiB"}
    with pytest.raises(SpecError, match=r"hosts\[1\]\.memories\.pmem: no tier module registers a memory 'pmem'"):
        Topology.from_dict(data, base_dir=DEFAULT_TOPOLOGY.parent)
