"""persia data profile guesses as a practitioner would: delimiters, multi-hot cells, ids unique per row and constant
columns left out, codes as tables, heavy-tailed counts as dense log1p, a schema's transforms kept, Criteo's data:
section, tables sized for a collision rate, a batch size of 50 steps an epoch; and the skeletons train."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings

import numpy as np
import pyarrow as pa
import pytest
import yaml
from log_layouts import avazu_log, criteo_csv, criteo_log, movielens_log
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.errors import SpecError
from persia_planner.model.data_schema import DenseTransform, load_data_schema
from persia_planner.model.dense import ArchKind, DenseArch
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.data.criteo_format import INTEGER_COLUMNS, check_criteo_schema, criteo_schema
from persia_planner.modules.data.ids import collision_rate, hash_ids, rows_for_collision_rate
from persia_planner.modules.data.profile import profile
from persia_planner.modules.data.shards import DataPass
from persia_planner.modules.data.skeleton import suggested_batch_size
from persia_planner.modules.data.source import DataSource, check_tabular
from persia_planner.modules.data.split import RowSplit, combine
from persia_planner.modules.data.tabular import TabularReader


def _profile(path, kind="csv", **kwargs):
    return profile(DataSource.parse(f"{kind}:{path}"), **kwargs)


@pytest.mark.parametrize("delimiter", [",", "\t", "|"])
def test_the_delimiter_is_found_and_space_separated_genres_are_multi_hot(tmp_path, delimiter):
    found = _profile(movielens_log(tmp_path / "ml.txt", rows=600, delimiter=delimiter))
    assert found.delimiter == delimiter and len(found.columns) == 10
    genres = found.column("genres")
    assert genres.kind == "list" and genres.separator == " " and round(genres.distinct) <= 9
    skeleton = found.model_skeleton()
    assert skeleton["data"]["sparse"]["genres"] == {"column": "genres", "separator": " "}
    assert skeleton["data"].get("delimiter", ",") == delimiter
    assert ModelSpec.from_dict(skeleton).data.delimiter == delimiter  # read back as written


def test_words_that_do_not_recur_are_one_id_not_a_list(tmp_path):
    rows = [f"{i % 2},title number {i} of {i * 7},u{i % 9}" for i in range(300)]
    (tmp_path / "t.csv").write_text("click,title,user\n" + "\n".join(rows) + "\n")
    title = _profile(tmp_path / "t.csv").column("title")
    assert title.kind == "text" and title.separator is None


def test_a_file_no_delimiter_splits_into_columns_fails_at_profile_time_in_one_line(tmp_path):
    (tmp_path / "one.csv").write_text("just one column\n1\n2\n")
    with pytest.raises(SpecError, match=r"its header is one column: none of ',', tab, '\|', ';' separates its names"):
        _profile(tmp_path / "one.csv")
    (tmp_path / "ragged.csv").write_text("a,b,c\n1,2,3\n1,2\n")
    with pytest.raises(SpecError, match="by ',' the header has 3 and line 3 2"):
        _profile(tmp_path / "ragged.csv")
    result = CliRunner().invoke(app, ["data", "profile", f"csv:{tmp_path}/ragged.csv", "--delimiter", "x"])
    assert result.exit_code == 2 and "--delimiter must be one of" in result.stderr


def test_a_comma_schema_on_a_tab_file_names_the_delimiter_to_add(tmp_path):
    data = movielens_log(tmp_path / "ml.tsv", rows=200, delimiter="\t")
    skeleton = _profile(data).model_skeleton()
    spec = ModelSpec.from_dict(skeleton)
    check_tabular(DataSource.parse(f"csv:{data}"), spec.data, spec, trainers=1)  # as profiled: reads
    del skeleton["data"]["delimiter"]
    spec = ModelSpec.from_dict(skeleton)
    with pytest.raises(
        SpecError, match=re.escape("separated by tab, not ','") + ".*" + re.escape('add delimiter: "\\t"')
    ):
        check_tabular(DataSource.parse(f"csv:{data}"), spec.data, spec, trainers=1)


def test_avazu_ids_unique_per_row_and_the_constant_hour_are_left_out_and_codes_are_tables(tmp_path):
    found = _profile(avazu_log(tmp_path / "avazu.csv", rows=3000))
    assert found.label == "click" and found.left_out == tuple(g for g in found.guesses if g.column in ("id", "hour"))
    assert "unique per row" in found.why("id") and "one value in every row" in found.why("hour")
    codes = ("C1", "banner_pos", "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20")
    assert all(found.role(c) == "sparse" for c in (*codes, "C21", "site_id", "device_ip"))
    assert found.dense == () and "hour" not in found.transforms  # never standardized with a std of 1
    notes = found.notes()
    assert notes == [
        "left out of the model: 'id' (unique per row, a row's own id: none recurs for a table to learn)",
        "left out of the model: 'hour' (one value in every row read: nothing to learn from)",
    ]


def test_criteo_counts_as_csv_are_dense_with_log1p_and_its_ids_tables(tmp_path):
    found = _profile(criteo_csv(tmp_path / "criteo.csv", rows=3000))
    assert found.dense == INTEGER_COLUMNS and len(found.sparse) == 26
    assert all(found.transforms[c] == DenseTransform(log1p=True, standardize=True) for c in INTEGER_COLUMNS)
    assert {found.why(c) for c in INTEGER_COLUMNS} == {"a heavy-tailed count"}


def test_integers_named_as_ids_are_tables_even_when_numbered_by_popularity(tmp_path):
    rows = [f"{i % 2},{1 + (i * i) % 7 if i % 3 else 1 + i % 400},{i}" for i in range(3000)]
    (tmp_path / "p.csv").write_text("click,movieId,seen\n" + "\n".join(rows) + "\n")
    found = _profile(tmp_path / "p.csv")
    movie = found.column("movieId")
    assert movie.median <= 7 and movie.high == 400  # a count's shape: only the name tells
    assert found.role("movieId") == "sparse" and found.why("movieId").endswith("named as ids")
    assert found.role("seen") == "dense" and found.why("seen") == "integers that hardly recur"  # unique, no id


def test_a_movielens_timestamp_is_dense_and_its_ids_and_codes_tables(tmp_path):
    found = _profile(movielens_log(tmp_path / "ml.csv", rows=3000))
    assert found.label == "click" and found.dense == ("timestamp",)
    assert found.transforms["timestamp"] == DenseTransform(standardize=True)  # no heavy tail: no log1p
    assert found.sparse == ("user_id", "item_id", "age", "gender", "occupation", "zip_code", "release_year", "genres")


def test_a_schemas_transforms_are_kept_and_a_constant_standardized_column_noted(tmp_path):
    rows = [f"{i % 2},u{i % 30},{i % 1000},5" for i in range(400)]
    (tmp_path / "c.csv").write_text("y,user,count,version\n" + "\n".join(rows) + "\n")
    (tmp_path / "s.yaml").write_text(
        "label: y\ndense: [{column: count, log1p: true}, {column: version, standardize: true}]\nsparse: {user: user}\n"
    )
    found = _profile(tmp_path / "c.csv", schema=load_data_schema(tmp_path / "s.yaml"))
    dense = found.model_skeleton()["data"]["dense"]
    assert dense == [{"column": "count", "log1p": True}, {"column": "version", "standardize": True}]
    assert found.notes()[0].startswith("1 dense column(s) of the schema hold one value in every row read, e.g. 'ver")


def test_the_criteo_skeleton_has_the_readers_data_section_which_training_checks(tmp_path):
    data = criteo_log(tmp_path / "day_0.tsv", rows=500)
    skeleton = _profile(data, "criteo").model_skeleton()
    assert skeleton["data"] == criteo_schema().to_dict()
    spec = ModelSpec.from_dict(skeleton)
    check_criteo_schema(spec.data, f"criteo:{data}")  # what the reader does: accepted
    skeleton["data"]["dense"][0] = {"column": "I1", "log1p": True, "standardize": True}
    with pytest.raises(SpecError, match=r"data.dense.I1: declares .*the Criteo reader applies log\(1 \+ max"):
        check_criteo_schema(ModelSpec.from_dict(skeleton).data, f"criteo:{data}")


def test_table_rows_hold_the_collision_rate_measured_with_the_ids_hash():
    distinct = 5000
    for rate in (0.01, 0.1, 0.39):
        rows = rows_for_collision_rate(distinct, rate)
        assert collision_rate(distinct, rows) <= rate < collision_rate(distinct, rows - 1)
        ids = hash_ids(pa.array([f"id{i}" for i in range(distinct)])).view(np.uint64) % np.uint64(rows)
        shared = np.isin(ids, np.flatnonzero(np.bincount(ids.astype(np.int64)) > 1)).mean()
        assert abs(shared - collision_rate(distinct, rows)) < 0.3 * rate + 0.003  # the hash is as uniform as assumed
    assert collision_rate(9000, 18000) == pytest.approx(0.3934, abs=1e-4)  # 2x rows: 39% of ids collide


def test_the_batch_gives_fifty_steps_an_epoch_up_to_4096():
    assert [suggested_batch_size(n) for n in (30, 100, 10_000, 80_000, 100_000, 10**7)] == [1, 1, 128, 1024, 1024, 4096]
    assert 100_000 * 0.95 / suggested_batch_size(100_000) >= 50


def test_the_skeleton_writes_dcn_at_torchrecs_sizes_explicitly(tmp_path):
    skeleton = _profile(movielens_log(tmp_path / "ml.csv", rows=600)).model_skeleton()
    arch = ModelSpec.from_dict(skeleton).dense.arch
    assert arch is not None and arch.inputs_from_data
    default = DenseArch(kind=ArchKind.DCN)
    assert arch.kind is ArchKind.DCN and (arch.bottom, arch.over, arch.dcn_layers) == (
        default.bottom,
        default.over,
        default.dcn_layers,
    )


def test_an_eval_split_over_multi_hot_rows_raises_no_numpy_warning(tmp_path):
    data = movielens_log(tmp_path / "ml.csv", rows=400)
    schema = ModelSpec.from_dict(_profile(data).model_skeleton()).data
    schema = schema.with_statistics({c: np.arange(5.0) for c in schema.to_measure})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        reader = TabularReader(
            [str(data)], schema, fmt="csv", batch_size=16, reading=DataPass(split=RowSplit(0.2, held_out=True))
        )
        held_out = sum(len(b.labels) for b in reader)
    assert 40 < held_out < 120
    with pytest.raises(TypeError, match="row keys mix integer bit patterns"):
        combine(np.zeros(2, np.uint64), np.array([0.5, 1.5]))


def test_the_cli_writes_the_notes_into_the_model_and_takes_the_collision_rate(tmp_path):
    data = avazu_log(tmp_path / "avazu.csv", rows=1500)
    out = tmp_path / "model.yaml"
    result = CliRunner().invoke(app, ["data", "profile", f"csv:{data}", "--out", str(out), "--collision-rate", "0.1"])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.splitlines()[1] == (
        "# note: left out of the model: 'id' (unique per row, a row's own id: none recurs for a table to learn)"
    )
    model = yaml.safe_load(text)
    found = _profile(data)
    site = round(found.column("site_id").distinct)
    rows = next(t["rows"] for t in model["tables"] if t["name"] == "site_id")
    assert collision_rate(site, rows) <= 0.1 and rows < 1.1 * rows_for_collision_rate(site, 0.1)
    result = CliRunner().invoke(app, ["data", "profile", f"csv:{data}", "--collision-rate", "1.5"])
    assert result.exit_code == 2 and "--collision-rate must be in (0, 1), got 1.5" in result.stderr


def _persia(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=500
    )


@pytest.mark.processes
@pytest.mark.parametrize("layout", ["criteo", "avazu", "movielens"])
def test_the_profiles_model_trains_without_edits(tmp_path, layout):
    data = {
        "criteo": lambda: f"criteo:{criteo_log(tmp_path / 'day_0.tsv', rows=2000)}",
        "avazu": lambda: f"csv:{avazu_log(tmp_path / 'avazu.csv', rows=2000)}",
        "movielens": lambda: f"csv:{movielens_log(tmp_path / 'ml.tsv', rows=2000, delimiter=chr(9))}",
    }[layout]()
    made = _persia("data", "profile", data, "--out", "model.yaml", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    ran = _persia("train", "--model", "model.yaml", "--data", data, "--steps", "4", "--json", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    summary = json.loads(ran.stdout)
    assert summary["steps"] == 4 and 0.0 <= summary["auc"] <= 1.0 and summary["eval_samples"] > 0
