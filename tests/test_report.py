"""Reports: explanations, the per-device / per-table data, the summary line, and the topology picture."""

from __future__ import annotations

import io

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.collections import PathCollection
from rich.console import Console

from persia_planner import ModelSpec, Topology, load_model, load_topology, plan
from persia_planner.paths import EXAMPLES
from persia_planner.report import (
    abbreviate,
    describe,
    device_rows,
    draw_topology,
    explain,
    explanations,
    print_plan,
    render_devices,
    render_tables,
    summary,
    table_rows,
    topology_lines,
)


@pytest.fixture(scope="module")
def example():
    model = load_model(EXAMPLES / "dlrm_criteo.yaml")
    topology = load_topology(EXAMPLES / "cluster_2x4_2ps.yaml")
    return model, topology, plan(model, topology, seed=0)


@pytest.fixture(scope="module")
def only_ps_fits():
    """A 45 GiB table next to 2.7 GiB of HBM and DDR: only the parameter servers can hold it."""
    model = ModelSpec.from_dict(
        {
            "name": "one-huge",
            "batch_size": 4096,
            "tables": [{"name": "huge", "rows": 200_000_000, "dim": 60}, {"name": "small", "rows": 1000, "dim": 16}],
        }
    )
    topology = Topology.simple(
        trainers=1, gpus_per_trainer=2, servers=2, hbm_bytes=1024**3, ddr_bytes=1024**3, ps_ddr_bytes=1024**4
    )
    return model, topology, plan(model, topology, seed=0)


def _node_collections(fig) -> dict[str, int]:
    ax = fig.axes[0]
    return {c.get_label(): len(c.get_offsets()) for c in ax.collections if isinstance(c, PathCollection)}


# ---- explain --------------------------------------------------------------------------------------------------------
def test_explain_names_each_large_table_and_its_next_best_option(example):
    model, topology, p = example
    lines = explain(p, model, topology)
    assert len(lines) == len(p.alternatives) > 0
    for line, (name, alternatives) in zip(lines, p.alternatives.items(), strict=True):
        placement = p.tables[name]
        chosen = (placement.sharding, placement.tier)
        other = next(a for a in alternatives if (a.option.sharding, a.option.tier) != chosen)
        assert line.startswith(f"{name} (")
        assert f"-> {describe(placement)} ({placement.mode.value}):" in line
        own = [a for a in alternatives if (a.option.sharding, a.option.tier) == chosen]
        assert not own or own[0].option.describe() == describe(placement)
        assert f"next best is {other.option.describe()} at {other.step_ms:.2f} ms per step" in line
        delta = other.step_ms - p.step_ms
        assert f"({delta:+.2f} ms / {100 * delta / p.step_ms:+.1f}% vs {p.step_ms:.2f} ms)" in line


def test_explanation_numbers_are_consistent(example):
    model, topology, p = example
    for e in explanations(p, model, topology):
        assert e.step_ms == p.step_ms
        assert e.next_step_ms is not None and e.delta_ms is not None and e.delta_pct is not None
        assert e.delta_ms == pytest.approx(e.next_step_ms - p.step_ms)
        assert e.delta_pct == pytest.approx(100 * e.delta_ms / p.step_ms)
        assert e.bytes == model.table(e.table).bytes(model.embedding_dtype)
        assert e.mode == p.tables[e.table].mode.value


def test_explain_says_when_nothing_else_fits(only_ps_fits):
    model, topology, p = only_ps_fits
    assert p.remote_tables()[0] == "huge"
    line = next(line for line in explain(p, model, topology) if line.startswith("huge"))
    assert line == (
        "huge (45.4 GiB) -> ps_hash on ps (async): only the parameter servers can hold it (45.4 GiB is more than all "
        "usable GPU HBM and host DDR together, 2.7 GiB)"
    )


