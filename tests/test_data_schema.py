"""model.yaml's data: section: dense columns with their transforms, and the first pass that standardizes."""

from __future__ import annotations

import numpy as np
import pytest

from persia_planner import SpecError
from persia_planner.model.data_schema import DataSchema, DenseTransform, SparseColumn
from persia_planner.model.specs import ModelSpec


def schema_of(dense) -> DataSchema:
    spec = ModelSpec.from_dict(
        {
            "batch_size": 8,
            "tables": [{"name": "u", "rows": 10, "dim": 4}],
            "data": {"label": "y", "dense": dense, "sparse": {"u": "user"}},
        }
    )
    assert spec.data is not None
    return spec.data


def test_dense_columns_declare_transforms_applied_in_order():
    schema = schema_of(["a", {"column": "b", "clip": [-5, 100], "log1p": True}, {"column": "c", "standardize": True}])
    assert schema.dense == ("a", "b", "c") and schema.num_inputs == 3 and schema.to_standardize == ("c",)
    b = schema.transforms["b"]
    assert b == DenseTransform(clip=(-5.0, 100.0), log1p=True)
    values = np.array([-20.0, -1.0, 0.0, 3.0, 1e6], dtype=np.float32)
    expected = np.sign([-5.0, -1, 0, 3, 100]) * np.log1p(np.abs([-5.0, -1, 0, 3, 100]))
    assert np.allclose(b.apply(values), expected) and b.apply(values).dtype == np.float32
    with pytest.raises(ValueError, match="standardize needs the first pass's mean and std"):
        schema.transforms["c"].apply(values)
    measured = schema.with_statistics({"c": np.array([1.0, 3.0, 5.0])})
    c = measured.transforms["c"]
    assert (c.mean, c.std) == pytest.approx((3.0, np.std([1, 3, 5])))
    assert np.allclose(c.apply(np.array([3.0, 5.0], np.float32)), [0.0, 2.0 / np.std([1, 3, 5])])
    assert measured.to_standardize == () and c.to_dict() == {"standardize": True, "mean": c.mean, "std": c.std}
    # A constant column keeps a std of 1 (no division by zero).
    assert DenseTransform(standardize=True).with_statistics(np.ones(4)).std == 1.0


def test_no_dense_column_is_one_constant_input():
    schema = DataSchema("y", (), (SparseColumn("u", "user", "u"),))
    assert schema.num_inputs == 1 and schema_of([]).num_inputs == 1


@pytest.mark.parametrize(
    ("dense", "message"),
    [
        ([{"column": "b", "clip": [3, 1]}], r"data.dense\[0\].clip: expected \[LOW, HIGH\] with LOW < HIGH"),
        ([{"column": "b", "log": True}], r"data.dense\[0\].log: unknown key"),
        ([{"clip": [0, 1]}], r"data.dense\[0\].column"),
        (["a", {"column": "a"}], r"data.dense: column 'a' is listed twice"),
        ([{"column": "b", "mean": 1.0, "std": 2.0}], r"data.dense\[0\].mean: is a statistic of 'standardize: true'"),
        ([{"column": "b", "standardize": True, "mean": 1.0}], r"data.dense\[0\].std: is missing beside 'mean'"),
        ([{"column": "b", "standardize": True, "mean": 1, "std": 0}], r"data.dense\[0\].std: must be > 0"),
        ([3], r"data.dense\[0\]: expected a column name or a mapping with 'column:', got 3"),
    ],
)
def test_a_bad_dense_entry_names_its_key(dense, message):
    with pytest.raises(SpecError, match=message):
        schema_of(dense)


def test_given_statistics_skip_the_first_pass_and_the_schema_writes_itself_back():
    given = {"column": "c", "log1p": True, "standardize": True, "mean": 2.5, "std": 0.5}
    schema = schema_of(["a", given])
    assert schema.to_standardize == () and schema.transforms["c"] == DenseTransform(None, True, True, 2.5, 0.5)
    written = schema.to_dict()
    assert written["dense"] == ["a", given] and written["sparse"] == {"u": "user"}
    assert schema_of(written["dense"]) == schema
