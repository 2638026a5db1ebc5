"""Early stopping: the best evaluation kept (checkpointed, named in BEST.json, never pruned), the stop after
``patience`` evaluations without a better one, a resumed run's best, and a BEST.json that is not persia's left alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from persia_planner.modules.train.best_checkpoint import (
    BEST_FILE,
    BestMark,
    EarlyStopMetric,
    EarlyStopping,
    forget_best,
    read_best,
)
from persia_planner.modules.train.job_checkpoints import complete_checkpoints, prune
from persia_planner.modules.train.trained_model import best_checkpoint
from tests.test_job_checkpoints import checkpoint


class FakeSaver:
    """Publishes a real checkpoint (tests.test_job_checkpoints) per save, pruning to ``keep``."""

    def __init__(self, root: Path, lineage: str, keep: int = 1) -> None:
        self.root, self.lineage, self.keep = root, lineage, keep
        self.last_step: int | None = None
        self.last_path: Path | None = None
        self.saved: list[int] = []

    def save(self, step: int) -> float:
        published = checkpoint(self.root, step, self.lineage)
        prune(self.root, published, self.keep)
        self.last_step, self.last_path = step, published.path
        self.saved.append(step)
        return 0.5


def test_auc_improves_upwards_and_ne_downwards_and_patience_counts_evaluations():
    auc = EarlyStopping(EarlyStopMetric.AUC, patience=2)
    seen = [auc.observe(s, {"auc": v}) for s, v in ((1, 0.70), (2, 0.72), (3, 0.72), (4, 0.71))]
    assert seen == [True, True, False, False] and auc.best_step == 2 and auc.should_stop
    ne = EarlyStopping(EarlyStopMetric.NE, patience=1)
    assert ne.observe(1, {"normalized_entropy": 0.9}) and ne.observe(2, {"normalized_entropy": 0.8})
    assert not ne.observe(3, {"normalized_entropy": None}) and ne.should_stop  # no entropy: never the best
    never = EarlyStopping(EarlyStopMetric.AUC, patience=0)
    for s in range(5):
        never.observe(s, {"auc": 0.5})
    assert not never.should_stop and never.best_step == 0


def test_the_best_evaluation_is_checkpointed_marked_and_outlives_pruning(tmp_path):
    saver = FakeSaver(tmp_path, "run-a", keep=1)
    stopping = EarlyStopping(EarlyStopMetric.AUC, patience=2)
    for step, auc in ((10, 0.70), (20, 0.75), (30, 0.74)):
        stopping.keep_best(step, {"auc": auc}, saver, publish=True)
    assert saver.saved == [10, 20]  # only the best evaluations are checkpointed here
    saver.save(40)  # the run's own next checkpoint: keep=1 prunes step 30's... but never the best
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000000040", "step-000000020"]
    assert read_best(tmp_path) == BestMark(20, "step-000000020", "auc", 0.75, "run-a", {"auc": 0.75})
    assert best_checkpoint(tmp_path).step == 20
    # A step that already has its checkpoint is not saved again.
    stopping.keep_best(40, {"auc": 0.8}, saver, publish=True)
    assert saver.saved == [10, 20, 40] and read_best(tmp_path).step == 40


def test_a_resumed_run_starts_from_the_best_its_lineage_marked(tmp_path):
    BestMark(20, "step-000000020", "auc", 0.75, "run-a").write(tmp_path)
    assert EarlyStopping.of_run(EarlyStopMetric.AUC, 2, tmp_path, "run-a").best_value == 0.75
    assert EarlyStopping.of_run(EarlyStopMetric.AUC, 2, tmp_path, "run-b").best_value is None  # another run's
    assert EarlyStopping.of_run(EarlyStopMetric.NE, 2, tmp_path, "run-a").best_value is None  # another metric


def test_a_mark_naming_a_checkpoint_of_another_run_is_ignored(tmp_path):
    checkpoint(tmp_path, 20, "run-b")  # --overwrite replaced run-a's checkpoints; its mark stayed behind
    BestMark(20, "step-000000020", "auc", 0.75, "run-a").write(tmp_path)
    assert best_checkpoint(tmp_path) is None


def test_a_best_json_that_is_not_persias_is_never_overwritten(tmp_path, caplog):
    theirs = json.dumps({"best": "mine"})
    (tmp_path / BEST_FILE).write_text(theirs)
    assert read_best(tmp_path) is None
    saver = FakeSaver(tmp_path, "run-a")
    EarlyStopping(EarlyStopMetric.AUC, 1).keep_best(10, {"auc": 0.7}, saver, publish=True)
    assert (tmp_path / BEST_FILE).read_text() == theirs
    assert "not marked" in caplog.text and "BEST.json exists and is not" in caplog.text
    with pytest.raises(Exception, match="exists and is not"):
        BestMark(10, "step-000000010", "auc", 0.7, "run-a").write(tmp_path)


def test_a_resumed_run_that_does_not_stop_early_forgets_its_runs_mark(tmp_path):
    BestMark(20, "step-000000020", "auc", 0.75, "run-a", {"auc": 0.75}).write(tmp_path)
    forget_best(tmp_path, "run-b")  # another run's mark stays
    assert read_best(tmp_path) is not None
    resumed = EarlyStopping.of_run(EarlyStopMetric.AUC, 2, tmp_path, "run-a")
    assert resumed.best_results == {"auc": 0.75} and resumed.since_best == 0
    forget_best(tmp_path, "run-a")
    assert not (tmp_path / BEST_FILE).exists()
    (tmp_path / BEST_FILE).write_text("theirs")  # not persia's: never removed
    forget_best(tmp_path, "run-a")
    assert (tmp_path / BEST_FILE).read_text() == "theirs"
