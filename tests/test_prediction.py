"""``persia predict``: a checkpoint scores new rows as its run scored its own (the same columns, transforms and
tables, the PS ones served again), in file order, with labels or without; bad input is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.errors import PlannerError
from persia_planner.modules.manifests import file_record
from persia_planner.modules.train.job_checkpoints import MANIFEST
from persia_planner.modules.train.prediction import prepare
from persia_planner.paths import EXAMPLES

ROOT = Path(__file__).resolve().parents[1]

MODEL_YAML = """
name: clicks
batch_size: 64
tables:
  - {name: user_id, rows: 200_000, dim: 16}
  - {name: item_ids, rows: 150_000, dim: 16, pooling_factor: 2}
  - {name: country, rows: 50, dim: 16}
data:
  label: clicked
  dense: [{column: price, log1p: true, standardize: true}]
  sparse:
    user_id: user
    item_ids: {column: items}
    country: country
"""


def _clicks(n: int, seed: int) -> pa.Table:
    """``n`` rows whose click depends on the user and the price (so that the model learns something)."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 40, n)
    price = rng.uniform(0, 1000, n)
    p = 1 / (1 + np.exp(-(np.where(users % 3 == 0, 1.5, -1.0) + (price - 500) / 400)))
    return pa.table(
        {
            "clicked": (rng.random(n) < p).astype(np.int64),
            "price": price,
            "user": [f"u{u}" for u in users],
            "items": [[f"it{(u + k) % 17}" for k in range(u % 3)] for u in users],
            "country": rng.integers(0, 9, n),
        }
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    return subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=540,
    )  # fmt: skip


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_a_checkpoint_scores_rows_as_its_run_evaluated_them(tmp_path):
    """2 PS + 2 trainers train in sync mode (the two large tables on the servers), evaluating every 4 steps on every
    row of a validation file (301: the trainers read 2 and 1 row groups, the last batch partial) and keeping the best
    evaluation's checkpoint; predict, in one process with 2 fresh servers loaded from that checkpoint, gives those
    rows the best evaluation's AUC and log loss. Without the label column the scores are the same."""
    (tmp_path / "model.yaml").write_text(MODEL_YAML)
    pq.write_table(_clicks(1024, seed=1), tmp_path / "train.parquet", row_group_size=256)
    valid = _clicks(301, seed=2)
    pq.write_table(valid, tmp_path / "valid.parquet", row_group_size=128)
    ckpt = tmp_path / "ckpt"
    train = _cli(
        "train", "--model", str(tmp_path / "model.yaml"), "--data", f"parquet:{tmp_path / 'train.parquet'}",
        "--eval-data", f"parquet:{tmp_path / 'valid.parquet'}", "--batch-size", "64", "--eval-every", "4",
        "--early-stop", "3", "--keep", "1", "--epochs", "2", "--mode", "sync", "--checkpoint", str(ckpt), "--json",
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    run = json.loads(train.stdout.strip().splitlines()[-1])
    assert sorted(run["ps_tables"]) == ["item_ids", "user_id"] and run["eval_samples"] == 301
    # 1,024 rows, 2 x 64 per step: 8 steps an epoch; evaluated at steps 4, 8 (the epoch's end), 12 and 16 (the end).
    stopping = run["early_stopping"]
    evaluated = [e["step"] for e in stopping["evaluations"]]
    assert run["last_step"] == 16 and evaluated == [4, 8, 12, 16]
    best = max(stopping["evaluations"], key=lambda e: e["value"])  # the first of equals: a later one is not better
    assert stopping["best_step"] == best["step"] and stopping["best"]["eval_samples"] == 301

    scored = _cli("predict", "--checkpoint", str(ckpt), "--data", f"parquet:{tmp_path / 'valid.parquet'}",
                  "--out", str(tmp_path / "scores.parquet"), "--batch-size", "100", "--json")  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads(scored.stdout.strip().splitlines()[-1])
    assert result["rows"] == 301 and result["step"] == stopping["best_step"]  # the best, kept beyond --keep 1
    m, at_best = result["metrics"], stopping["best"]
    assert m["auc"] == pytest.approx(at_best["auc"], abs=1e-6) and m["auc"] > 0.6
    assert run["auc"] == at_best["auc"]  # the summary heads with the model the run kept
    if stopping["best_step"] != run["last_step"]:
        assert run["final_evaluation"]["auc"] != run["auc"]
    assert m["eval_loss"] == pytest.approx(at_best["eval_loss"], abs=1e-5)
    assert m["normalized_entropy"] == pytest.approx(at_best["normalized_entropy"], abs=1e-5)
    scores = pq.read_table(tmp_path / "scores.parquet")
    assert scores.column_names == ["row", "score", "label"]
    assert scores["row"].to_pylist() == list(range(301))  # file order, the partial batches too
    assert scores["label"].to_pylist() == [float(x) for x in valid["clicked"].to_pylist()]

    # Rows to score have no label column: the same scores, no label, no metrics.
    pq.write_table(valid.drop(["clicked"]), tmp_path / "new.parquet")
    step_dir = ckpt / f"step-{stopping['best_step']:09d}"  # one checkpoint, named
    unlabeled = _cli("predict", "--checkpoint", str(step_dir), "--data", f"parquet:{tmp_path / 'new.parquet'}",
                     "--out", str(tmp_path / "new_scores.parquet"), "--json")  # fmt: skip
    assert unlabeled.returncode == 0, unlabeled.stderr[-3000:]
    assert json.loads(unlabeled.stdout.strip().splitlines()[-1])["metrics"] is None
    again = pq.read_table(tmp_path / "new_scores.parquet")
    assert again.column_names == ["row", "score"]
    assert np.allclose(again["score"].to_numpy(), scores["score"].to_numpy(), atol=1e-6)

    # Bad input: one line, exit 2, nothing overwritten.
    before = (tmp_path / "scores.parquet").read_bytes()
    empty = tmp_path / "empty"
    empty.mkdir()
    for args, needle in (
        (["--out", str(tmp_path / "scores.parquet")], "scores.parquet exists; fix: add --overwrite"),
        (["--out", str(tmp_path / "x.parquet"), "--checkpoint", str(empty)], "no checkpoint in"),
        (["--out", str(tmp_path / "x.parquet"), "--data", f"csv:{tmp_path / 'none.csv'}"], "none.csv"),
    ):
        base = {"--checkpoint": str(ckpt), "--data": f"parquet:{tmp_path / 'valid.parquet'}"}
        given = dict(zip(args[::2], args[1::2], strict=True))
        flat = [x for k, v in (base | given).items() for x in (k, v)]
        bad = _cli("predict", *flat)
        assert bad.returncode == 2 and needle in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert (tmp_path / "scores.parquet").read_bytes() == before


# ---- the checkpoint checked whole against its plan before any process starts ----------------------------------------
TINY_YAML = """
name: tiny
batch_size: 32
tables:
  - {name: user_id, rows: 200_000, dim: 8}
  - {name: country, rows: 50, dim: 8}
data:
  label: clicked
  dense: [{column: price, log1p: true, standardize: true}]
  sparse: {user_id: user, country: country}
"""
runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A ``step-*`` folder of a tiny run (1 trainer, 1 server): user_id on the server, country on the trainer;
    ``data.parquet`` lies two folders up."""
    root = tmp_path_factory.mktemp("trained")
    (root / "model.yaml").write_text(TINY_YAML)
    profile = str(EXAMPLES / "profiles" / "cpu-2core.yaml")
    topology = {
        "name": "tiny-1x1",
        "hosts": [
            {"name": "trainer", "ddr": "8GiB", "profile": profile, "cpus": {"count": 1, "memory": "4MiB"}},
            {"name": "ps", "role": "parameter_server", "ddr": "2GiB", "profile": profile},
        ],
    }
    (root / "topology.yaml").write_text(json.dumps(topology))
    pq.write_table(_clicks(256, seed=3).drop(["items"]), root / "data.parquet")
    train = _cli(
        "train", "--model", str(root / "model.yaml"), "--topology", str(root / "topology.yaml"), "--trainers", "1",
        "--data", f"parquet:{root / 'data.parquet'}", "--eval-split", "0.2", "--eval-batches", "1",
        "--batch-size", "32", "--steps", "4", "--checkpoint", str(root / "run"),
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    (step,) = (root / "run").glob("step-*")
    return step


def _rehash(step: Path) -> None:
    """The manifest naming ``step``'s files as they are now: what one who edits a checkpoint on purpose does."""
    manifest = json.loads((step / MANIFEST).read_text())
    files = sorted(p for p in step.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest["files"] = {p.relative_to(step).as_posix(): file_record(p) for p in files}
    (step / MANIFEST).write_text(json.dumps(manifest))


class _Payload:
    """Unpickled, it makes the folder ``marker``: a trainer.pt that runs code when loaded as a pickle."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _edit_state(step: Path, change: Callable[[dict], None]) -> None:
    state = torch.load(step / "trainer.pt", weights_only=True)
    change(state)
    torch.save(state, step / "trainer.pt")


def _move_to_trainers(step: Path) -> None:
    """plan.json says user_id trained on the trainers (it trained on the server; trainer.pt has no weights of it)."""
    plan = json.loads((step / "plan.json").read_text())
    plan["user_id"] = dict(plan["country"], shards=[dict(plan["country"]["shards"][0], rows=[0, 200_000])])
    (step / "plan.json").write_text(json.dumps(plan))


def _reshape(part: str, key: str, shape: tuple[int, ...]) -> Callable[[Path], None]:
    return lambda step: _edit_state(step, lambda s: s[part].__setitem__(key, torch.zeros(*shape)))


OVER = "over_arch.model.1.weight"  # the logit layer: (1, 32)
DOCTORED: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing table": (
        lambda step: _edit_state(step, lambda s: s["local"].pop("country")),
        "{trainer} holds no weights of table 'country', which plan.json places on the trainers; fix: {restore}",
    ),
    "plan moves a table to the trainers": (
        _move_to_trainers,
        "{trainer} holds no weights of table 'user_id', which plan.json places on the trainers; fix: {restore}",
    ),
    "malicious trainer.pt": (
        lambda step: _edit_state(step, lambda s: s.__setitem__("extra", _Payload(str(step.parent / "ran")))),
        "{trainer} is not a checkpoint persia train wrote (it holds objects other than tensors); fix: point "
        "--checkpoint at a checkpoint persia train wrote; never load this file with torch.load(weights_only=False)",
    ),
    "no plan.json": (
        lambda step: (step / "plan.json").unlink(),
        "{step} has no plan.json, the placement its tables trained with; fix: {restore}",
    ),
    "no ps/": (
        lambda step: shutil.rmtree(step / "ps"),
        "{step} has no ps/, the tables plan.json puts on the parameter servers ('user_id'); fix: {restore}",
    ),
    "no model.yaml": (
        lambda step: (step / "model.yaml").unlink(),
        "{step} has no model.yaml (written by an earlier version of persia train, or removed); fix: {restore} or "
        "train on with --resume for a step: its checkpoint holds one",
    ),
    "a table's shape changed": (
        _reshape("local", "country", (50, 4)),
        "{trainer} holds table 'country' of shape (50, 4), model.yaml gives it (50, 8) (rows x dim); fix: {restore}",
    ),
    "a dense tensor's shape changed": (
        _reshape("dense", OVER, (1, 31)),
        f"{{trainer}} holds {OVER} of shape (1, 31), the model of model.yaml builds (1, 32); fix: {{restore}}",
    ),
    "a dense tensor dropped": (
        lambda step: _edit_state(step, lambda s: s["dense"].pop(OVER)),
        f"{{trainer}} lacks the dense network's {OVER} (1 of its 10 tensors missing); fix: {{restore}}",
    ),
    "a dense tensor the model lacks": (
        _reshape("dense", "extra.weight", (2, 2)),
        "{trainer} holds dense tensor 'extra.weight', which the model of model.yaml does not have; fix: {restore}",
    ),
    "NaN weights": (
        lambda step: _edit_state(step, lambda s: s["local"]["country"].fill_(float("nan"))),
        "{trainer} holds NaN or infinite weights in table 'country': the run diverged, or the file was changed; fix: "
        "score with an earlier checkpoint of the run or {restore}",
    ),
    "a server's shard lost": (
        lambda step: next((step / "ps").rglob("*.pt")).unlink(),
        "{step}/ps/v00000001/user_id.server0-of-1.pt: missing; fix: {restore}",
    ),
    "trainer.pt of another PS version": (
        lambda step: _edit_state(step, lambda s: s.__setitem__("ps_version", 7)),
        "{trainer} was saved with parameter-server version 7, {step}/ps holds version 1: they were not saved "
        "together; fix: {restore}",
    ),
}


@pytest.mark.processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(DOCTORED))
def test_a_doctored_checkpoint_is_refused_in_one_line_before_any_process(trained, tmp_path, case):
    """Each file of a checkpoint changed (and its manifest re-hashed, as one who edits it on purpose would): one
    line naming the file, exit 2, in seconds, no payload run, nothing written at --out."""
    change, line = DOCTORED[case]
    step = tmp_path / "run" / trained.name
    shutil.copytree(trained, step)
    change(step)
    _rehash(step)
    out = tmp_path / "scores.parquet"
    started = time.perf_counter()
    result = runner.invoke(
        app,
        ["predict", "--checkpoint", str(step), "--data", f"parquet:{trained.parents[1] / 'data.parquet'}",
         "--out", str(out)],
        prog_name="persia",
    )  # fmt: skip
    restore = "restore the checkpoint from a copy, or point --checkpoint at another one"
    expected = "error: --checkpoint: " + line.format(step=step, trainer=step / "trainer.pt", restore=restore)
    assert (result.exit_code, result.stderr.strip()) == (2, expected)
    assert time.perf_counter() - started < 10
    assert not out.exists() and not (tmp_path / "ran").exists()


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_checkpoint_changed_without_its_manifest_is_refused_by_its_checksum(trained, tmp_path):
    step = tmp_path / "run" / trained.name
    shutil.copytree(trained, step)
    was = (step / "trainer.pt").stat().st_size
    _edit_state(step, lambda s: s["local"].pop("country"))
    now = (step / "trainer.pt").stat().st_size
    with pytest.raises(PlannerError) as err:
        prepare(step, f"parquet:{trained.parents[1] / 'data.parquet'}", tmp_path / "scores.parquet")
    assert str(err.value) == f"{step / 'trainer.pt'}: {now} bytes, its manifest recorded {was}: truncated or replaced"
    assert not (tmp_path / "scores.parquet").exists()


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_whole_checkpoint_is_prepared_with_what_its_trainer_builds(trained, tmp_path):
    prepared = prepare(trained.parent, f"parquet:{trained.parents[1] / 'data.parquet'}", tmp_path / "s.parquet")
    assert prepared.trained.checkpoint.path == trained and prepared.trained.servers == 1
    assert prepared.trained.ps_version == 1 and prepared.trained.local_tables == {"country": (50, 8)}
    assert prepared.settings.dense[OVER] == (1, 32) and len(prepared.settings.dense) == 10
    assert prepared.arch.num_dense == 1 and prepared.settings.dense_arch.num_dense == 1
    assert not (tmp_path / "s.parquet").exists()
