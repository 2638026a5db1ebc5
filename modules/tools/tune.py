"""Measured refinement: run candidate plans on this machine for a short timed window each, alternated.

``persia plan --tune`` hands this the plans worth measuring (:func:`persia_planner.planner.candidate_plans`, and
TorchRec's planner's plan where torchrec is installed); each runs as ``persia train`` would run it (the same
launcher, servers, trainers and synthetic data), in rounds that visit every candidate once, until the budget would
run out. What each run measured becomes the plan's :class:`persia_planner.plan.tuning.Tuning` record.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from persia_planner.cost.analytic import CostModel
from persia_planner.errors import Interrupted, PlannerError, first_line
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.engine import train_local
from persia_planner.modules.train.run_model import run_config
from persia_planner.plan.plan import Plan
from persia_planner.plan.tuning import MeasuredCandidate, Tuning, fastest
from persia_planner.plan.validation import validate
from persia_planner.planner import candidate_plans, priced_plan
from persia_planner.topology.graph import Topology
from persia_planner.topology.hardware import DeviceKind

__all__ = ["TuneRun", "measure_candidates", "require_this_machine", "tune", "tune_config", "tune_runs"]

RUN_TIMEOUT_S = 600.0
"""A candidate's run that takes longer than this is stopped and counted as failed."""


@dataclass(frozen=True)
class TuneRun:
    """One candidate to measure.

    Attributes:
        name: What the candidate is (``search``, ``whole tables``, ``torchrec``).
        plan: Its plan (every table's placement, and its estimate under the cost model).
    """

    name: str
    plan: Plan


def require_this_machine(topology: Topology) -> None:
    """Refuse a topology that this machine cannot run the candidates of: one trainer host, its GPUs present.

    Raises:
        PlannerError: The topology has several trainer hosts, or more GPUs than this machine.
    """
    import torch

    if len(topology.trainers) != 1:
        raise PlannerError(
            f"--tune runs the candidates on this machine, and topology {topology.name!r} has "
            f"{len(topology.trainers)} trainer hosts",
            fixes=("tune on a topology of this machine (one trainer host), then plan the cluster with what it chose",),
        )
    if topology.device_kind is DeviceKind.GPU and torch.cuda.device_count() < len(topology.gpus):
        raise PlannerError(
            f"--tune runs the candidates on this machine, which has {torch.cuda.device_count()} GPUs; topology "
            f"{topology.name!r} has {len(topology.gpus)}",
            fixes=("tune where the topology's GPUs are",),
        )


def tune_config(model: ModelSpec, topology: Topology, *, steps: int, seed: int = 0) -> TrainConfig:
    """The training options of a timed run: the model's K (``sync`` at K = 0), one trainer per trainer device of
    ``topology``, the model's batch, synthetic data, one evaluation batch, no progress bar."""
    return run_config(model, steps=steps, trainers=len(topology.gpus), eval_batches=1, seed=seed, progress=False)


def measure_candidates(
    runs: Sequence[TuneRun],
    model: ModelSpec,
    topology: Topology,
    cfg: TrainConfig,
    *,
    budget_s: float,
    on_run: Callable[[str, float | None], None] | None = None,
    train: Callable[..., dict] = train_local,
) -> list[MeasuredCandidate]:
    """Run every candidate in alternated rounds until the next round would overrun ``budget_s`` (at least one).

    A candidate that fails (TorchRec would not run it here, a run error) is measured no further and keeps its error
    line; the others go on. Rounds alternate the candidates so that a machine that slows down or speeds up during the
    tuning slows all of them alike.

    Args:
        runs: The candidates, the search's first.
        model: The model (with the run's K and wire).
        topology: The cluster the plans are for; this machine runs its trainer devices and servers.
        cfg: The options of every run (:func:`tune_config`).
        budget_s: Seconds the tuning may take; a round is started only when the last one's length still fits.
        on_run: Called after each run with the candidate's name and its samples/s (None when it failed).
        train: The launcher (``train_local``; tests pass a stand-in that does not start processes).

    Returns:
        One :class:`MeasuredCandidate` per run, in ``runs``' order.
    """
    rates: dict[str, list[float]] = {r.name: [] for r in runs}
    errors: dict[str, str] = {}
    started = time.monotonic()
    while True:
        round_started = time.monotonic()
        for run in runs:
            if run.name in errors:
                continue
            try:
                result = train(
                    cfg,
                    model,
                    dict(run.plan.tables),
                    servers=max(1, len(topology.servers)),
                    topology=topology,
                    run_timeout_s=RUN_TIMEOUT_S,
                )
            except Interrupted:  # a signal stops the tuning, not just this candidate
                raise
            except Exception as err:  # one candidate's failure is its record, not the tuning's end
                errors[run.name] = first_line(err, with_type=not isinstance(err, PlannerError))
                if on_run is not None:
                    on_run(run.name, None)
                continue
            rate = float(result["samples_per_s"])
            rates[run.name].append(rate)
            if on_run is not None:
                on_run(run.name, rate)
        # The next round runs what this one ran (a failed candidate drops out): it takes about as long.
        round_s = time.monotonic() - round_started
        if len(errors) == len(runs) or time.monotonic() - started + round_s > budget_s:
            break
        cfg = dataclasses.replace(cfg, seed=cfg.seed + 1)  # another draw of the data, the same for every candidate
    return [MeasuredCandidate(r.name, r.plan.step_ms, tuple(rates[r.name]), errors.get(r.name)) for r in runs]


