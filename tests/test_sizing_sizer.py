"""The sizer: the cheapest shape that meets the target, the same as trying every shape; each stage that rules a
shape out without planning it is sound (no plan there beats the ceiling it states)."""

from __future__ import annotations

import pytest

from persia_planner.errors import PlannerError
from persia_planner.sizing import Resource, Stage, all_shapes, plan_shape, size
from persia_planner.synthetic import random_model
from persia_planner.topology.graph import Topology
from tests.test_sizing_shapes import small_catalog

MAX_HOSTS = 4


def every_shape(model, catalog):
    """Each shape with its plan's speed (None: the model does not fit)."""
    found = []
    for shape in all_shapes(model, catalog, MAX_HOSTS):
        topology = Topology.from_dict(shape.topology_dict(catalog))
        try:
            found.append((shape, plan_shape(model, topology).samples_per_s))
        except PlannerError:
            found.append((shape, None))
    return found


@pytest.fixture(scope="module", params=[0, 1])
def instance(request):
    model = random_model(5, seed=request.param, rows_range=(1e5, 2e8), batch_size=16384)
    catalog = small_catalog()
    return model, catalog, every_shape(model, catalog)


@pytest.mark.parametrize("quantile", [0.3, 0.8])
def test_size_finds_the_price_of_the_exhaustive_search(instance, quantile):
    model, catalog, speeds = instance
    reached = sorted(s for _, s in speeds if s is not None)
    target = reached[int(quantile * (len(reached) - 1))]
    cheapest = min(shape.price_per_hour for shape, s in speeds if s is not None and s >= target)
    sized = size(model, catalog, target, max_hosts=MAX_HOSTS)
    assert sized.chosen is not None and sized.chosen.meets
    assert sized.chosen.shape.price_per_hour == pytest.approx(cheapest)
    assert sized.plans < len(speeds)
    # the plan it returns is the one persia plan makes on that topology
    again = plan_shape(model, Topology.from_dict(sized.chosen.shape.topology_dict(catalog)))
    assert sized.plan is not None and sized.plan.step_ms == pytest.approx(again.step_ms)
    assert sized.chosen.samples_per_s == pytest.approx(again.samples_per_s)
    # every cheaper shape is accounted for: looked at and failing, or short of memory
    looked = {v.shape.describe(): v for v in sized.verdicts}
    for shape, _ in speeds:
        if shape.price_per_hour < cheapest - 1e-9:
            verdict = looked.get(shape.describe())
            assert verdict is None or not verdict.meets


def test_no_ceiling_is_beaten_by_the_plan_of_its_shape(instance):
    """A shape ruled out by the dense step or a bound states a ceiling that its plan indeed does not exceed."""
    model, catalog, speeds = instance
    planned = {shape.describe(): s for shape, s in speeds}
    reached = sorted(s for s in planned.values() if s is not None)
    sized = size(model, catalog, reached[-1], max_hosts=MAX_HOSTS)
    ruled = [
        v for v in sized.verdicts if v.stage in (Stage.DENSE, Stage.TRAINERS_BOUND, Stage.STREAM_BOUND, Stage.BOUND)
    ]
    assert ruled, "the instance should exercise the pruning stages"
    for verdict in ruled:
        speed = planned[verdict.shape.describe()]
        if speed is not None and verdict.ceiling_samples_per_s is not None:
            assert speed <= verdict.ceiling_samples_per_s * (1 + 1e-9), verdict


def test_nothing_meets_an_unreachable_target_and_the_failures_say_why(instance):
    model, catalog, speeds = instance
    fastest = max(s for _, s in speeds if s is not None)
    sized = size(model, catalog, fastest * 3, max_hosts=MAX_HOSTS)
    assert sized.chosen is None and sized.plan is None
    failures = sized.failures()
    assert sum(failures.values()) == len(speeds)
    assert set(failures) <= set(Resource)
    assert all(not v.meets for v in sized.verdicts)


def test_bad_targets_and_budgets_are_refused():
    model = random_model(3, seed=0)
    with pytest.raises(PlannerError, match="above 0"):
        size(model, small_catalog(), 0.0, max_hosts=2)
    with pytest.raises(PlannerError, match="max_hosts"):
        size(model, small_catalog(), 1.0, max_hosts=0)


def test_a_server_class_whose_profile_sets_the_constants_is_judged_with_them(tmp_path):
    """A topology takes its cost constants from the trainers' profile, else from any host's: beside servers whose
    profile refits the dense step, the trainers' verdicts (dense step, ideal servers) are not those of the trainers
    alone, and must not rule those shapes out."""
    import yaml

    from persia_planner.paths import EXAMPLES
    from persia_planner.sizing import catalog_from_dict
    from tests.test_sizing_catalog import GPU_HOST, SERVER

    profile = yaml.safe_load((EXAMPLES / "profiles" / "cpu-2core.yaml").read_text())
    profile["refit"] = {"factors": {"dense": 0.2, "all_reduce": 0.2}}
    (tmp_path / "fast.yaml").write_text(yaml.safe_dump(profile))
    data = {
        "trainers": {"gpu": GPU_HOST | {"gpus": GPU_HOST["gpus"] | {"count": 1, "tflops": 1}}},
        "servers": {"ps": SERVER | {"profile": "fast.yaml"}},
    }
    catalog = catalog_from_dict(data, "c.yaml", tmp_path)
    model = random_model(4, seed=0, rows_range=(1e3, 1e5), batch_size=4096)
    speeds = every_shape(model, catalog)
    with_servers = [s for shape, s in speeds if shape.servers and s is not None]
    alone = [s for shape, s in speeds if not shape.servers and s is not None]
    assert with_servers and alone and max(with_servers) > max(alone)  # the servers' profile speeds the step up
    target = max(with_servers)
    cheapest = min(shape.price_per_hour for shape, s in speeds if s is not None and s >= target)
    sized = size(model, catalog, target, max_hosts=MAX_HOSTS)
    assert sized.chosen is not None and sized.chosen.shape.price_per_hour == pytest.approx(cheapest)
