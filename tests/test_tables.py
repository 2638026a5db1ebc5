"""model.yaml's table entries (persia_planner/model/tables.py): pooled and sequence tables, and the one-line
refusals of a sequence table's bad entries."""

import pytest

from persia_planner import ModelSpec, SpecError
from persia_planner.kinds import Sharding
from persia_planner.model.pooling import SEQUENCE_SHARDINGS, Pooling, SequenceLength
from persia_planner.model.tables import TableSpec


def _model(**table):
    return ModelSpec.from_dict({"batch_size": 64, "tables": [{"name": "h", "rows": 1000, "dim": 16, **table}]})


def test_a_sequence_table_reads_its_length_and_prices_its_ids_as_lookups():
    t = _model(pooling="none", sequence_length={"mean": 20, "max": 50}).tables[0]
    assert t.pooling is Pooling.NONE and t.sequence
    assert t.pooling_factor == 20.0 and t.max_sequence_length == 50
    assert t.sequence_length == SequenceLength(20.0, 50)
    assert t.outputs_per_sample == 20.0  # every id is an output row
    pooled = _model(pooling_factor=20).tables[0]
    assert pooled.pooling is Pooling.SUM and not pooled.sequence and pooled.outputs_per_sample == 1.0
    assert _model(pooling="mean").tables[0].pooling is Pooling.MEAN


def test_a_sequence_table_allows_the_embedding_collections_shardings_only():
    t = TableSpec("h", 100, 16, pooling=Pooling.NONE)
    assert {s for s in Sharding if t.allows(s)} == SEQUENCE_SHARDINGS
    assert Sharding.TABLE_ROW_WISE not in SEQUENCE_SHARDINGS and Sharding.TABLE_COLUMN_WISE not in SEQUENCE_SHARDINGS
    assert all(TableSpec("b", 100, 16).allows(s) for s in Sharding)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"pooling": "none"},
            "model.yaml: tables[0].sequence_length: a sequence table (pooling: none) needs its sequence_length; "
            "fix: write sequence_length: {mean: M, max: N}",
        ),
        (
            {"pooling": "none", "pooling_factor": 3, "sequence_length": {"mean": 2, "max": 4}},
            "model.yaml: tables[0].pooling_factor: a sequence table (pooling: none) gives its ids per sample as "
            "sequence_length",
        ),
        (
            {"sequence_length": {"mean": 2, "max": 4}},
            "model.yaml: tables[0].sequence_length: only a sequence table (pooling: none) has a sequence_length",
        ),
        (
            {"pooling": "none", "sequence_length": {"mean": 9, "max": 4}},
            "model.yaml: tables[0].sequence_length.mean: 9 is over max 4",
        ),
        (
            {"pooling": "none", "sequence_length": {"max": 4}},
            "model.yaml: tables[0].sequence_length.mean:",
        ),
        (
            {"pooling": "max"},
            "model.yaml: tables[0].pooling: unknown value 'max'; fix: use one of sum | mean | none",
        ),
        (
            {
                "pooling": "none",
                "sequence_length": {"mean": 2, "max": 4},
                "constraints": {"sharding_types": ["row_wise", "table_row_wise"]},
            },
            "model.yaml: tables[0].constraints: a sequence table (pooling: none) cannot be sharded table_row_wise; "
            "fix: allow only column_wise, data_parallel, ps_hash, row_wise, table_wise",
        ),
    ],
)
def test_a_bad_sequence_entry_is_one_line_naming_its_key(table, message):
    with pytest.raises(SpecError) as err:
        _model(**table)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_sequence_tables_max_may_be_unknown_and_is_written_back_so():
    t = _model(pooling="none", sequence_length={"mean": 3}).tables[0]
    assert t.pooling_factor == 3.0 and t.max_sequence_length is None and t.sequence_length is None
    spec = _model(pooling="none", sequence_length={"mean": 3})
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_a_sequence_table_is_written_back_as_read():
    m = ModelSpec.from_dict(
        {
            "batch_size": 64,
            "tables": [
                {"name": "h", "rows": 1000, "dim": 16, "pooling": "none", "sequence_length": {"mean": 7.5, "max": 30}},
                {"name": "m", "rows": 10, "dim": 16, "pooling": "mean", "pooling_factor": 2},
                {"name": "s", "rows": 10, "dim": 16},
            ],
        }
    )
    written = m.to_dict()["tables"]
    assert written[0]["pooling"] == "none" and written[0]["sequence_length"] == {"mean": 7.5, "max": 30}
    assert "pooling_factor" not in written[0] and written[1]["pooling"] == "mean" and "pooling" not in written[2]
    assert ModelSpec.from_dict(m.to_dict()) == m


def test_a_sequence_length_needs_a_mean_within_its_max():
    with pytest.raises(ValueError, match="mean <= max"):
        SequenceLength(5.0, 4)
    with pytest.raises(ValueError, match="pooled table has no max_sequence_length"):
        TableSpec("b", 10, 4, max_sequence_length=3)


def test_the_sequence_tables_share_one_dim():
    seq = {"pooling": "none", "sequence_length": {"mean": 2, "max": 4}}
    tables = [{"name": "a", "rows": 10, "dim": 16, **seq}, {"name": "b", "rows": 10, "dim": 8, **seq}]
    with pytest.raises(SpecError) as err:
        ModelSpec.from_dict({"batch_size": 8, "tables": [*tables, {"name": "c", "rows": 10, "dim": 4}]})
    assert str(err.value) == (
        "model.yaml: tables: the sequence tables (pooling: none) have dims 8, 16: TorchRec's EmbeddingCollection "
        "needs one dim for all of them; fix: give every sequence table the same dim"
    )


def test_a_sequence_tables_candidate_is_looked_up_in_it_too():
    seq = {"pooling": "none", "sequence_length": {"mean": 10, "max": 40}, "candidate": "item"}
    data = {
        "batch_size": 64,
        "tables": [{"name": "item", "rows": 100, "dim": 8}, {"name": "history", "rows": 100, "dim": 8, **seq}],
    }
    spec = ModelSpec.from_dict(data)
    history = spec.table("history")
    assert history.features == ("history", "item") and history.candidate == "item"
    assert history.pooling_factor == 11.0 and history.sequence_mean == 10.0  # the candidate's id is a lookup too
    assert history.sequence_length == SequenceLength(10.0, 40)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match=r"table 'history': candidate 'user' is not a pooled table of the model"):
        ModelSpec.from_dict({**data, "tables": [data["tables"][0], {**data["tables"][1], "candidate": "user"}]})
    with pytest.raises(SpecError, match=r"tables\[0\].candidate: only a sequence table \(pooling: none\)"):
        _model(candidate="item")
