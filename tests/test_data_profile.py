"""persia data profile: columns, distinct ids, roles and the model.yaml it suggests, on CSV, Parquet and Criteo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from persia_planner.model.data_schema import load_data_schema
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.data.profile import profile, suggested_rows
from persia_planner.modules.data.source import DataSource
from persia_planner.modules.train.config import TrainConfig, check_before_start

ROOT = Path(__file__).resolve().parents[1]


def _csv(path: Path, rows: int = 6000) -> Path:
    lines = ["clicked,hour,user,items,country,price"]
    for i in range(rows):
        lines.append(
            f"{i % 5 == 0:d},{14102100 + i // 100},u{(i * 7919) % 3000},a{i % 300}|b{i % 40},c{i % 6},{i % 97}.5"
        )
    lines[7] = "0,14102100,,a1|b1,,"  # a row with missing values
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_csv_log_is_profiled_and_its_roles_guessed(tmp_path):
    found = profile(DataSource.parse(f"csv:{_csv(tmp_path / 'c.csv')}"))
    assert found.rows == 6000 and found.guessed
    assert (found.label, found.dense, found.sparse) == ("clicked", ("price",), ("hour", "user", "items", "country"))
    user, items, country = found.column("user"), found.column("items"), found.column("country")
    assert user.kind == "text" and user.missing == 1 and abs(user.distinct - 3000) <= 0.03 * 3000
    assert items.kind == "list" and items.separator == "|" and abs(items.distinct - 340) <= 0.03 * 340
    assert round(country.distinct) == 6 and found.column("price").high == 96.5
    skeleton = found.model_skeleton()
    tables = {t["name"]: t for t in skeleton["tables"]}
    assert tables["user"]["rows"] == suggested_rows(user.distinct) and tables["items"]["pooling_factor"] == 2.0
    assert skeleton["data"]["sparse"]["items"] == {"column": "items", "separator": "|"}
    assert skeleton["data"]["dense"] == [{"column": "price", "standardize": True}]


def test_the_suggested_model_trains_on_the_log_it_came_from(tmp_path):
    data = _csv(tmp_path / "c.csv")
    skeleton = profile(DataSource.parse(f"csv:{data}")).model_skeleton()
    spec = ModelSpec.from_dict(skeleton)
    assert spec.data is not None and spec.data.transforms["price"].standardize
    cfg = TrainConfig(data=f"csv:{data}", batch_size=64, trainers=2)
    assert check_before_start(cfg, spec, with_ps=False).data_rows > 5000


def test_suggested_rows_are_twice_the_ids_in_two_digits():
    assert [suggested_rows(x) for x in (1, 4, 49, 4881, 123_456)] == [2, 8, 98, 9800, 250_000]


def test_a_schema_gives_the_roles_and_parquet_lists_are_multi_hot(tmp_path):
    table = pa.table(
        {
            "y": [i % 2 for i in range(1000)],
            "score": [float(i) for i in range(1000)],
            "tags": [[f"t{i % 50}", f"t{(i + 1) % 50}"] for i in range(1000)],
            "uid": [i % 77 for i in range(1000)],
        }
    )
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=300)
    (tmp_path / "s.yaml").write_text("label: y\ndense: [score, uid]\nsparse: {tags: {column: tags}}\n")
    found = profile(DataSource.parse(f"parquet:{tmp_path / 'p.parquet'}"), load_data_schema(tmp_path / "s.yaml"))
    assert not found.guessed and (found.label, found.dense, found.sparse) == ("y", ("score", "uid"), ("tags",))
    tags = found.column("tags")
    assert (
        tags.kind == "list"
        and round(tags.distinct) == 50
        and found.model_skeleton()["tables"][0]["pooling_factor"] == 2
    )
    assert round(found.column("uid").distinct) == 77 and found.column("score").high == 999
    # log1p for large non-negative values, then standardize
    assert found.model_skeleton()["data"]["dense"][0] == {"column": "score", "log1p": True, "standardize": True}


def test_a_criteo_log_has_the_formats_roles(tmp_path):
    (tmp_path / "day_0").write_text(
        "".join(f"{i % 2}\t{i}" + "\t" * 12 + f"\t{i % 13:x}" + "\t" * 25 + "\n" for i in range(500))
    )
    found = profile(DataSource.parse(f"criteo:{tmp_path / 'day_0'}"))
    assert not found.guessed and found.label == "label" and len(found.dense) == 13 and len(found.sparse) == 26
    assert round(found.column("C1").distinct) == 13 and found.column("C2").missing == 500
    tables = found.model_skeleton()["tables"]
    assert tables[0]["name"] == "c1" and "data" not in found.model_skeleton()


@pytest.mark.processes
def test_persia_data_profile_writes_the_model_and_refuses_bad_input_in_one_line(tmp_path):
    data = _csv(tmp_path / "c.csv", rows=500)

    def persia(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "persia_planner.cli", "data", "profile", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip

    done = persia(f"csv:{data}", "--out", str(tmp_path / "m.yaml"), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["rows"] == 500 and {c["name"]: c["role"] for c in result["columns"]}["items"] == "sparse"
    assert yaml.safe_load((tmp_path / "m.yaml").read_text()) == result["model"]
    for args, message in (
        ([f"csv:{tmp_path / 'none.csv'}"], "none.csv: file or directory not found"),
        (["synthetic"], "persia data profile reads a log: synthetic data has none"),
        (["hdfs:/x"], "--data must be 'synthetic', 'criteo:PATH', 'parquet:PATH' or 'csv:PATH'"),
    ):
        done = persia(*args)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
