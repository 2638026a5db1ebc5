"""Device choice alone (:class:`persia_planner.search.device_choice.DeviceChoice`): the best devices of one option of
a table, in a state of a real cost model where some GPUs are busier than others."""

import numpy as np
import pytest
from search_inputs import cluster, forced_choice, model, snapshot, state, table

from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.search.base import Option
from persia_planner.search.result import build_placement
from persia_planner.tiers import Memory, Tier

TW, CW, TCW = Sharding.TABLE_WISE, Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE
RW, TRW, DP, HASH = Sharding.ROW_WISE, Sharding.TABLE_ROW_WISE, Sharding.DATA_PARALLEL, Sharding.PS_HASH
IN_HBM = Option(TW, Tier.HBM)


def busy_state(busy_gpus, topology=None, *more_tables):
    """2 hosts x 2 GPUs (16 GiB) and 2 servers; a heavy table table-wise on each GPU of ``busy_gpus``, and the table
    ``t`` (100 k rows, dim 64) not placed yet."""
    busy = [table(f"busy{g}", 2_000_000, 64, 40.0) for g in busy_gpus]
    cost = CostModel(model(table("t", 100_000, 64, 4.0), *busy, *more_tables), topology or cluster(2, 2, 2))
    s = state(cost)
    for g in busy_gpus:
        s.add(f"busy{g}", forced_choice(cost, f"busy{g}", IN_HBM, (g,)))
    return s


def best(s, option, name="t"):
    return s.devices.best_choice_of(s.specs[name], [option])[0]


def test_a_table_wise_option_goes_to_the_least_loaded_gpu():
    assert best(busy_state([0, 1, 2]), IN_HBM).gpus == (3,)
    assert best(busy_state([1, 2, 3]), IN_HBM).gpus == (0,)


def test_a_column_split_goes_to_the_least_loaded_gpus_one_shard_each():
    choice = best(busy_state([0, 1]), Option(CW, Tier.HBM, splits=2))
    assert sorted(choice.gpus) == [2, 3]


def test_a_table_column_split_stays_on_one_host_the_least_loaded():
    choice = best(busy_state([0, 1]), Option(TCW, Tier.HBM, splits=2))
    assert sorted(choice.gpus) == [2, 3]  # trainer1's GPUs
    assert best(busy_state([2, 3]), Option(TCW, Tier.HBM, splits=2)).gpus == (0, 1)


def test_a_row_wise_option_spans_every_gpu_in_order():
    assert best(busy_state([0]), Option(RW, Tier.HBM)).gpus == (0, 1, 2, 3)


def test_a_table_row_wise_option_spans_the_least_loaded_host():
    assert best(busy_state([0]), Option(TRW, Tier.HBM)).gpus == (2, 3)
    assert best(busy_state([3]), Option(TRW, Tier.HBM)).gpus == (0, 1)


def test_a_replica_is_on_every_gpu_and_a_hashed_table_on_no_gpu():
    s = busy_state([0])
    replica = best(s, Option(DP, Tier.HBM))
    assert replica.gpus == (0, 1, 2, 3)
    assert (s.cost.hbm_of(replica.mem) > 0).all()
    hashed = best(s, Option(HASH, Tier.PS))
    assert hashed.gpus == ()
    assert not s.cost.hbm_of(hashed.mem).any() and (s.cost.slots_of(hashed.mem, Memory.SERVER) > 0).all()


@pytest.mark.parametrize(
    "option",
    [
        IN_HBM,
        Option(CW, Tier.HBM, splits=2),
        Option(TCW, Tier.DDR, splits=2),
        Option(RW, Tier.HBM_CACHE, 0.1),
        Option(TRW, Tier.HBM),
        Option(DP, Tier.HBM),
        Option(HASH, Tier.PS),
    ],
)
def test_a_choices_vectors_are_the_cost_models_of_its_placement(option):
    """The search builds a choice's vectors from per-table parts; they are the cost model's vectors of the plan's
    shards, and its score is the state's score with it added."""
    s = busy_state([0])
    choice = best(s, option)
    spec = s.specs["t"]
    loads, mem = s.cost.placement_loads(spec, build_placement(s.cost, spec, option, choice.gpus))
    assert np.allclose(choice.loads, loads, rtol=1e-12, atol=1e-15)
    assert np.allclose(choice.mem, mem, rtol=0, atol=1.0)
    assert s.score_of(choice) == pytest.approx(float(s.score(s.loads + choice.loads)[0]), rel=1e-12)


def test_choosing_devices_does_not_change_the_state():
    s = busy_state([0, 1])
    loads, mem, placed = snapshot(s)
    s.devices.best_choice_of(s.specs["t"], s.options(s.specs["t"], explore=True))
    after = snapshot(s)
    assert np.array_equal(after[0], loads) and np.array_equal(after[1], mem) and after[2] == placed


def test_every_options_best_devices_come_back_best_first():
    s = busy_state([0, 1])
    options = s.options(s.specs["t"], explore=True)
    choice, scored = s.devices.best_choice_of(s.specs["t"], options)
    values = [value for _, value in scored]
    assert values == sorted(values) and scored[0][0] is choice
    assert {c.option for c, _ in scored} == set(options)


def test_a_tables_allowed_devices_win_over_load():
    held = table("held", 100_000, 64, 4.0, constraints={"devices": ["trainer0/gpu0"]})
    s = busy_state([0], None, held)
    assert best(s, IN_HBM, "held").gpus == (0,)


def test_nothing_is_returned_where_nothing_fits():
    """12 GB table-wise does not fit a 16 GiB GPU holding 8 GB already; on every GPU so loaded, there is no choice."""
    tables = [table(f"fill{g}", 8_000_000_000 // 260, 64, 1.0) for g in range(4)]
    cost = CostModel(model(table("t", 12_000_000_000 // 260, 64, 1.0), *tables), cluster(2, 2, 2))
    s = state(cost)
    for g in range(4):
        s.add(f"fill{g}", forced_choice(cost, f"fill{g}", IN_HBM, (g,)))
    spec = s.specs["t"]
    assert s.devices.first_step(spec, IN_HBM) is None
    assert s.devices.best_choice_of(spec, [IN_HBM]) == (None, [])
    # Split in four, 3 GB a GPU, it fits again.
    assert best(s, Option(RW, Tier.HBM)).gpus == (0, 1, 2, 3)
