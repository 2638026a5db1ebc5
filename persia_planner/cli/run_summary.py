"""What ``persia train`` reports of a finished run: the plan it ended on, priced; the run's refit of the cost model
(per term predicted / measured / refitted, and the refitted profile beside its logs); the summary printed as a table
or as JSON, and written to ``--log-dir``."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

import typer

from persia_planner.cli.app import make_console, note
from persia_planner.errors import PlannerError

if TYPE_CHECKING:
    from persia_planner.model.specs import ModelSpec
    from persia_planner.modules.train.config import TrainConfig
    from persia_planner.modules.train.run_refit import PlanPrediction
    from persia_planner.plan.plan import Plan
    from persia_planner.topology.graph import Topology

__all__ = ["report_run"]


def report_run(
    result: dict[str, Any], model: ModelSpec, topology: Topology, the_plan: Plan, cfg: TrainConfig, *, as_json: bool
) -> None:
    """Report a finished run (trainer 0's ``result``) of ``the_plan``: its summary with the plan it ended on priced
    and the run's refit, printed (``as_json``: as one JSON line) and written to ``--log-dir``."""
    ended_on = _final_plan(model, topology, the_plan, result)
    _report(result, ended_on, _predicted_terms(model, topology, ended_on), cfg, as_json=as_json)


def _predicted_terms(model: ModelSpec, topology: Topology, the_plan: Plan) -> PlanPrediction:
    """The cost model's parts of the plan's step on its slowest GPU (ms), beside which a run shows its measured ones
    (at the factors the plan was priced with, and with every factor 1 for the run's refit)."""
    from persia_planner.modules.train.run_refit import PlanPrediction

    return PlanPrediction.of(model, topology, the_plan)


def _final_plan(model: ModelSpec, topology: Topology, the_plan: Plan, result: dict[str, Any]) -> Plan:
    """The plan the run ended on: ``the_plan``, or after ``--adapt`` migrated, the last one (priced here, as the
    summary's prediction and the run's refit are of the plan that ran last)."""
    final = result.get("final_plan")
    if not final:
        return the_plan
    from persia_planner.bound import lower_bound
    from persia_planner.cost.analytic import CostModel
    from persia_planner.model.qcomms import QComms
    from persia_planner.plan.plan import placement_from_dict
    from persia_planner.planner import priced_plan

    tables = {name: placement_from_dict(p, "final plan", name) for name, p in final["tables"].items()}
    if final.get("qcomms") is not None:  # a re-plan may have chosen the collectives again
        model = dataclasses.replace(model, qcomms=QComms.from_value(final["qcomms"], "final plan qcomms"))
    cost = CostModel(model, topology)
    result["first_plan_step_ms"] = the_plan.step_ms
    return priced_plan(cost, tables, lower_bound_ms=lower_bound(cost).value_ms)


def _report(
    result: dict[str, Any], the_plan: Plan, predicted: PlanPrediction, cfg: TrainConfig, *, as_json: bool
) -> None:
    """Print the run's summary (and write it to ``--log-dir``) with what the plan was priced for and predicted."""
    result.pop("history", None)
    result["plan_staleness"] = the_plan.staleness
    result["plan_ps_wire_dtype"] = None if the_plan.ps_wire_dtype is None else the_plan.ps_wire_dtype.value
    result["plan_qcomms"] = None if the_plan.qcomms is None else the_plan.qcomms.to_dict()
    result["plan_step_ms"] = the_plan.step_ms
    predicted.add_to(result)
    _refit(result, predicted, cfg)
    if cfg.log_dir:  # summary.json is what --json prints, what the plan was priced for included
        from persia_planner.modules.train.metrics_log import write_summary

        write_summary(cfg.log_dir, result)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        _print_result(result)


def _refit(result: dict[str, Any], predicted: PlanPrediction, cfg: TrainConfig) -> None:
    """The run's refit into its summary (``refit``: per term predicted / measured / refitted) and, with
    ``--log-dir``, the refitted profile beside its logs (``profile.fitted.yaml``)."""
    from persia_planner.modules.train.run_refit import refit_of_run, refit_rows, write_fitted_profile

    source = cfg.log_dir or "this run"
    final = result.get("final_plan")
    if final and final.get("step_ms") is None:  # migrated at the last step: nothing measured the plan it ended on
        result["refit"] = None
        return
    try:
        # After a migration, the last plan's own steps: the whole run's median spans every plan.
        measured = result | {k: v for k, v in (result.get("final_plan") or {}).items() if k.startswith("step_")}
        result["refit"] = refit_rows(refit_of_run(measured, predicted.unscaled_ms, source))
        if cfg.log_dir:
            written = write_fitted_profile(cfg.log_dir, measured, predicted.unscaled_ms, predicted.profile_source)
            result["refit_file"] = None if written is None else str(written)
    except PlannerError as err:  # the run itself succeeded: say why there is no refit, and report the rest
        result["refit"] = None
        note(f"no refit of this run: {err.message}", to_stderr=True)


def _print_result(result: dict[str, Any]) -> None:
    """The run's summary table, the parameter servers' table and where the checkpoint went."""
    from rich.table import Table

    from persia_planner.modules.train.ps_usage import usage_table
    from persia_planner.modules.train.terminal import summary_rows

    table = Table(title="persia train")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in summary_rows(result):
        table.add_row(name, value)
    make_console().print(table)
    if result.get("ps_servers"):
        header, server_rows = usage_table(result["ps_servers"])
        servers_table = Table(title="parameter servers")
        for i, column in enumerate(header):
            servers_table.add_column(column, justify="left" if i == 0 else "right")
        for row in server_rows:
            servers_table.add_row(*row)
        make_console().print(servers_table)
    if result.get("checkpoint"):
        note(f"checkpoint of step {result['last_step']} in {result['checkpoint']}", to_stderr=False)
