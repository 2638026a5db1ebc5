"""persia data profile: columns, distinct ids, roles and the model.yaml it suggests, on CSV, Parquet and Criteo."""

from __future__ import annotations

import csv
import datetime
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.errors import SpecError
from persia_planner.model.data_schema import FLOAT32_MAX, load_data_schema
from persia_planner.model.specs import ModelSpec, load_model
from persia_planner.modules.data.criteo_format import criteo_schema
from persia_planner.modules.data.ids import collision_rate, rows_for_collision_rate
from persia_planner.modules.data.profile import profile, suggested_rows, table_names
from persia_planner.modules.data.source import DataSource
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.run_inputs import check_before_start
from persia_planner.paths import EXAMPLE_TOPOLOGY

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


def test_suggested_rows_meet_the_collision_rate_in_two_digits():
    assert [suggested_rows(x) for x in (1, 4, 49, 4881, 123_456)] == [1, 300, 4800, 490_000, 13_000_000]
    for n in (4, 49, 4881, 123_456):
        rows = suggested_rows(n)
        assert collision_rate(n, rows) <= 0.01 and rows <= 1.1 * rows_for_collision_rate(n)
    assert suggested_rows(4881, 0.2) == 22_000 and collision_rate(4881, 22_000) <= 0.2


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
    # 0..999, evenly spread: standardized, no log1p (which is for heavy tails); uid, listed without transforms
    # by the schema, gets the suggested standardize
    assert found.model_skeleton()["data"]["dense"] == [
        {"column": "score", "standardize": True},
        {"column": "uid", "standardize": True},
    ]


def test_a_criteo_log_has_the_formats_roles(tmp_path):
    (tmp_path / "day_0").write_text(
        "".join(f"{i % 2}\t{i}" + "\t" * 12 + f"\t{i % 13:x}" + "\t" * 25 + "\n" for i in range(500))
    )
    found = profile(DataSource.parse(f"criteo:{tmp_path / 'day_0'}"))
    assert not found.guessed and found.label == "label" and len(found.dense) == 13 and len(found.sparse) == 26
    assert round(found.column("C1").distinct) == 13 and found.column("C2").missing == 500
    skeleton = found.model_skeleton()
    assert skeleton["tables"][0]["name"] == "c1" and skeleton["data"] == criteo_schema().to_dict()
    assert skeleton["data"]["dense"][0] == {"column": "I1", "clip": [0.0, FLOAT32_MAX], "log1p": True}


def test_a_constant_column_is_left_out_with_a_note_and_the_model_trains(tmp_path):
    data = tmp_path / "c.csv"
    rows = [f"{i % 5 == 0:d},u{i % 300},{i % 97}.5,7" for i in range(6000)]
    data.write_text("clicked,user,price,version\n" + "\n".join(rows) + "\n")
    found = profile(DataSource.parse(f"csv:{data}"))
    assert found.dense == ("price",) and found.role("version") == "left out" and found.constant_dense == ()
    skeleton = found.model_skeleton()
    assert skeleton["data"]["dense"] == [{"column": "price", "standardize": True}]
    cfg = TrainConfig(data=f"csv:{data}", batch_size=64, trainers=2)
    assert check_before_start(cfg, ModelSpec.from_dict(skeleton), with_ps=False).data_rows > 5000
    result = profile_cli(f"csv:{data}")
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "note: left out of the model: 'version' (one value in every row read: nothing to learn from)\n"
    )


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


# ---- malformed and hostile logs: one line, exit 2 ------------------------------------------------------------------
runner = CliRunner()
ESC_NAME = "a\x1b[2Jb"  # clears the screen when written raw
BIDI_NAME = "x\u202ey"  # shows what follows it reversed


def profile_cli(*args: object):
    return runner.invoke(app, ["data", "profile", *(str(a) for a in args)], prog_name="persia")


def _parquet_bytes(table: pa.Table) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


