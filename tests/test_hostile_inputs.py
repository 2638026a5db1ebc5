"""Broken and hostile inputs, round two: names that a terminal would act on or rich would read as markup, outputs
that name an input, flags that contradict a shard's sharding, alias bombs with a repeated key, numbers beyond what
an option means, FIFOs where data is expected. Each case: exit 2 (1 for an invalid plan) and one exact line, no
traceback, no file written beside ``--out``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.paths import EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, EXAMPLES

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
ESC_NAME = "a\x1b[2Jb"  # clears the screen when written raw


def run(*args: object):
    return runner.invoke(app, [str(a) for a in args], prog_name="persia")


def persia(*args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    """The CLI in a child process (a FIFO, or `persia train`, in a child of its own)."""
    code = "from persia_planner.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def model_dict(**top) -> dict:
    return {"name": "m", "batch_size": 1024, "tables": [{"name": "t0", "rows": 1000, "dim": 16}], **top}


def topology_dict() -> dict:
    return yaml.safe_load(EXAMPLE_TOPOLOGY.read_text())


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


def example_plan(tmp_path: Path) -> dict:
    out = tmp_path / "plan.json"
    assert run("plan", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, "--out", out).exit_code == 0
    return json.loads(out.read_text())


# ---- names: shown as the text they are, or refused where a terminal would act on them -------------------------------
MARKUP_NAMES = ["[/]", "dlrm[v2]", "[bold red]x[/bold red]", "[link=http://x]y", ":smile:", "a[/]b[/]"]


@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_a_model_name_that_reads_as_markup_is_printed_as_it_is(tmp_path, name):
    model = write_yaml(tmp_path / "m.yaml", model_dict(name=name))
    result = run("plan", model, EXAMPLE_TOPOLOGY, "--explain")
    assert result.exit_code == 0, result.output
    assert f"tables ({name})" in result.stdout


@pytest.mark.parametrize("name", MARKUP_NAMES[:3])
def test_a_host_name_that_reads_as_markup_is_printed_as_it_is(tmp_path, name):
    topology = topology_dict()
    topology["name"] = name
    topology["hosts"][0]["name"] = name
    path = write_yaml(tmp_path / "t.yaml", topology)
    result = run("plan", write_yaml(tmp_path / "m.yaml", model_dict()), path)
    assert result.exit_code == 0, result.output
    assert f"devices ({name})" in result.stdout and f"{name}0/gpu0" in result.stdout
    shown = run("topology", path)
    assert shown.exit_code == 0 and f"topology {name}:" in shown.stdout


UNPRINTABLE = {
    "esc": (ESC_NAME, "\\x1b"),
    "bell": ("a\x07b", "\\x07"),
    "backspace": ("ab\x08\x08xy", "\\x08"),
    "rtl-override": ("abc\u202edef", "\\u202e"),
    "c1-csi": ("a\x9b2Jb", "\\x9b"),
    "nul": ("a\x00b", "\\x00"),
}


def refusal(source: str, key: str, name: str, char: str) -> str:
    shown = repr(name)
    return (
        f"error: {source}: {key}: {shown} holds the character {char}, which a terminal would act on or cannot show; "
        "fix: use printable characters only\n"
    )


@pytest.mark.parametrize("case", list(UNPRINTABLE), ids=list(UNPRINTABLE))
def test_a_model_name_a_terminal_would_act_on_is_refused_in_one_line(tmp_path, case):
    name, char = UNPRINTABLE[case]
    model = write_yaml(tmp_path / "m.yaml", model_dict(name=name))
    result = run("plan", model, EXAMPLE_TOPOLOGY)
    assert result.exit_code == 2, result.output
    assert result.stderr == refusal(model.name, "name", name, char)
    assert result.stdout == ""


@pytest.mark.parametrize("case", ["esc", "rtl-override", "bell"])
def test_a_host_name_a_terminal_would_act_on_is_refused(tmp_path, case):
    name, char = UNPRINTABLE[case]
    topology = topology_dict()
    topology["hosts"][0]["name"] = name
    path = write_yaml(tmp_path / "t.yaml", topology)
    result = run("topology", path)
    assert result.exit_code == 2, result.output
    assert result.stderr == refusal(path.name, "hosts[0].name", name, char)


def test_a_topology_name_with_an_escape_is_refused(tmp_path):
    topology = topology_dict()
    topology["name"] = ESC_NAME
    path = write_yaml(tmp_path / "t.yaml", topology)
    result = run("topology", path)
    assert result.exit_code == 2 and result.stderr == refusal(path.name, "name", ESC_NAME, "\\x1b")


@pytest.mark.parametrize(
    ("where", "value", "char"),
    [("model", ESC_NAME, "\\x1b"), ("model", "s\ud800t", "\\ud800"), ("topology", "x\u202ey", "\\u202e")],
)
def test_plan_json_names_a_terminal_would_act_on_are_refused(tmp_path, where, value, char):
    data = example_plan(tmp_path)
    data[where] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))  # JSON escapes keep a lone surrogate in the file
    result = run("validate", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, bad)
    assert result.exit_code == 2, result.output
    assert result.stderr == refusal(bad.name, where, value, char)


def test_a_plan_json_table_key_with_an_escape_is_refused(tmp_path):
    data = example_plan(tmp_path)
    data["tables"][ESC_NAME] = data["tables"].pop("c1_user")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = run("validate", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, bad)
    assert result.exit_code == 2, result.output
    assert result.stderr == refusal(bad.name, f"tables.{ESC_NAME}", ESC_NAME, "\\x1b").replace(
        f"tables.{ESC_NAME}", "tables.a\\x1b[2Jb"
    )


def test_an_error_line_escapes_what_it_quotes():
    from persia_planner.errors import PlannerError, one_line

    line = one_line(str(PlannerError(f"no such device {ESC_NAME}")))
    assert line == "no such device a\\x1b[2Jb" and "\x1b" not in line


# ---- outputs never replace inputs ------------------------------------------------------------------------------------
OUT_CASES: dict[str, Callable[[Path, Path, Path], tuple[tuple, str]]] = {
    "out-is-model": lambda m, t, d: (("plan", m, t, "--out", m), f"--out {m} is the MODEL file"),
    "out-is-topology": lambda m, t, d: (("plan", m, t, "--out", t), f"--out {t} is the TOPOLOGY file"),
    "png-is-model": lambda m, t, d: (("plan", m, t, "--png", m), f"--png {m} is the MODEL file"),
    "out-links-to-model": lambda m, t, d: (("plan", m, t, "--out", d / "link.yaml"), f"--out {d / 'link.yaml'} is"),
    "out-and-png-one-file": lambda m, t, d: (
        ("plan", m, t, "--out", d / "x", "--png", d / "x"),
        f"--out and --png name one file, {d / 'x'}",
    ),
    "topology-png-is-topology": lambda m, t, d: (("topology", t, "--png", t), f"--png {t} is the TOPOLOGY file"),
}


@pytest.mark.parametrize("case", list(OUT_CASES), ids=list(OUT_CASES))
def test_an_output_that_names_an_input_is_refused_before_any_work(tmp_path, case):
    model = write_yaml(tmp_path / "m.yaml", model_dict())
    topology = write_yaml(tmp_path / "t.yaml", topology_dict())
    (tmp_path / "link.yaml").symlink_to(model)
    args, start = OUT_CASES[case](model, topology, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    result = run(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {start}"), result.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


# ---- a flag must not contradict the sharding -------------------------------------------------------------------------
@pytest.mark.parametrize("sharding", ["ps_hash", "table_wise"])
def test_a_replica_flag_on_a_shard_of_another_sharding_is_an_invalid_plan(tmp_path, sharding):
    data = example_plan(tmp_path)
    name, table = next((n, t) for n, t in data["tables"].items() if t["sharding"] == sharding)
    table["shards"][0]["replica"] = True
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = run("validate", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, bad)
    assert result.exit_code == 1, result.output
    assert result.stderr == (
        f"error: invalid plan: table '{name}': shard 0 has replica: true but only data_parallel shards are replicas\n"
    )


# ---- YAML ------------------------------------------------------------------------------------------------------------
@pytest.mark.processes
def test_a_repeated_key_beside_nested_aliases_is_named_at_once(tmp_path):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, label in zip("abcdefg", "bcdefgh", strict=True):
        lines.append(f"{label}: &{label} [" + ", ".join([f"*{prev}"] * 10) + "]")  # 10**8 leaves, shared
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join([*lines, "name: m", "name: n"]) + "\n")
    result = persia("plan", bomb, EXAMPLE_TOPOLOGY, timeout=10)  # was over a minute of one core
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: {bomb}: name: key given twice in one mapping (line 10); fix: keep one of them\n"


def test_a_profile_that_is_a_directory_is_named_as_one(tmp_path):
    topology = yaml.safe_load((EXAMPLES / "local_2x1.yaml").read_text())
    (tmp_path / "prof").mkdir()
    topology["hosts"][0]["profile"] = "prof"
    path = write_yaml(tmp_path / "t.yaml", topology)
    result = run("topology", path)
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"error: {tmp_path / 'prof'}: is a directory, not a regular file; fix: give the path of a regular file\n"
    )


# ---- numbers beyond what an option means, and data that is no file ---------------------------------------------------
TRAIN_OPTIONS = {
    "seed": (("--seed", 10**14), "--seed must be at most 4,294,967,295, got 100,000,000,000,000; fix: lower --seed"),
    "ps-delay": (
        ("--ps-delay-ms", "1e300"),
        "--ps-delay-ms must be a number in [0, 60000] (ms per PS call), got 1e+300",
    ),
    "steps": (("--steps", 10**10), "--steps must be at most 1,000,000,000, got 10,000,000,000; fix: lower --steps"),
    "trainers": (("--trainers", 100_000), "--trainers must be at most 1,024, got 100,000; fix: lower --trainers"),
    "eval-batches": (
        ("--eval-batches", 10**7),
        "--eval-batches must be at most 1,000,000, got 10,000,000; fix: lower --eval-batches",
    ),
    "eval-every": (
        ("--eval-every", 10**12),
        "--eval-every must be at most 1,000,000,000, got 1,000,000,000,000; fix: lower --eval-every",
    ),
}


@pytest.mark.processes
@pytest.mark.parametrize("case", list(TRAIN_OPTIONS), ids=list(TRAIN_OPTIONS))
def test_a_train_option_beyond_what_it_means_is_refused_before_the_run(case):
    args, line = TRAIN_OPTIONS[case]
    result = persia("train", *args, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: {line}\n"


@pytest.mark.processes
def test_data_that_is_a_fifo_is_refused_not_waited_for(tmp_path):
    from persia_planner import load_model

    schema = tmp_path / "schema.yaml"
    tables = load_model(EXAMPLES / "dlrm_small.yaml").tables
    write_yaml(schema, {"label": "y", "dense": ["a"], "sparse": {t.name: t.name for t in tables}})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = persia("train", "--steps", 2, "--data", f"csv:{fifo}", "--schema", schema, timeout=30)
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr
        == f"error: {fifo}: is a FIFO (named pipe), not a regular file; fix: give the path of a regular file\n"
    )


# ---- more of each format ---------------------------------------------------------------------------------------------
MODEL_TEXTS = {
    "list-as-key": (
        "name: m\nbatch_size: 1024\n? [a, b]\n: 1\ntables:\n  - {name: t0, rows: 1000, dim: 16}\n",
        "malformed YAML at line 3, column 3: found unhashable key; fix: fix the YAML syntax",
    ),
    "python-tag": (
        "name: m\nbatch_size: 1024\ntables:\n  - !!python/object:os.system {}\n",
        "malformed YAML at line 4, column 5: could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object:os.system'; fix: fix the YAML syntax",
    ),
    "nan-batch": (
        "name: m\nbatch_size: .nan\ntables:\n  - {name: t0, rows: 1000, dim: 16}\n",
        "batch_size: nan must be a finite, non-negative count",
    ),
    "inf-pooling": (
        "name: m\nbatch_size: 1024\ntables:\n  - {name: t0, rows: 1000, dim: 16, pooling_factor: .inf}\n",
        "tables[0].pooling_factor: inf must be a finite, non-negative number",
    ),
    "bool-rows": (
        "name: m\nbatch_size: 1024\ntables:\n  - {name: t0, rows: true, dim: 16}\n",
        "tables[0].rows: True is not a whole number like 40_000_000 or 1e9",
    ),
    "tables-mapping": ("name: m\nbatch_size: 1024\ntables: {}\n", "tables: expected a list, got dict"),
}


@pytest.mark.parametrize("case", list(MODEL_TEXTS), ids=list(MODEL_TEXTS))
def test_a_malformed_model_yaml_is_one_line(tmp_path, case):
    text, line = MODEL_TEXTS[case]
    model = tmp_path / "m.yaml"
    model.write_text(text)
    result = run("plan", model, EXAMPLE_TOPOLOGY)
    assert result.exit_code == 2, result.output
    source = model if line.startswith("malformed YAML") else model.name  # as the loader names the file
    assert result.stderr == f"error: {source}: {line}\n"


def _set(path: tuple, value):
    def change(data: dict) -> None:
        node = data
        for key in path[:-1]:
            node = node[next(iter(node))] if key is None else node[key]
        node[path[-1]] = value

    return change


PLAN_CASES = {
    "nan-step": (
        _set(("estimate", "step_ms"), float("nan")),
        2,
        "bad.json: estimate.step_ms: nan must be a finite, non-negative number",
    ),
    "device-list": (
        _set(("tables", None, "shards", 0, "device"), ["a"]),
        2,
        "bad.json: tables.c1_user.shards[0].device: expected a string, got ['a']",
    ),
    "negative-cache": (
        _set(("tables", None, "shards", 0, "cache_fraction"), -0.5),
        2,
        "bad.json: tables.c1_user.shards[0].cache_fraction: -0.5 must be a finite, non-negative number",
    ),
    "negative-staleness": (_set(("staleness",), -1), 2, "bad.json: staleness: -1 must be a finite, non-negative count"),
    "reversed-rows": (
        _set(("tables", None, "shards", 0, "rows"), [5, 2]),
        1,
        "invalid plan: table 'c1_user': shard 0 rows [5, 2] are outside [0, 40000000) (and 1 more)",
    ),
    "markup-sharding": (
        _set(("tables", None, "sharding"), "[bold]x"),
        2,
        "bad.json: tables.c1_user.sharding: unknown value '[bold]x'; fix: use one of table_wise | row_wise | "
        "column_wise | table_row_wise | table_column_wise | data_parallel | ps_hash",
    ),
}


@pytest.mark.parametrize("case", list(PLAN_CASES), ids=list(PLAN_CASES))
def test_a_malformed_plan_json_is_one_line(tmp_path, case):
    change, code, line = PLAN_CASES[case]
    data = example_plan(tmp_path)
    change(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = run("validate", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, bad)
    assert result.exit_code == code, result.output
    assert result.stderr == f"error: {line}\n"


def test_a_profile_of_denormal_rates_is_named_not_an_internal_error(tmp_path):
    profile = yaml.safe_load((EXAMPLES / "profiles" / "cpu-2core.yaml").read_text())
    for point in profile["memory"]["gather"]:
        point["bytes_per_s"] = 1e-320
    write_yaml(tmp_path / "profile.yaml", profile)
    topology = yaml.safe_load((EXAMPLES / "local_2x1.yaml").read_text())
    for host in topology["hosts"]:
        host["profile"] = "profile.yaml"
    result = run("topology", write_yaml(tmp_path / "t.yaml", topology))
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        "error: profile.yaml: memory.gather: the measurements fit no positive rate (are they zero, or beyond what a "
        "float holds?); fix: run persia calibrate again\n"
    )


@pytest.mark.parametrize(
    ("section", "line"),
    [
        ({"factors": "fast"}, "profile.yaml: refit.factors: expected a mapping, got str"),
        ({"runs": []}, "profile.yaml: refit.factors: required key is missing; fix: add 'factors:'"),
        (
            {"factors": {"dense": 1.0}, "sharding_factors": {"grid_shard": 2.0}},
            "profile.yaml: refit.sharding_factors.grid_shard: is no sharding type with an exchange; fix: use one of "
            "table_wise, row_wise, column_wise, table_row_wise, table_column_wise",
        ),
    ],
)
def test_a_profiles_malformed_refit_section_is_one_line(tmp_path, section, line):
    profile = yaml.safe_load((EXAMPLES / "profiles" / "cpu-2core.yaml").read_text())
    write_yaml(tmp_path / "profile.yaml", profile | {"refit": section})
    topology = yaml.safe_load((EXAMPLES / "local_2x1.yaml").read_text())
    for host in topology["hosts"]:
        host["profile"] = "profile.yaml"
    result = run("topology", write_yaml(tmp_path / "t.yaml", topology))
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {line}\n"


def test_a_csv_header_that_names_a_column_twice_is_refused(tmp_path):
    from persia_planner.errors import SpecError
    from persia_planner.modules.data.source import csv_columns

    data = tmp_path / "dup.csv"
    data.write_text("y,a,a\n1,2,3\n")
    with pytest.raises(SpecError) as info:
        csv_columns(str(data))
    assert str(info.value) == (
        f"{data}: the header names column 'a' twice (columns 2 and 3); fix: give each column its own name"
    )


@pytest.mark.processes
def test_parquet_files_that_hold_no_rows_are_said_to(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from persia_planner import load_model

    tables = load_model(EXAMPLES / "dlrm_small.yaml").tables
    columns = {"y": pa.array([], pa.float32()), "a": pa.array([], pa.float32())}
    columns |= {t.name: pa.array([], pa.int64()) for t in tables}
    (tmp_path / "pq").mkdir()
    for i in range(2):  # empty part files, as a Spark partition without rows writes
        pq.write_table(pa.table(columns), tmp_path / "pq" / f"part-{i}.parquet")
    schema = write_yaml(
        tmp_path / "schema.yaml", {"label": "y", "dense": ["a"], "sparse": {t.name: t.name for t in tables}}
    )
    result = persia("train", "--steps", 2, "--data", f"parquet:{tmp_path / 'pq'}", "--schema", schema, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"error: {tmp_path / 'pq'}: the 2 Parquet files hold no rows; fix: point --data at the files with the data\n"
    )


@pytest.mark.processes
def test_a_checkpoint_path_through_a_symlink_loop_is_named(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    result = persia("train", "--steps", 2, "--checkpoint", tmp_path / "loop" / "ckpt", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"error: --checkpoint {tmp_path / 'loop' / 'ckpt'}: {tmp_path / 'loop'} is a symbolic link that loops back "
        "to itself; fix: point the link at a directory, or pass another path\n"
    )


@pytest.mark.parametrize(
    ("schema", "key", "value"),
    [
        ({"label": "y\x1b[2J", "dense": ["a"], "sparse": {"t0": "b"}}, "label", "y\x1b[2J"),
        ({"label": "y", "dense": ["a", "b\x07"], "sparse": {"t0": "c"}}, "dense[1]", "b\x07"),
        ({"label": "y", "dense": ["a"], "sparse": {"t\u202e0": "c"}}, "sparse.t\\u202e0", "t\u202e0"),
    ],
)
def test_a_data_schema_name_a_terminal_would_act_on_is_refused(tmp_path, schema, key, value):
    from persia_planner.errors import SpecError, unprintable
    from persia_planner.model.data_schema import load_data_schema

    path = write_yaml(tmp_path / "schema.yaml", schema)
    with pytest.raises(SpecError) as info:
        load_data_schema(path)
    assert str(info.value).endswith(
        f"{key}: {value!r} holds the character {unprintable(value)}, which a terminal would act on or cannot show; "
        "fix: use printable characters only"
    ), str(info.value)


def test_a_plan_json_device_name_with_an_escape_is_refused(tmp_path):
    data = example_plan(tmp_path)
    data["devices"][ESC_NAME] = data["devices"].pop(next(iter(data["devices"])))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = run("validate", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, bad)
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        "error: bad.json: devices.a\\x1b[2Jb: 'a\\x1b[2Jb' holds the character \\x1b, which a terminal would act on "
        "or cannot show; fix: use printable characters only\n"
    )


@pytest.mark.processes
def test_parquet_rows_fewer_than_a_batch_per_trainer_are_refused_before_the_start(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from persia_planner import load_model

    tables = load_model(EXAMPLES / "dlrm_small.yaml").tables
    columns = {"y": pa.array([1.0] * 20, pa.float32()), "a": pa.array([0.5] * 20, pa.float32())}
    columns |= {t.name: pa.array(list(range(20)), pa.int64()) for t in tables}
    data = tmp_path / "twenty.parquet"
    pq.write_table(pa.table(columns), data, row_group_size=10)
    schema = write_yaml(
        tmp_path / "schema.yaml", {"label": "y", "dense": ["a"], "sparse": {t.name: t.name for t in tables}}
    )
    result = persia("train", "--data", f"parquet:{data}", "--schema", schema, "--batch-size", 1000, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"error: parquet:{data}: 20 rows, 19 of them for training, hold no full batch of 1,000 samples for each of "
        "2 trainers (2,000 rows a step); fix: use a smaller --batch-size, fewer --trainers or more data\n"
    )
