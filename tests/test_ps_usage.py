"""Per-server usage of a training run: the reduction of the servers' metrics and memory (no processes), and a run
whose PS tables receive more distinct ids than the servers hold, so they evict while training."""

from __future__ import annotations

from pathlib import Path

import pytest

from persia_planner.kinds import Sharding
from persia_planner.model.specs import ModelSpec, TableSpec
from persia_planner.modules.tools.memory_audit import cpu_topology, placed
from persia_planner.modules.train.ps_usage import WARM_UP_TABLE, planned_server_bytes, server_usage, usage_table


def _table(rows: int, capacity: int, lookups: int, misses: int, inserts: int, evictions: int) -> dict[str, int]:
    return {
        "rows": rows,
        "capacity": capacity,
        "lookups": lookups,
        "misses": misses,
        "inserts": inserts,
        "not_admitted": 0,
        "evictions": evictions,
        "updates": 0,
    }


def test_usage_sums_a_servers_tables_without_the_warm_up_and_subtracts_the_baseline():
    metrics = [
        {
            "name": "ps0",
            "tables": {
                "a": _table(90, 100, 1_000, 300, 300, 210),
                "b": _table(10, 50, 100, 10, 10, 0),
                WARM_UP_TABLE: _table(64, 256, 128, 64, 64, 0),
            },
        }
    ]
    before = [{"resident_bytes": 1_000_000, "store_bytes": 4_000}]
    after = [{"resident_bytes": 1_500_000, "store_bytes": 54_000}]
    (usage,) = server_usage(metrics, before, after, {"ps0": 400_000})
    assert (usage.lookups, usage.hits, usage.misses) == (1_100, 790, 310)
    assert (usage.admissions, usage.evictions, usage.rows, usage.capacity) == (310, 210, 100, 150)
    assert usage.admissions - usage.evictions == usage.rows
    assert (usage.store_bytes, usage.rss_growth_bytes, usage.planned_bytes) == (50_000, 500_000, 400_000)
    assert usage.to_dict()["rss_over_planned"] == 1.25
    header, rows = usage_table([usage.to_dict()])
    assert len(rows) == 1 and len(rows[0]) == len(header)
    assert dict(zip(header, rows[0], strict=True)) == {
        "server": "ps0",
        "hit rate": "71.8%",
        "admissions": "310",
        "evictions": "210",
        "rows / capacity": "100 / 150",
        "store": "48.8 KiB",
        "RSS growth": "488.3 KiB",
        "planned": "390.6 KiB",
    }


def _case() -> tuple[ModelSpec, dict, object]:
    """Two trainers, two servers; one PS table of 2,048 rows (a store of 2,304 rows per server) and a local one."""
    spec = ModelSpec("pressure", 1024, (TableSpec("ids", 2_048, 8), TableSpec("small", 100, 8)))
    c = placed(
        "pressure",
        spec,
        cpu_topology(2, 2),
        {"ids": (Sharding.PS_HASH, ()), "small": (Sharding.TABLE_WISE, (0,))},
    )
    return c.spec, c.tables, c.topology


def test_the_plan_charges_each_server_its_share():
    spec, tables, topology = _case()
    planned = planned_server_bytes(spec, tables, topology)
    assert set(planned) == {"ps0", "ps1"} and planned["ps0"] == planned["ps1"] > 0


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_run_drawing_ids_from_beyond_the_servers_capacity_evicts_while_training(tmp_path):
    from persia_planner.modules.ps.table_checkpoints import load_rows
    from persia_planner.modules.train import TrainConfig, train_local

    spec, tables, topology = _case()
    # 64x the rows: ~10,000 distinct ids in 20 steps of 1,024 samples, against 2 x 1,216 rows of capacity
    # (1,024 + 4 sqrt(1,024) + 64 each).
    cfg = TrainConfig(
        steps=20,
        batch_size=512,
        eval_batches=1,
        teacher_rows_scale=64,
        progress=False,
        checkpoint=str(tmp_path / "ckpt"),
    )
    result = train_local(cfg, spec, dict(tables), servers=2, topology=topology, run_timeout_s=240)
    # The servers' warm-up table was dropped before the run: the checkpoint holds the run's table only.
    rows, _ = load_rows(Path(result["checkpoint"]) / "ps", server=0, n_servers=1)
    assert set(rows) == {"ids"} and len(rows["ids"]["ids"]) == sum(s["rows"] for s in result["ps_servers"])
    servers = result["ps_servers"]
    assert [s["name"] for s in servers] == ["ps0", "ps1"] and result["id_space"] == 64
    for s in servers:
        assert s["evictions"] > 0, s
        assert s["admissions"] - s["evictions"] == s["rows"], s  # nothing was loaded: every row was admitted
        assert s["capacity"] == 1_216 and 0.9 * s["capacity"] <= s["rows"] <= s["capacity"], s
        assert s["hits"] + s["misses"] == s["lookups"] and s["hits"] > 0, s
        assert s["store_bytes"] > 0 and s["rss_growth_bytes"] > 0 and s["planned_bytes"] > 0, s