def _malformed(tmp_path: Path, case: str) -> tuple[str, str]:
    """The log of ``case`` under ``tmp_path``, and the line persia data profile must give for it."""
    fix_csv = "give a CSV file: a header line of column names, then a row per line"
    if case == "empty file":
        (tmp_path / "e.csv").write_bytes(b"")
        return f"csv:{tmp_path}/e.csv", f"{tmp_path}/e.csv: not a readable CSV file (Empty CSV file); fix: {fix_csv}"
    if case == "binary file":
        (tmp_path / "b.csv").write_bytes(bytes(range(256)) * 4)
        return (
            f"csv:{tmp_path}/b.csv",
            f"{tmp_path}/b.csv: not CSV text: it holds binary data (NUL bytes); fix: {fix_csv}",
        )
    if case == "corrupt Parquet":
        good = _parquet_bytes(pa.table({"a": [1, 2, 3]}))
        (tmp_path / "c.parquet").write_bytes(good[:-12] + b"x" * 4 + good[-8:])  # the footer's bytes, not its magic
        return f"parquet:{tmp_path}/c.parquet", (
            f"{tmp_path}/c.parquet: not a readable Parquet file (Couldn't deserialize thrift: ...); fix: give a "
            "Parquet file (e.g. written by pyarrow or Spark)"
        )
    if case == "40 MiB line":
        with open(tmp_path / "l.csv", "wb") as f:
            f.write(b"label,u\n1," + b"x" * (40 << 20) + b"\n0,y\n")
        return f"csv:{tmp_path}/l.csv", (
            f"{tmp_path}/l.csv: a line is longer than 16 MiB, more than any click log's row; fix: check the file: a "
            "quote left open joins the lines after it into one"
        )
    if case == "10^6-column header":
        (tmp_path / "w.csv").write_text(",".join(f"c{i}" for i in range(10**6)) + "\n" + "1," * (10**6 - 1) + "1\n")
        return f"csv:{tmp_path}/w.csv", (
            f"{tmp_path}/w.csv: 1,000,000 columns, more than the 10,000 a profile reads (a table or a dense input "
            "each: no model to plan); fix: profile the columns the model will read: write them to a file of their own"
        )
    if case == "mixed folder":
        (tmp_path / "log").mkdir()
        (tmp_path / "log" / "a.csv").write_text("label,u\n1,a\n")
        (tmp_path / "log" / "b.parquet").write_bytes(_parquet_bytes(pa.table({"label": [1], "u": ["a"]})))
        (tmp_path / "log" / "notes.txt").write_text("hello\n")
        return f"csv:{tmp_path}/log", (
            f"{tmp_path}/log/b.parquet: not CSV text: it is a Parquet file; fix: move b.parquet out of {tmp_path}/log: "
            "csv: reads every file there but those starting with '.' or '_'"
        )
    if case == "duplicate column":
        (tmp_path / "d.csv").write_text("label,user,label\n1,a,0\n")
        return f"csv:{tmp_path}/d.csv", (
            f"{tmp_path}/d.csv: the header names column 'label' twice (columns 1 and 3); fix: give each column its "
            "own name"
        )
    if case == "criteo: on a CSV":
        (tmp_path / "c.csv").write_text("label,user\n1,a\n")
        return f"criteo:{tmp_path}/c.csv", (
            f"{tmp_path}/c.csv:1: expected 40 tab-separated columns (label, 13 integer, 26 categorical), found 1; fix: "
            "give Criteo TSV lines: label, 13 integers, 26 hex ids or profile a CSV file as csv:PATH"
        )
    if case == "missing path":
        return f"csv:{tmp_path}/none.csv", (
            f"{tmp_path}/none.csv: file or directory not found; fix: name a csv file, or a folder of them: persia "
            "data profile csv:PATH"
        )
    assert case == "folder with no data files"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_bytes(b"")
    (tmp_path / "empty" / ".crc").write_bytes(b"")
    return f"parquet:{tmp_path}/empty", (
        f"{tmp_path}/empty: the directory holds no files; fix: name a parquet file, or a folder of them: persia data "
        "profile parquet:PATH"
    )


@pytest.mark.parametrize(
    "case",
    [
        "empty file",
        "binary file",
        "corrupt Parquet",
        "40 MiB line",
        "10^6-column header",
        "mixed folder",
        "duplicate column",
        "criteo: on a CSV",
        "missing path",
        "folder with no data files",
    ],
)
def test_a_malformed_log_is_refused_in_one_line(tmp_path, case):
    source, line = _malformed(tmp_path, case)
    started = time.perf_counter()
    result = profile_cli(source, "--json")
    assert (result.exit_code, result.stdout) == (2, "")
    # "..." stands for pyarrow's words, which its versions put differently
    assert re.fullmatch(".*".join(re.escape(part) for part in f"error: {line}\n".split("...")), result.stderr)
    assert time.perf_counter() - started < 30  # seconds, not the minutes pyarrow takes for a million columns


def test_a_folder_holding_another_logs_file_names_it(tmp_path):
    (tmp_path / "a.csv").write_text("label,user\n1,a\n")
    (tmp_path / "b.csv").write_text("label,item\n1,a\n")
    result = profile_cli(f"csv:{tmp_path}")
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {tmp_path}/b.csv: lacks column 'user', unlike a.csv: the files of {tmp_path} are not one log; fix: "
        f"move the files of other logs out of {tmp_path} or profile each log on its own\n",
    )


