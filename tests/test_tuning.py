"""The tuning record in plan.json, the fastest-measured choice, and the candidate plans it chooses among."""

import json

import pytest

from persia_planner import ModelSpec, SpecError, Topology, plan
from persia_planner.kinds import Sharding
from persia_planner.plan.plan import Plan
from persia_planner.plan.tuning import MeasuredCandidate, Tuning, fastest
from persia_planner.planner import candidate_plans

RECORD = Tuning(
    "whole tables",
    40,
    60.0,
    (
        MeasuredCandidate("search", 10.0, (100.0, 130.0, 90.0)),
        MeasuredCandidate("whole tables", 11.0, (120.0, 110.0, 140.0)),
        MeasuredCandidate("torchrec", None, (), "TorchRec's planner found no plan: insufficient storage"),
    ),
)


def test_the_fastest_median_is_kept_and_a_tie_keeps_the_search():
    assert [c.median_samples_per_s for c in RECORD.candidates] == [100.0, 120.0, 0.0]
    assert fastest(RECORD.candidates).name == "whole tables"
    tie = (MeasuredCandidate("search", 1.0, (5.0,)), MeasuredCandidate("other", 1.0, (5.0,)))
    assert fastest(tie).name == "search"
    nothing_ran = (MeasuredCandidate("search", 1.0, (), "x"), MeasuredCandidate("other", 1.0, (), "y"))
    assert fastest(nothing_ran).name == "search"
    with pytest.raises(ValueError, match="no candidates"):
        fastest(())


def test_a_tuned_plan_round_trips_through_plan_json():
    tuned = Plan("m", "t", {}, {}, 1.0, 1.0, 1.0, staleness=0, tuning=RECORD)
    data = json.loads(tuned.to_json())
    assert data["tuning"]["chosen"] == "whole tables"
    assert data["tuning"]["candidates"][1] == {
        "name": "whole tables",
        "estimate_step_ms": 11.0,
        "samples_per_s": [120.0, 110.0, 140.0],
        "median_samples_per_s": 120.0,
    }
    # TorchRec's planner found no plan: no estimate (JSON null, never NaN), its error line, no runs.
    assert data["tuning"]["candidates"][2] == {
        "name": "torchrec",
        "estimate_step_ms": None,
        "samples_per_s": [],
        "median_samples_per_s": 0.0,
        "error": "TorchRec's planner found no plan: insufficient storage",
    }
    assert "NaN" not in tuned.to_json()
    assert Plan.from_dict(data).tuning == RECORD


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"chosen": "nobody"}, "plan.json: tuning.chosen: 'nobody' is none of the candidates"),
        ({"steps": 0}, "plan.json: tuning.steps: "),
        (
            {"candidates": [{"name": "search", "estimate_step_ms": 1, "samples_per_s": [-1]}]},
            "plan.json: tuning.candidates[0].samples_per_s: expected a list of at most 1000 numbers >= 0",
        ),
        ({"surprise": 1}, "plan.json: tuning.surprise: unknown key"),
    ],
)
def test_a_malformed_tuning_record_is_refused_naming_its_key(edit, message):
    data = json.loads(Plan("m", "t", {}, {}, 1.0, 1.0, 1.0, tuning=RECORD).to_json())
    data["tuning"].update(edit)
    with pytest.raises(SpecError) as err:
        Plan.from_dict(data)
    assert str(err.value).startswith(message), str(err.value)


MODEL = ModelSpec.from_dict(
    {
        "name": "m",
        "batch_size": 8192,
        "staleness": 0,
        "tables": [
            {"name": "hot", "rows": 4_000_000, "dim": 128, "pooling_factor": 40},
            {"name": "wide", "rows": 1_000_000, "dim": 64, "pooling_factor": 4},
            {"name": "tiny", "rows": 100, "dim": 64, "count": 6},
        ],
    }
)
TOPO = Topology.simple(trainers=1, gpus_per_trainer=4, servers=0)


def test_candidates_are_the_search_first_then_distinct_alternatives_by_estimate():
    searched = plan(MODEL, TOPO, improve_time_s=0.5)
    found = candidate_plans(MODEL, TOPO, limit=5, improve_time_s=0.5, first=searched)
    names = [name for name, _ in found]
    assert names[0] == "search" and found[0][1] is searched
    assert len(set(names)) == len(names) and 2 <= len(found) <= 5
    placements = [dict(p.tables) for _, p in found]
    assert all(a != b for i, a in enumerate(placements) for b in placements[i + 1 :])
    estimates = [p.step_ms for _, p in found[1:]]
    assert estimates == sorted(estimates)
    whole = dict(found).get("whole tables")
    if whole is not None:  # no splits in that family's plan
        assert {p.sharding for p in whole.tables.values()} <= {Sharding.TABLE_WISE, Sharding.DATA_PARALLEL}
    assert len(candidate_plans(MODEL, TOPO, limit=1, improve_time_s=0.5)) == 1
