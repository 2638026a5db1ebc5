"""The ``ssd`` tier end to end: with the servers' DDR short the planner puts a table's rows on their disks, ``persia
train`` runs that plan with real files behind DDR caches, and a crash's ``--resume`` loses none of those rows."""

from __future__ import annotations

import shutil

import pytest
import yaml

from persia_planner import ModelSpec, Topology, load_model, plan
from persia_planner.errors import ConstraintError
from persia_planner.modules.train import TrainConfig, train_local
from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY
from persia_planner.tiers import Tier

SPEC = load_model(DEFAULT_MODEL)


def topology(ps_ddr: str, ssd: str | None = "1GiB") -> Topology:
    """The bundled local cluster (two CPU trainers, two servers) with servers of ``ps_ddr`` DDR and ``ssd`` disks."""
    data = yaml.safe_load(DEFAULT_TOPOLOGY.read_text())
    server = next(h for h in data["hosts"] if h.get("role") == "parameter_server")
    server["ddr"] = ps_ddr
    if ssd is not None:
        server["ssd"] = {"size": ssd, "read_iops": 20_000, "write_iops": 20_000}
    return Topology.from_dict(data, base_dir=DEFAULT_TOPOLOGY.parent)


def test_with_the_servers_ddr_short_the_plan_puts_rows_on_their_disks():
    roomy = plan(SPEC, topology("2GiB"))
    assert {p.tier for p in roomy.tables.values() if not p.tier.spec.local} == {Tier.PS}  # DDR first: it is faster
    short = plan(SPEC, topology("24MiB"))
    on_disk = sorted(name for name, p in short.tables.items() if p.tier is Tier.SSD)
    assert on_disk, "no table went to the ssd tier"
    for name in on_disk:
        shards = short.tables[name].shards
        assert {s.device for s in shards} == {"ps0", "ps1"} and 0 < shards[0].cache_fraction < 1
    assert all(short.devices[s].bytes_of("disk_bytes") > 0 for s in ("ps0", "ps1"))
    with pytest.raises(Exception, match="DDR"):  # without disks the same servers cannot hold the model
        plan(SPEC, topology("24MiB", ssd=None))


def _ssd_only(tiers: list[str]) -> ModelSpec:
    data = yaml.safe_load(DEFAULT_MODEL.read_text())
    next(t for t in data["tables"] if t["name"] == "c20")["constraints"] = {"tiers": tiers}
    return ModelSpec.from_dict(data)


def test_a_table_held_to_the_ssd_tier_on_servers_without_disks_is_told_to_add_them():
    prefix = "table 'c20': no placement keeps its constraints (tiers [ssd]): the ssd tier keeps a table's rows on "
    fix = "; fix: add 'ssd: SIZE' (e.g. ssd: 2TiB) to the topology's parameter-server hosts or allow tier ps"
    with pytest.raises(ConstraintError) as none:
        plan(_ssd_only(["ssd"]), topology("2GiB", ssd=None))
    assert str(none.value) == (
        f"{prefix}every parameter server's disk, and no parameter server of topology 'local-2trainers-2ps' has an "
        f"ssd: disk{fix}"
    )
    data = yaml.safe_load(DEFAULT_TOPOLOGY.read_text())
    server = next(h for h in data["hosts"] if h.get("role") == "parameter_server")
    data["hosts"].append({**server, "name": "disk", "count": 1, "ssd": "1GiB"})
    with pytest.raises(ConstraintError) as some:
        plan(_ssd_only(["ssd"]), Topology.from_dict(data, base_dir=DEFAULT_TOPOLOGY.parent))
    assert str(some.value) == (
        f"{prefix}every parameter server's disk, and ps0 and 1 more of the 3 parameter servers have no ssd: disk{fix}"
    )
    assert plan(_ssd_only(["ssd", "ps"]), topology("2GiB", ssd=None)).tables["c20"].tier is Tier.PS


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_a_plan_on_the_ssd_tier_trains_and_resumes_exactly_after_a_crash(tmp_path):
    # c20 on disk behind a cache of 0.5% of its rows (250 a server): six small steps miss and evict.
    data = yaml.safe_load(DEFAULT_MODEL.read_text())
    next(t for t in data["tables"] if t["name"] == "c20")["constraints"] = {"tiers": ["ssd"], "cache_fraction": 0.005}
    spec = ModelSpec.from_dict(data)
    topo = topology("24MiB")
    tables = dict(plan(spec, topo).tables)
    assert tables["c20"].tier is Tier.SSD

    def run(**options) -> dict:
        # K = 0: reproducible, so "exactly" is a fair demand; every id of the tables is drawn (--id-space 1), so the
        # servers' DDR caches miss and evict to their disks.
        cfg = TrainConfig(
            progress=False, eval_batches=2, batch_size=256, mode="sync", trainers=2, teacher_rows_scale=1.0,
            ssd_dir=str(tmp_path / "disks"), **options,
        )  # fmt: skip
        return train_local(cfg, spec, tables, servers=2, topology=topo)

    # Files of the user's that look like the servers' files: a run leaves them as they are.
    (tmp_path / "disks").mkdir()
    theirs = {"c20.ps0.backup.rows": b"backup" * 1000, "c20.ps1.old.rows": b"old", "c20.ps0.123.rows": bytes(9000)}
    for name, data in theirs.items():
        (tmp_path / "disks" / name).write_bytes(data)
    whole = run(steps=6, checkpoint=str(tmp_path / "whole"), checkpoint_every=3, keep=3)
    servers = whole["ps_servers"]
    assert all(s["disk_reads"] > 0 and s["disk_writes"] > 0 for s in servers), servers
    # The job killed after step 4: its directory holds the checkpoint of step 3, the servers' files are gone.
    shutil.copytree(tmp_path / "whole" / "step-000000003", tmp_path / "step-000000003")
    rest = run(steps=6, checkpoint=str(tmp_path), resume=True)
    assert rest["first_step"] == 3 and rest["last_step"] == 6
    assert [h["loss"] for h in rest["history"]] == [h["loss"] for h in whole["history"][3:]]  # bit-exact
    assert rest["auc"] == whole["auc"]
    # each server removed its files when its run ended, and only those
    assert {p.name: p.read_bytes() for p in (tmp_path / "disks").iterdir()} == theirs
