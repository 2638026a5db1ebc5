"""What a training run shows on the terminal: trainer 0's progress bar and the summary table's rows.

The bar draws on the process's terminal even when its output goes to a log file
(:func:`persia_planner.modules.process_logs.terminal`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from persia_planner.modules.process_logs import terminal
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.run_inputs import describe_hyper_parameters

__all__ = ["early_stop_rows", "ema", "epochs_text", "plan_rows", "progress_bar", "refit_rows", "summary_rows"]


def ema(xs: list[float], window: int = 20) -> float:
    """The mean of the last ``window`` values (the bar's smoothed loss)."""
    tail = xs[-window:]
    return sum(tail) / len(tail)


def progress_bar(cfg: TrainConfig) -> Any:
    """A ``rich`` progress bar of the run's steps (the planned count, an estimate on data files: the task's total):
    loss, samples/s and staleness."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    out = terminal()
    width = None  # rich measures fds 0-2, which a log file may have taken: measure the terminal itself
    with contextlib.suppress(OSError, ValueError):
        width = os.get_terminal_size(out.fileno()).columns or None
    return Progress(
        TextColumn("[bold]train[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[rate]:,.0f} samples/s"),
        TextColumn("staleness {task.fields[stale]}" + f"/{cfg.effective_staleness}"),
        TimeRemainingColumn(),
        console=Console(file=out, width=width),
        transient=False,
    )


def _maybe(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def epochs_text(result: dict[str, Any]) -> str:
    """The summary's epochs: how many, and the steps of each (of at most how many, where the run stopped early)."""
    if not result.get("epochs"):
        return "-"
    done = result.get("epoch_steps") or []
    steps = ", ".join(str(n) for n in done) or "none finished"
    if result.get("stopped_by") == "early stop":  # --epochs was the most it would train
        return f"{len(done)} of at most {result['epochs']}, stopped early ({steps})"
    return f"{result['epochs']} ({steps})"


def refit_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's refit (``refit`` in the summary), per term: predicted / measured / refitted ms ("-": not measured
    alone), and the file it was written to."""
    found = result.get("refit")
    if not found:
        return []
    factors = result.get("plan_factors") or {}
    priced = ", ".join(f"{t} {f:.2f}" for t, f in factors.items() if f != 1.0) or "1 each"
    rows = [(f"refit: term, ms predicted / measured / refitted (plan's factors: {priced})", "")]
    for row in found:
        measured = "-" if row["measured_ms"] is None else f"{row['measured_ms']:.1f}"
        rows.append((f"  {row['term']}", f"{row['predicted_ms']:.1f} / {measured} / {row['refitted_ms']:.1f}"))
    if result.get("refit_file"):
        rows.append(("  refitted profile", str(result["refit_file"])))
    return rows


def early_stop_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The best evaluation of a run that tracked one (``--early-stop``): its step and metrics, the checkpoint that
    ``persia predict`` scores with."""
    found = result.get("early_stopping") or {}
    best = found.get("best")
    if not found.get("patience") or not best:
        return []
    auc, ne = best.get("auc"), best.get("normalized_entropy")
    stopped = " (stopped early)" if result.get("stopped_by") == "early stop" else ""
    return [(f"best evaluation{stopped}: step; AUC; NE", f"{found['best_step']}; {auc:.4f}; {_maybe(ne)}")]


def plan_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """``--adapt``'s plans, one row each: the steps it ran, why, and its step predicted / measured / refitted."""
    plans = result.get("plans") or []
    rows = [("plans (--adapt): steps, why; step ms predicted / measured / refitted", "")] if plans else []
    for p in plans:
        until = "end" if p.get("to_step") is None else str(p["to_step"])
        moved = f", moved {', '.join(p['tables_moved'])}" if p.get("tables_moved") else ""
        figures = " / ".join(_maybe(p.get(k), ".1f") for k in ("predicted_ms", "measured_ms", "refitted_ms"))
        rows.append((f"  plan {p['index']}: steps {p['from_step'] + 1}-{until}, {p['reason']}{moved}", figures))
    return rows


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary table's rows (metric, value)."""
    final = result.get("final_evaluation")
    which = "AUC of the best evaluation's checkpoint" if final else "AUC"
    rows = [
        (f"{which} ({result.get('eval_samples', 0):,} validation rows)", f"{result['auc']:.4f}"),
        ("teacher AUC (best possible)", f"{result['teacher_auc']:.4f}" if result.get("teacher_auc") else "-"),
        ("train loss (last 10%)", f"{result['loss']:.4f}"),
        ("eval log loss", f"{result['eval_loss']:.4f}"),
        (
            "normalized entropy; calibration",
            f"{_maybe(result.get('normalized_entropy'))}; {_maybe(result.get('calibration'))}",
        ),
        ("samples/s", f"{result['samples_per_s']:,.0f}"),
        ("step ms (median, after warm-up)", f"{result['step_ms']:.1f}"),
        (
            "  of which (ms)",
            ", ".join(f"{k} {v:.1f}" for k, v in result.get("step_breakdown_ms", {}).items() if k != "data") or "-",
        ),
        ("step ms the plan predicted", _maybe(result.get("plan_step_ms"), ".1f")),
        (
            "  of which (ms), slowest GPU",
            ", ".join(f"{k} {v:.1f}" for k, v in result.get("plan_step_terms_ms", {}).items() if v) or "-",
        ),
        ("data ms per step (not in the step)", f"{result.get('step_breakdown_ms', {}).get('data', 0.0):.1f}"),
        ("global batch x steps", f"{result['batch_size']} x {result['steps']}"),
        ("epochs (steps of each)", epochs_text(result)),
        ("dense arch; optimizers (lr)", describe_hyper_parameters(result.get("hyper_parameters"))),
        ("staleness K (max seen)", f"{result['staleness']} ({result['staleness_max_seen']})"),
        ("trainers / PS servers", f"{result['trainers']} / {result['servers']}"),
        ("PS wire dtype", result["ps_wire"]),
        ("PS tables (async)", ", ".join(result["ps_tables"]) or "-"),
        ("local tables (sync)", f"{len(result['local_tables'])}"),
        ("executed as planned", "yes" if result.get("executed_matches_plan") else "no"),
    ]
    if final:
        rows.insert(1, ("AUC at the last step", f"{final['auc']:.4f}"))
    rows += early_stop_rows(result)
    rows += plan_rows(result)
    rows += refit_rows(result)
    bad = result.get("bad_rows")
    if bad and bad["on_bad_row"] != "fail":  # under fail, a bad row stops the run
        skipped, imputed = bad["skipped"], bad["imputed"]
        text = f"{skipped['train']:,} skipped per training epoch, {skipped['eval']:,} in evaluation"
        if bad["on_bad_row"] == "impute":
            text += f"; {imputed['train']:,} imputed per epoch, {imputed['eval']:,} in evaluation"
        rows.append((f"bad rows (on_bad_row: {bad['on_bad_row']})", text))
    return rows
