"""Enumeration alone (:class:`persia_planner.search.options.TieredOptions`): which options of a table it offers in a
state, on a real cost model of small clusters."""

import pytest
from search_inputs import GIB, ROW_BYTES_64, cluster, model, state, table

from persia_planner import SearchConfig
from persia_planner.bound import TierChoice
from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.placement.memory import largest_cache_fraction
from persia_planner.search.base import Option
from persia_planner.search.options import TieredOptions
from persia_planner.tiers import Tier

HBM, DDR, CACHE, PS, SSD = Tier.HBM, Tier.DDR, Tier.HBM_CACHE, Tier.PS, Tier.SSD
TW, CW, TCW, RW, TRW = (
    Sharding.TABLE_WISE,
    Sharding.COLUMN_WISE,
    Sharding.TABLE_COLUMN_WISE,
    Sharding.ROW_WISE,
    Sharding.TABLE_ROW_WISE,
)
DP, HASH = Sharding.DATA_PARALLEL, Sharding.PS_HASH


def options_of(name, *tables, topology=None, config=None, explore=False, hint=None, placed=()):
    """The options of table ``name`` of a model of ``tables`` on ``topology`` (2 hosts x 2 GPUs of 16 GiB, 2 servers
    without disks), in a state holding the tables ``placed`` at their best choices first."""
    cost = CostModel(model(*tables), topology or cluster(2, 2, 2))
    s = state(cost, config)
    for other in placed:
        choice, _ = s.best_choice(s.specs[other])
        s.add(other, choice)
    return TieredOptions().options(s, s.specs[name], explore, hint)


def test_a_small_hot_table_gets_every_sharding_in_hbm_a_replica_and_the_servers():
    """Every split is offered (hot in an empty state), only in HBM: the table fits one GPU's free HBM, so the slower
    local tiers are pruned; tiny (2.6 MB, under 0.2% of a GPU's HBM), so a replica on every GPU is offered too."""
    found = options_of("hot", table("hot", 10_000, 64, 30.0))
    assert set(found) == {
        Option(TW, HBM),
        Option(CW, HBM, splits=2),
        Option(CW, HBM, splits=4),
        Option(TCW, HBM, splits=2),
        Option(RW, HBM),
        Option(TRW, HBM),
        Option(DP, HBM),
        Option(HASH, PS),
    }
    assert len(found) == len(set(found))


def test_a_table_bigger_than_one_gpus_hbm_is_offered_hbm_only_split():
    """20 GB does not fit one 16 GiB GPU but does fit a quarter per GPU: no table-wise HBM and no replica, but
    row-wise and a 4-way column split in HBM; the slower local tiers are offered again."""
    rows = 20_000_000_000 // ROW_BYTES_64
    found = options_of("mid", table("mid", rows, 64, 4.0, zipf_alpha=1.0))
    in_hbm = {o for o in found if o.tier is HBM}
    assert {o.sharding for o in in_hbm} == {RW, CW, TCW, TRW}
    assert all(o.splits >= 2 for o in in_hbm if o.sharding in (CW, TCW))
    assert Option(TW, DDR) in found and any(o.tier is CACHE for o in found)
    assert Option(HASH, PS) in found


def test_a_table_bigger_than_every_gpus_hbm_together_gets_no_hbm_option():
    """390 GB (1.5 G rows) is more than the four GPUs' HBM together: no option keeps its rows in HBM; the servers'
    option remains."""
    found = options_of("cold", table("cold", 1_500_000_000, 64, 1.0, zipf_alpha=1.1), topology=cluster(2, 2, 2))
    assert found
    assert not [o for o in found if o.tier is HBM]
    assert Option(HASH, PS) in found


def test_a_table_that_fits_nowhere_gets_no_option():
    """One 1 GiB GPU, 64 GiB of DDR and no servers hold no part of 390 GB: no option at all (the search then names
    the table in a CapacityError)."""
    assert options_of("cold", table("cold", 1_500_000_000, 64, 1.0), topology=cluster(1, 1, 0, hbm="1GiB")) == []


def test_explore_adds_the_split_options_of_a_table_that_is_not_hot():
    """Beside a heavy table, a light one's work is under a quarter of the mean GPU step: plain enumeration offers it
    whole (table-wise, a replica, the servers); the local search's ``explore`` adds every split."""
    tables = (table("heavy", 10_000_000, 64, 50.0), table("light", 100_000, 64, 1.0))
    plain = options_of("light", *tables, placed=["heavy"])
    explored = options_of("light", *tables, placed=["heavy"], explore=True)
    assert set(plain) == {Option(TW, HBM), Option(DP, HBM), Option(HASH, PS)}
    assert set(explored) - set(plain) == {
        Option(CW, HBM, splits=2),
        Option(CW, HBM, splits=4),
        Option(TCW, HBM, splits=2),
        Option(RW, HBM),
        Option(TRW, HBM),
    }


def test_a_narrow_table_is_never_split_by_columns():
    """Column splits need at least 16 columns a shard: a dim-16 table gets none, even exploring."""
    found = options_of("narrow", table("narrow", 100_000, 16, 30.0), explore=True)
    assert not [o for o in found if o.sharding in (CW, TCW)]
    assert Option(RW, HBM) in found


