"""The first pass, before any process starts: bad rows of the first training rows named (or left out, or imputed)
and what the schema needs measured, or one line saying why it cannot be."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.errors import SpecError
from persia_planner.model.data_schema import BadRowPolicy
from persia_planner.model.specs import ModelSpec, load_model
from persia_planner.modules.data.blocks import BAD_ROW_FIXES
from persia_planner.modules.data.statistics import first_pass
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.run_inputs import check_before_start

FIX = "; fix: " + " or ".join(BAD_ROW_FIXES)
NAN = math.nan
MODEL = """
name: clicks
batch_size: 16
tables:
  - {name: user_id, rows: 1000, dim: 8}
data:
  label: clicked
  dense: [age, PRICE]
  sparse: {user_id: user}
"""


def _setup(tmp_path: Path, price: list[float], *, price_entry: str = "price") -> tuple[ModelSpec, Path]:
    """model.yaml with ``price_entry`` as its second dense column, and a Parquet file of two row groups."""
    (tmp_path / "model.yaml").write_text(MODEL.replace("PRICE", price_entry))
    n = len(price)
    table = pa.table(
        {
            "clicked": [i % 2 for i in range(n)],
            "age": [float(i % 7) for i in range(n)],
            "price": pa.array(price, pa.float64()),
            "user": [f"u{i}" for i in range(n)],
        }
    )
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=(n + 1) // 2)
    good = table.set_column(2, "price", pa.array([1.0] * n))  # --eval-data: the first pass reads no such row
    pq.write_table(good, tmp_path / "e.parquet", row_group_size=(n + 1) // 2)
    return load_model(tmp_path / "model.yaml"), path


def _prices(n: int, every: int = 50) -> list[float]:
    """A price per row, NaN in one row of ``every`` (2%), the first at row 18 (1-based)."""
    return [NAN if i % every == 17 else float(i % 11) for i in range(n)]


def test_nan_in_two_percent_of_a_dense_column_stops_persia_train_before_any_process(tmp_path):
    """The first pass reads the first rows even when nothing is standardized: one line, exit 2, nothing started."""
    spec, path = _setup(tmp_path, _prices(400))
    with pytest.raises(SpecError) as err:
        check_before_start(TrainConfig(data=f"parquet:{path}", trainers=2), spec, with_ps=False)
    assert str(err.value) == f"parquet:{path} row 18, column 'price': NaN{FIX}"
    run = CliRunner().invoke(
        app, ["train", "--model", str(tmp_path / "model.yaml"), "--data", f"parquet:{path}"], prog_name="persia"
    )
    assert run.exit_code == 2 and run.stderr == f"error: parquet:{path} row 18, column 'price': NaN{FIX}\n"


def test_skip_and_impute_go_on_with_what_the_first_pass_measured(tmp_path):
    spec, path = _setup(tmp_path, _prices(400), price_entry="{column: price, standardize: true}")
    data = f"parquet:{path}"
    skipped = check_before_start(TrainConfig(data=data, trainers=2, on_bad_row="skip"), spec, with_ps=False)
    price = skipped.schema.transforms["price"]
    assert skipped.schema.on_bad_row is BadRowPolicy.SKIP and price.std > 0 and price.fill is None
    imputed = check_before_start(TrainConfig(data=data, trainers=2, on_bad_row="impute"), spec, with_ps=False)
    transforms = imputed.schema.transforms
    assert (transforms["price"].mean, transforms["price"].std) == (price.mean, price.std)  # the finite values'
    assert transforms["price"].fill == pytest.approx(price.mean) and transforms["age"].fill is not None
    # A second check (the launcher's) keeps what the first measured.
    assert check_before_start(imputed, spec, with_ps=False).schema == imputed.schema
    # The first pass counts what it left out.
    found = first_pass(skipped.schema, [str(path)], "parquet", 0.0, rows=400)
    assert (found.rows, found.counts.skipped) == (392, 8)


@pytest.mark.parametrize(
    ("policy", "line"),
    [
        ("fail", "{path} row 1, column 'price': NaN" + FIX),
        (
            "skip",
            "{data}: all of the first 400 training rows are bad (a NaN or infinite dense value, or no label), and "
            "on_bad_row: skip leaves them out: nothing to train on; fix: repair the data or drop the broken column "
            "from data.dense",
        ),
        (
            "impute",
            "{data}: column 'price': no finite value in the first pass's rows (all 400 NaN or infinite): no mean to "
            "standardize or impute with; fix: drop its standardize or drop the column from data.dense or "
            "on_bad_row: skip or fail",
        ),
    ],
)
def test_a_standardized_column_of_only_nan_and_inf_is_refused_before_start(tmp_path, policy, line):
    prices = [NAN, math.inf, -math.inf, NAN] * 100
    spec, path = _setup(tmp_path, prices, price_entry="{column: price, standardize: true}")
    eval_data = f"parquet:{tmp_path / 'e.parquet'}"
    cfg = TrainConfig(data=f"parquet:{path}", trainers=2, eval_data=eval_data, on_bad_row=policy)
    with pytest.raises(SpecError) as err:
        check_before_start(cfg, spec, with_ps=False)
    assert str(err.value) == line.format(path=f"parquet:{path}", data=f"parquet:{path}")


def test_a_constant_standardized_column_is_refused_before_start(tmp_path):
    _, path = _setup(tmp_path, [7.0] * 400, price_entry="{column: price, log1p: true, standardize: true}")
    args = ["--model", tmp_path / "model.yaml", "--data", f"parquet:{path}", "--eval-data", f"parquet:{path}.e"]
    (tmp_path / "d.parquet.e").symlink_to(tmp_path / "e.parquet")
    run = CliRunner().invoke(app, ["train", *map(str, args)], prog_name="persia")
    assert run.exit_code == 2
    assert run.stderr == (
        f"error: parquet:{path}: column 'price': constant (2.07944 in all 400 first-pass rows, after clip and log1p): "
        "standardize would divide by a std of 0; fix: drop its standardize or drop the column from data.dense\n"
    )


def test_the_first_rows_of_eval_data_are_read_before_start_too(tmp_path):
    spec, path = _setup(tmp_path, [float(i % 11) for i in range(400)])
    bad = tmp_path / "bad-eval.parquet"
    pq.write_table(pa.table({"clicked": [0, 1], "age": [1.0, NAN], "price": [1.0, 2.0], "user": ["a", "b"]}), bad)
    cfg = TrainConfig(data=f"parquet:{path}", trainers=1, eval_data=f"parquet:{bad}", batch_size=1)
    with pytest.raises(SpecError) as err:
        check_before_start(cfg, spec, with_ps=False)
    assert str(err.value) == f"parquet:{bad} row 2, column 'age': NaN{FIX}"
    cfg = TrainConfig(data=f"parquet:{path}", trainers=1, eval_data=f"parquet:{bad}", batch_size=1, on_bad_row="skip")
    assert check_before_start(cfg, spec, with_ps=False).data_rows == 400
    only_bad = tmp_path / "only-bad.parquet"
    pq.write_table(pa.table({"clicked": [0], "age": [NAN], "price": [1.0], "user": ["a"]}), only_bad)
    with pytest.raises(SpecError) as err:
        check_before_start(
            TrainConfig(data=f"parquet:{path}", trainers=1, eval_data=f"parquet:{only_bad}", batch_size=1,
                        on_bad_row="skip"),
            spec,
            with_ps=False,
        )  # fmt: skip
    assert str(err.value) == (
        f"parquet:{only_bad}: all of the first 1 rows are bad (a NaN or infinite dense value, or no label), and "
        "on_bad_row: skip leaves them out: nothing to validate on; fix: repair the data or drop the broken column "
        "from data.dense"
    )
