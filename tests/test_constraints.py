"""Per-table constraints: model.yaml's ``constraints:`` read into ``TableConstraints``, and TorchRec's
``ParameterConstraints`` read as ours."""

from types import SimpleNamespace

import pytest

from persia_planner import ModelSpec, SpecError, Topology
from persia_planner.kinds import Sharding
from persia_planner.model.constraints import NO_CONSTRAINTS, TableConstraints, from_parameter_constraints
from persia_planner.tiers import Tier


def model_with(constraints, **table) -> ModelSpec:
    return ModelSpec.from_dict(
        {"batch_size": 64, "tables": [{"name": "user", "rows": 1000, "dim": 16, **table, "constraints": constraints}]}
    )


def test_reads_every_key():
    allowed = (
        model_with(
            {
                "sharding_types": ["row_wise", "TABLE_WISE", "row_wise"],
                "tiers": ["hbm", "hbm_cache"],
                "devices": ["trainer0/gpu0", "trainer0/gpu1"],
                "cache_fraction": 0.25,
            }
        )
        .tables[0]
        .constraints
    )
    assert allowed == TableConstraints(
        frozenset({Sharding.ROW_WISE, Sharding.TABLE_WISE}),
        frozenset({Tier.HBM, Tier.HBM_CACHE}),
        frozenset({"trainer0/gpu0", "trainer0/gpu1"}),
        0.25,
    )
    assert allowed.describe() == (
        "sharding_types [table_wise, row_wise], tiers [hbm, hbm_cache], devices [trainer0/gpu0, trainer0/gpu1], "
        "cache_fraction 0.25"
    )
    assert allowed.combinations() == [
        (Sharding.TABLE_WISE, Tier.HBM),
        (Sharding.TABLE_WISE, Tier.HBM_CACHE),
        (Sharding.ROW_WISE, Tier.HBM),
        (Sharding.ROW_WISE, Tier.HBM_CACHE),
    ]


def test_a_table_without_constraints_allows_everything_and_its_copies_share_them():
    plain = ModelSpec.from_dict({"batch_size": 64, "tables": [{"name": "a", "rows": 10, "dim": 4}]})
    assert plain.tables[0].constraints is NO_CONSTRAINTS and not NO_CONSTRAINTS.constrained
    assert len(NO_CONSTRAINTS.combinations()) == 3 * 5 + 3  # five splits on three local tiers, a replica, ps_hash x 2
    copies = model_with({"tiers": ["ddr"]}, count=3)
    assert [t.constraints.tiers for t in copies.tables] == [frozenset({Tier.DDR})] * 3


def test_tiers_without_ps_keep_a_table_off_the_servers():
    allowed = model_with({"tiers": ["hbm", "ddr"]}).tables[0].constraints
    assert not allowed.allows_tier(Tier.PS) and allowed.allows(Sharding.DATA_PARALLEL, Tier.HBM)
    no_hash = model_with({"sharding_types": ["table_wise"]}).tables[0].constraints
    assert not no_hash.allows_tier(Tier.PS) and no_hash.allows_tier(Tier.DDR)


@pytest.mark.parametrize(
    ("constraints", "message"),
    [
        (
            {"tier": ["hbm"]},
            "model.yaml: tables[0].constraints.tier: unknown key; fix: did you mean 'tiers'?",
        ),
        (
            {"tiers": "hbm"},
            "model.yaml: tables[0].constraints.tiers: expected a list of names, got 'hbm'; fix: write tiers: [hbm]",
        ),
        (
            {"tiers": ["hbm", "hmb"]},
            "model.yaml: tables[0].constraints.tiers[1]: unknown value 'hmb'; "
            "fix: use one of hbm | ddr | hbm_cache | ps | ssd",
        ),
        (
            {"sharding_types": ["grid_shard"]},
            "model.yaml: tables[0].constraints.sharding_types[0]: unknown value 'grid_shard'; fix: use one of "
            "table_wise | row_wise | column_wise | table_row_wise | table_column_wise | data_parallel | ps_hash",
        ),
        (
            {"devices": []},
            "model.yaml: tables[0].constraints.devices: is an empty list, which allows nothing; "
            "fix: name one or more, or drop devices",
        ),
        ({"devices": ["gpu0", 3]}, "model.yaml: tables[0].constraints.devices[1]: expected a non-empty string, got 3"),
        ({"cache_fraction": 0}, "model.yaml: tables[0].constraints.cache_fraction: table 'user': must be > 0, got 0"),
        (
            {"cache_fraction": 1.5},
            "model.yaml: tables[0].constraints.cache_fraction: must be <= 1, got 1.5; fix: use at most 1",
        ),
        (
            {"sharding_types": ["ps_hash"], "tiers": ["hbm"]},
            "model.yaml: tables[0].constraints.tiers: table 'user': sharding_types [ps_hash], tiers [hbm] have no "
            "pair in common (ps_hash runs on ps or ssd); fix: allow a tier that one of its sharding types runs on",
        ),
        (
            {"tiers": ["ddr"], "cache_fraction": 0.1},
            "model.yaml: tables[0].constraints.cache_fraction: table 'user': cache_fraction sizes the cache of the "
            "hbm_cache or ssd tier, which its tiers [ddr] leave out; fix: allow tier hbm_cache or ssd or drop "
            "cache_fraction",
        ),
        ("hbm", "model.yaml: tables[0].constraints: expected a mapping, got str"),
    ],
)
def test_bad_constraints_are_one_line_naming_the_key(constraints, message):
    with pytest.raises(SpecError) as err:
        model_with(constraints)
    assert str(err.value) == message


