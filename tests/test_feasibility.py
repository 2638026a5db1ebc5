"""Constraints against a topology (refused before planning when no plan can keep them) and against a plan
(``validate`` names the table, the constraint and what the plan did)."""

import dataclasses

import pytest

from persia_planner import CapacityError, ModelSpec, Planner, PlannerError, SearchConfig, Topology, validate
from persia_planner.errors import ConstraintError
from persia_planner.kinds import Sharding
from persia_planner.placement.feasibility import check_constraints, constraint_problems, placeable
from persia_planner.placement.shards import TablePlacement
from persia_planner.search import GreedyLocalSearch
from persia_planner.tiers import Tier

GIB = 2**30
WITH_SERVERS = Topology.simple(trainers=2, gpus_per_trainer=2, servers=2, hbm_bytes=16 * GIB, ddr_bytes=64 * GIB)
NO_SERVERS = Topology.simple(trainers=2, gpus_per_trainer=2, hbm_bytes=16 * GIB, ddr_bytes=64 * GIB)
# Hosts of 2 PiB: a table meets a server store's row limit before their memory.
LARGE_SERVERS = Topology.simple(trainers=2, gpus_per_trainer=2, servers=2, hbm_bytes=16 * GIB, ddr_bytes=2 * 1024**5)


def model_with(constraints: dict, rows: int = 1000, dim: int = 16) -> ModelSpec:
    table = {"name": "user", "rows": rows, "dim": dim, "constraints": constraints}
    return ModelSpec.from_dict({"batch_size": 64, "tables": [table, {"name": "other", "rows": 1000, "dim": 16}]})


@pytest.mark.parametrize(
    ("constraints", "topology", "size", "error", "message"),
    [
        (
            {"devices": ["trainer9/gpu0", "ps7"]},
            WITH_SERVERS,
            {},
            ConstraintError,
            "table 'user': constraints.devices names 'ps7', which topology 'generated' does not have (nor 1 more of "
            "its names); fix: name trainer devices (e.g. trainer0/gpu0) or parameter servers (e.g. ps0)",
        ),
        (
            {"devices": ["trainer1"]},
            WITH_SERVERS,
            {},
            ConstraintError,
            "table 'user': constraints.devices names 'trainer1', which topology 'generated' does not have; "
            "fix: name the devices of host trainer1 (e.g. trainer1/gpu0)",
        ),
        (
            {"tiers": ["ps"]},
            NO_SERVERS,
            {},
            ConstraintError,
            "table 'user': no placement keeps its constraints (tiers [ps]): ps_hash needs parameter servers, and "
            "topology 'generated' has none; fix: add parameter servers (hosts with role: parameter_server) or allow "
            "a tier of the trainers",
        ),
        (
            {"sharding_types": ["ps_hash"], "devices": ["ps1"]},
            WITH_SERVERS,
            {},
            ConstraintError,
            "table 'user': no placement keeps its constraints (sharding_types [ps_hash], devices [ps1]): ps_hash "
            "hashes a table over every parameter server, and it names 1 of the 2 servers; fix: name the devices "
            "those need or allow a tier of the trainers",
        ),
        (
            {"sharding_types": ["row_wise", "data_parallel"], "devices": ["trainer0/gpu0", "trainer1/gpu0"]},
            WITH_SERVERS,
            {},
            ConstraintError,
            "table 'user': no placement keeps its constraints (sharding_types [row_wise, data_parallel], devices "
            "[trainer0/gpu0, trainer1/gpu0]): row_wise and data_parallel span every trainer device, and it names 2 "
            "of the 4; fix: name the devices those need or allow table_wise",
        ),
        (
            {"tiers": ["hbm"], "sharding_types": ["table_wise"]},
            WITH_SERVERS,
            {"rows": 100_000_000, "dim": 64},
            CapacityError,
            "table 'user' (24.2 GiB) fits nowhere its constraints allow (sharding_types [table_wise], tiers [hbm]): "
            "table_wise on hbm, the nearest to fitting, needs 24.2 GiB of HBM on one device, and the largest it may "
            "use has 14.4 GiB usable (short by 9.8 GiB); fix: allow more tiers, sharding types or devices or give "
            "those devices more memory or reduce its rows",
        ),
        (
            {"tiers": ["hbm"]},
            WITH_SERVERS,
            {"rows": 1_000_000_000, "dim": 64},
            CapacityError,
            "table 'user' (242.1 GiB) fits nowhere its constraints allow (tiers [hbm]): row_wise on hbm, the nearest "
            "to fitting, needs 242.1 GiB of HBM, and the devices it may use have 57.6 GiB (short by 184.5 GiB); "
            "fix: allow more tiers, sharding types or devices or give those devices more memory or reduce its rows",
        ),
        (
            {"tiers": ["ps"]},
            LARGE_SERVERS,
            {"rows": 3_000_000_000_000, "dim": 4},
            CapacityError,
            "table 'user' (54.6 TiB) fits nowhere its constraints allow (tiers [ps]): ps_hash on ps, the nearest to "
            "fitting, would give each of the 2 parameter servers 1,500,000,000,000 of its rows, over the "
            "1,099,507,433,414 of one table a server's store holds; fix: allow more tiers, sharding types or devices "
            "or give those devices more memory or reduce its rows",
        ),
    ],
)
def test_unsatisfiable_constraints_are_refused_before_planning(constraints, topology, size, error, message):
    model = model_with(constraints, **size)
    with pytest.raises(error) as err:
        check_constraints(model, topology)
    assert str(err.value) == message
    assert err.value.table == "user"
    with pytest.raises(error):  # the planner asks first
        Planner().plan(model, topology)


