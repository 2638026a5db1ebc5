"""The per-step metrics sinks: one JSON line per step with its evaluation, TensorBoard scalars, resume appends."""

from __future__ import annotations

import json
import math

from persia_planner.modules.train.metrics_log import (
    JsonLinesSink,
    Sinks,
    StepRecord,
    TensorBoardSink,
    logged_steps,
    open_sinks,
    write_summary,
)


def record(step: int, loss: float = 0.5) -> StepRecord:
    return StepRecord(step, loss, 100.0 * step, step % 3, 1.5, 2.5, 0.25, 40.0, 0.1 * step)


def scalars(directory, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


class Recording:
    """A sink that keeps what it was given (the composition's other end)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def log_step(self, record: StepRecord) -> None:
        self.calls.append(("step", record.step))

    def log_eval(self, step: int, metrics) -> None:
        self.calls.append(("eval", step))

    def close(self) -> None:
        self.calls.append(("close",))


def test_json_lines_hold_one_line_per_step_with_its_evaluation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonLinesSink(path)
    sink.log_step(record(1))
    sink.log_step(record(2))
    assert [line["step"] for line in logged_steps(path)] == [1]  # step 2 waits for its evaluation
    sink.log_eval(2, {"auc": 0.75, "eval_loss": 0.6, "teacher_auc": None, "eval_samples": 128})
    sink.log_step(record(3, loss=math.nan))
    sink.close()
    sink.close()  # twice is harmless
    lines = logged_steps(path)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[0] == {
        "step": 1,
        "loss": 0.5,
        "samples_per_s": 100.0,
        "staleness": 1,
        "ps_wait_ms": 1.5,
        "push_ms": 2.5,
        "data_ms": 0.25,
        "step_ms": 40.0,
        "t_s": 0.1,
    }
    assert lines[1]["auc"] == 0.75 and lines[1]["eval_loss"] == 0.6
    assert "teacher_auc" not in lines[1] and "eval_samples" not in lines[1]
    assert lines[2]["loss"] is None  # NaN is not JSON
    assert all(json.loads(text) for text in path.read_text().splitlines())


def test_a_resumed_run_drops_the_steps_after_its_checkpoint_and_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonLinesSink(path)
    for step in range(1, 6):
        sink.log_step(record(step))
    sink.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # a crash cut the last line short
    resumed = JsonLinesSink(path, after_step=3)
    for step in (4, 5):
        resumed.log_step(record(step, loss=0.25))
    resumed.close()
    lines = logged_steps(path)
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert [line["loss"] for line in lines] == [0.5, 0.5, 0.5, 0.25, 0.25]


def test_tensorboard_has_a_scalar_per_field_and_a_resume_hides_the_steps_it_redoes(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for step in range(1, 5):
        sink.log_step(record(step))
    sink.log_eval(4, {"auc": 0.7, "eval_samples": 64})
    sink.close()
    assert [s for s, _ in scalars(tmp_path, "loss")] == [1, 2, 3, 4]
    assert scalars(tmp_path, "step_ms") == [(s, 40.0) for s in range(1, 5)]
    assert [s for s, _ in scalars(tmp_path, "auc")] == [4] and scalars(tmp_path, "eval_samples") == []
    resumed = TensorBoardSink(tmp_path, purge_step=3)
    for step in (3, 4, 5):
        resumed.log_step(record(step, loss=0.25))
    resumed.close()
    assert scalars(tmp_path, "loss") == [(1, 0.5), (2, 0.5), (3, 0.25), (4, 0.25), (5, 0.25)]


def test_sinks_compose_in_order_and_all_close(tmp_path):
    a, b = Recording(), Recording()
    both = Sinks(a, b)
    both.log_step(record(1))
    both.log_eval(1, {"auc": 0.5})
    both.close()
    assert a.calls == b.calls == [("step", 1), ("eval", 1), ("close",)]


def test_open_sinks_writes_both_formats_into_the_log_dir(tmp_path):
    assert Sinks().sinks == open_sinks(None).sinks == ()
    sinks = open_sinks(tmp_path / "logs")
    sinks.log_step(record(1))
    sinks.log_step(record(2))
    sinks.close()
    assert [line["step"] for line in logged_steps(tmp_path / "logs" / "metrics.jsonl")] == [1, 2]
    assert [s for s, _ in scalars(tmp_path / "logs" / "tensorboard", "loss")] == [1, 2]


def test_the_summary_leaves_out_the_history(tmp_path):
    path = write_summary(tmp_path, {"auc": 0.7, "steps": 4, "history": [{"step": 1}]})
    assert json.loads(path.read_text()) == {"auc": 0.7, "steps": 4}


def test_a_record_takes_the_loops_measurements():
    from persia_planner.modules.train.loop import StepStats

    stats = StepStats(loss=0.5, step_ms=40.0, staleness=1, samples=64, data_ms=0.25, ps_wait_ms=1.5, push_ms=2.5)
    assert StepRecord.of(1, stats, samples_per_s=100.0, t_s=0.1) == record(1)
