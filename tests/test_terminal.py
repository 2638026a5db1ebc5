"""What a run shows on the terminal: the progress bar keeps the terminal's width when a log file took fds 1 and 2."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import sys
import termios

CHILD = """
import os, sys
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.process_logs import log_to_file
from persia_planner.modules.train.terminal import progress_bar

os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # as a forked worker's stdin
log_to_file(sys.argv[1], "trainer0")
bar = progress_bar(TrainConfig())
bar.console.print(f"width={bar.console.width} terminal={bar.console.is_terminal}", highlight=False)
"""


def test_the_bar_draws_on_the_terminal_at_its_width_with_a_log_file(tmp_path):
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal 137 columns wide
        fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 137, 0, 0))
        os.execv(sys.executable, [sys.executable, "-c", CHILD, str(tmp_path)])
    shown = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, shown
    assert b"width=137 terminal=True" in shown
    assert "width=" not in (tmp_path / "trainer0.log").read_text()


def test_the_summary_lists_each_plan_of_an_adapted_run():
    from persia_planner.modules.train.terminal import plan_rows

    plans = [
        {"index": 0, "from_step": 0, "to_step": 40, "predicted_ms": 50.0, "measured_ms": 80.0, "refitted_ms": None,
         "reason": "initial", "tables_moved": []},
        {"index": 1, "from_step": 40, "to_step": None, "predicted_ms": 30.0, "measured_ms": 35.5, "refitted_ms": 33.25,
         "reason": "faster plan", "tables_moved": ["c1", "c10"]},
    ]  # fmt: skip
    rows = plan_rows({"plans": plans})
    assert rows[1] == ("  plan 0: steps 1-40, initial", "50.0 / 80.0 / -")
    assert rows[2] == ("  plan 1: steps 41-end, faster plan, moved c1, c10", "30.0 / 35.5 / 33.2")
    assert plan_rows({"plans": None}) == []


def test_a_run_that_kept_its_best_evaluation_says_so_in_its_summary():
    from persia_planner.modules.train.terminal import early_stop_rows, epochs_text

    result = {
        "epochs": 10,
        "epoch_steps": [86, 86, 86],
        "stopped_by": "early stop",
        "early_stopping": {"patience": 1, "best_step": 172, "best": {"auc": 0.7912, "normalized_entropy": 0.81}},
    }
    assert epochs_text(result) == "3 of at most 10, stopped early (86, 86, 86)"
    assert early_stop_rows(result) == [("best evaluation (stopped early): step; AUC; NE", "172; 0.7912; 0.8100")]
    assert early_stop_rows({"early_stopping": {"patience": 0, "best": {"auc": 0.7}}}) == []  # tracked, not kept
    assert epochs_text({"epochs": 2, "epoch_steps": [5, 5]}) == "2 (5, 5)"
