"""The job's checkpoints: published whole, checked file by file, the newest whole one resumed, pruned by lineage;
no file of a checkpoint is unpickled beyond tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from persia_planner.errors import PlannerError
from persia_planner.modules.ps import EmbeddingStore, RowWiseAdagrad
from persia_planner.modules.ps.table_checkpoints import save_all
from persia_planner.modules.train.job_checkpoints import (
    MANIFEST,
    complete_checkpoints,
    new_lineage,
    newest_complete,
    prune,
    publish,
    staging_dir,
    verify,
)
from persia_planner.modules.train.run_directories import check_resume_exists
from persia_planner.modules.train.trainer_state import TRAINER_STATE, check_resume

WORLD = {"trainers": 2, "servers": 1}


def state(step: int) -> dict:
    return {"step": step, "ps_version": 1, "dense": {"w": torch.full((2, 2), float(step))}, "local": {},
            "local_optimizer": {}, "trainers": 2}  # fmt: skip


def checkpoint(root: Path, step: int, lineage: str, *, with_ps: bool = True):
    """A checkpoint as trainer 0 writes it: PS tables, trainer state and plan into staging, then published."""
    staging = staging_dir(root, step)
    if with_ps:
        store = EmbeddingStore(4, 10, RowWiseAdagrad())
        store.lookup(torch.arange(3))
        save_all([{"t": store}], staging / "ps", version=1)
    torch.save(state(step), staging / TRAINER_STATE)
    (staging / "plan.json").write_text("{}")
    return publish(staging, step=step, lineage=lineage, world=WORLD)


def test_published_checkpoint_names_every_file_with_size_and_checksum(tmp_path):
    ckpt = checkpoint(tmp_path, 4, "a")
    assert ckpt.path == tmp_path / "step-000000004" and ckpt.step == 4 and ckpt.world == WORLD
    manifest = json.loads((ckpt.path / MANIFEST).read_text())
    on_disk = sorted(p.relative_to(ckpt.path).as_posix() for p in ckpt.path.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [n for n in on_disk if n != MANIFEST]
    assert {"trainer.pt", "plan.json", "ps/LATEST"} <= set(manifest["files"])
    assert all(len(e["sha256"]) == 64 and e["bytes"] > 0 for e in manifest["files"].values())
    assert verify(ckpt.path) == ckpt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the staging directory became it


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_a_damaged_newest_checkpoint_is_named_in_one_line_and_the_older_one_resumed(tmp_path, damage):
    checkpoint(tmp_path, 2, "a")
    newest = checkpoint(tmp_path, 4, "a")
    victim = newest.path / ("ps/v00000001" if damage == "delete" else TRAINER_STATE)
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:50])
        needle = "trainer.pt: 50 bytes, its manifest recorded"
    elif damage == "flip":
        data = bytearray(victim.read_bytes())
        data[-30] ^= 1
        victim.write_bytes(bytes(data))
        needle = "trainer.pt: its bytes do not match the checksum its manifest recorded"
    elif damage == "delete":
        victim = next(victim.glob("*.pt"))
        victim.unlink()
        needle = f"{victim.name}: missing"
    else:
        (newest.path / MANIFEST).write_text("{not json")
        needle = "MANIFEST.json is not readable"
    skipped: list[str] = []
    found = newest_complete(tmp_path, on_skip=skipped.append)
    assert found.step == 2
    assert len(skipped) == 1 and "\n" not in skipped[0] and needle in skipped[0], skipped
    ckpt, loaded = check_resume(tmp_path, with_ps=True)
    assert ckpt.step == 2 and loaded["step"] == 2
    # With no whole checkpoint left, the newest one's problem is the error.
    (tmp_path / "step-000000002" / TRAINER_STATE).write_bytes(b"")
    with pytest.raises(PlannerError, match=rf"^--resume: no whole checkpoint in {tmp_path}; the newest: .*{needle}"):
        newest_complete(tmp_path)


def test_a_checkpoint_being_written_is_invisible_and_pruned_later(tmp_path):
    older = checkpoint(tmp_path, 2, "a")
    staging = staging_dir(tmp_path, 4)  # a crash while writing step 4: no manifest, never renamed
    torch.save(state(4), staging / TRAINER_STATE)
    assert newest_complete(tmp_path) == older
    assert check_resume_exists(tmp_path) == older.path
    newest = checkpoint(tmp_path, 6, "a")
    prune(tmp_path, newest, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002", "step-000000006"]


def test_prune_touches_only_this_runs_checkpoints_unless_it_replaces_the_others(tmp_path):
    old = new_lineage()
    for step in (2, 4, 6, 8):
        checkpoint(tmp_path, step, old, with_ps=False)
    run = new_lineage()
    newest = checkpoint(tmp_path, 10, run, with_ps=False)
    prune(tmp_path, newest, keep=2)  # another lineage's checkpoints are not this run's to prune
    assert [p.name for p in complete_checkpoints(tmp_path)] == [f"step-{step:09d}" for step in (10, 8, 6, 4, 2)]
    # --overwrite: a new run from scratch; its first checkpoint replaces the old run's of the same step, and its
    # prune the old run's others.
    newest = checkpoint(tmp_path, 4, run, with_ps=False)
    prune(tmp_path, newest, keep=2, replacing=True)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000000004"]
    # A resume that fell back to step 4 abandons what came after it in its own lineage too.
    for step in (6, 8):
        checkpoint(tmp_path, step, run, with_ps=False)
    (tmp_path / "step-000000008" / TRAINER_STATE).write_bytes(b"damaged")
    assert newest_complete(tmp_path).step == 6
    newest = checkpoint(tmp_path, 7, run, with_ps=False)
    prune(tmp_path, newest, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000000007", "step-000000006"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune(tmp_path, newest, keep=0)


def test_a_file_someone_put_into_a_checkpoint_survives_its_removal(tmp_path):
    run = new_lineage()
    first = checkpoint(tmp_path, 2, run)
    (first.path / "notes.txt").write_text("mine")
    (first.path / "ps" / "extra.bin").write_bytes(b"\x01")
    for step in (4, 6):
        newest = checkpoint(tmp_path, step, run)
    assert prune(tmp_path, newest, keep=2) == []  # step 2 could not go whole: it holds files that are not its own
    # What is left of it no longer has a checkpoint's name: nothing mistakes it for a damaged checkpoint.
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000000006", "step-000000004"]
    (rest,) = tmp_path.glob(".step-000000002.old-*")
    assert sorted(p.relative_to(rest).as_posix() for p in rest.rglob("*")) == ["notes.txt", "ps", "ps/extra.bin"]
    assert (rest / "notes.txt").read_text() == "mine"
    # A checkpoint replaced by one of the same step (a resume that went back) keeps them too.
    (newest.path / "mine.txt").write_text("x")
    replaced = checkpoint(tmp_path, 6, run)
    assert replaced.path == newest.path and not (replaced.path / "mine.txt").exists()
    (kept,) = tmp_path.glob(".step-000000006.old-*")
    assert [p.name for p in kept.iterdir()] == ["mine.txt"]
    prune(tmp_path, replaced, keep=2)
    assert kept.exists() and (kept / "mine.txt").read_text() == "x" and rest.exists()


def test_a_manifest_never_leads_the_removal_out_of_its_checkpoint(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "precious.csv").write_text("a")
    (mine / "data.csv").write_text("b")
    root = tmp_path / "ck"
    ckpt = checkpoint(root, 2, "a", with_ps=False)
    (ckpt.path / "sub").symlink_to(mine)
    manifest = json.loads((ckpt.path / MANIFEST).read_text())
    for name in (str(mine / "precious.csv"), "sub/data.csv", "../../mine/data.csv"):
        manifest["files"][name] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt.path / MANIFEST).write_text(json.dumps(manifest))
    newest = checkpoint(root, 4, "a", with_ps=False)
    prune(root, newest, keep=1)
    assert sorted(p.name for p in mine.iterdir()) == ["data.csv", "precious.csv"]
    assert [p.name for p in complete_checkpoints(root)] == ["step-000000004"]


def test_no_checkpoint_or_one_of_an_earlier_version_is_one_line(tmp_path):
    with pytest.raises(PlannerError, match=rf"^--resume: no checkpoint in {tmp_path} \(no step-\* directory\)"):
        check_resume_exists(tmp_path)
    torch.save(state(3), tmp_path / TRAINER_STATE)
    with pytest.raises(PlannerError, match="holds a checkpoint of an earlier version of persia train"):
        check_resume_exists(tmp_path)


def test_trainer_state_and_ps_tables_must_belong_together(tmp_path):
    ckpt = checkpoint(tmp_path, 3, "a")
    assert check_resume(tmp_path, with_ps=False)[1]["step"] == 3  # a plan without PS tables ignores them
    staged = tmp_path / ".step-000000003.tmp-1"
    ckpt.path.rename(staged)
    torch.save(state(3) | {"ps_version": 2}, staged / TRAINER_STATE)
    publish(staged, step=3, lineage="a", world=WORLD)
    with pytest.raises(
        PlannerError,
        match="trainer state for PS version 2 but its parameter-server tables are at version 1: they were not",
    ):
        check_resume(tmp_path, with_ps=True)


class Planted:
    """Unpickling it would create ``path``: what a crafted checkpoint could do with any code."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_planted_reduce_in_any_loadable_file_never_runs(tmp_path):
    """Every file a resume unpickles (the trainer state, each PS shard) is loaded with weights_only: a crafted one
    is refused in one line naming it, and its code never runs. (The manifests and plan are JSON.)"""
    planted = tmp_path / "planted"
    ckpt = checkpoint(tmp_path / "ckpt", 3, "a")
    loadable = [ckpt.path / TRAINER_STATE, *sorted((ckpt.path / "ps").rglob("*.pt"))]
    assert len(loadable) == 2
    for file in loadable:
        original = file.read_bytes()
        payload = torch.load(file, weights_only=True) | {"payload": Planted(planted)}
        torch.save(payload, file)
        for manifest in (ckpt.path / "ps").rglob("manifest.*.json"):  # the PS's own size check would refuse first
            data = json.loads(manifest.read_text())
            data["tables"]["t"]["bytes"] = (manifest.parent / data["tables"]["t"]["file"]).stat().st_size
            manifest.write_text(json.dumps(data))
        staged = ckpt.path.with_name(".step-000000003.tmp-9")
        ckpt.path.rename(staged)
        publish(staged, step=3, lineage="a", world=WORLD)  # checksums of the crafted file: only the load can refuse
        with pytest.raises(PlannerError, match=rf"{file.name}.*(UnpicklingError|not readable)"):
            ckpt_, _state = check_resume(tmp_path / "ckpt", with_ps=True)
            from persia_planner.modules.ps.table_checkpoints import load_rows

            load_rows(ckpt_.path / "ps", server=0, n_servers=1)
        assert not planted.exists()
        file.write_bytes(original)
