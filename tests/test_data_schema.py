"""model.yaml's data: section: dense columns with their transforms, and the first pass that standardizes."""

from __future__ import annotations

import numpy as np
import pytest

from persia_planner import SpecError
from persia_planner.model.data_schema import BadRowPolicy, DataSchema, DenseTransform, SparseColumn, load_data_schema
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
    # A constant column is refused: standardize would divide by a std of 0.
    with pytest.raises(ValueError, match=r"constant \(1 in all 4 first-pass rows, after clip and log1p\)"):
        DenseTransform(standardize=True).with_statistics(np.ones(4))


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
        ([{"column": "b", "standardize": True, "mean": 1, "std": 0}], r"data.dense\[0\].std: must be in \[1.2e-38, "),
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


STD_RANGE = "[1.2e-38, 3.4e+38] (a positive float32: standardize divides by it)"
MEAN_RANGE = "[-3.4e+38, 3.4e+38] (a float32 number)"
FIRST_PASS = "; fix: leave mean and std out for a first pass to measure them"


@pytest.mark.parametrize(
    ("statistics", "line"),
    [
        ("mean: 0, std: 1e-300", f"dense[0].std: must be in {STD_RANGE}, got '1e-300'"),  # YAML: a string
        ("mean: 0, std: 1.0e-300", f"dense[0].std: must be in {STD_RANGE}, got 1e-300"),
        ("mean: 0, std: 0", f"dense[0].std: must be in {STD_RANGE}, got 0"),
        ("mean: 0, std: -2", f"dense[0].std: must be in {STD_RANGE}, got -2"),
        ("mean: 0, std: .inf", f"dense[0].std: must be in {STD_RANGE}, got inf"),
        ("mean: 0, std: .nan", f"dense[0].std: must be in {STD_RANGE}, got nan"),
        ("mean: 0, std: 1e39", f"dense[0].std: must be in {STD_RANGE}, got '1e39'"),
        ("mean: .inf, std: 1", f"dense[0].mean: must be in {MEAN_RANGE}, got inf"),
        ("mean: .nan, std: 1", f"dense[0].mean: must be in {MEAN_RANGE}, got nan"),
        (
            f"mean: {10**400}, std: 1",
            f"dense[0].mean: must be in {MEAN_RANGE}, got 100000000000000000...0000000000000000000",
        ),
        ("mean: x, std: 1", "dense[0].mean: expected a number, got 'x'"),
        ("mean: 0, std: [1]", "dense[0].std: expected a number, got [1]"),
    ],
)
def test_hand_given_statistics_are_refused_out_of_float32s_range_naming_the_key(tmp_path, statistics, line):
    path = tmp_path / "schema.yaml"
    path.write_text(f"label: y\ndense: [{{column: a, standardize: true, {statistics}}}]\nsparse: {{u: user}}\n")
    with pytest.raises(SpecError) as err:
        load_data_schema(path)
    assert str(err.value) == f"schema.yaml: {line}{FIRST_PASS}"


def test_on_bad_row_and_fill_are_read_and_fill_written_back(tmp_path):
    path = tmp_path / "schema.yaml"
    path.write_text("label: y\non_bad_row: impute\ndense: [a, {column: b, fill: 2.5}]\nsparse: {u: user}\n")
    schema = load_data_schema(path)
    assert schema.on_bad_row is BadRowPolicy.IMPUTE and schema.from_file
    assert schema.transforms == {"b": DenseTransform(fill=2.5)} and schema.to_measure == ("a",)
    assert schema.to_dict()["dense"] == ["a", {"column": "b", "fill": 2.5}]  # no on_bad_row: each reader says
    path.write_text("label: y\non_bad_row: drop\nsparse: {u: user}\n")
    with pytest.raises(SpecError) as err:
        load_data_schema(path)
    assert str(err.value) == "schema.yaml: on_bad_row: unknown value 'drop'; fix: use one of fail | skip | impute"
    path.write_text("label: y\ndense: [{column: b, fill: .inf}]\nsparse: {u: user}\n")
    with pytest.raises(
        SpecError, match=r"dense\[0\].fill: must be a number in \[-3.4e\+38, 3.4e\+38\] \(a float32\), got inf"
    ):
        load_data_schema(path)


def test_the_first_pass_measures_finite_values_and_refuses_what_it_cannot_measure():
    standardize = DenseTransform(log1p=True, standardize=True)
    values = np.array([1.0, np.nan, 3.0, np.inf, 5.0])
    measured = standardize.with_statistics(values, fill=True)
    seen = np.log1p([1.0, 3.0, 5.0])
    assert (measured.mean, measured.std, measured.fill) == pytest.approx((seen.mean(), seen.std(), 3.0))
    with pytest.raises(ValueError, match=r"^no finite value in the first pass's rows \(all 2 NaN or infinite\)"):
        standardize.with_statistics(np.array([np.nan, -np.inf]))
    # Nothing to measure: as it is.
    assert DenseTransform(clip=(0.0, 1.0)).with_statistics(np.array([np.nan])) == DenseTransform(clip=(0.0, 1.0))
    schema = DataSchema("y", ("a", "b"), (SparseColumn("u", "user", "u"),), on_bad_row="impute")
    assert schema.on_bad_row is BadRowPolicy.IMPUTE and schema.to_measure == ("a", "b")
    with pytest.raises(ValueError) as err:
        schema.with_statistics({"a": np.array([1.0]), "b": np.array([np.nan])})
    assert err.value.args[1] == "b"
