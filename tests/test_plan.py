import dataclasses
import json

import pytest

from persia_planner import CostModel, ModelSpec, SpecError, Topology, load_plan, plan, validate
from persia_planner.bound import lower_bound
from persia_planner.errors import PlannerError
from persia_planner.kinds import Sharding
from persia_planner.model.specs import DType
from persia_planner.placement.memory import ps_server_capacity
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.plan import Plan
from persia_planner.plan.validation import require_plan_agrees
from persia_planner.report import bound_line
from persia_planner.tiers import Tier

MODEL = ModelSpec.from_dict(
    {
        "name": "m",
        "batch_size": 8192,
        "tables": [
            {"name": "big", "rows": 3_000_000_000, "dim": 64, "zipf_alpha": 1.1},
            {"name": "mid", "rows": 20_000_000, "dim": 128, "pooling_factor": 10},
            {"name": "small", "rows": 500, "dim": 16},
        ],
        "dense": {"parameters": 1_000_000, "flops_per_sample": 1e7},
    }
)
TOPO = Topology.from_dict(
    {
        "name": "t",
        "hosts": [
            {
                "name": "trainer",
                "count": 2,
                "ddr": "256GiB",
                "ddr_bandwidth": "100GB/s",
                "nic_bandwidth": "25GB/s",
                "gpus": {
                    "count": 2,
                    "hbm": "16GiB",
                    "hbm_bandwidth": "900GB/s",
                    "tflops": 100,
                    "pcie_bandwidth": "32GB/s",
                },
            },
            {
                "name": "ps",
                "count": 2,
                "role": "parameter_server",
                "ddr": "2TiB",
                "ddr_bandwidth": "100GB/s",
                "nic_bandwidth": "25GB/s",
            },
        ],
    }
)


@pytest.fixture(scope="module")
def the_plan():
    return plan(MODEL, TOPO, improve_time_s=1.0)


def test_json_has_the_contract_keys(the_plan):
    data = json.loads(the_plan.to_json())
    assert data["format"] == "persia-plan/1"
    assert (data["model"], data["topology"]) == ("m", "t")
    assert set(data["estimate"]) == {"step_ms", "lower_bound_ms", "samples_per_s", "lower_bound"}
    assert set(data["tables"]) == {"big", "mid", "small"}
    big = data["tables"]["big"]
    assert big["sharding"] == "ps_hash" and big["mode"] == "async"
    assert [s["hash"] for s in big["shards"]] == [[0, 2], [1, 2]]
    assert {s["device"] for s in big["shards"]} == {"ps0", "ps1"}
    assert sum(s["bytes"] for s in big["shards"]) == 3_000_000_000 * (64 * 4 + 4)
    # what the runtime needs and used to recompute: the rows' dtype, each server's store (its capacity in rows)
    assert big["dtype"] == "fp32" and {s["store_rows"] for s in big["shards"]} == {ps_server_capacity(3_000_000_000, 2)}
    keys = {
        "rows",
        "hash",
        "cols",
        "tier",
        "device",
        "bytes",
        "cache_fraction",
        "replica",
        "store_rows",
        "backing_rows",
    }
    for name, table in data["tables"].items():
        assert set(table) == {"sharding", "mode", "dtype", "shards"}, name
        for shard in table["shards"]:
            assert set(shard) <= keys, name
    gpu = data["devices"]["trainer0/gpu0"]
    assert set(gpu) == {"hbm_bytes", "ddr_bytes", "cost_ms"}
    assert data["estimate"]["lower_bound_ms"] <= data["estimate"]["step_ms"]


def test_save_and_load_round_trip(the_plan, tmp_path):
    path = tmp_path / "plan.json"
    the_plan.save(path)
    again = load_plan(path)
    assert again.tables == the_plan.tables
    assert again.step_ms == pytest.approx(the_plan.step_ms, abs=1e-4)
    assert again.bound_parts == pytest.approx(the_plan.bound_parts, abs=1e-4)
    assert again.bound_binding == the_plan.bound_binding
    assert not list(tmp_path.glob(".*.tmp"))
    assert validate(again, MODEL, TOPO) == []


