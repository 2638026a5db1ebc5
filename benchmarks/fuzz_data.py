"""Fuzz targets of click logs: junk rows and columns through ``persia data profile``, ``persia train``'s checks before
start (the first pass included) and ``persia predict``'s."""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from fuzz_runs import prepared, trained_checkpoint
from fuzzing import (
    HOSTILE_TEXT,
    Outcome,
    check,
    junk,
    run_cli,
    write_document,
)
from hypothesis import strategies as st

_DATA_COLUMNS = ["clicked", "price", "user", "country"]
data_changes = st.tuples(
    st.sampled_from(["parquet", "csv"]),
    st.lists(
        st.tuples(st.sampled_from(["drop", "rename", "cell", "column", "rows", "raw"]), st.integers(0, 100), junk),
        min_size=1,
        max_size=3,
    ),
)


def _junk_file(kind: str, columns: dict[str, list[Any]], path: Path) -> None:
    """``columns`` as a ``kind`` file; values of mixed types become text (Parquet columns hold one type)."""
    if kind == "csv":
        import csv

        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            writer.writerows(zip(*columns.values(), strict=True))
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    def as_text(values: list[Any]) -> Any:
        return pa.array([json.dumps(v, default=str) for v in values])

    arrays = {}
    for name, values in columns.items():
        try:
            arrays[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            arrays[name] = as_text(values)
    try:
        pq.write_table(pa.table(arrays), path)
    except pa.ArrowException:  # a type Parquet cannot hold (a struct without fields)
        pq.write_table(pa.table({name: as_text(values) for name, values in columns.items()}), path)


def target_predict_data(change: tuple[str, list[tuple[str, int, Any]]]) -> str:
    """Rows to score with junk in them (a column dropped or renamed, cells or whole columns of junk values, no rows,
    or the file's bytes junk) as CSV or Parquet, through ``persia predict``'s checks with a trained checkpoint."""
    kind, edits = change
    trained = trained_checkpoint()
    rows = 8
    columns: dict[str, list[Any]] = {
        "clicked": [i % 2 for i in range(rows)],
        "price": [float(i) for i in range(rows)],
        "user": [f"u{i}" for i in range(rows)],
        "country": list(range(rows)),
    }
    raw: bytes | None = None
    for edit, at, value in edits:
        names = list(columns)
        name = names[at % len(names)] if names else None
        if edit == "drop" and name is not None:
            del columns[name]
        elif edit == "rename" and name is not None:
            columns[f"{name}_{at}"] = columns.pop(name)
        elif edit == "cell" and name is not None and columns[name]:
            columns[name][at % len(columns[name])] = value
        elif edit == "column" and name is not None:
            columns[name] = [value] * len(columns[name])
        elif edit == "rows":
            columns = {k: v[: at % 3] for k, v in columns.items()}
        elif edit == "raw":
            raw = json.dumps(value, default=str).encode()[: at + 1]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"rows.{kind}"
        if raw is not None:
            path.write_bytes(raw)
        else:
            _junk_file(kind, columns, path)
        return prepared(trained, f"{kind}:{path}", Path(tmp) / "scores.parquet")


# Column names and cells a click log may hold: hostile text (markup, escapes, bidi, paths, empty), numbers, NaN and
# inf, separators, quotes and newlines.
_LOG_NAMES = [*HOSTILE_TEXT, "label", "clicked", "user", "items", "a/b", "a_b", "a?b", "x" * 250, "null", "-x", ".h"]
_LOG_CELLS = ["", "0", "1", "2", "-1", "NaN", "nan", "inf", "-inf", "1e309", "1.5", "a|b", "a;b;c", "|", "x\u202ey"]
_LOG_CELLS += ["a\x1b[2Jb", '"', 'a"b', "a,b", "a\nb", "\r", "\t", "\x00", "[/]", "9" * 30, "a" * 200]
_LOG_DAMAGE = ["none"] * 6 + ["truncate", "random", "empty", "folder", "mixed", "duplicate", "ragged"]
data_logs = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["csv", "csv", "parquet", "parquet", "criteo"]),
        "names": st.lists(st.one_of(st.sampled_from(_LOG_NAMES), st.text(max_size=8)), min_size=1, max_size=6),
        "rows": st.lists(
            st.lists(
                st.one_of(
                    st.none(),
                    st.sampled_from(_LOG_CELLS),
                    st.integers(-(2**64), 2**64),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=6),
                ),
                max_size=7,
            ),
            min_size=1,
            max_size=12,
        ),
        "labelled": st.booleans(),
        "tags": st.booleans(),
        "damage": st.sampled_from(_LOG_DAMAGE),
        "cut": st.integers(0, 10**6),
        "noise": st.binary(max_size=200),
    }
)