def test_a_replica_is_offered_only_for_tiny_tables():
    """Data-parallel replicas only up to 0.2% of the smallest GPU's HBM (33 MB of 16 GiB)."""
    assert Option(DP, HBM) in options_of("t", table("t", 100_000, 64, 4.0))  # 26 MB
    assert Option(DP, HBM) not in options_of("t", table("t", 200_000, 64, 4.0))  # 52 MB


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        (
            TierChoice(DDR),
            {
                Option(TW, DDR),
                Option(CW, DDR, splits=2),
                Option(CW, DDR, splits=4),
                Option(TCW, DDR, splits=2),
                Option(RW, DDR),
                Option(TRW, DDR),
            },
        ),
        (TierChoice(HBM, replicated=True), {Option(DP, HBM)}),
        (TierChoice(PS), {Option(HASH, PS)}),
        # The relaxation's one server column stands for every server tier.
        (TierChoice(SSD, 0.1), {Option(HASH, PS)}),
    ],
)
def test_a_hint_restricts_the_options_to_the_hinted_tier(hint, expected):
    """With the bound's tier for the table, only that tier's options, unpruned: DDR is offered though the table
    fits HBM."""
    assert set(options_of("hot", table("hot", 10_000, 64, 30.0), hint=hint)) == expected


def test_a_hinted_cache_is_tried_at_the_relaxations_size_to_three_digits():
    found = options_of("hot", table("hot", 10_000, 64, 30.0), hint=TierChoice(CACHE, 0.012345))
    assert found and {o.tier for o in found} == {CACHE}
    assert {o.cache_fraction for o in found} == {0.0123}


def test_a_hint_of_a_tier_the_config_leaves_out_offers_nothing():
    config = SearchConfig(tiers=frozenset({HBM, PS}))
    assert options_of("hot", table("hot", 10_000, 64, 30.0), config=config, hint=TierChoice(DDR)) == []


def test_the_configs_shardings_and_tiers_bound_every_option():
    config = SearchConfig(shardings=frozenset({RW, HASH}), tiers=frozenset({DDR, PS}))
    found = options_of("hot", table("hot", 10_000, 64, 30.0), config=config)
    assert set(found) == {Option(RW, DDR), Option(HASH, PS)}


def test_a_tables_constraints_narrow_its_options():
    held = table("t", 100_000, 64, 4.0, constraints={"tiers": ["ddr"], "sharding_types": ["table_wise", "row_wise"]})
    assert set(options_of("t", held)) == {Option(TW, DDR), Option(RW, DDR)}
    on_one_gpu = table("t", 100_000, 64, 4.0, constraints={"devices": ["trainer1/gpu0"]})
    found = options_of("t", on_one_gpu)
    # Only placements that can keep to one GPU: no row-wise over every GPU, no replica everywhere, no servers.
    assert {o.sharding for o in found} == {TW}


def test_ssd_options_need_a_disk_on_every_server_and_keep_rows_on_it():
    """The ``ssd`` tier is offered where the servers have disks, at the constants' cache sizes and the hit-rate
    targets', each below 1 (a cache of every row is the ``ps`` tier)."""
    skewed = table("t", 10_000_000, 64, 4.0, zipf_alpha=1.0)
    assert not [o for o in options_of("t", skewed) if o.tier is SSD]
    found = options_of("t", skewed, topology=cluster(2, 2, 2, ssd="1TiB"))
    fractions = sorted(o.cache_fraction for o in found if o.tier is SSD)
    assert {0.05, 0.2} <= set(fractions)
    assert len(fractions) > 2 and all(0 < f < 1 for f in fractions)
    assert all(o.sharding is HASH for o in found if o.tier is SSD)


def test_a_fixed_cache_fraction_is_the_only_one_tried():
    on_ssd = table("t", 10_000_000, 64, 4.0, constraints={"tiers": ["ssd"], "cache_fraction": 0.3})
    assert options_of("t", on_ssd, topology=cluster(2, 2, 2, ssd="1TiB")) == [Option(HASH, SSD, 0.3)]
    cached = table("t", 100_000, 64, 4.0, constraints={"tiers": ["hbm_cache"], "cache_fraction": 0.123})
    found = options_of("t", cached)
    assert found and {(o.tier, o.cache_fraction) for o in found} == {(CACHE, 0.123)}


def test_cache_sizes_are_those_the_free_hbm_can_hold():
    """For a table four times a GPU's HBM, every ``hbm_cache`` size tried fits: none above the largest cache the
    freest GPU holds whole or each GPU holds a row block of."""
    spec = table("big", 4 * 16 * GIB // ROW_BYTES_64, 64, 4.0, zipf_alpha=1.05)
    cost = CostModel(model(spec), cluster(1, 4, 0, ddr="512GiB"))
    s = state(cost)
    big = s.specs["big"]
    free = s.free_room()
    fractions = {o.cache_fraction for o in TieredOptions().options(s, big) if o.tier is CACHE}
    dtype = cost.dtype_of(big)
    whole = largest_cache_fraction(big, big.rows, big.dim, dtype, free.hbm_sorted[0])
    spread = largest_cache_fraction(big, -(-big.rows // 4), big.dim, dtype, free.hbm_sorted[-1])
    assert fractions and max(fractions) <= max(whole, spread)
    assert fractions == set(TieredOptions.cache_fractions(s, big, free))