# ---- tables and summary ---------------------------------------------------------------------------------------------
def test_device_rows_use_the_usable_capacities(example):
    model, topology, p = example
    rows = {r.name: r for r in device_rows(p, topology)}
    assert list(rows) == list(p.devices)
    for gpu in topology.gpus:
        row = rows[gpu.name]
        assert row.kind == "GPU"
        assert row.hbm_usable == topology.hbm_capacity(gpu)
        assert row.hbm_bytes == p.devices[gpu.name].hbm_bytes
        assert 0 <= row.hbm_fraction <= 1
    for server in topology.servers:
        row = rows[server.name]
        assert row.kind == "PS" and row.hbm_usable is None
        assert row.ddr_usable == topology.ddr_capacity(server)
        # What the server's stores take for the shards there (not their bytes: the store keeps float32 rows,
        # records and an index).
        on_server = sum(
            s.storage(model.table(name), model.embedding_dtype).ddr_bytes
            for name, t in p.tables.items()
            for s in t.shards
            if s.device == server.name
        )
        assert row.ddr_bytes == on_server
    assert {r.kind for r in rows.values()} == {"GPU", "host", "PS"}


def test_table_rows_cover_every_table_and_shares_add_up(example):
    model, topology, p = example
    rows = table_rows(p, model, topology)
    assert [r.name for r in rows] == [t.name for t in model.tables]
    assert sum(r.share for r in rows) == pytest.approx(1.0)
    for row in rows:
        placement = p.tables[row.name]
        assert row.bytes == sum(s.bytes for s in placement.shards)
        assert row.shards == len(placement.shards)
        if row.mode == "async":
            assert row.tier == "ps" and row.sync_ms == 0 and row.async_ms > 0
        else:
            assert row.async_ms == 0 and row.sync_ms > 0


def test_summary_line(example):
    _, _, p = example
    line = summary(p)
    assert "\n" not in line
    assert line.startswith(f"step {p.step_ms:.2f} ms | lower bound {p.lower_bound_ms:.2f} ms | quality ")
    assert f"{p.samples_per_s:,.0f} samples/s" in line
    remote = p.remote_tables()
    assert f"{len(remote)} of {len(p.tables)} tables remote (PS, async): {remote[0]}" in line


def test_rich_tables_have_a_row_per_device_and_table(example):
    model, topology, p = example
    assert render_devices(p, topology).row_count == len(p.devices)
    assert render_tables(p, model, topology).row_count == len(model.tables)
    console = Console(width=160, record=True, file=io.StringIO())
    print_plan(p, model, topology, console, explain=True)
    text = console.export_text()
    assert "why the largest tables went where they did" in text
    assert summary(p) in text


def test_device_table_keeps_the_busiest_devices_and_a_line_for_the_rest(example, monkeypatch):
    _, topology, p = example
    rows = device_rows(p, topology)
    monkeypatch.setattr("persia_planner.report.render.DEVICE_ROWS", 4)
    table = render_devices(p, topology)
    assert table.row_count == 5
    busiest = sorted(rows, key=lambda r: -r.cost_ms)
    names = [str(cell) for cell in table.columns[0].cells]  # cells are Text: never read as markup
    assert set(names[:4]) == {r.name for r in busiest[:4]}
    assert names[4] == f"+{len(rows) - 4} more"
    assert str(list(table.columns[-1].cells)[4]) == f"<= {busiest[4].cost_ms:.2f}"


def test_abbreviate():
    topology = Topology.simple(trainers=2, gpus_per_trainer=2, servers=3)
    assert abbreviate(["trainer0/gpu0"], topology) == "trainer0/gpu0"
    assert abbreviate([g.name for g in topology.gpus], topology) == "all 4 GPUs"
    assert abbreviate(["ps2", "ps0", "ps1"], topology) == "all 3 PS"
    assert abbreviate(["a", "b", "c", "d", "e"]) == "a, b, +3 more (5)"


def test_topology_lines_without_parameter_servers():
    lines = topology_lines(Topology.simple(trainers=1, gpus_per_trainer=2))
    assert "parameter servers: none" in lines
    assert "switch bandwidth: unlimited" in lines