def target_data_profile(case: dict[str, Any]) -> str:
    """A small click log, hostile (names a terminal would act on or model.yaml cannot hold, junk and non-finite
    values, ragged, empty, truncated or random bytes, a duplicate column, a folder mixing kinds) through ``persia data
    profile KIND:PATH --json``: one line, or a profile whose suggested model loads with the model loader."""
    from persia_planner.errors import PlannerError
    from persia_planner.model.specs import load_model

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        path = _write_log(d, case)
        outcome = run_cli(["data", "profile", f"{case['kind']}:{path}", "--json"])
        found = check(outcome)
        if found or outcome.code != 0:
            return found
        try:
            model = json.loads(outcome.stdout)["model"]
            load_model(write_document(d, "model.yaml", model))
        except (PlannerError, ValueError, KeyError) as err:
            return f"the suggested model does not load: {type(err).__name__}: {str(err)[:300]}"
        return ""


def _write_log(d: Path, case: dict[str, Any]) -> Path:
    """The case's log in ``d``: a file of its kind (damaged as the case says), or a folder of files."""
    names = list(case["names"])
    if case["damage"] == "duplicate":
        names.append(names[0])
    width = len(names)
    rows = [row if case["damage"] == "ragged" else (row + [None] * width)[:width] for row in case["rows"]]
    kind = case["kind"]
    if case["labelled"]:  # a 0/1 label first, as a log has (Criteo's first field too)
        names, rows = ["clicked", *names], [[i % 2, *row] for i, row in enumerate(rows)]
    if case["tags"] and kind != "criteo":  # a multi-hot column: a list of ids (Parquet), "a|b" text (CSV)
        bags = [[f"t{(i * j) % 5}" for j in range(i % 4)] for i in range(len(rows))]
        tags = bags if kind == "parquet" else ["|".join(bag) for bag in bags]
        names, rows = [*names, "tags"], [[*row, tag] for row, tag in zip(rows, tags, strict=True)]
    data = _log_bytes(kind, names, rows)
    damage = case["damage"]
    if damage == "truncate":
        data = data[: case["cut"] % (len(data) + 1)]
    elif damage == "random":
        data = case["noise"]
    elif damage == "empty":
        data = b""
    if damage in ("folder", "mixed"):
        folder = d / "log"
        folder.mkdir()
        (folder / f"a.{kind}").write_bytes(data)
        (folder / f"b.{kind}").write_bytes(_log_bytes(kind, names[::-1], rows[:3]))
        if damage == "mixed":
            other = "csv" if kind != "csv" else "parquet"
            (folder / f"c.{other}").write_bytes(_log_bytes(other, names, rows))
            (folder / "notes.txt").write_bytes(b"not a log\n")
            (folder / "_SUCCESS").write_bytes(b"")
        return folder
    path = d / f"log.{kind}"
    path.write_bytes(data)
    return path


def _log_bytes(kind: str, names: list[str], rows: list[list[Any]]) -> bytes:
    import csv
    import io

    def text(value: Any) -> str:
        return "" if value is None else str(value)

    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrays = []
        for j in range(len(names)):
            values = [row[j] if j < len(row) else None for row in rows]
            try:
                arrays.append(pa.array(values))
            except (pa.ArrowException, OverflowError, TypeError, ValueError):  # mixed types: as text
                arrays.append(pa.array([None if v is None else text(v) for v in values], pa.string()))
        out = io.BytesIO()
        pq.write_table(pa.Table.from_arrays(arrays, names=names), out, row_group_size=5)
        return out.getvalue()
    if kind == "criteo":  # the format's 40 fields, numbers and hex where the rows have them
        lines = []
        for row in rows:
            fields = [text(v) for v in row][:40]
            lines.append("\t".join(fields + ["1" if not fields else ""] * (40 - len(fields))))
        return "\n".join(lines).encode("utf-8", "surrogatepass")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(names)
    writer.writerows([[text(v) for v in row] for row in rows])
    return buffer.getvalue().encode("utf-8", "surrogatepass")