def test_the_plan_says_what_its_bound_is_made_of(the_plan):
    bound = lower_bound(CostModel(the_plan.priced_model(MODEL), TOPO))
    assert the_plan.bound_parts == {part.name: part.weight for part in bound.parts}
    assert sum(the_plan.bound_parts.values()) == pytest.approx(1.0)
    assert all(w > 0 for w in the_plan.bound_parts.values())
    line = bound_line(the_plan)
    assert line.startswith(f"lower bound {the_plan.lower_bound_ms:.2f} ms = ")
    assert all(name in line for name in the_plan.bound_parts)


def _replace_table(p: Plan, name: str, placement: TablePlacement) -> Plan:
    return dataclasses.replace(p, tables={**p.tables, name: placement})


def test_validate_finds_a_missing_table(the_plan):
    broken = dataclasses.replace(the_plan, tables={k: v for k, v in the_plan.tables.items() if k != "mid"})
    assert validate(broken, MODEL, TOPO) == ["table 'mid' is not placed"]


def test_validate_finds_gaps_and_overlaps(the_plan):
    mid = the_plan.tables["mid"]
    first = mid.shards[0]
    cut = dataclasses.replace(
        first,
        rows=(0, first.rows[1] - 1),
        bytes=first.bytes - MODEL.table("mid").row_bytes(MODEL.embedding_dtype, first.n_cols),
    )
    problems = validate(
        _replace_table(the_plan, "mid", dataclasses.replace(mid, shards=(cut, *mid.shards[1:]))), MODEL, TOPO
    )
    assert problems and all(p.startswith("table 'mid': ") for p in problems)
    assert any(p.startswith("table 'mid': rows of cols") for p in problems)
    doubled = TablePlacement(mid.sharding, (*mid.shards, mid.shards[0]))
    problems = validate(_replace_table(the_plan, "mid", doubled), MODEL, TOPO)
    assert any("twice" in p for p in problems) or any("table_wise has exactly one shard" in p for p in problems)


def test_validate_finds_capacity_and_device_errors(the_plan):
    name = next(n for n, p in the_plan.tables.items() if p.tier is not Tier.PS)
    small = the_plan.tables[name]
    # A table-wise HBM shard of 'big' would need ~780 GB on one 16 GiB GPU.
    rows = MODEL.table("big").rows
    from persia_planner.placement.shards import Shard

    huge = TablePlacement(Sharding.TABLE_WISE, (Shard("trainer0/gpu0", Tier.HBM, (0, 64), rows * 260, rows=(0, rows)),))
    problems = validate(_replace_table(the_plan, "big", huge), MODEL, TOPO)
    assert any(p.startswith("trainer0/gpu0 HBM holds") and "short by" in p for p in problems)
    wrong = TablePlacement(small.sharding, tuple(dataclasses.replace(s, device="ps0") for s in small.shards))
    problems = validate(_replace_table(the_plan, name, wrong), MODEL, TOPO)
    assert any("'ps0' is not a GPU" in p for p in problems)
    nowhere = TablePlacement(small.sharding, tuple(dataclasses.replace(s, device="nosuch") for s in small.shards))
    problems = validate(_replace_table(the_plan, name, nowhere), MODEL, TOPO)
    assert any(
        "'nosuch' is not a device of topology 't' (its GPUs: trainer0/gpu0, trainer0/gpu1, trainer1/gpu0, "
        "trainer1/gpu1)" in p
        for p in problems
    ), problems
    bad_bytes = TablePlacement(small.sharding, tuple(dataclasses.replace(s, bytes=s.bytes + 1) for s in small.shards))
    assert any("bytes" in p for p in validate(_replace_table(the_plan, name, bad_bytes), MODEL, TOPO))


def test_plan_json_errors(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"format": "persia-plan/0", "tables": {}}')
    with pytest.raises(SpecError, match=r"p\.json: format: expected 'persia-plan/1', got 'persia-plan/0'"):
        load_plan(path)
    path.write_text("{not json")
    with pytest.raises(SpecError, match=r"p\.json: malformed JSON at line 1"):
        load_plan(path)


def test_plan_json_replica_must_be_a_boolean(the_plan, tmp_path):
    """``"replica": "no"`` is a typo, not a replica: refused with the field's path instead of read as true."""
    data = json.loads(the_plan.to_json())
    name = next(n for n, t in data["tables"].items() if t["shards"])
    data["tables"][name]["shards"][0]["replica"] = "no"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"p\.json: .*replica: expected true or false, got 'no'"):
        load_plan(path)
    data["tables"][name]["shards"][0]["replica"] = False
    path.write_text(json.dumps(data))
    assert not load_plan(path).tables[name].shards[0].replica