def test_text_under_parquet_and_a_bad_criteo_value_name_the_file_and_line(tmp_path):
    (tmp_path / "t.parquet").write_text("label,user\n1,a\n")
    result = profile_cli(f"parquet:{tmp_path}/t.parquet")
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {tmp_path}/t.parquet: not a Parquet file: it is text; fix: profile a CSV file as "
        f"csv:{tmp_path}/t.parquet\n",
    )
    good = "1\t5" + "\t" * 12 + "\tab" + "\t" * 25 + "\n"
    (tmp_path / "day_0").write_text(good * 3 + good.replace("ab", "xyz"))
    result = profile_cli(f"criteo:{tmp_path}/day_0")
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {tmp_path}/day_0:4: C1: 'xyz' is not hexadecimal (at most 16 hex digits); fix: give Criteo TSV "
        "lines: label, 13 integers, 26 hex ids or profile a CSV file as csv:PATH\n",
    )


def test_a_log_wider_than_the_limit_is_refused_from_its_header(tmp_path, monkeypatch):
    from persia_planner.modules.data import log_blocks

    monkeypatch.setattr(log_blocks, "MAX_COLUMNS", 20)
    (tmp_path / "ok.csv").write_text(",".join(f"c{i}" for i in range(20)) + "\n" + ",".join("1" * 20) + "\n")
    assert len(profile(DataSource.parse(f"csv:{tmp_path}/ok.csv")).columns) == 20
    (tmp_path / "wide.csv").write_text(",".join(f"c{i}" for i in range(21)) + "\n")
    pq.write_table(pa.table({f"c{i}": [1] for i in range(21)}), tmp_path / "wide.parquet")
    for source in (f"csv:{tmp_path}/wide.csv", f"parquet:{tmp_path}/wide.parquet"):
        with pytest.raises(SpecError, match="21 columns, more than the 20 a profile reads"):
            profile(DataSource.parse(source))


def test_a_log_without_rows_or_without_an_id_column_is_refused(tmp_path):
    (tmp_path / "h.csv").write_text("label,price\n")
    result = profile_cli(f"csv:{tmp_path}/h.csv")
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {tmp_path}/h.csv: the log holds no rows; fix: profile the files that hold the rows\n",
    )
    (tmp_path / "n.csv").write_text("label,price,age\n" + "".join(f"{i % 2},{i % 3}.5,{i}.25\n" for i in range(50)))
    result = profile_cli(f"csv:{tmp_path}/n.csv", "--json")
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        f"error: {tmp_path}/n.csv: no column to feed an embedding table (every column is the label, dense or left "
        "out): the model would have no table; fix: name the id columns: --schema FILE with a data: mapping whose "
        "sparse: maps tables to them\n"
    )
    (tmp_path / "s.yaml").write_text("label: label\ndense: [price]\nsparse: {age: age}\n")
    result = profile_cli(f"csv:{tmp_path}/n.csv", "--schema", tmp_path / "s.yaml", "--json")
    assert result.exit_code == 0 and [t["name"] for t in json.loads(result.stdout)["model"]["tables"]] == ["age"]


def test_a_schema_is_checked_against_each_file_and_refused_for_criteo(tmp_path):
    data = _csv(tmp_path / "c.csv", rows=50)
    (tmp_path / "s.yaml").write_text("label: clicked\ndense: [price, nosuch]\nsparse: {u: user}\n")
    result = profile_cli(f"csv:{data}", "--schema", tmp_path / "s.yaml")
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: {data}: nosuch: no such column (the schema's dense); the file has clicked, hour, user, items, "
        "country, price; fix: fix s.yaml's data.dense\n",
    )
    (tmp_path / "day_0").write_text("")
    result = profile_cli(f"criteo:{tmp_path}/day_0", "--schema", tmp_path / "s.yaml")
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: --schema maps the columns of a CSV or Parquet log; criteo:{tmp_path}/day_0 has the format's own; "
        "fix: drop --schema or profile a CSV or Parquet log as csv:PATH or parquet:PATH\n",
    )


# ---- what the suggestions and the printing hold ---------------------------------------------------------------------
HOSTILE_NAMES = ["clicked", "a/b", "a_b", "..", ESC_NAME, BIDI_NAME, "", "u" * 300, "[/]", "null", "-x", ".h", "a b"]


def _hostile_log(tmp_path: Path, kind: str) -> Path:
    columns = [[i % 2 for i in range(200)]] + [[f"v{(i * 7 + j) % 50}" for i in range(200)] for j in range(1, 13)]
    if kind == "parquet":
        path = tmp_path / "h.parquet"
        pq.write_table(pa.Table.from_arrays([pa.array(c) for c in columns], names=HOSTILE_NAMES), path)
        return path
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows([HOSTILE_NAMES, *zip(*columns, strict=True)])
    path = tmp_path / "h.csv"
    path.write_text(buffer.getvalue())
    return path