_TD_BAD = [math.nan, math.inf, -math.inf, 1e39, -1e300, 3.4e38, None, "NaN", "-nan", "inf"]
_TD_TEXT = ["abc", "1e5", "a\x1bb", "x\u202ey", "1;5", " "]
_TD_LABELS = [None, math.nan, "NaN", 2, -1, math.inf]
_TD_STATISTICS = [0, 1, 2.5, 1e-300, 1e-38, 1.2e-38, -1, 1e39, 10**400, math.inf, -math.inf, math.nan, "1e-300", "x"]
_TD_STATISTICS += [None, True, [1]]
_TD_TRANSFORMS: list[dict[str, Any]] = [
    {},
    {"standardize": True},
    {"standardize": True},
    {"log1p": True, "standardize": True},
    {"clip": [-5, 5], "standardize": True},
    {"clip": [0, 10]},
    {"log1p": True},
    {"fill": 2.5},
    {"clip": [10, 0]},
    {"clip": [0, math.inf]},
    {"standardize": "yes"},
]
# What a case makes hostile: its values (most cases: they reach the first pass), the schema's statistics, the
# policies, --eval-data, a text cell, or all of these at once.
_TD_MODES = ["values"] * 6 + ["statistics", "policy", "eval", "text", "all"]
train_data_cases = st.fixed_dictionaries(
    {
        "mode": st.sampled_from(_TD_MODES),
        "kind": st.sampled_from(["csv", "parquet"]),
        "good_rows": st.one_of(st.integers(20, 60), st.integers(20, 60), st.integers(0, 20)),
        # Bad cells (row, column 0 label / 1 a / 2 b, value): NaN, inf, huge, missing, a few of text.
        "bad": st.lists(
            st.tuples(
                st.integers(0, 80),
                st.integers(0, 2),
                st.sampled_from(_TD_BAD * 3 + _TD_LABELS),
            ),
            max_size=5,
        ),
        "all_bad": st.sampled_from([None, None, None, math.nan, math.inf, 7.0]),  # one value in every row of a
        "transform": st.sampled_from(_TD_TRANSFORMS),
        "text": st.sampled_from([None] * 8 + _TD_TEXT),  # in one cell of a dense column or the label
        "statistics": st.sampled_from([None] * 3 + _TD_STATISTICS),  # given: the std, the mean 0 (or it, the std 1)
        "mean_bad": st.booleans(),
        "on_bad_row": st.sampled_from(["fail", "skip", "impute", "(absent)"] * 3 + ["drop", 3]),
        "option": st.sampled_from([None] * 3 + ["fail", "skip", "impute", "bogus"]),
        "eval": st.sampled_from(["split", "split", "apart", "apart", "same", "link", "hardlink", "folder"]),
        "schema_file": st.booleans(),
        "trainers": st.sampled_from([1, 1, 2]),
    }
)