TORCHREC = "torchrec"
"""The name of TorchRec's planner's plan among the candidates."""


def tune_runs(
    searched: Plan, model: ModelSpec, topology: Topology, *, limit: int, seed: int = 0, with_torchrec: bool = True
) -> tuple[list[TuneRun], list[MeasuredCandidate]]:
    """The candidates worth running, and those that cannot run (with why).

    The search's plan and its best distinct alternatives (:func:`.planner.candidate_plans`, ``limit`` in all), then,
    with ``with_torchrec``, TorchRec's own planner's plan of the same model and cluster, unless it equals one of
    them; when TorchRec finds no plan, or one that overfills a device as this runtime allocates, it is recorded as
    such and not run.
    """
    runs = [TuneRun(name, p) for name, p in candidate_plans(model, topology, limit=limit, seed=seed, first=searched)]
    failed: list[MeasuredCandidate] = []
    if with_torchrec:
        from persia_planner.plan.torchrec_scoring import plan_with_torchrec

        try:
            placements = plan_with_torchrec(model, topology)
        except PlannerError as err:
            failed.append(MeasuredCandidate(TORCHREC, None, (), first_line(err)))
        else:
            # Beside the search's bound: no plan of its options beats it, and TorchRec's are among them.
            theirs = priced_plan(CostModel(model, topology), placements, lower_bound_ms=searched.lower_bound_ms)
            problems = validate(theirs, model, topology)
            if problems:
                failed.append(MeasuredCandidate(TORCHREC, theirs.step_ms, (), f"does not fit here: {problems[0]}"))
            elif all(dict(theirs.tables) != dict(r.plan.tables) for r in runs):
                runs.append(TuneRun(TORCHREC, theirs))
    return runs, failed


def tune(
    searched: Plan,
    model: ModelSpec,
    topology: Topology,
    *,
    budget_s: float,
    steps: int,
    limit: int = 4,
    seed: int = 0,
    with_torchrec: bool = True,
    on_runs: Callable[[Sequence[TuneRun]], None] | None = None,
    on_run: Callable[[str, float | None], None] | None = None,
) -> Plan:
    """The fastest measured of ``searched`` and its alternatives, with the :class:`persia_planner.plan.tuning.Tuning`
    record.

    Args:
        searched: The search's plan of ``model`` on ``topology``.
        model: The model (with the run's K and wire).
        topology: The cluster; this machine runs its trainer devices and servers.
        budget_s: Seconds the runs may take (at least one round is run).
        steps: Training steps of each run.
        limit: Plans of our search to consider (TorchRec's comes on top).
        seed: Seed of the searches and of the first round's data.
        with_torchrec: Also run TorchRec's planner's plan.
        on_runs: Called with the candidates before the first run.
        on_run: Called after each run (:func:`measure_candidates`).
    """
    runs, failed = tune_runs(searched, model, topology, limit=limit, seed=seed, with_torchrec=with_torchrec)
    if on_runs is not None:
        on_runs(runs)
    cfg = tune_config(model, topology, steps=steps, seed=seed)
    measured = measure_candidates(runs, model, topology, cfg, budget_s=budget_s, on_run=on_run) + failed
    best = fastest(measured)
    record = Tuning(best.name, steps, float(budget_s), tuple(measured))
    kept = next((r.plan for r in runs if r.name == best.name), searched)
    return dataclasses.replace(kept, tuning=record)
