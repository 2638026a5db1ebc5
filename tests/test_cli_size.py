"""``persia size``: the sized folder (a topology persia plan reads back to the same plan), the frontier, and bad
input in one line with exit 2; nothing that is not ours is overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persia_planner import load_model, load_plan, load_topology
from persia_planner.cli import app
from persia_planner.errors import MAX_LINE_CHARS
from persia_planner.paths import EXAMPLES
from persia_planner.sizing import load_catalog, size

MODEL = EXAMPLES / "dlrm_small.yaml"
CATALOG = EXAMPLES / "catalog_cpu.yaml"
TARGET = 60_000  # samples/s: more than the cheapest shapes' plans of dlrm_small reach on these CPU classes
runner = CliRunner()


def run(*args: object):
    return runner.invoke(app, [str(a) for a in args], prog_name="persia")


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert len(lines[0]) <= MAX_LINE_CHARS + len("error: ")
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="module")
def expected():
    return size(load_model(MODEL), load_catalog(CATALOG), TARGET, max_hosts=6)


def test_size_writes_the_cheapest_cluster_and_its_plan(tmp_path: Path, expected):
    out = tmp_path / "sized"
    result = run("size", MODEL, CATALOG, "--target-samples-per-s", TARGET, "--max-hosts", 6, "--out", out)
    assert result.exit_code == 0, result.output
    chosen = expected.chosen
    assert chosen is not None
    assert f"cheapest: {chosen.shape.describe()}, {chosen.shape.price_per_hour:,.2f} USD/h" in result.stdout
    assert "cost / throughput frontier" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["frontier.png", "plan.json", "sizing.json", "topology.yaml"]
    # the topology is an ordinary topology.yaml, its profile found from the output folder
    topology = load_topology(out / "topology.yaml")
    assert len(topology.trainers) == chosen.shape.trainers and len(topology.servers) == chosen.shape.servers
    assert (out / "topology.yaml").read_text().startswith("# persia size: the cheapest cluster of catalog_cpu.yaml")
    plan = load_plan(out / "plan.json")
    assert plan.step_ms == pytest.approx(expected.plan.step_ms)
    record = json.loads((out / "sizing.json").read_text())
    assert record["format"] == "persia-sizing/1"
    assert record["chosen"]["shape"] == chosen.shape.describe()
    assert record["chosen"]["samples_per_s"] >= TARGET
    assert len(record["verdicts"]) == len(expected.verdicts)
    assert (out / "frontier.png").read_bytes().startswith(b"\x89PNG")
    # persia plan of the written files plans the same step
    again = run("plan", MODEL, out / "topology.yaml", "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["estimate"]["step_ms"] == pytest.approx(plan.step_ms, rel=1e-6)


def test_a_second_run_needs_overwrite_and_replaces_only_our_files(tmp_path: Path):
    out = tmp_path / "sized"
    args = ("size", MODEL, CATALOG, "--target-samples-per-s", TARGET, "--max-hosts", 4, "--out", out)
    assert run(*args).exit_code == 0
    line = one_error_line(run(*args))
    assert "exists" in line and "--overwrite" in line
    assert run(*args, "--overwrite").exit_code == 0
    # a topology.yaml that persia did not write is never replaced, with or without --overwrite
    (out / "topology.yaml").write_text("name: mine\n")
    line = one_error_line(run(*args, "--overwrite"))
    assert "topology.yaml" in line
    assert (out / "topology.yaml").read_text() == "name: mine\n"


def test_an_unreachable_target_names_the_binding_resource(tmp_path: Path):
    out = tmp_path / "sized"
    line = one_error_line(run("size", MODEL, CATALOG, "--target-samples-per-s", 1e9, "--max-hosts", 3, "--out", out))
    assert "with at most 3 hosts reaches 1,000,000,000 samples/s" in line
    assert "binds" in line and "--max-hosts" in line
    assert not out.exists(), "the folder made for the outputs is removed again"


def test_a_model_no_shape_holds_says_memory(tmp_path: Path):
    big = tmp_path / "big.yaml"
    big.write_text(MODEL.read_text().replace("rows: 200_000", "rows: 2_000_000_000"))
    line = one_error_line(run("size", big, CATALOG, "--target-samples-per-s", 1, "--max-hosts", 2))
    assert "holds the model" in line and "memory" in line


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (("--target-samples-per-s", 0), "above 0"),
        (("--target-samples-per-s", 10, "--max-hosts", 0), "--max-hosts"),
        (("--target-samples-per-s", 10, "--out", "no/such/folder/sized"), "does not exist"),
    ],
)
def test_bad_arguments_are_one_line(extra, words):
    assert words in one_error_line(run("size", MODEL, CATALOG, *extra))


def test_a_bad_catalog_names_the_file_and_the_class(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CATALOG.read_text().replace("ddr: 8GiB", "ddr: 8 gigs"))
    line = one_error_line(run("size", MODEL, bad, "--target-samples-per-s", 10))
    assert "bad.yaml: trainers.cpu-2core.ddr" in line


def test_a_folder_made_for_the_outputs_is_removed_when_the_inputs_are_bad(tmp_path: Path):
    out = tmp_path / "sized"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    one_error_line(run("size", MODEL, bad, "--target-samples-per-s", 10, "--out", out))
    assert not out.exists()


def test_constraints_naming_devices_are_refused_in_one_line(tmp_path: Path):
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(
        MODEL.read_text().replace(
            "  - {name: c2,  rows: 2_000,   dim: 16}",
            "  - {name: c2,  rows: 2_000,   dim: 16, constraints: {devices: [trainer0/cpu0]}}",
        )
    )
    assert "names devices in its constraints" in one_error_line(
        run("size", pinned, CATALOG, "--target-samples-per-s", 10)
    )


def test_a_catalog_named_topology_yaml_is_never_taken_for_ours(tmp_path: Path):
    out = tmp_path / "sized"
    out.mkdir()
    (out / "topology.yaml").write_text(CATALOG.read_text())  # starts "# persia size's catalog ..."
    line = one_error_line(
        run("size", MODEL, CATALOG, "--target-samples-per-s", TARGET, "--max-hosts", 4, "--out", out, "--overwrite")
    )
    assert "topology.yaml" in line
    assert (out / "topology.yaml").read_text() == CATALOG.read_text()
