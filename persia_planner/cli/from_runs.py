"""``persia calibrate --from-runs DIR...``: one profile refitted from the summaries of several ``persia train`` runs.

Each folder is a run's ``--log-dir``: its ``summary.json`` holds the measured step and its terms, the plan's terms
with every factor 1 (``plan_step_terms_unscaled_ms``), the factors it was priced with and the trainers' profile
(``profile_source``). The refit is :func:`persia_planner.cost.refit.refit` over every run's equations; runs of
different plans separate the factors that runs of one plan can only scale together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from persia_planner.cli.app import make_console, note
from persia_planner.cost.refit import Refit, RunTerms, refit, refitted_profile
from persia_planner.errors import PlannerError
from persia_planner.fields import load_document
from persia_planner.outputs import Output, OutputKind, check_outputs, write_output
from persia_planner.topology.cost_constants import SCALED_TERMS
from persia_planner.topology.profile import HardwareProfile

__all__ = ["SUMMARY_FILE", "calibrate_from_runs", "read_run"]

SUMMARY_FILE = "summary.json"
_NOT_A_RUN = "give the --log-dir folder of a finished persia train run"


def read_run(folder: Path) -> tuple[RunTerms, Mapping[str, Any]]:
    """The run in ``folder`` (its ``summary.json``): its terms, and the summary itself.

    Raises:
        PlannerError: No summary there, or not a ``persia train`` summary (one line naming the file).
    """
    path = folder / SUMMARY_FILE
    if not folder.is_dir():
        raise PlannerError(f"--from-runs {folder}: no such folder", fixes=(_NOT_A_RUN,))
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlannerError(f"--from-runs {folder}: no {SUMMARY_FILE} there", fixes=(_NOT_A_RUN,)) from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        problem = err.strerror if isinstance(err, OSError) else "not JSON"
        raise PlannerError(f"--from-runs {path}: cannot read it ({problem})", fixes=(_NOT_A_RUN,)) from None
    if not isinstance(summary, dict):
        raise PlannerError(f"--from-runs {path}: not a persia train summary", fixes=(_NOT_A_RUN,))
    predicted = summary.get("plan_step_terms_unscaled_ms")
    if predicted is None and summary.get("plan_factors") is None:
        predicted = summary.get("plan_step_terms_ms")  # a run from before the factors: priced with every one 1
    if not isinstance(predicted, dict) or not all(_is_number(predicted.get(t)) for t in SCALED_TERMS):
        raise PlannerError(
            f"--from-runs {path}: not a persia train summary (no plan_step_terms_unscaled_ms: the plan's terms)",
            fixes=(_NOT_A_RUN,),
        )
    try:
        run = RunTerms.from_summary(summary, predicted, str(folder))
    except PlannerError:
        raise PlannerError(
            f"--from-runs {path}: not a persia train summary (needs step_ms > 0, step_breakdown_ms and staleness)",
            fixes=(_NOT_A_RUN,),
        ) from None
    return run, summary


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _base_profile(summaries: Sequence[Mapping[str, Any]], profile: Path | None) -> Path:
    """``--profile``, else the first run's ``profile_source``."""
    if profile is not None:
        return profile
    for summary in summaries:
        source = summary.get("profile_source")
        if isinstance(source, str) and source:
            return Path(source)
    raise PlannerError(
        "--from-runs: no run names the profile its plan was priced with (profile_source)",
        fixes=("give --profile PROFILE.yaml",),
    )


def calibrate_from_runs(runs: Sequence[Path], out: Path, profile: Path | None, *, overwrite: bool) -> None:
    """Refit one profile from the runs in ``runs`` and write it to ``out``; print the per-term table and what the
    runs could not separate.

    Raises:
        PlannerError: No run, a folder that holds no ``persia train`` summary, an unreadable profile or output
            (one line).
    """
    if not runs:
        raise PlannerError("--from-runs needs one or more run folders", fixes=("persia calibrate --from-runs DIR...",))
    profile_out = Output("--out", out, OutputKind.PROFILE)
    check_outputs([profile_out], {"--from-runs": list(runs), "--profile": profile}, overwrite=overwrite)
    found = [read_run(Path(folder)) for folder in runs]
    terms, summaries = [t for t, _ in found], [s for _, s in found]
    base = _base_profile(summaries, profile)
    data, source = load_document(base, "give --profile PROFILE.yaml (persia calibrate writes one)")
    fitted = HardwareProfile.from_dict(data, source)  # a profile: refused in one line otherwise
    prior = summaries[0].get("plan_factors")
    fallback = dict(fitted.refit_factors) | dict(fitted.refit_sharding_factors)
    result = refit(terms, prior if isinstance(prior, dict) else fallback)
    content = refitted_profile(data, result, terms)
    HardwareProfile.from_dict(content, str(out))
    text = OutputKind.PROFILE.header(f"refitted from {len(terms)} persia train run(s) (persia calibrate --from-runs)")
    text += yaml.safe_dump(content, sort_keys=False)
    write_output(profile_out, lambda path: path.write_text(text, encoding="utf-8"), overwrite=overwrite)
    _print(result, base)
    note(f"wrote {out}", to_stderr=False)


def _print(result: Refit, base: Path) -> None:
    from rich.table import Table

    table = Table(title=f"persia calibrate --from-runs: terms (ms) of each run, on {base.name}")
    for column in ("run", "term", "predicted", "measured", "refitted"):
        table.add_column(column, justify="left" if column in ("run", "term") else "right")
    for row in result.rows:
        measured = "-" if row.measured_ms is None else f"{row.measured_ms:.2f}"
        table.add_row(row.source, row.term, f"{row.predicted_ms:.2f}", measured, f"{row.refitted_ms:.2f}")
    make_console().print(table)
    note("factors: " + ", ".join(f"{t} {f:.3f}" for t, f in result.factors.items()), to_stderr=False)
    for line in result.notes:
        note(line, to_stderr=False)