def test_table_names_are_what_model_yaml_accepts_each_once():
    assert table_names(["a/b", "a_b", "..", "", "u" * 300, "[/]", "-x", ".h", "a b", "a_b_2", "é"]) == (
        "a_b",
        "a_b_2",
        "_..",
        "column_4",
        "u" * 200,
        "___",
        "_-x",
        "_.h",
        "a_b_3",
        "a_b_2_2",
        "_",
    )


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_hostile_column_names_give_a_model_that_loads_and_plans(tmp_path, kind):
    log = _hostile_log(tmp_path, kind)
    result = profile_cli(f"{kind}:{log}", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == (
        "note: left out of the model: 'a\\x1b[2Jb', 'x\\u202ey' (a control or format character in its name, which "
        "model.yaml cannot hold: rename it to use it)\n"
    )
    found = json.loads(result.stdout)
    assert [c["name"] for c in found["columns"]] == HOSTILE_NAMES  # the real names, as JSON escapes them
    roles = {c["name"]: c["role"] for c in found["columns"]}
    assert roles[ESC_NAME] == roles[BIDI_NAME] == "left out" and roles["clicked"] == "label"
    model = found["model"]
    assert [t["name"] for t in model["tables"]] == [
        "a_b", "a_b_2", "_..", "column_4", "u" * 200, "___", "null", "_-x", "_.h", "a_b_3"
    ]  # fmt: skip
    columns = ["a/b", "a_b", "..", "", "u" * 300, "[/]", "null", "-x", ".h", "a b"]  # as they are
    assert model["data"]["sparse"] == dict(zip([t["name"] for t in model["tables"]], columns, strict=True))
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(model))
    spec = load_model(tmp_path / "m.yaml")
    assert len(spec.tables) == 10 and spec.data.label == "clicked"
    planned = runner.invoke(
        app, [str(a) for a in ("plan", tmp_path / "m.yaml", EXAMPLE_TOPOLOGY, "--out", tmp_path / "p.json")]
    )
    assert planned.exit_code == 0, planned.stderr
    assert set(json.loads((tmp_path / "p.json").read_text())["tables"]) == set(model["data"]["sparse"])


def test_names_are_printed_escaped_and_the_printed_model_loads(tmp_path):
    result = profile_cli(f"csv:{_hostile_log(tmp_path, 'csv')}")
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
    rows = {line.split("│")[1].strip() for line in result.stdout.splitlines() if line.startswith("│")}
    assert {"a\\x1b[2Jb", "x\\u202ey", "[/]", ".."} <= rows
    model = result.stdout.split("# a model.yaml for it (roles guessed: check them)\n")[1]
    assert len(load_model_text(tmp_path, model).tables) == 10


def load_model_text(tmp_path: Path, text: str):
    (tmp_path / "printed.yaml").write_text(text)
    return load_model(tmp_path / "printed.yaml")


def test_columns_no_reader_takes_are_counted_not_profiled(tmp_path):
    n = 40
    table = pa.table(
        {
            "label": pa.array([i % 2 for i in range(n)], pa.int8()),
            "raw": pa.array([b"\x00\x01" * (i % 3) for i in range(n)], pa.binary()),
            "when": pa.array([datetime.datetime(2020, 1, 1 + i % 20) for i in range(n)]),
            "nested": pa.array([[["a"]]] * n),
            "scores": pa.array([[1.5, 2.5]] * n),
            "huge": pa.array([1.7e308 / (1 + i % 2) for i in range(n)]),
            "user": pa.array([f"u{i % 7}" for i in range(n)]).dictionary_encode(),
        }
    )
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=15)
    found = profile(DataSource.parse(f"parquet:{tmp_path}/x.parquet"))
    assert [(c.name, c.kind) for c in found.columns] == [
        ("label", "numeric"), ("raw", "other"), ("when", "other"), ("nested", "other"), ("scores", "other"),
        ("huge", "numeric"), ("user", "text"),
    ]  # fmt: skip
    assert (found.label, found.dense, found.sparse) == ("label", ("huge",), ("user",))
    huge = found.column("huge")
    assert (
        huge.high == 1.7e308 and huge.mean is None and found.why("huge") == "floats, not ids"
    )  # the sum overflows: no mean, and --json stays JSON
    result = profile_cli(f"parquet:{tmp_path}/x.parquet", "--json")
    assert json.loads(result.stdout)["columns"][5]["mean"] is None