def _train_data_file(path: Path, kind: str, rows: list[list[Any]]) -> None:
    """``rows`` (label, a, b) and an id each, as a ``kind`` file; a column holding text is text (as a CSV reads)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {name: [r[i] for r in rows] for i, name in enumerate(("clicked", "a", "b"))}
    if kind == "csv":
        cell = {None: ""}
        lines = ["clicked,a,b,u"] + [
            ",".join(cell.get(v, str(v)) if not isinstance(v, str) else v for v in (*r, f"u{i}"))
            for i, r in enumerate(rows)
        ]
        path.write_text("\n".join(lines) + "\n")
        return
    arrays = {}
    for name, values in columns.items():
        text = any(isinstance(v, str) and v.strip().lower().lstrip("+-") not in ("nan", "inf") for v in values)
        arrays[name] = pa.array(
            [None if v is None else str(v) if text else float(v) for v in values], pa.string() if text else pa.float64()
        )
    arrays["u"] = pa.array([f"u{i}" for i in range(len(rows))])
    pq.write_table(pa.table(arrays), path, row_group_size=max(1, len(rows) // 2))


def _train_data_read(cfg: Any, spec: Any) -> str:
    """What the run's readers make of the files ``cfg`` passed the checks with: finite dense values and 0/1 labels
    (the statistics a float32 can use), or a one-line error; "" when so."""
    import numpy as np

    from persia_planner.errors import PlannerError
    from persia_planner.model.data_schema import FLOAT32_MAX, FLOAT32_TINY
    from persia_planner.modules.data.source import DataSource
    from persia_planner.modules.data.tabular import TabularReader
    from persia_planner.modules.train.run_inputs import data_schema

    schema = data_schema(spec, cfg)
    for t in schema.transforms.values():
        if t.standardize and not (abs(t.mean) <= FLOAT32_MAX and FLOAT32_TINY <= t.std <= FLOAT32_MAX):
            return f"standardize with mean {t.mean}, std {t.std}"
    for data in filter(None, (cfg.data, cfg.eval_data)):
        source = DataSource.parse(data)
        try:
            for block in TabularReader(source.files(), schema, fmt=source.kind.value, batch_size=4).blocks():
                if not np.isfinite(block.dense).all() or not np.isin(block.labels, (0.0, 1.0)).all():
                    return f"read {block.dense.tolist()[:4]}, labels {block.labels.tolist()[:4]} from {data}"
        except PlannerError as err:
            found = check(Outcome(2, f"error: {err}\n", 0.0))
            if found:
                return found
    return ""


_TD_CALM: dict[str, Any] = {"text": None, "statistics": None, "eval": "split", "transform": {"standardize": True}}
_TD_HOSTILE_IN = {"text": ("text",), "statistics": ("statistics",), "eval": ("eval",)}
_TD_HOSTILE_IN |= {"transform": ("statistics", "values")}


def target_train_data(case: dict[str, Any]) -> str:
    """A small CSV or Parquet click log with junk (NaN, inf, huge, text) in its dense columns and labels, hostile
    statistics in its schema (model.yaml's data: or --schema), an ``on_bad_row`` policy (the schema's, junk, and
    ``--on-bad-row``) and ``--eval-data`` the same file, a link to it, a folder holding it, or apart: through the
    checks ``persia train`` runs before any process starts (TrainConfig, check_before_start and its first pass), in
    this process. They refuse in one line, or pass data the run's readers read as finite values (or refuse in one
    line)."""
    import os

    from persia_planner.errors import PlannerError
    from persia_planner.model.data_schema import load_data_schema
    from persia_planner.model.specs import load_model
    from persia_planner.modules.data import statistics  # noqa: F401  # torch: imported once, not in a case's time
    from persia_planner.modules.train.config import TrainConfig
    from persia_planner.modules.train.run_inputs import check_before_start

    mode = case["mode"]
    case = {**case, **{k: v for k, v in _TD_CALM.items() if mode not in ("all", *_TD_HOSTILE_IN[k])}}
    if mode not in ("all", "policy"):  # a policy that reads: fail, skip or impute
        case["on_bad_row"] = case["on_bad_row"] if case["on_bad_row"] in ("fail", "skip", "impute") else "(absent)"
        case["option"] = None if case["option"] == "bogus" else case["option"]
    kind, ext = case["kind"], "csv" if case["kind"] == "csv" else "parquet"
    n = case["good_rows"] + len(case["bad"])
    rows = [[i % 2, float(i % 5) if case["all_bad"] is None else case["all_bad"], i * 0.5] for i in range(n)]
    for row, column, value in case["bad"]:
        # A label: most often missing or NaN (a bad row), sometimes one that is not 0 or 1 (always refused).
        rows[row % n][column] = value if column or value in _TD_LABELS else (None if row % 2 else math.nan)
    if case["text"] is not None:
        rows[n // 2][n % 3] = case["text"]
    transform = dict(case["transform"])
    if case["statistics"] is not None:
        transform |= (
            {"mean": case["statistics"], "std": 1} if case["mean_bad"] else {"mean": 0, "std": case["statistics"]}
        )
        transform.setdefault("standardize", True)
    data_mapping: dict[str, Any] = {"label": "clicked", "dense": [{"column": "a", **transform}, "b"]}
    data_mapping["sparse"] = {"u": "u"}
    if case["on_bad_row"] != "(absent)":
        data_mapping["on_bad_row"] = case["on_bad_row"]
    model: dict[str, Any] = {"name": "m", "batch_size": 4, "tables": [{"name": "u", "rows": 1000, "dim": 4}]}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "data").mkdir()
        data = d / "data" / f"d.{ext}"
        _train_data_file(data, kind, rows)
        _train_data_file(d / f"e.{ext}", kind, [[i % 2, 1.0, 2.0] for i in range(16)])
        eval_path = {"same": data, "folder": d / "data", "apart": d / f"e.{ext}"}.get(case["eval"])
        if case["eval"] in ("link", "hardlink"):
            eval_path = d / f"link.{ext}"
            (eval_path.symlink_to if case["eval"] == "link" else eval_path.hardlink_to)(data)
        if case["schema_file"]:
            schema_path = write_document(d, "schema.yaml", data_mapping)
        else:
            model["data"] = data_mapping
        model_path = write_document(d, "model.yaml", model)
        started = time.perf_counter()
        try:
            spec = load_model(model_path)
            cfg = TrainConfig(
                data=f"{kind}:{data}",
                eval_data=None if eval_path is None else f"{kind}:{eval_path}",
                schema=load_data_schema(schema_path) if case["schema_file"] else None,
                eval_split=0.3 if eval_path is None else None,
                on_bad_row=case["option"],
                trainers=case["trainers"],
                progress=False,
            )
            checked = check_before_start(cfg, spec, with_ps=False)
        except PlannerError as err:
            return check(Outcome(2, f"error: {err}\n", time.perf_counter() - started))
        except Exception as err:  # what the target looks for
            return f"raised {type(err).__name__}: {err}"
        try:
            found = _train_data_read(checked, spec)
        except Exception as err:  # what the target looks for
            return f"reading raised {type(err).__name__}: {err}"
        if found or not os.path.exists(data):
            return found or "the data file is gone"
        return check(Outcome(0, "", time.perf_counter() - started))
