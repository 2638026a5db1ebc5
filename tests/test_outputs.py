"""The one rule of every output path (persia_planner/outputs.py): never an input, never inside a checkpoint or a run's
folder, never a folder or a special file, refused before any work; ``--overwrite`` replaces only a file of the same
kind that persia wrote. Each refusal is one line, exit 2, and leaves every file as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.errors import PlannerError
from persia_planner.outputs import (
    RUN_MARKER,
    Output,
    OutputKind,
    check_outputs,
    check_run_folder,
    enclosing_run_folder,
    write_output,
)
from persia_planner.paths import EXAMPLE_MODEL, EXAMPLE_TOPOLOGY

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args], prog_name="persia")


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def a_checkpoint(root: Path, step: int = 4) -> Path:
    """A published checkpoint as persia train leaves it: ``root/step-N/`` with a manifest, and the run's marker."""
    step_dir = root / f"step-{step:09d}"
    step_dir.mkdir(parents=True)
    (step_dir / "trainer.pt").write_bytes(b"weights")
    (step_dir / "MANIFEST.json").write_text(json.dumps({"format": "persia-checkpoint/1", "step": step, "files": {}}))
    (root / RUN_MARKER).write_text("")
    return step_dir


def refused(result, line: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {line}\n"


# ---- the examples, through the commands ----------------------------------------------------------------------
def test_predict_out_naming_its_data_is_refused_even_with_overwrite(tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("clicked,price\n1,2\n")
    before = snapshot(tmp_path)
    result = run("predict", "--checkpoint", tmp_path / "ck", "--data", f"csv:{data}", "--out", data, "--overwrite")
    refused(result, f"--out {data} is the --data file: writing there would replace it; fix: choose another path for "
                    "the output")  # fmt: skip
    assert snapshot(tmp_path) == before


def test_predict_out_inside_a_checkpoint_is_refused_even_with_overwrite(tmp_path):
    ck = tmp_path / "ck"
    step = a_checkpoint(ck)
    before = snapshot(tmp_path)
    for out, where in ((step / "trainer.pt", f"the checkpoint {step.name} ({step})"),
                       (ck / "scores.parquet", f"the --checkpoint folder of a persia train run ({ck})")):  # fmt: skip
        result = run("predict", "--checkpoint", ck, "--data", "csv:x.csv", "--out", out, "--overwrite")
        refused(result, f"--out {out} is inside {where}: writing there would change a training run's files; fix: "
                        "write it outside the run's folders")  # fmt: skip
    assert snapshot(tmp_path) == before


def test_predict_out_inside_its_data_folder_is_refused(tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "a.csv").write_text("clicked\n1\n")
    out = folder / "scores.parquet"
    result = run("predict", "--checkpoint", tmp_path, "--data", f"csv:{folder}", "--out", out)
    refused(result, f"--out {out} is inside the --data folder {folder}: the next read of that folder would take it "
                    "in; fix: write it outside the input folder")  # fmt: skip
    assert not out.exists()


def test_predict_out_that_is_a_folder_or_under_proc_is_one_line(tmp_path):
    result = run("predict", "--checkpoint", tmp_path, "--data", "csv:x.csv", "--out", tmp_path)
    refused(result, f"--out {tmp_path} is a folder; fix: name a file in it, e.g. {tmp_path / 'scores.parquet'}")
    result = run("predict", "--checkpoint", tmp_path, "--data", "csv:x.csv", "--out", "/proc/scores.parquet")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --out /proc/scores.parquet: cannot write in /proc (")
    assert result.stderr.endswith("; fix: choose a writable folder\n") and result.stderr.count("\n") == 1


def test_plan_out_refuses_a_file_it_did_not_write_and_replaces_its_own_with_overwrite(tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    refused(run("plan", "--out", mine), f"--out {mine} exists; fix: add --overwrite to replace it or name another file")
    refused(
        run("plan", "--out", mine, "--overwrite"),
        f"--out {mine} exists and is not a plan (persia plan --out): --overwrite replaces only a file of the same kind "
        "that persia wrote; fix: name another file",
    )
    assert mine.read_text() == '{"mine": true}'
    plan = tmp_path / "plan.json"
    assert run("plan", "--out", plan).exit_code == 0
    first = plan.read_text()
    assert json.loads(first)["format"] == "persia-plan/1"
    refused(run("plan", "--out", plan), f"--out {plan} exists; fix: add --overwrite to replace it or name another file")
    assert run("plan", "--out", plan, "--overwrite", "--seed", "3").exit_code == 0
    assert json.loads(plan.read_text())["format"] == "persia-plan/1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "plan.json"]  # no temporary file left


def test_a_picture_is_replaced_only_when_persia_drew_it(tmp_path):
    png = tmp_path / "cluster.png"
    assert run("topology", EXAMPLE_TOPOLOGY, "--png", png).exit_code == 0
    assert OutputKind.PICTURE.written_by_persia(png)
    assert run("topology", EXAMPLE_TOPOLOGY, "--png", png, "--overwrite").exit_code == 0
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    refused(
        run("plan", "--png", photo, "--overwrite"),
        f"--png {photo} exists and is not a picture (persia plan/topology --png, persia size's frontier.png): "
        "--overwrite replaces only a file of the same kind that persia wrote; fix: name another file",
    )
    assert photo.read_bytes() == b"\x89PNG\r\n\x1a\n" + b"\x00" * 64


def test_calibrate_refuses_an_existing_file_before_measuring_anything(tmp_path):
    model = tmp_path / "model.yaml"
    model.write_text(EXAMPLE_MODEL.read_text())
    refused(run("calibrate", "--out", model), f"--out {model} exists; fix: add --overwrite to replace it or name "
                                              "another file")  # fmt: skip
    refused(
        run("calibrate", "--out", model, "--overwrite"),
        f"--out {model} exists and is not a hardware profile (persia calibrate --out): --overwrite replaces only a "
        "file of the same kind that persia wrote; fix: name another file",
    )
    assert model.read_text() == EXAMPLE_MODEL.read_text()


def test_plan_out_inside_a_checkpoint_is_refused(tmp_path):
    step = a_checkpoint(tmp_path / "ck")
    out = step / "plan.json"
    refused(
        run("plan", "--out", out),
        f"--out {out} is inside the checkpoint {step.name} ({step}): writing there would change a training run's "
        "files; fix: write it outside the run's folders",
    )


# ---- the rule itself -------------------------------------------------------------------------------------------------
def test_two_outputs_naming_one_file_are_refused(tmp_path):
    a = Output("--out", tmp_path / "x", OutputKind.PLAN)
    b = Output("--png", tmp_path / "x", OutputKind.PICTURE)
    expected = rf"^--out and --png name one file, {tmp_path / 'x'}; fix: give each its own path$"
    with pytest.raises(PlannerError, match=expected):
        check_outputs([a, b], {}, overwrite=False)


def test_an_output_under_a_file_or_a_special_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    expected = r"plan.json: .*/f is a file, not a folder; fix: name a file in an existing folder$"
    with pytest.raises(PlannerError, match=expected):
        check_outputs([Output("--out", tmp_path / "f" / "plan.json", OutputKind.PLAN)], {}, overwrite=False)
    with pytest.raises(PlannerError, match=r"^--out /dev/null is not a regular file; fix: name a regular file$"):
        check_outputs([Output("--out", Path("/dev/null"), OutputKind.PLAN)], {}, overwrite=True)


def test_a_dangling_link_counts_as_an_existing_file(tmp_path):
    link = tmp_path / "plan.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    expected = r"plan.json exists; fix: add --overwrite to replace it or name another file$"
    with pytest.raises(PlannerError, match=expected):
        check_outputs([Output("--out", link, OutputKind.PLAN)], {}, overwrite=False)


def test_a_name_taken_while_writing_is_not_replaced(tmp_path):
    out = Output("--out", tmp_path / "plan.json", OutputKind.PLAN)
    check_outputs([out], {}, overwrite=False)

    def write(path: Path) -> None:
        path.write_text('{"format": "persia-plan/1"}')
        out.path.write_text("someone else's")  # another program takes the name meanwhile

    with pytest.raises(PlannerError, match=r"plan.json appeared while it was being written"):
        write_output(out, write, overwrite=False)
    assert out.path.read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_a_failed_write_leaves_nothing(tmp_path):
    out = Output("--out", tmp_path / "plan.json", OutputKind.PLAN)

    def write(path: Path) -> None:
        path.write_text("half")
        raise OSError(28, "No space left on device")

    expected = r"^--out: cannot write .*plan.json \(No space left on device\); fix: choose a writable path$"
    with pytest.raises(PlannerError, match=expected):
        write_output(out, write, overwrite=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kind", "ours", "theirs"),
    [
        (OutputKind.PLAN, b'{\n "format": "persia-plan/1",\n "model": "m"}', b'{"model": "m"}'),
        (OutputKind.PROFILE, b"# persia calibrate: raw\nformat: 1\n", b"format: 1\n# persia calibrate\n"),
        (OutputKind.MODEL, b"# persia data profile: csv:d.csv\nname: m\n", b"name: m\n"),
    ],
)
def test_each_kind_knows_its_own_files(tmp_path, kind, ours, theirs):
    (tmp_path / "ours").write_bytes(ours)
    (tmp_path / "theirs").write_bytes(theirs)
    assert kind.written_by_persia(tmp_path / "ours")
    assert not kind.written_by_persia(tmp_path / "theirs")
    assert not kind.written_by_persia(tmp_path / "missing")


def test_scores_are_known_by_their_parquet_metadata(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from persia_planner.outputs import SCORES_METADATA

    pq.write_table(pa.table({"score": [0.5]}).replace_schema_metadata(SCORES_METADATA), tmp_path / "ours.parquet")
    pq.write_table(pa.table({"score": [0.5]}), tmp_path / "theirs.parquet")
    assert OutputKind.SCORES.written_by_persia(tmp_path / "ours.parquet")
    assert not OutputKind.SCORES.written_by_persia(tmp_path / "theirs.parquet")
    (tmp_path / "text.parquet").write_text("not parquet")
    assert not OutputKind.SCORES.written_by_persia(tmp_path / "text.parquet")


def test_run_folders_are_found_by_marker_manifest_or_checkpoints(tmp_path):
    step = a_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / RUN_MARKER).unlink()  # a run of an earlier version: no marker, its checkpoints say it
    assert enclosing_run_folder(step / "x").path == step
    assert enclosing_run_folder(tmp_path / "ck" / "x").what == "the --checkpoint folder of a persia train run"
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / RUN_MARKER).write_text(json.dumps({"format": "persia-run/1", "role": "--log-dir"}))
    assert enclosing_run_folder(logs / "x").what == "the --log-dir folder of a persia train run"
    assert enclosing_run_folder(tmp_path / "elsewhere.json") is None


def test_a_run_folder_may_be_its_own_run_folder_but_not_inside_anothers(tmp_path):
    ck = tmp_path / "ck"
    step = a_checkpoint(ck)
    check_run_folder("--checkpoint", ck, {})  # a --resume: the folder is the run's own
    check_run_folder("--log-dir", ck / "logs", {}, own=[ck])  # its logs inside its own checkpoint folder
    with pytest.raises(
        PlannerError, match=r"^--log-dir .*/ck/logs is inside the --checkpoint folder of a persia train"
    ):
        check_run_folder("--log-dir", ck / "logs", {})
    with pytest.raises(PlannerError, match=r"^--checkpoint .*step-000000004 is inside the checkpoint step-000000004"):
        check_run_folder("--checkpoint", step, {})
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(PlannerError, match=r"^--checkpoint .*/data/ck is inside the --data folder"):
        check_run_folder("--checkpoint", data / "ck", {"--data": [data]})
    with pytest.raises(PlannerError, match=r"^--checkpoint .*/data is the --data folder"):
        check_run_folder("--checkpoint", data, {"--data": [data]})


def _clicks_csv(path: Path) -> Path:
    rows = "\n".join(f"{i % 2},{i * 3.5},u{i % 7},c{i % 3}" for i in range(200))
    path.write_text("clicked,price,user,country\n" + rows + "\n")
    return path


def test_data_profile_never_writes_over_its_log_or_a_users_model(tmp_path):
    data = _clicks_csv(tmp_path / "d.csv")
    before = snapshot(tmp_path)
    for extra in ([], ["--overwrite"]):
        refused(
            run("data", "profile", f"csv:{data}", "--out", data, *extra),
            f"--out {data} is the log file: writing there would replace it; fix: choose another path for the output",
        )
    model = tmp_path / "model.yaml"
    model.write_text("name: mine\n")
    before = snapshot(tmp_path)
    refused(
        run("data", "profile", f"csv:{data}", "--out", model),
        f"--out {model} exists; fix: add --overwrite to replace it or name another file",
    )
    refused(
        run("data", "profile", f"csv:{data}", "--out", model, "--overwrite"),
        f"--out {model} exists and is not a suggested model (persia data profile --out): --overwrite replaces only a "
        "file of the same kind that persia wrote; fix: name another file",
    )
    assert snapshot(tmp_path) == before


def test_data_profile_replaces_its_own_model_with_overwrite_and_the_model_loads(tmp_path):
    from persia_planner import load_model

    data = _clicks_csv(tmp_path / "d.csv")
    suggested = tmp_path / "suggested.yaml"
    assert run("data", "profile", f"csv:{data}", "--out", suggested).exit_code == 0
    first = suggested.read_text()
    assert first.startswith(f"# persia data profile: suggested for csv:{data}\n")
    assert {t.name for t in load_model(suggested).tables} >= {"user", "country"}
    result = run("data", "profile", f"csv:{data}", "--out", suggested, "--overwrite", "--max-rows", "50")
    assert result.exit_code == 0, result.output
    assert suggested.read_text().startswith("# persia data profile: ")
