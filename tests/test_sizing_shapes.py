"""Cluster shapes: their price, the memory test that keeps shapes unbuilt, and the cheapest-first order."""

from __future__ import annotations

import itertools

import pytest

from persia_planner.errors import CapacityError
from persia_planner.planner import check_capacity
from persia_planner.sizing import Shape, all_shapes, catalog_from_dict, cheapest_first, streams
from persia_planner.synthetic import random_model
from persia_planner.topology.graph import Topology
from tests.test_sizing_catalog import GPU_HOST, SERVER


def small_catalog():
    trainers = {
        "small": GPU_HOST | {"price_per_hour": 3.0, "gpus": GPU_HOST["gpus"] | {"count": 1, "hbm": "4GiB"}},
        "big": GPU_HOST | {"price_per_hour": 7.0, "ddr": "16GiB", "gpus": GPU_HOST["gpus"] | {"count": 2}},
    }
    servers = {"ps": SERVER | {"ddr": "24GiB", "price_per_hour": 1.25}, "fat": SERVER | {"ddr": "200GiB"}}
    links = {
        "lan": {"price_per_hour": 0, "source": "s"},
        "fast": {"price_per_hour": 0.5, "source": "s", "latency": "1us"},
    }
    return catalog_from_dict({"trainers": trainers, "servers": servers, "links": links}, "small.yaml")


def test_a_shape_costs_its_hosts_and_the_link_for_each():
    cat = small_catalog()
    shape = Shape(cat.trainers[1], 3, cat.servers[0], 4, cat.links[1])
    assert shape.price_per_hour == pytest.approx(3 * 7.0 + 4 * 1.25 + 7 * 0.5)
    assert shape.describe() == "3 x big + 4 x ps on fast"
    assert Shape(cat.trainers[0], 1, None, 0, cat.links[0]).describe() == "1 x small on lan"


@pytest.mark.parametrize("seed", range(3))
def test_the_memory_test_keeps_out_exactly_the_shapes_the_planner_refuses(seed):
    """A stream's first held count is where check_capacity stops refusing (and never above): nothing the planner
    could place is left out unbuilt."""
    model = random_model(6, seed=seed, rows_range=(1e6, 3e8))
    cat = small_catalog()
    for stream in streams(model, cat, max_hosts=8):
        counts = [0] if stream.server is None else range(1, stream.last + 1)
        for servers in counts:
            topology = Topology.from_dict(stream.shape(servers).topology_dict(cat))
            try:
                check_capacity(model, topology)
                refused = False
            except CapacityError:
                refused = True
            assert refused == (servers not in stream.held), (stream, servers)


def test_cheapest_first_visits_every_held_shape_once_in_price_order():
    model = random_model(6, seed=1, rows_range=(1e6, 3e8))
    cat = small_catalog()
    found = streams(model, cat, max_hosts=6)
    visited = [shape for _, shape in cheapest_first(found)]
    prices = [s.price_per_hour for s in visited]
    assert prices == sorted(prices)
    held = sum(len(s.held) for s in found)
    assert len(visited) == held == len({s.describe() for s in visited})
    assert len(all_shapes(model, cat, 6)) == sum(len(s.held) + len(s.short) for s in found)
    assert all(s.hosts <= 6 for s in visited)


def test_a_dropped_stream_yields_no_more_shapes():
    model = random_model(6, seed=1, rows_range=(1e6, 3e8))
    found = streams(model, small_catalog(), max_hosts=6)
    order = cheapest_first(found)
    first_index, _ = next(order)
    order.drop(first_index)
    assert all(index != first_index for index, _ in order)


def test_max_count_caps_a_class():
    cat = small_catalog()
    capped = catalog_from_dict(
        {
            "trainers": {
                "big": dict(cat.trainers[1].hardware) | {"price_per_hour": 7.0, "source": "s", "max_count": 2}
            },
            "servers": {},
        },
        "capped.yaml",
    )
    model = random_model(3, seed=0, rows_range=(1e3, 1e4))
    assert {s.trainers for s in all_shapes(model, capped, 8)} == {1, 2}
    assert list(itertools.islice((s.servers for s in all_shapes(model, capped, 8)), 3)) == [0, 0]