def test_placeable_follows_the_devices_each_sharding_needs():
    one_host = model_with({"devices": ["trainer1/gpu0", "trainer1/gpu1"], "tiers": ["hbm"]}).tables[0]
    assert placeable(one_host, WITH_SERVERS) == [
        (Sharding.TABLE_WISE, Tier.HBM),
        (Sharding.COLUMN_WISE, Tier.HBM),
        (Sharding.TABLE_ROW_WISE, Tier.HBM),
        (Sharding.TABLE_COLUMN_WISE, Tier.HBM),
    ]
    servers = model_with({"devices": ["ps0", "ps1"]}).tables[0]
    assert placeable(servers, WITH_SERVERS) == [(Sharding.PS_HASH, Tier.PS)]


def test_a_plan_breaking_a_constraint_is_refused_by_validate():
    """Each constraint broken by hand in a plan that kept it: one line naming the table, the constraint and what the
    plan did."""
    constraints = {"sharding_types": ["table_wise"], "tiers": ["hbm_cache"], "devices": ["trainer0/gpu1"]}
    constraints["cache_fraction"] = 0.5
    model = model_with(constraints, rows=1_000_000, dim=64)
    plan = Planner(GreedyLocalSearch(SearchConfig(improve_time_s=0.2))).plan(model, NO_SERVERS)
    placement = plan.tables["user"]
    assert validate(plan, model, NO_SERVERS) == []
    assert (placement.sharding, placement.tier, placement.devices) == (
        Sharding.TABLE_WISE,
        Tier.HBM_CACHE,
        ("trainer0/gpu1",),
    )

    def broken(**change) -> list[str]:
        shards = tuple(dataclasses.replace(s, **change) for s in placement.shards)
        tables = {**plan.tables, "user": TablePlacement(placement.sharding, shards)}
        return validate(dataclasses.replace(plan, tables=tables), model, NO_SERVERS)

    assert broken(device="trainer1/gpu0") == [
        "table 'user': the plan puts shard 0 on trainer1/gpu0, but its constraints allow devices [trainer0/gpu1]"
    ]
    assert broken(tier=Tier.DDR, cache_fraction=None) == [
        "table 'user': the plan puts it on tier ddr, but its constraints allow tiers [hbm_cache]"
    ]
    assert broken(cache_fraction=0.2) == [
        "table 'user': the plan gives shard 0 cache_fraction 0.2, but its constraints fix cache_fraction 0.5"
    ]
    tables = {**plan.tables, "user": TablePlacement(Sharding.COLUMN_WISE, placement.shards)}
    assert validate(dataclasses.replace(plan, tables=tables), model, NO_SERVERS) == [
        "table 'user': the plan shards it column_wise, but its constraints allow sharding_types [table_wise]"
    ]


def test_constraint_problems_of_an_unconstrained_table_are_none():
    model = model_with({})
    plan = Planner(GreedyLocalSearch(SearchConfig(improve_time_s=0.1))).plan(model, NO_SERVERS)
    assert constraint_problems(model.tables[1], plan.tables["other"]) == []
    assert isinstance(ConstraintError("t", "m"), PlannerError)