def test_validate_reports_ps_hash_shards_on_a_gpu(the_plan):
    big = the_plan.tables["big"]
    on_gpus = TablePlacement(
        Sharding.PS_HASH,
        tuple(dataclasses.replace(s, tier=Tier.HBM, device=f"trainer0/gpu{i}") for i, s in enumerate(big.shards)),
    )
    assert validate(_replace_table(the_plan, "big", on_gpus), MODEL, TOPO) == [
        "table 'big': shard 0 is on tier hbm but ps_hash shards must be on tier ps",
        "table 'big': shard 1 is on tier hbm but ps_hash shards must be on tier ps",
    ]


def test_validate_refuses_a_ps_hash_shard_that_also_gives_rows(the_plan):
    # Its size would be read from the range: a 1-row range made a 6.3 GiB table pass as 68 bytes a server.
    big = the_plan.tables["big"]
    both = dataclasses.replace(big, shards=(dataclasses.replace(big.shards[0], rows=(0, 1)), *big.shards[1:]))
    assert validate(_replace_table(the_plan, "big", both), MODEL, TOPO) == [
        "table 'big': shard 0 has both 'rows' and 'hash' (a range shard gives rows, a ps_hash shard hash)"
    ]


def test_load_plan_unreadable_files(tmp_path):
    with pytest.raises(SpecError) as err:
        load_plan(tmp_path)
    assert (
        str(err.value) == f"{tmp_path.name}: is a directory, not a regular file; fix: give the path of a regular file"
    )
    path = tmp_path / "p.json"
    path.write_bytes(b'{"format": "persia-plan/1", \xff}')
    with pytest.raises(SpecError) as err:
        load_plan(path)
    assert str(err.value) == "p.json: not UTF-8 text (byte 0xff at offset 28); fix: save it as UTF-8"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match=r"^p\.json: JSON nested too deeply to read; fix: "):
        load_plan(path)


