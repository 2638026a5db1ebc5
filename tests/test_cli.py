"""The ``persia`` command: happy paths asserted on values, and bad inputs that must give one line and exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persia_planner import load_model, load_plan, load_topology, plan, validate
from persia_planner.cli import app
from persia_planner.errors import MAX_LINE_CHARS
from persia_planner.paths import EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, EXAMPLES
from persia_planner.plan.plan import Plan
from persia_planner.report import explanations

ROOT = Path(__file__).resolve().parents[1]
MODEL, TOPOLOGY = EXAMPLE_MODEL, EXAMPLE_TOPOLOGY
BAD = Path(__file__).resolve().parent / "bad_inputs"

runner = CliRunner()


def run(*args: object):
    return runner.invoke(app, [str(a) for a in args], prog_name="persia")


@pytest.fixture(scope="module")
def example():
    """The bundled example planned through the API, as the CLI plans it (seed 0)."""
    model, topology = load_model(MODEL), load_topology(TOPOLOGY)
    return model, topology, plan(model, topology, seed=0)


# ---- persia plan ----------------------------------------------------------------------------------------------------
def test_plan_without_arguments_plans_the_bundled_example(example):
    _, _, expected = example
    result = run("plan")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "no files given: planning the bundled example dlrm_criteo.yaml on cluster_2x4_2ps.yaml"
    assert f"step {expected.step_ms:.2f} ms" in result.stdout
    assert f"lower bound {expected.lower_bound_ms:.2f} ms" in result.stdout
    assert f"quality {expected.quality:.3f}x" in result.stdout
    assert f"{expected.samples_per_s:,.0f} samples/s" in result.stdout
    # the per-device table has every device, the per-table table every table
    for name in (*expected.devices, *expected.tables):
        assert re.search(rf"│ {re.escape(name)} +│", result.stdout), name
    remote = expected.remote_tables()
    assert f"{len(remote)} of 26 tables remote (PS, async)" in result.stdout


def test_plan_json_is_the_plan_and_nothing_else(example):
    model, topology, expected = example
    result = run("plan", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # the whole of stdout is the JSON document
    assert data["format"] == "persia-plan/1"
    assert data == expected.to_dict()
    assert validate(Plan.from_dict(data), model, topology) == []
    assert "bundled example" in result.stderr  # the notice went to stderr


def test_plan_json_with_files_and_seed_validates(example):
    model, topology, _ = example
    result = run("plan", MODEL, TOPOLOGY, "--json", "--seed", 7)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    loaded = Plan.from_dict(json.loads(result.stdout))
    assert validate(loaded, model, topology) == []
    assert loaded.model == "dlrm-criteo" and loaded.topology == "2x4-l4-2ps"
    assert set(loaded.tables) == {t.name for t in model.tables}


def test_plan_out_writes_a_plan_that_reads_back_equal(tmp_path, example):
    _, _, expected = example
    out = tmp_path / "plan.json"
    result = run("plan", MODEL, TOPOLOGY, "--out", out)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stdout
    assert load_plan(out) == Plan.from_dict(expected.to_dict())
    assert json.loads(out.read_text()) == expected.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary file left behind


def test_plan_json_and_out_together(tmp_path, example):
    _, _, expected = example
    out = tmp_path / "plan.json"
    result = run("plan", MODEL, TOPOLOGY, "--json", "--out", out)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(out.read_text()) == expected.to_dict()
    assert result.stderr == f"wrote {out}\n"


def test_an_internal_error_is_one_line_with_exit_3(monkeypatch):
    import persia_planner

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(persia_planner, "plan", broken)
    result = run("plan")
    assert result.exit_code == 3
    assert result.stderr == (
        "error: internal error (RuntimeError: boom); please report it, PERSIA_DEBUG=1 shows the traceback\n"
    )


def test_plan_explain_names_each_large_table_and_its_alternative(example):
    model, topology, expected = example
    result = run("plan", "--explain")
    assert result.exit_code == 0, result.output
    assert "why the largest tables went where they did" in result.stdout
    section = result.stdout.split("why the largest tables went where they did", 1)[1].splitlines()
    for e in explanations(expected, model, topology):
        row = next(line for line in section if line.startswith(f"│ {e.table} "))
        assert e.chosen in row
        assert e.next_best is not None and e.next_best in row
        assert f"{e.next_step_ms:.2f}" in row


@pytest.mark.processes
def test_plan_does_not_import_torch_or_matplotlib():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from persia_planner.cli import app\n"
        "for args in (['plan', '--json'], ['plan', '--explain'], ['validate', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0, args\n"
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


@pytest.mark.processes
def test_entry_point_prints_one_line_and_exits_2():
    out = subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", "plan", "missing.yaml", str(TOPOLOGY)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert out.stderr == "error: missing.yaml: file not found; fix: check the path\n"
    assert out.stdout == ""


def test_bare_command_shows_help():
    result = runner.invoke(app, [], prog_name="persia")
    assert result.exit_code == 0
    for command in ("plan", "validate", "topology"):
        assert command in result.stdout


# ---- persia validate ------------------------------------------------------------------------------------------------
@pytest.fixture()
def plan_file(tmp_path, example):
    _, _, expected = example
    path = tmp_path / "plan.json"
    expected.save(path)
    return path


def test_validate_accepts_a_fresh_plan(plan_file, example):
    _, _, expected = example
    result = run("validate", MODEL, TOPOLOGY, plan_file)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        f"OK: {plan_file} places all 26 tables of dlrm-criteo on 2x4-l4-2ps within capacity"
    )
    assert f"re-estimated step {expected.step_ms:.2f} ms" in result.stdout
    assert f"step {expected.step_ms:.2f} ms | lower bound {expected.lower_bound_ms:.2f} ms" in result.stdout


def test_validate_notes_a_plan_made_for_another_model(plan_file, tmp_path):
    renamed = tmp_path / "renamed.yaml"
    renamed.write_text(MODEL.read_text().replace("name: dlrm-criteo", "name: dlrm-renamed"))
    result = run("validate", renamed, TOPOLOGY, plan_file)
    assert result.exit_code == 0, result.output
    assert result.stderr == f"note: {plan_file} was made for model 'dlrm-criteo', checked against 'dlrm-renamed'\n"


def _tamper(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_validate_rejects_a_plan_with_a_missing_shard(plan_file, example):
    _, _, expected = example
    # the largest multi-shard table loses its last shard
    name = next(n for n, p in expected.tables.items() if len(p.shards) > 1 and p.sharding.value != "data_parallel")
    _tamper(plan_file, lambda d: d["tables"][name]["shards"].pop())
    result = run("validate", MODEL, TOPOLOGY, plan_file)
    assert result.exit_code == 1, result.output
    assert f"{plan_file} is INVALID for dlrm-criteo on 2x4-l4-2ps" in result.stdout
    assert f"table '{name}'" in result.stdout
    assert result.stderr.startswith(f"error: invalid plan: table '{name}'")
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


def test_validate_rejects_a_plan_over_capacity(plan_file):
    # put the two 40M-row tables whole in one GPU's HBM: 2 x 20.6 GB, far beyond its 21.6 GiB
    model = load_model(MODEL)

    def stack(data):
        for name in ("c1_user", "c20_ad"):
            table = model.table(name)
            data["tables"][name] = {
                "sharding": "table_wise",
                "mode": "sync",
                "shards": [
                    {
                        "rows": [0, table.rows],
                        "cols": [0, table.dim],
                        "tier": "hbm",
                        "device": "trainer0/gpu0",
                        "bytes": table.bytes(model.embedding_dtype),
                    }
                ],
            }

    _tamper(plan_file, stack)
    result = run("validate", MODEL, TOPOLOGY, plan_file)
    assert result.exit_code == 1, result.output
    assert re.search(r"trainer0/gpu0 HBM holds [0-9.]+ GiB, over its usable 21\.6 GiB", result.stdout)
    assert result.stderr.startswith("error: invalid plan: trainer0/gpu0 HBM holds")


def test_validate_against_a_smaller_cluster_names_each_full_gpu(plan_file, tmp_path):
    smaller = tmp_path / "small_hbm.yaml"
    smaller.write_text(TOPOLOGY.read_text().replace("hbm: 24GiB", "hbm: 4GiB"))
    result = run("validate", MODEL, smaller, plan_file)
    assert result.exit_code == 1, result.output
    full = [name for name, use in load_plan(plan_file).devices.items() if use.hbm_bytes > 3.6 * 1024**3]
    assert full, "the example plan should fill some GPU beyond 3.6 GiB"
    for name in full:
        assert f"{name} HBM holds" in result.stdout
    assert result.stdout.count("HBM holds") == len(full)
    assert "over its usable 3.6 GiB" in result.stdout


def test_plan_keeps_a_tables_constraints_and_validate_refuses_a_plan_that_breaks_them(tmp_path):
    """A table held to one GPU: planned there; moved elsewhere by hand, the plan is refused with exit 1 and one
    line naming the table, the constraint and where the plan put it."""
    model = tmp_path / "model.yaml"
    held = MODEL.read_text().replace("{name: c2,", "{name: c2, constraints: {devices: [trainer1/gpu2], tiers: [hbm]},")
    assert "trainer1/gpu2" in held
    model.write_text(held)
    out = tmp_path / "plan.json"
    result = run("plan", model, TOPOLOGY, "--out", out)
    assert result.exit_code == 0, result.output
    shards = json.loads(out.read_text())["tables"]["c2"]["shards"]
    assert [(s["device"], s["tier"]) for s in shards] == [("trainer1/gpu2", "hbm")]
    _tamper(out, lambda d: d["tables"]["c2"]["shards"][0].update(device="trainer0/gpu0"))
    result = run("validate", model, TOPOLOGY, out)
    assert result.exit_code == 1, result.output
    assert result.stderr == (
        "error: invalid plan: table 'c2': the plan puts shard 0 on trainer0/gpu0, but its constraints allow "
        "devices [trainer1/gpu2]\n"
    )
    assert "Traceback" not in result.output


# ---- persia topology ------------------------------------------------------------------------------------------------
def test_topology_summary():
    result = run("topology", TOPOLOGY)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "topology 2x4-l4-2ps: 13 nodes, 24 links",
        "trainer hosts: 2 (trainer0, trainer1), 4 GPUs each, NIC 25.0 GB/s",
        "GPUs: 8, HBM 192.0 GiB total (172.8 GiB usable), HBM bandwidth 300.0 GB/s, PCIe 32.0 GB/s",
        "trainer DDR: 256.0 GiB total (230.4 GiB usable)",
        "parameter servers: 2 (ps0, ps1), DDR 1.0 TiB total (819.2 GiB usable), NIC 25.0 GB/s",
        "switch bandwidth: 400.0 GB/s",
        "latency: 10.0 us one-way, host to host",
    ]


def test_topology_png(tmp_path):
    png = tmp_path / "cluster.png"
    result = run("topology", EXAMPLES / "persia_100t_cluster.yaml", "--png", png)
    assert result.exit_code == 0, result.output
    assert "GPUs: 64" in result.stdout and "parameter servers: 30" in result.stdout
    assert "switch bandwidth: unlimited" in result.stdout
    assert result.stdout.splitlines()[-1] == f"wrote {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_fits_one_1_4_trillion_row_fp16_table_in_30_servers(tmp_path):
    """The Persia paper's scale on a few large-memory servers: one table of 1.4e12 rows, dim 64, fp16 (90T
    parameters) on 30 servers of 12 TB. It fits only because the stores keep fp16 rows (float32 rows would take
    373 TiB where the servers have 262 TiB) and hold past 2^31 rows of a table each (46.7 billion here)."""
    model, topology = tmp_path / "model.yaml", tmp_path / "topology.yaml"
    model.write_text(
        "name: persia-100t-one-table\nbatch_size: 65536\n"
        "tables: [{name: big, rows: 1.4e12, dim: 64, pooling_factor: 1, embedding_dtype: fp16, zipf_alpha: 1.05}]\n"
    )
    link = "pcie_bandwidth: 32GB/s, nvlink_bandwidth: 300GB/s"
    gpus = f"{{count: 8, hbm: 80GiB, hbm_bandwidth: 2TB/s, tflops: 300, {link}}}"
    topology.write_text(
        "name: 8x8-30ps\nhosts:\n"
        f"  - {{name: trainer, count: 8, ddr: 1TB, ddr_bandwidth: 200GB/s, nic_bandwidth: 25GB/s, gpus: {gpus}}}\n"
        "  - {name: ps, count: 30, role: parameter_server, ddr: 12TB, ddr_bandwidth: 100GB/s, nic_bandwidth: 25GB/s}\n"
    )
    out = tmp_path / "plan.json"
    result = run("plan", model, topology, "--out", out)
    assert result.exit_code == 0, result.output
    written, servers = load_plan(out), load_topology(topology).servers
    assert written.tables["big"].sharding.value == "ps_hash" and len(servers) == 30
    usable = {s.name: s.ddr_bytes * (1 - load_topology(topology).constants.ps_reserve_fraction) for s in servers}
    held = {name: d.ddr_bytes for name, d in written.devices.items() if name in usable}
    assert len(held) == 30 and all(0.75 * usable[n] < b <= usable[n] for n, b in held.items()), held


def test_plan_png_draws_the_placement(tmp_path, example):
    _, _, expected = example
    png, out = tmp_path / "plan.png", tmp_path / "plan.json"
    result = run("plan", MODEL, TOPOLOGY, "--png", png, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(out.read_text()) == expected.to_dict()  # stdout: the plan alone
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.stderr == f"wrote {out}\nwrote {png}\n"
    bad = run("plan", MODEL, TOPOLOGY, "--png", tmp_path / "missing" / "plan.png")
    assert bad.exit_code == 2
    assert bad.stderr == (
        f"error: --png {tmp_path / 'missing' / 'plan.png'}: the folder {tmp_path / 'missing'} does not exist; "
        "fix: create it first\n"
    )


# ---- bad inputs: one line on stderr, exit 2, no traceback -----------------------------------------------------------
def _plan_model(name):
    return ("plan", BAD / name, TOPOLOGY)


def _topology(name):
    return ("topology", BAD / name)


def _validate(name):
    return ("validate", MODEL, TOPOLOGY, BAD / name)


BAD_INPUTS = [
    # model.yaml: a table's constraints that no plan can keep
    (
        _plan_model("model_constraint_unknown_device.yaml"),
        "table 'user': constraints.devices names 'trainer2/gpu0', which topology '2x4-l4-2ps' does not have; "
        "fix: name trainer devices (e.g. trainer0/gpu0) or parameter servers (e.g. ps0)",
    ),
    (
        ("validate", BAD / "model_constraint_unknown_device.yaml", TOPOLOGY, BAD / "not_read.json"),
        "table 'user': constraints.devices names 'trainer2/gpu0', which topology '2x4-l4-2ps' does not have; "
        "fix: name trainer devices (e.g. trainer0/gpu0) or parameter servers (e.g. ps0)",
    ),
    (
        _plan_model("model_constraint_no_pair.yaml"),
        "model_constraint_no_pair.yaml: tables[0].constraints.tiers: table 'user': sharding_types [ps_hash], "
        "tiers [hbm] have no pair in common (ps_hash runs on ps or ssd); fix: allow a tier that one of its sharding "
        "types runs on",
    ),
    (
        _plan_model("model_constraint_unknown_tier.yaml"),
        "model_constraint_unknown_tier.yaml: tables[0].constraints.tiers[1]: unknown value 'uvm'; "
        "fix: use one of hbm | ddr | hbm_cache | ps | ssd",
    ),
    (
        ("plan", BAD / "model_constraint_ps_only.yaml", BAD / "topology_without_servers.yaml"),
        "table 'user': no placement keeps its constraints (tiers [ps]): ps_hash needs parameter servers, and "
        "topology '1x2' has none; fix: add parameter servers (hosts with role: parameter_server) or allow a tier of "
        "the trainers",
    ),
    (
        _plan_model("model_constraint_some_servers.yaml"),
        "table 'user': no placement keeps its constraints (sharding_types [ps_hash], devices [ps1]): ps_hash hashes "
        "a table over every parameter server, and it names 1 of the 2 servers; fix: name the devices those need or "
        "allow a tier of the trainers",
    ),
    (
        _plan_model("model_constraint_row_wise_on_one_host.yaml"),
        "table 'user': no placement keeps its constraints (sharding_types [row_wise], devices [trainer0/gpu0, "
        "trainer0/gpu1, trainer0/gpu2, trainer0/gpu3]): row_wise spans every trainer device, and it names 4 of the "
        "8; fix: name the devices those need or allow table_wise",
    ),
    (
        _plan_model("model_constraint_larger_than_hbm.yaml"),
        "table 'user' (24.2 GiB) fits nowhere its constraints allow (sharding_types [table_wise], tiers [hbm]): "
        "table_wise on hbm, the nearest to fitting, needs 24.2 GiB of HBM on one device, and the largest it may use "
        "has 21.6 GiB usable (short by 2.6 GiB); fix: allow more tiers, sharding types or devices or give those "
        "devices more memory or reduce its rows",
    ),
    # model.yaml
    (
        _plan_model("model_typo_key.yaml"),
        "model_typo_key.yaml: tables[0].pooling_factr: unknown key; fix: did you mean 'pooling_factor'?",
    ),
    (
        _plan_model("model_malformed.yaml"),
        f"{BAD / 'model_malformed.yaml'}: malformed YAML at line 5, column 1: expected ',' or '}}', "
        "but got '<stream end>'; fix: fix the YAML syntax",
    ),
    (
        _plan_model("model_negative_rows.yaml"),
        "model_negative_rows.yaml: tables[0].rows: -5 must be a finite, non-negative count",
    ),
    (_plan_model("model_zero_dim.yaml"), "model_zero_dim.yaml: tables[0].dim: must be > 0, got 0"),
    (
        _plan_model("model_unknown_dtype.yaml"),
        "model_unknown_dtype.yaml: embedding_dtype: unknown value 'fp8'; fix: use one of fp32 | fp16 | bf16",
    ),
    (
        _plan_model("model_unknown_optimizer.yaml"),
        "model_unknown_optimizer.yaml: tables[0].optimizer: unknown value 'adamw'; "
        "fix: use one of sgd | rowwise_adagrad | adagrad | adam",
    ),
    (
        _plan_model("model_missing_batch_size.yaml"),
        "model_missing_batch_size.yaml: batch_size: required key is missing; fix: add 'batch_size:'",
    ),
    (
        _plan_model("model_duplicate_table.yaml"),
        "model_duplicate_table.yaml: tables[1].name: table name 'user' is already used by tables[0]; fix: rename it",
    ),
    (_plan_model("model_top_level_list.yaml"), "model_top_level_list.yaml: (top level): expected a mapping, got list"),
    (
        _plan_model("model_count_with_unit.yaml"),
        "model_count_with_unit.yaml: tables[0].rows: unknown unit 'M' in '4M'; "
        "expected a whole number like 40_000_000 or 1e9",
    ),
    (
        _plan_model("model_empty.yaml"),
        f"{BAD / 'model_empty.yaml'}: file is empty; fix: see formats.md for the model.yaml keys",
    ),
    (
        ("plan", BAD / "model_too_big.yaml", BAD / "topology_tiny.yaml"),
        "the tables need 24.2 GiB but HBM + DDR + PS hold 1.8 GiB after reservations: trainer DDR is short by "
        "22.4 GiB; fix: add parameter servers (hosts with role: parameter_server) or set embedding_dtype: fp16 or "
        "reduce table rows",
    ),
    # topology.yaml
    (
        _topology("topology_unknown_unit.yaml"),
        "topology_unknown_unit.yaml: hosts[0].gpus.hbm: unknown unit 'GX' in '24GX'; "
        "expected an integer byte count or a size like '80GiB' or '1.5TB'",
    ),
    (
        _topology("topology_bandwidth_without_per_second.yaml"),
        "topology_bandwidth_without_per_second.yaml: hosts[0].nic_bandwidth: unknown unit 'GB' in '25GB'; "
        "expected a bandwidth like '64GB/s', '900GiB/s' or '400Gbps'",
    ),
    (
        _topology("topology_network_typo.yaml"),
        "topology_network_typo.yaml: network.latncy: unknown key; fix: did you mean 'latency'?",
    ),
    (
        _topology("topology_unknown_role.yaml"),
        "topology_unknown_role.yaml: hosts[1].role: unknown value 'server'; fix: use one of trainer | parameter_server",
    ),
    (_topology("topology_zero_gpus.yaml"), "topology_zero_gpus.yaml: hosts[0].gpus.count: must be > 0, got 0"),
    (
        _topology("topology_negative_latency.yaml"),
        "topology_negative_latency.yaml: network.latency: -1e-06 must be a finite, non-negative duration",
    ),
    (
        _topology("topology_gpu_without_host.yaml"),
        "topology_gpu_without_host.yaml: links: GPU 'gpu1' is not linked to a host; "
        "fix: add a link from it to its host",
    ),
    (
        _topology("topology_unknown_link_end.yaml"),
        "topology_unknown_link_end.yaml: links[0].b: unknown node 'hots0'; fix: declare it under 'nodes:'",
    ),
    (
        _topology("topology_no_trainer.yaml"),
        "topology_no_trainer.yaml: hosts: the topology has no trainer GPU; fix: add a host with 'gpus:'",
    ),
    (
        _topology("topology_both_forms.yaml"),
        "topology_both_forms.yaml: nodes: give either 'hosts:' or 'nodes:'/'links:', not both",
    ),
    (
        _topology("topology_constant_typo.yaml"),
        "topology_constant_typo.yaml: constants.hbm_eficiency: unknown key; fix: did you mean 'hbm_efficiency'?",
    ),
    # plan.json
    (_validate("plan_truncated.json"), "plan_truncated.json: malformed JSON at line 2: Expecting value"),
    (
        _validate("plan_wrong_format.json"),
        "plan_wrong_format.json: format: expected 'persia-plan/1', got 'persia-plan/0'; "
        "fix: re-run 'persia plan' to write a current plan",
    ),
    (_validate("plan_not_object.json"), "plan_not_object.json: expected a JSON object"),
    (_validate("plan_no_tables.json"), "plan_no_tables.json: tables: required key is missing; fix: add 'tables:'"),
    (
        _validate("plan_unknown_tier.json"),
        "plan_unknown_tier.json: tables.c1_user.shards[0].tier: unknown value 'nvme'; "
        "fix: use one of hbm | ddr | hbm_cache | ps | ssd",
    ),
    (
        _validate("plan_mode_mismatch.json"),
        "plan_mode_mismatch.json: tables.c1_user.mode: 'async' does not match sharding 'table_wise'; "
        "fix: use mode: sync",
    ),
    # model: ceilings, repeated keys, deep nesting, huge numbers, table names
    (
        _plan_model("model_alias_bomb.yaml"),
        "model_alias_bomb.yaml: name: expected a string, got [[[[...], [...], [...], [...], [...], "
        "[...], ...], [[...]....], ...], ...], ...]",
    ),
    (
        _plan_model("model_batch_size_huge.yaml"),
        "model_batch_size_huge.yaml: batch_size: must be <= 2,147,483,647, got '1e300'; fix: use at most 2,147,483,647",
    ),
    (
        _plan_model("model_count_huge.yaml"),
        "model_count_huge.yaml: tables[0].count: must be <= 1,000,000, got 2000000; fix: use at most 1,000,000",
    ),
    (
        _plan_model("model_deep_nesting.yaml"),
        f"{BAD / 'model_deep_nesting.yaml'}"
        ": YAML nested too deeply to read; fix: an input file nests a few levels, not hundreds",
    ),
    (
        _plan_model("model_dense_flops_huge.yaml"),
        "model_dense_flops_huge.yaml: dense.flops_per_sample: must be <= 1e+15, got 1e+300; fix: use at most 1e+15",
    ),
    (
        _plan_model("model_dense_parameters_huge.yaml"),
        "model_dense_parameters_huge.yaml: dense.parameters: must be <= 17,592,186,044,416, got "
        "'1e300'; fix: use at most 17,592,186,044,416",
    ),
    (
        _plan_model("model_dim_huge.yaml"),
        "model_dim_huge.yaml: tables[0].dim: must be <= 16,384, got 100000; fix: use at most 16,384",
    ),
    (
        _plan_model("model_dtype_not_string.yaml"),
        "model_dtype_not_string.yaml: embedding_dtype: unknown value {'fp': 16}; fix: use one of fp32 | fp16 | bf16",
    ),
    (
        _plan_model("model_duplicate_key.yaml"),
        f"{BAD / 'model_duplicate_key.yaml'}"
        ": batch_size: key given twice in one mapping (line 5); fix: keep one of them",
    ),
    (
        _plan_model("model_duplicate_table_key.yaml"),
        f"{BAD / 'model_duplicate_table_key.yaml'}"
        ": tables[0].rows: key given twice in one mapping (line 7); fix: keep one of them",
    ),
    (
        _plan_model("model_pooling_factor_huge.yaml"),
        "model_pooling_factor_huge.yaml: tables[0].pooling_factor: must be <= 100,000, got 1e+300; "
        "fix: use at most 100,000",
    ),
    (
        _plan_model("model_rows_5000_digits.yaml"),
        f"{BAD / 'model_rows_5000_digits.yaml'}"
        ": malformed YAML: a number has more than 4,300 digits; fix: fix the value",
    ),
    (
        _plan_model("model_rows_huge.yaml"),
        "model_rows_huge.yaml: tables[0].rows: must be <= 17,592,186,044,416, got '1e300'; fix: "
        "use at most 17,592,186,044,416",
    ),
    (
        _plan_model("model_rows_over_ceiling.yaml"),
        "model_rows_over_ceiling.yaml: tables[0].rows: must be <= 17,592,186,044,416, got "
        "17592186044417; fix: use at most 17,592,186,044,416",
    ),
    (
        _plan_model("model_staleness_huge.yaml"),
        "model_staleness_huge.yaml: staleness: must be <= 1,000, got '1e300'; fix: use at most 1,000",
    ),
    (
        _plan_model("model_table_name_dotdot.yaml"),
        "model_table_name_dotdot.yaml: tables[0].name: table name '..' cannot be a checkpoint file "
        "name; fix: name it to match [A-Za-z0-9_][A-Za-z0-9_.-]{0,199} (letters, digits, '_', '-', "
        "'.'; no leading '.'; at most 200 characters)",
    ),
    (
        _plan_model("model_table_name_empty.yaml"),
        "model_table_name_empty.yaml: tables[0].name: table name is empty; fix: name it to match "
        "[A-Za-z0-9_][A-Za-z0-9_.-]{0,199} (letters, digits, '_', '-', '.'; no leading '.'; at "
        "most 200 characters)",
    ),
    (
        _plan_model("model_table_name_leading_dot.yaml"),
        "model_table_name_leading_dot.yaml: tables[0].name: table name '.user' cannot be a "
        "checkpoint file name; fix: name it to match [A-Za-z0-9_][A-Za-z0-9_.-]{0,199} (letters, "
        "digits, '_', '-', '.'; no leading '.'; at most 200 characters)",
    ),
    (
        _plan_model("model_table_name_long.yaml"),
        "model_table_name_long.yaml: tables[0].name: table name "
        "'ttttttttttttttttttttttttttt...tttttttttttttttttttttttttttt' cannot be a checkpoint file "
        "name; fix: name it to match [A-Za-z0-9_][A-Za-z0-9_.-]{0,199} (letters, digits, '_', '-', "
        "'.'; no leading '.'; at most 200 characters)",
    ),
    (
        _plan_model("model_table_name_nul.yaml"),
        "model_table_name_nul.yaml: tables[0].name: 'user\\x00id' holds the character \\x00, which a terminal "
        "would act on or cannot show; fix: use printable characters only",
    ),
    (
        _plan_model("model_table_name_slash.yaml"),
        "model_table_name_slash.yaml: tables[0].name: table name 'users/by_id' cannot be a "
        "checkpoint file name; fix: name it to match [A-Za-z0-9_][A-Za-z0-9_.-]{0,199} (letters, "
        "digits, '_', '-', '.'; no leading '.'; at most 200 characters)",
    ),
    (
        _plan_model("model_zipf_alpha_huge.yaml"),
        "model_zipf_alpha_huge.yaml: tables[0].zipf_alpha: must be <= 10, got 1000; fix: use at most 10",
    ),
    # topology: ceilings, repeated keys, deep nesting, huge numbers, table names
    (
        _topology("topology_bandwidth_huge.yaml"),
        "topology_bandwidth_huge.yaml: hosts[0].nic_bandwidth: must be <= 1e+15 B/s, got "
        "'1e20GB/s'; fix: use at most 1e+15 B/s",
    ),
    (
        _topology("topology_constant_huge.yaml"),
        "topology_constant_huge.yaml: constants.shard_overhead_ms: must be <= 1e+18, got 1e+300; "
        "fix: use at most 1e+18",
    ),
    (
        _topology("topology_ddr_huge.yaml"),
        "topology_ddr_huge.yaml: hosts[0].ddr: must be <= 1,152,921,504,606,846,976 bytes (1024.0 "
        "PiB), got '1e300'; fix: use at most 1,152,921,504,606,846,976 bytes (1024.0 PiB)",
    ),
    (
        _topology("topology_duplicate_key.yaml"),
        f"{BAD / 'topology_duplicate_key.yaml'}"
        ": hosts[0].ddr: key given twice in one mapping (line 5); fix: keep one of them",
    ),
    (
        _topology("topology_hbm_huge.yaml"),
        "topology_hbm_huge.yaml: hosts[0].gpus.hbm: must be <= 1,152,921,504,606,846,976 bytes "
        "(1024.0 PiB), got '2048PiB'; fix: use at most 1,152,921,504,606,846,976 bytes (1024.0 PiB)",
    ),
    (
        _topology("topology_host_count_huge.yaml"),
        "topology_host_count_huge.yaml: hosts[0].count: must be <= 100,000, got '1e300'; fix: use at most 100,000",
    ),
    (
        _topology("topology_latency_huge.yaml"),
        "topology_latency_huge.yaml: network.latency: must be <= 10 s, got '1000000000s'; fix: use at most 10 s",
    ),
    (
        _topology("topology_link_latency_huge.yaml"),
        "topology_link_latency_huge.yaml: links[0].latency: must be <= 10 s, got '1000000000s'; fix: use at most 10 s",
    ),
    (
        _topology("topology_tflops_huge.yaml"),
        "topology_tflops_huge.yaml: hosts[0].gpus.tflops: must be <= 1e+06, got 1e+300; fix: use at most 1e+06",
    ),
    (
        _topology("topology_ssd_read_iops_tiny.yaml"),
        "topology_ssd_read_iops_tiny.yaml: hosts[1].ssd.read_iops: must be in [1, 1e+09], got '1e-300'; "
        "fix: give the 4 KiB blocks the disk reads a second at random (persia calibrate measures them)",
    ),
    (
        _topology("topology_ssd_size_tiny.yaml"),
        "topology_ssd_size_tiny.yaml: hosts[1].ssd: must be in [1.0 MiB, 1024.0 PiB], got 2; "
        "fix: give the disk's size, e.g. ssd: 2TiB",
    ),
    (
        _plan_model("model_constraint_ssd_only.yaml"),
        "table 'user': no placement keeps its constraints (tiers [ssd]): the ssd tier keeps a table's rows on every "
        "parameter server's disk, and no parameter server of topology '2x4-l4-2ps' has an ssd: disk; "
        "fix: add 'ssd: SIZE' (e.g. ssd: 2TiB) to the topology's parameter-server hosts or allow tier ps",
    ),
    (
        _topology("topology_too_many_devices.yaml"),
        "topology_too_many_devices.yaml: hosts[0].count: the topology would have 102,500,000 hosts and devices and "
        "52,480,100,000 links, over the 200,000 and 2,000,000 a topology may have; "
        "fix: check the counts of hosts and devices",
    ),
    # plan: ceilings, repeated keys, deep nesting, huge numbers, table names
    (
        _validate("plan_bytes_huge.json"),
        "plan_bytes_huge.json: tables.c1_user.shards[0].bytes: must be <= "
        "9,223,372,036,854,775,807 bytes (8192.0 PiB), got 1e+300; fix: use at most "
        "9,223,372,036,854,775,807 bytes (8192.0 PiB)",
    ),
    (
        _validate("plan_deep_nesting.json"),
        "plan_deep_nesting.json: JSON nested too deeply to read; fix: an input file nests a few levels, not hundreds",
    ),
    (
        _validate("plan_duplicate_key.json"),
        "plan_duplicate_key.json: tables.c1_user.shards[0].tier: key given twice in one object; fix: keep one of them",
    ),
    (
        _validate("plan_duplicate_table.json"),
        "plan_duplicate_table.json: tables.c1_user: key given twice in one object; fix: keep one of them",
    ),
    (
        _validate("plan_int_5000_digits.json"),
        "plan_int_5000_digits.json: malformed JSON: a number has more than 4,300 digits; fix: fix the value",
    ),
    (
        _validate("plan_rows_huge.json"),
        "plan_rows_huge.json: tables.c1_user.shards[0].rows: expected [start, end] of two integers "
        "in [0, 2**63), got [0, 1000000000000000000000000000000]",
    ),
    (
        _validate("plan_step_ms_huge.json"),
        "plan_step_ms_huge.json: estimate.step_ms: must be <= 1e+18, got 1e+300; fix: use at most 1e+18",
    ),
    # arguments and paths
    (("plan", "no_such_model.yaml", TOPOLOGY), "no_such_model.yaml: file not found; fix: check the path"),
    (("validate", MODEL, TOPOLOGY, "no_such_plan.json"), "no_such_plan.json: file not found; fix: check the path"),
    (("topology", BAD), f"{BAD}: is a directory, not a regular file; fix: give the path of a regular file"),
    (
        ("plan", MODEL),
        "give both MODEL and TOPOLOGY (or --model and --topology), or neither to plan the bundled "
        "example; "
        "fix: persia plan model.yaml topology.yaml",
    ),
    (("validate", MODEL, TOPOLOGY), "Missing argument 'PLAN'. (see 'persia validate --help')"),
    (
        ("plan", "--seed", "seven"),
        "Invalid value for '--seed': Input should be a valid integer, unable to parse string as an integer "
        "(see 'persia plan --help')",
    ),
    (
        ("plan", "--seed", "-1"),
        "Invalid value for '--seed': Input should be greater than or equal to 0 (see 'persia plan --help')",
    ),
    (
        ("train", "--staleness", 10**30),
        "Invalid value for '--staleness': Input should be less than or equal to 1000 (see 'persia train --help')",
    ),
    (
        ("train", "--batch-size", 2**31),
        "Invalid value for '--batch-size': Input should be less than or equal to 2147483647 "
        "(see 'persia train --help')",
    ),
    (
        ("plan", "--out", BAD / "no_such_dir" / "plan.json"),
        f"--out {BAD / 'no_such_dir' / 'plan.json'}: the folder {BAD / 'no_such_dir'} does not exist; "
        "fix: create it first",
    ),
]


def _case_id(args: tuple) -> str:
    bad = [Path(str(a)).name for a in args[1:] if str(a).startswith(str(BAD))]
    return f"{args[0]}-{bad[0]}" if bad else "-".join(Path(str(a)).name for a in args)


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS, ids=[_case_id(args) for args, _ in BAD_INPUTS])
def test_bad_input_gives_one_line_and_exit_2(args, message):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {message}\n"
    assert result.stdout == "" or result.stdout.startswith("no files given")
    assert "Traceback" not in result.output


def test_there_are_enough_bad_inputs():
    assert len(BAD_INPUTS) >= 60
    files = {p.name for p in BAD.iterdir()}
    used = {Path(str(a)).name for args, _ in BAD_INPUTS for a in args}
    assert files <= used, f"unused bad inputs: {sorted(files - used)}"


def test_validate_zero_hash_buckets_is_reported_not_crashed(tmp_path):
    bad = tmp_path / "zero_buckets.json"
    shard = {"hash": [0, 0], "cols": [0, 128], "tier": "ps", "device": "ps0", "bytes": 1}
    bad.write_text(
        json.dumps({"format": "persia-plan/1", "tables": {"c1_user": {"sharding": "ps_hash", "shards": [shard]}}})
    )
    result = run("validate", MODEL, TOPOLOGY, bad)
    assert result.exit_code == 1, result.output
    assert "c1_user" in result.stderr


# ---- special files and huge inputs, made here rather than committed --------------------------------------------------
def _persia(*args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    """The CLI in a child process: a file that blocked the reader (a FIFO) would hang an in-process runner."""
    code = "from persia_planner.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def _one_error_line(stderr: str, *names: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr and len(lines[0]) <= len("error: ") + MAX_LINE_CHARS, stderr
    for name in names:
        assert name in lines[0], (name, stderr)
    return lines[0]


def _special_inputs(tmp_path: Path) -> dict[str, Path]:
    import os
    import socket

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    null = tmp_path / "null.yaml"
    null.symlink_to("/dev/null")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    big = tmp_path / "big.yaml"
    with big.open("wb") as file:
        file.truncate(64 * 2**20 + 1)  # sparse: one byte over the limit, without writing 64 MiB
    inputs = {"a FIFO": fifo, "a character device": zero, "a directory": folder, "larger than 64.0 MiB": big}
    inputs["a character device "] = null
    sock = tmp_path / "sock.yaml"
    if len(str(sock)) < 100:  # AF_UNIX paths are short
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(sock))
        inputs["a socket"] = sock
    return inputs


@pytest.mark.processes
@pytest.mark.parametrize("role", ["model", "topology", "plan"])
def test_special_files_are_refused_before_reading(tmp_path, role):
    for what, path in _special_inputs(tmp_path).items():
        args = {
            "model": ("plan", path, TOPOLOGY),
            "topology": ("topology", path),
            "plan": ("validate", MODEL, TOPOLOGY, path),
        }[role]
        if path.is_fifo():
            child = _persia(*args, timeout=30)  # in a child: reading a FIFO with no writer hung forever
            code, stderr = child.returncode, child.stderr
        else:
            result = run(*args)
            code, stderr = result.exit_code, result.stderr
        assert code == 2, (what, stderr)
        _one_error_line(stderr, path.name, what.strip())


def _example_plan_dict() -> dict:
    return plan(load_model(MODEL), load_topology(TOPOLOGY), seed=0).to_dict()


def _with_copied_shards(tmp_path: Path, copies: int) -> tuple[str, Path]:
    data = _example_plan_dict()
    name, table = next(iter(data["tables"].items()))
    table["shards"] = table["shards"][:1] * copies
    bad = tmp_path / "dup_shards.json"
    bad.write_text(json.dumps(data))
    return name, bad


@pytest.mark.processes
def test_validate_200k_duplicate_shards_are_refused_in_one_line(tmp_path):
    name, bad = _with_copied_shards(tmp_path, 200_000)
    result = _persia("validate", MODEL, TOPOLOGY, bad)
    assert result.returncode == 2, result.stderr[:500]
    line = _one_error_line(result.stderr, "dup_shards.json", f"tables.{name}.shards")  # was a 1.6 MB line
    assert line.endswith("has 200,000 items, more than 100,000; fix: give at most 100,000")


def test_validate_20k_duplicate_shards_gives_a_short_answer(tmp_path):
    _, bad = _with_copied_shards(tmp_path, 20_000)
    result = run("validate", MODEL, TOPOLOGY, bad)
    assert result.exit_code == 1, result.output[:500]
    _one_error_line(result.stderr, "invalid plan")
    assert len(result.stdout) < 10_000


def test_validate_hash_bucket_count_of_1e18_is_answered_at_once(tmp_path):
    data = _example_plan_dict()
    name, table = next((n, t) for n, t in data["tables"].items() if t["sharding"] == "ps_hash")
    table["shards"][0]["hash"] = [0, 10**18]
    bad = tmp_path / "many_buckets.json"
    bad.write_text(json.dumps(data))
    result = run("validate", MODEL, TOPOLOGY, bad)
    assert result.exit_code == 1, result.output
    _one_error_line(result.stderr, name, "hash buckets")


def test_huge_yaml_nesting_is_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("batch_size: 1\ntables: " + "[" * 100_000 + "]" * 100_000 + "\n")
    result = run("plan", deep, TOPOLOGY)
    assert result.exit_code == 2, result.output
    _one_error_line(result.stderr, "deep.yaml", "nested too deeply")


def test_plan_out_writes_through_a_symlink(tmp_path):
    target = tmp_path / "plans" / "plan.json"
    target.parent.mkdir()
    assert run("plan", "--out", target).exit_code == 0
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    result = run("plan", "--json", "--out", link, "--seed", 1, "--overwrite")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert json.loads(target.read_text()) == json.loads(result.stdout)
    assert sorted(p.name for p in target.parent.iterdir()) == ["plan.json"]  # no temporary file left


@pytest.mark.processes
def test_plan_out_refuses_a_path_that_is_not_a_regular_file(tmp_path):
    import os

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "out.json"
    link.symlink_to(fifo)
    for out, problem in ((fifo, "is not a regular file"), (link, "is not a regular file"), (tmp_path, "is a folder")):
        result = _persia("plan", "--out", out, "--overwrite", timeout=60)
        assert result.returncode == 2, result.stderr
        _one_error_line(result.stderr, f"--out {out} {problem}")
    assert fifo.is_fifo() and link.is_symlink()  # neither replaced by the rename


def test_plan_and_train_define_the_run_options_once_and_read_dtypes_in_either_vocabulary():
    import typer.main

    from persia_planner.cli import run_options

    commands = {c.name: typer.main.get_command(app).commands[c.name] for c in app.registered_commands if c.name}
    for flag in ("--staleness", "--ps-wire", "--model", "--topology"):
        helps = {name: next(p.help for p in commands[name].params if flag in p.opts) for name in ("plan", "train")}
        assert helps["plan"] == helps["train"], flag
    assert "--qcomms" in [o for p in commands["plan"].params for o in p.opts]
    assert sorted(run_options.__all__) == [
        "ModelOption", "PsWireOption", "QCommsOption", "StalenessOption", "TopologyOption"
    ]  # fmt: skip
    plans = [CliRunner().invoke(app, ["plan", "--ps-wire", wire, "--json"]) for wire in ("fp16", "float16")]
    assert [p.exit_code for p in plans] == [0, 0] and plans[0].stdout == plans[1].stdout
    assert json.loads(plans[0].stdout)["ps_wire_dtype"] == "fp16"


def test_plan_takes_the_model_and_topology_as_train_does_or_as_arguments_but_each_once():
    model, topology = str(EXAMPLES / "dlrm_small.yaml"), str(EXAMPLES / "local_2x1.yaml")
    by_argument = CliRunner().invoke(app, ["plan", model, topology, "--json"])
    by_option = CliRunner().invoke(app, ["plan", "--model", model, "--topology", topology, "--json"])
    mixed = CliRunner().invoke(app, ["plan", model, "--topology", topology, "--json"])
    assert [r.exit_code for r in (by_argument, by_option, mixed)] == [0, 0, 0]
    assert by_argument.stdout == by_option.stdout == mixed.stdout
    assert json.loads(by_option.stdout)["model"] == "dlrm-small"
    twice = CliRunner().invoke(app, ["plan", model, topology, "--model", model])
    assert (twice.exit_code, twice.stderr) == (2, "error: MODEL and --model both given; fix: give the file once\n")
