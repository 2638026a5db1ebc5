"""One log file per process: a process's output goes to its file, the terminal keeps its warnings and the bar."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from persia_planner.modules.process_logs import launcher_log, log_failure, log_file

SCRIPT = textwrap.dedent(
    """
    import logging, os, sys
    from persia_planner.modules.process_logs import process_log, terminal

    with process_log(sys.argv[1], "trainer0"):
        print("printed")
        os.write(2, b"a C++ line\\n")
        logging.getLogger("x").info("an info")
        logging.getLogger("x").warning("a warning")
        terminal().write("the bar\\n")
        if sys.argv[2] == "fail":
            raise ValueError("boom")
    print("after the job")
    logging.getLogger("x").warning("a warning after")
    """
)


def run(tmp_path, how: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "logs"), how], capture_output=True, text=True, timeout=120
    )


@pytest.mark.processes
def test_a_process_writes_its_output_to_its_file_and_its_warnings_to_the_terminal_too(tmp_path):
    done = run(tmp_path, "ok")
    assert done.returncode == 0, done.stderr
    written = log_file(tmp_path / "logs", "trainer0").read_text()
    assert written.startswith("==== trainer0 (pid ")
    for line in ("printed", "a C++ line", "INFO x: an info", "WARNING x: a warning"):
        assert line in written, written
    assert "the bar" not in written and "after" not in written
    # The terminal: the warning and the bar during the job; everything again after it.
    assert "a warning" in done.stderr and "the bar" in done.stderr and "a warning after" in done.stderr
    assert "an info" not in done.stderr and "a C++ line" not in done.stderr
    assert done.stdout == "after the job\n"


@pytest.mark.processes
def test_a_failure_leaves_its_traceback_in_the_file_and_appends(tmp_path):
    run(tmp_path, "ok")
    done = run(tmp_path, "fail")
    assert done.returncode == 1
    written = log_file(tmp_path / "logs", "trainer0").read_text()
    assert written.count("==== trainer0 (pid ") == 2  # the second run appended
    assert "trainer0 failed" in written and "ValueError: boom" in written
    assert "ValueError: boom" in done.stderr  # the process's own error after the job, as without a log dir


class Failed(Exception):
    detail = "Traceback (most recent call last):\n  in trainer1\nRuntimeError: gone\n"


def test_the_launcher_log_holds_the_job_and_its_failure_only_there(tmp_path, capsys):
    handler = launcher_log(tmp_path, "TrainConfig(steps=4)")
    try:
        log_failure(handler, Failed("trainer1 failed: RuntimeError: gone"))
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    written = log_file(tmp_path, "launcher").read_text().splitlines()
    assert written[0].startswith("==== launcher (pid ") and written[1] == "TrainConfig(steps=4)"
    assert written[2].endswith("ERROR persia_planner.modules.process_logs: Failed: trainer1 failed: RuntimeError: gone")
    assert written[-1] == "RuntimeError: gone"
    assert "gone" not in capsys.readouterr().err