def test_from_a_real_parameter_constraints():
    pytest.importorskip("torchrec")
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams, ShardingType

    theirs = ParameterConstraints(
        sharding_types=[ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value, "grid_shard"],
        compute_kernels=["fused_uvm_caching", "fused_uvm", "key_value"],
        pooling_factors=[2.0, 3.5],
        cache_params=CacheParams(load_factor=0.3),
    )
    ours, pooling = from_parameter_constraints("user", theirs)
    assert ours == TableConstraints(
        frozenset({Sharding.ROW_WISE, Sharding.TABLE_WISE}), frozenset({Tier.HBM_CACHE, Tier.DDR}), None, 0.3
    )
    assert pooling == 5.5  # both features' ids are looked up in the table


def test_from_torchrec_reads_each_tables_parameter_constraints():
    torchrec = pytest.importorskip("torchrec")
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams

    configs = [
        torchrec.EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=100, feature_names=["f0"]),
        torchrec.EmbeddingBagConfig(name="t1", embedding_dim=32, num_embeddings=1000, feature_names=["f1"]),
    ]
    constraints = {
        "t0": ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["dense"]),
        "t1": ParameterConstraints(pooling_factors=[4.0], cache_params=CacheParams(load_factor=0.1)),
    }
    model = ModelSpec.from_torchrec(configs, batch_size=512, constraints=constraints, pooling_factors={"t0": 2.0})
    t0, t1 = model.tables
    assert t0.constraints.combinations() == [(Sharding.DATA_PARALLEL, Tier.HBM)]
    assert t0.pooling_factor == 2.0  # the argument wins over the constraints' default [1.0]
    assert (t1.pooling_factor, t1.constraints) == (4.0, TableConstraints(cache_fraction=0.1))
    with pytest.raises(SpecError, match="ParameterConstraints: t9: constrains table 't9', which the collection lacks"):
        ModelSpec.from_torchrec(configs, batch_size=512, constraints={"t9": ParameterConstraints()})


def test_ranks_become_the_devices_of_the_topology():
    topology = Topology.simple(trainers=1, gpus_per_trainer=4)
    ranked = SimpleNamespace(ranks=[1, 3], sharding_types=None, compute_kernels=None, pooling_factors=[1.0])
    ours, _ = from_parameter_constraints("user", ranked, [g.name for g in topology.gpus])
    assert ours.devices == frozenset({topology.gpus[1].name, topology.gpus[3].name})
    with pytest.raises(SpecError, match=r"ParameterConstraints: user.ranks: .* fix: pass topology="):
        from_parameter_constraints("user", ranked)
    with pytest.raises(SpecError, match="rank 3 is beyond the topology's 2 devices"):
        from_parameter_constraints("user", ranked, ["a", "b"])


def test_torchrec_names_without_ours_are_refused():
    nothing = SimpleNamespace(compute_kernels=["key_value"])
    with pytest.raises(SpecError) as err:
        from_parameter_constraints("user", nothing)
    assert str(err.value) == (
        "ParameterConstraints: user.compute_kernels: table 'user': none of ['key_value'] has a persia tier; "
        "fix: use fused, fused_uvm, fused_uvm_caching, dense"
    )


def test_constraints_read_back_as_model_yaml_writes_them():
    from persia_planner.synthetic import model_dict

    constraints = {"sharding_types": ["table_wise"], "tiers": ["hbm_cache"], "devices": ["b", "a"]}
    model = model_with({**constraints, "cache_fraction": 0.5})
    assert model.tables[0].constraints.to_dict() == {**constraints, "devices": ["a", "b"], "cache_fraction": 0.5}
    assert ModelSpec.from_dict(model_dict(model)).tables == model.tables