def test_saving_a_plan_onto_a_directory_leaves_no_temporary_file(tmp_path):
    from persia_planner.errors import PlannerError

    plan_ = Plan("m", "t", {}, {}, 0.0, 0.0, 0.0)
    (tmp_path / "out").mkdir()
    with pytest.raises(PlannerError, match="it exists and is not a regular file"):
        plan_.save(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    plan_.save(tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").tables == {}


def test_plan_matches_model_check():
    from persia_planner.errors import ErrorKind, PlannerError
    from persia_planner.plan.validation import require_same_tables, table_mismatch

    assert table_mismatch({"b": 1, "z": 2, "y": 3}, ["a", "b", "c"]) == (["a", "c"], ["y", "z"])
    assert table_mismatch(["a", "b"], ["b", "a"]) == ([], [])
    require_same_tables(["a", "b"], ["b", "a"])
    with pytest.raises(PlannerError, match=r"no placement for tables \['c'\]") as err:
        require_same_tables(["a", "b"], ["a", "b", "c"])
    assert err.value.kind is ErrorKind.INVALID_PLAN
    with pytest.raises(PlannerError, match=r"places tables \['x'\] that are not in the collection"):
        require_same_tables(["a", "x"], ["a"], holder="the collection")


def test_the_plan_records_the_staleness_and_wire_it_was_priced_for(the_plan, tmp_path):
    data = json.loads(the_plan.to_json())
    assert (data["staleness"], data["ps_wire_dtype"]) == (MODEL.staleness, "fp32") == (4, "fp32")
    fp16_k0 = plan(dataclasses.replace(MODEL, staleness=0, ps_wire_dtype=DType.FP16), TOPO, improve_time_s=0.5)
    path = tmp_path / "plan.json"
    fp16_k0.save(path)
    again = load_plan(path)
    assert (again.staleness, again.ps_wire_dtype) == (0, DType.FP16)
    # A plan of an older writer or another planner records neither, and reads as unknown.
    del data["staleness"], data["ps_wire_dtype"]
    older = Plan.from_dict(data)
    assert (older.staleness, older.ps_wire_dtype) == (None, None)


def test_a_run_with_another_staleness_or_wire_than_its_plan_is_refused(the_plan):
    assert "big" in the_plan.remote_tables()
    require_plan_agrees(the_plan, MODEL)  # the run trains as planned
    with pytest.raises(PlannerError) as err:
        require_plan_agrees(the_plan, dataclasses.replace(MODEL, staleness=0), "p.json")
    assert str(err.value) == (
        "p.json was priced for staleness K = 4, but this run trains its parameter-server tables with K = 0; "
        "fix: re-plan with 'persia plan --staleness 0' or train with --staleness 4 --mode hybrid"
    )
    with pytest.raises(PlannerError, match=r"priced for parameter-server traffic in float32, but this run sends "):
        require_plan_agrees(the_plan, dataclasses.replace(MODEL, ps_wire_dtype=DType.BF16))
    # Neither matters to a plan without parameter-server tables, nor to one that does not record them.
    remote = set(the_plan.remote_tables())
    local = dataclasses.replace(the_plan, tables={k: v for k, v in the_plan.tables.items() if k not in remote})
    require_plan_agrees(local, dataclasses.replace(MODEL, staleness=0, ps_wire_dtype=DType.BF16))
    unknown = dataclasses.replace(the_plan, staleness=None, ps_wire_dtype=None)
    require_plan_agrees(unknown, dataclasses.replace(MODEL, staleness=0, ps_wire_dtype=DType.BF16))


def test_ps_traffic_is_priced_in_the_wire_dtype():
    fp16_wire = dataclasses.replace(MODEL, ps_wire_dtype=DType.FP16)
    big = MODEL.table("big")
    exact, halved = CostModel(MODEL, TOPO), CostModel(fp16_wire, TOPO)
    rows = exact.unique_rows(big, exact.local_batch)
    id_bytes = TOPO.constants.id_bytes
    assert exact.ps_bytes_per_gpu(big) == pytest.approx(rows * (64 * 4 + 2 * id_bytes))
    assert halved.ps_bytes_per_gpu(big) == pytest.approx(rows * (64 * 2 + 2 * id_bytes))
    # The stores keep what they keep whatever the wire: their bytes moved do not change.
    assert halved.ps_moved_bytes(big) == exact.ps_moved_bytes(big)
    assert plan(fp16_wire, TOPO, improve_time_s=0.5).step_ms <= plan(MODEL, TOPO, improve_time_s=0.5).step_ms


def test_each_table_is_planned_and_validated_in_its_own_dtype():
    mixed = ModelSpec.from_dict(
        {
            "batch_size": 8192,
            "tables": [
                {"name": "half", "rows": 2_000_000, "dim": 64, "embedding_dtype": "fp16"},
                {"name": "full", "rows": 2_000_000, "dim": 64},
            ],
        }
    )
    placed = plan(mixed, TOPO, improve_time_s=0.5)
    assert validate(placed, mixed, TOPO) == []
    for name, value_bytes in (("half", 2), ("full", 4)):
        for s in placed.tables[name].shards:  # rowwise_adagrad keeps one float32 per row in every column shard
            assert s.bytes == s.n_rows(mixed.table(name)) * (s.n_cols * value_bytes + 4), (name, s)
    # The same plan for a model that now keeps "half" in fp32: told why, once; a plan.json written before dtypes were
    # recorded still shows the shards' wrong bytes.
    as_fp32 = dataclasses.replace(
        mixed, tables=tuple(dataclasses.replace(t, embedding_dtype=None) for t in mixed.tables)
    )
    assert validate(placed, as_fp32, TOPO) == [
        "table 'half': was planned with fp16 rows, and the model keeps it in fp32 (its dtype or embedding_dtype "
        "changed since): plan again"
    ]
    unrecorded = {n: dataclasses.replace(p, dtype=None) for n, p in placed.tables.items()}
    assert any(
        "bytes" in problem for problem in validate(dataclasses.replace(placed, tables=unrecorded), as_fp32, TOPO)
    )


def test_a_placement_written_before_dtype_and_store_rows_were_recorded_is_the_same_placement(the_plan):
    big = the_plan.tables["big"]
    old = dataclasses.replace(
        big, dtype=None, shards=tuple(dataclasses.replace(s, store_rows=None) for s in big.shards)
    )
    assert old != big and old.same_as(big) and big.same_as(old)
    moved = dataclasses.replace(big, shards=tuple(dataclasses.replace(s, device="ps9") for s in old.shards))
    assert not moved.same_as(big)
    other_dtype = dataclasses.replace(big, dtype=DType.FP16)
    assert not other_dtype.same_as(big) and other_dtype.same_as(old)