# ---- draw_topology --------------------------------------------------------------------------------------------------
def test_draw_topology_has_one_node_per_gpu_host_and_server(example):
    _, topology, _ = example
    fig = draw_topology(topology)
    assert _node_collections(fig) == {"GPU": 8, "trainer host": 2, "parameter server": 2, "switch": 1}
    assert len(fig.axes) == 1  # no colour bar without a plan


def test_draw_topology_with_a_plan_colours_by_memory_and_lists_tables(example):
    _, topology, p = example
    fig = draw_topology(topology, p)
    counts = _node_collections(fig)
    assert counts == {"GPU": len(topology.gpus), "trainer host": 2, "parameter server": 2, "switch": 1}
    assert len(fig.axes) == 2  # the plot and its colour bar
    gpus = next(c for c in fig.axes[0].collections if c.get_label() == "GPU")
    expected = [p.devices[g.name].hbm_bytes / topology.hbm_capacity(g) for g in topology.gpus]
    assert list(gpus.get_array()) == pytest.approx(expected)
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    on_ps = sorted(p.remote_tables(), key=lambda n: -sum(s.bytes for s in p.tables[n].shards))
    for name in on_ps[:3]:
        assert name in texts  # the largest tables are listed on the parameter servers
    biggest_local = max(
        (n for n, t in p.tables.items() if t.mode.value == "sync" and t.sharding.value != "data_parallel"),
        key=lambda n: sum(s.bytes for s in p.tables[n].shards),
    )
    assert biggest_local in texts


def test_draw_topology_into_given_axes_and_graph_form():
    from matplotlib.figure import Figure

    topology = Topology.from_dict(
        {
            "name": "graph-form",
            "nodes": [
                {"name": "sw", "kind": "switch"},
                {"name": "h0", "kind": "host", "ddr": "64GiB", "ddr_bandwidth": "100GB/s"},
                {"name": "h1", "kind": "host", "ddr": "64GiB", "ddr_bandwidth": "100GB/s"},
                {"name": "ps", "kind": "host", "role": "parameter_server", "ddr": "1TiB", "ddr_bandwidth": "50GB/s"},
                *(
                    {"name": f"g{i}", "kind": "gpu", "hbm": "16GiB", "hbm_bandwidth": "900GB/s", "tflops": 100}
                    for i in range(3)
                ),
            ],
            "links": [
                {"a": "g0", "b": "h0", "bandwidth": "32GB/s"},
                {"a": "g1", "b": "h0", "bandwidth": "32GB/s"},
                {"a": "g2", "b": "h1", "bandwidth": "32GB/s"},
                {"a": "h0", "b": "sw", "bandwidth": "25GB/s", "latency": "5us"},
                {"a": "h1", "b": "sw", "bandwidth": "25GB/s", "latency": "5us"},
                {"a": "ps", "b": "sw", "bandwidth": "25GB/s", "latency": "5us"},
            ],
        }
    )
    fig = Figure()
    ax = fig.add_subplot()
    assert draw_topology(topology, ax=ax) is fig
    assert _node_collections(fig) == {"GPU": 3, "trainer host": 2, "parameter server": 1, "switch": 1}


def test_draw_topology_of_the_100t_cluster_with_its_plan(tmp_path):
    model = load_model(EXAMPLES / "persia_100t.yaml")
    topology = load_topology(EXAMPLES / "persia_100t_cluster.yaml")
    # The paper's 30 servers of 12 TB (a store holds memory.PS_MAX_ROWS rows of a table: the id tables fit).
    fig = draw_topology(topology, plan(model, topology, seed=0))
    assert _node_collections(fig) == {"GPU": 64, "trainer host": 8, "parameter server": 30, "switch": 1}
    fig.savefig(tmp_path / "100t.png", dpi=40)
    assert (tmp_path / "100t.png").stat().st_size > 0
