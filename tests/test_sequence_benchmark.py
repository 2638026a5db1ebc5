"""benchmarks/sequence.py's parts: the teacher's rows written as the CSV the runs read (a history per row, its ids
those of the item column), its AUCs, and the model files of the three runs."""

from __future__ import annotations

import csv

from benchmark_modules import load

from persia_planner.model.specs import ModelSpec

bench = load("sequence")


def test_the_rows_are_the_teachers_with_their_history(tmp_path):
    auc, blind = bench.write_rows(tmp_path / "rows.csv", 2_000, seed=3)
    with (tmp_path / "rows.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10_000 and set(rows[0]) == {"user", "item", "history", "click"}  # whole batches of 10,000
    lengths = [len(r["history"].split("|")) if r["history"] else 0 for r in rows]
    assert abs(sum(lengths) / len(lengths) - bench.HISTORY_MEAN) < 0.3
    items = {r["item"] for r in rows}
    assert sum(h in items for r in rows for h in r["history"].split("|") if h) > 0.5 * sum(lengths)
    assert {r["click"] for r in rows} == {"0", "1"}
    assert auc > blind + 0.02  # the history matters to the teacher


def test_the_three_runs_models_read_as_model_yaml():
    hybrid = ModelSpec.from_dict(bench.model(True, True))
    assert [t.name for t in hybrid.tables if t.sequence] == ["history"] and hybrid.dense.arch.kind.value == "din"
    assert hybrid.table("history").constraints.tiers is not None
    assert ModelSpec.from_dict(bench.model(True, False)).table("history").constraints.tiers is None
    blind = ModelSpec.from_dict(bench.model(False, False))
    assert [t.name for t in blind.tables] == ["user", "item"] and blind.dense.arch.kind.value == "dlrm"
    assert "history" not in {c.feature for c in blind.data.sparse}
