"""The last phase of ``persia calibrate``: whole training steps, set against the cost model's prediction of them.

The other benchmarks time the engines one by one (fbgemm's kernels, the dense network, gloo, one RPC); a step also
spends time none of them sees: TorchRec's input distribution, each sharding type's own collectives and reshuffles,
Python and autograd, the client's work for each PS table, and the waits of trainers that share the machine in their
collectives. Small ``persia train`` jobs (TorchRec's DMP, and the servers), predicted from the figures just measured,
fit what the model lacks:

- ``table_wise`` (every table whole, at a batch, table count and width plans run at) gives a fixed time per step
  (``overhead_ms``, the cost model's ``step_overhead_ms``: its residual, measured - predicted);
- one job per other TorchRec sharding type, every table placed by it, gives the factor on its tables' modelled
  exchange (a replica's work) that makes DMP's run of that type take what it measured with that fixed time
  (``sharding_scale``: that type's input and output distribution, row-wise bucketize and reduce-scatter,
  column-wise concat, the replica's all-reduce);
- ``ps`` (half its tables on two servers, K = 4), predicted with all of those, gives what one PS request costs
  the trainer in a step (``ps_client_ms``), in place of the bare RPC round trip;
- ``large`` (4 narrow tables at twice the batch) is predicted with all of these and kept as a check of the fit
  (``check_error``: predicted / measured - 1), not fitted to.

A disturbance shows twice. Within a job, the median step of its first half (after warm-up) and of its second half
differ (:func:`halves_spread`): the job runs again, up to a bound, and its quietest run is kept. Across jobs, the
reference measured before and after the sharding jobs disagrees (:func:`reference_agrees`): the whole phase runs
again, up to :data:`PHASE_RETRIES` times, and if it still disagrees the section says ``noisy: true`` with both
figures. Both land in the profile's ``noise:`` section, under ``step``. Past a time budget nothing runs again: on a
busy machine the runs again cost the most and help the least.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persia_planner.modules.tools.noise import Timer, Timing

__all__ = [
    "PHASE_RETRIES",
    "STEP_JOBS",
    "STEP_TOLERANCE",
    "Phase",
    "StepJob",
    "calibrate_step",
    "halves_spread",
    "reference_agrees",
    "repeat_job",
    "sharding_phase",
]


@dataclass(frozen=True)
class StepJob:
    """One small training job: ``tables`` tables of ``rows`` rows and ``dim`` columns on two trainers of this
    machine (Zipf ids over every row), the first ``ps_tables`` of them on ``servers`` parameter servers.

    Attributes:
        sharding: Every local table placed by this TorchRec sharding type (None: as the planner chooses).
    """

    batch: int
    tables: int = 4
    dim: int = 16
    rows: int = 2000
    ps_tables: int = 0
    servers: int = 0
    staleness: int = 0
    sharding: str | None = None


# The sharding jobs' shape: a batch, table count and width the benchmarks' cases run at, so that a type's
# collectives (row-wise's reduce-scatter is not linear in its bytes on gloo) are measured where plans run.
_SHAPE = {"batch": 2048, "tables": 12, "dim": 32}
# Each TorchRec sharding type a CPU cluster runs, beside the reference.
SHARDING_JOBS = ("row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")
STEP_JOBS: dict[str, StepJob] = {
    "table_wise": StepJob(**_SHAPE, sharding="table_wise"),
    **{name: StepJob(**_SHAPE, sharding=name) for name in SHARDING_JOBS},
    # Tables go to the servers because they are large: their requests carry many distinct rows, whose store work
    # on servers that share the trainers' cores is part of what a request costs a trainer here.
    "ps": StepJob(**_SHAPE, rows=20_000, ps_tables=6, servers=2, staleness=4),
    "large": StepJob(batch=4096, tables=4, dim=16),
}
_TRAINERS = 2
_SHAPE_STEPS_FACTOR = 4  # each job's steps, in calibration's steps per job (Sizes.step_steps)
# The factors a fit may reach: a job's noise must not price a type as free, and the modelled exchange a factor
# multiplies is small beside what DMP adds to it on CPU (row-wise: about 15x).
_SCALE_RANGE = (0.05, 100.0)
# How far a job's two halves, or the reference before and after the others, may differ (relative to the smaller).
STEP_TOLERANCE = 0.10
PHASE_RETRIES = 2  # runs of the sharding phase beyond the first, while its reference disagrees
_WARM_UP_STEPS = 20  # at most: a job's first steps (and the trainer's profiled window) are not its steady state


def halves_spread(step_ms: Sequence[float]) -> float:
    """How far the median of a job's first half of steps is from its second half's, over the smaller (0 for fewer
    than two steps): a disturbance in part of a job moves one half."""
    if len(step_ms) < 2:
        return 0.0
    middle = len(step_ms) // 2
    first, second = statistics.median(step_ms[:middle]), statistics.median(step_ms[middle:])
    smaller = min(first, second)
    return abs(first - second) / smaller if smaller > 0 else 0.0


def reference_agrees(before_ms: float, after_ms: float, tolerance: float = STEP_TOLERANCE) -> bool:
    """Whether the reference's step before the other jobs and after them agree within ``tolerance`` (of the
    smaller): if not, the machine changed under the jobs between them."""
    return abs(before_ms - after_ms) <= tolerance * min(before_ms, after_ms)


@dataclass(frozen=True)
class Phase:
    """The sharding phase as kept: the reference before and after, each sharding job, the runs it took.

    Attributes:
        before: The reference job run first.
        jobs: Each sharding job, by name.
        after: The reference job run last.
        tries: How many times the phase ran.
        agreed: Whether the kept run's reference agreed with itself (:func:`reference_agrees`).
    """

    before: Mapping[str, Any]
    jobs: Mapping[str, Mapping[str, Any]]
    after: Mapping[str, Any]
    tries: int
    agreed: bool

    @property
    def disagreement(self) -> float:
        """How far the reference's two steps differ, over the smaller."""
        a, b = self.before["measured_ms"], self.after["measured_ms"]
        return abs(a - b) / min(a, b)


def sharding_phase(
    run: Callable[[str], Mapping[str, Any]],
    jobs: Sequence[str],
    tolerance: float = STEP_TOLERANCE,
    retries: int = PHASE_RETRIES,
    out_of_time: Callable[[], bool] = lambda: False,
) -> Phase:
    """Run the reference (``table_wise``), each of ``jobs``, and the reference again, with ``run(name)`` (a job's
    result, with ``measured_ms``); while the reference's two steps disagree, run the whole phase again, at most
    ``retries`` more times and not once ``out_of_time()``. Keeps the run whose reference agreed, else the one whose
    reference disagreed least."""
    kept: Phase | None = None
    tries = 0
    while True:
        tries += 1
        before = run("table_wise")
        done = {name: run(name) for name in jobs}
        after = run("table_wise")
        agreed = reference_agrees(before["measured_ms"], after["measured_ms"], tolerance)
        phase = Phase(before, done, after, tries, agreed)
        if kept is None or phase.disagreement < kept.disagreement:
            kept = phase
        if agreed or tries > retries or out_of_time():
            return dataclasses.replace(kept, tries=tries)


def calibrate_step(
    measured: dict[str, Any],
    steps: int,
    runs: int = 2,
    timer: Timer | None = None,
    retries: int = PHASE_RETRIES,
    budget_s: float = math.inf,
) -> dict[str, Any]:
    """Run :data:`STEP_JOBS` and fit the step's terms the other benchmarks cannot see.

    Args:
        measured: The profile so far (every other benchmark's results).
        steps: Calibration's steps per job (``Sizes.step_steps``); each job runs 4x as many and its median step
            after warm-up is measured.
        runs: The most runs of one job while its halves disagree (:func:`halves_spread`).
        timer: Records each job's spread and runs, and the reference's disagreement (the ``noise:`` section).
        retries: The most runs of the sharding phase beyond the first while its reference disagrees.
        budget_s: Seconds after which no job runs again and no phase is retried: on a busy machine the runs again
            cost the most and help the least.

    Returns:
        The profile's ``step`` section: ``overhead_ms``, ``ps_client_ms``, ``sharding_scale`` (per type),
        ``check_error``, each job's ``measured_ms`` and ``predicted_ms`` (with the fit as far as it had come
        when the job ran), and whether the phase was ``noisy`` (its reference still disagreed) with the
        reference's two steps (``reference_ms``) and the phase's ``tries``.
    """
    # The jobs run longer than a step's few ms of difference between sharding types needs on a quiet machine, so
    # that their medians hold still on a busy one (a step costs far less than a job's start); the reference runs
    # before and after the others, and what they share is the mean of its two residuals.
    steps = _SHAPE_STEPS_FACTOR * steps
    bare = {**measured, "step": {"overhead_ms": 0.0}}
    deadline = time.monotonic() + budget_s

    def out_of_time() -> bool:
        return time.monotonic() > deadline

    def measure(name: str, profile: dict[str, Any]) -> dict[str, Any]:
        return repeat_job(lambda: _run(name, profile, steps), runs, out_of_time=out_of_time)

    phase = sharding_phase(lambda name: measure(name, bare), SHARDING_JOBS, retries=retries, out_of_time=out_of_time)
    before, runs_by_type, after = phase.before, dict(phase.jobs), phase.after
    shared_ms = (before["residual_ms"] + after["residual_ms"]) / 2
    jobs = {"table_wise": {**after, "measured_ms": (before["measured_ms"] + after["measured_ms"]) / 2}}
    jobs |= runs_by_type
    fitted: dict[str, Any] = {
        "overhead_ms": max(0.0, shared_ms),
        "sharding_scale": {name: _fit_scale(job, job["measured_ms"] - shared_ms) for name, job in runs_by_type.items()},
    }
    # The PS job, predicted with all of these: what is left is the trainer's cost of its PS requests.
    jobs["ps"] = ps = measure("ps", {**measured, "step": fitted})
    fitted["ps_client_ms"] = max(0.0, ps["ps_client_ms"] + ps["residual_ms"] / ps["requests"])
    jobs["large"] = measure("large", {**measured, "step": fitted})
    if timer is not None:
        for name, job in (("table_wise before", before), *runs_by_type.items(), ("table_wise after", after)):
            timer.record(name, job["timing"])
        for name in ("ps", "large"):
            timer.record(name, jobs[name]["timing"])
        timer.record(
            "table_wise before / after",
            Timing(jobs["table_wise"]["measured_ms"] / 1e3, phase.disagreement, phase.tries, not phase.agreed),
        )
    return {
        **fitted,
        "check_error": jobs["large"]["predicted_ms"] / jobs["large"]["measured_ms"] - 1,
        "noisy": not phase.agreed,
        "reference_ms": [before["measured_ms"], after["measured_ms"]],
        "tries": phase.tries,
        "jobs": {
            name: {
                **{k: v for k, v in dataclasses.asdict(STEP_JOBS[name]).items() if v is not None},
                **{k: job[k] for k in ("measured_ms", "predicted_ms")},
            }
            for name, job in jobs.items()
        },
    }


def _fit_scale(job: dict[str, Any], target_ms: float) -> float:
    """The factor on the job's sharding type at which its predicted step is ``target_ms`` (bisection: the step
    grows with the factor), within :data:`_SCALE_RANGE`."""
    predict = job["predict_with_scale"]
    lo, hi = _SCALE_RANGE
    if predict(lo) >= target_ms:
        return lo
    if predict(hi) <= target_ms:
        return hi
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predict(mid) < target_ms else (lo, mid)
    return (lo * hi) ** 0.5


def repeat_job(
    run: Callable[[], Mapping[str, Any]],
    runs: int,
    tolerance: float = STEP_TOLERANCE,
    out_of_time: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """``run()`` (a job's result, with ``measured_ms`` and its halves' ``spread``) again while its halves disagree
    by more than ``tolerance``, at most ``runs`` times in all and not once ``out_of_time()``; the quietest run, with
    its ``timing`` (its median step, its spread, the runs it took, whether it stayed noisy)."""
    done = [run()]
    while done[-1]["spread"] > tolerance and len(done) < runs and not out_of_time():
        done.append(run())
    kept = min(done, key=lambda job: job["spread"])
    noisy = kept["spread"] > tolerance
    return {**kept, "timing": Timing(kept["measured_ms"] / 1e3, kept["spread"], len(done), noisy)}


def _step_times_ms(history: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each step's ms after warm-up, from the summary's ``history`` (the time at each step's end)."""
    ends = [float(h["t_s"]) for h in history]
    times = [(b - a) * 1e3 for a, b in itertools.pairwise(ends)]
    return times[min(_WARM_UP_STEPS, len(times) // 2) :]


def _topology(name: str, job: StepJob, profile: dict[str, Any], folder: str) -> Any:
    """A topology of this machine described by ``profile``: one host of two trainers (and the job's servers)."""
    import yaml

    from persia_planner import Topology

    # The profile is this machine's, measured now; the topology host it is meant for is another topology's name.
    machine = {k: v for k, v in profile.get("machine", {}).items() if k != "topology_host"}
    Path(folder, "profile.yaml").write_text(yaml.safe_dump({**profile, "machine": machine}))
    hosts: list[dict[str, Any]] = [
        {"name": "trainer", "ddr": "8GiB", "profile": "profile.yaml", "cpus": {"count": _TRAINERS, "memory": "256MiB"}}
    ]
    if job.servers:
        hosts.append(
            {"name": "ps", "count": job.servers, "role": "parameter_server", "ddr": "2GiB", "profile": "profile.yaml"}
        )
    return Topology.from_dict({"name": f"calibrate-{name}", "hosts": hosts}, base_dir=folder)


def _run(name: str, profile: dict[str, Any], steps: int) -> dict[str, Any]:
    """Plan, predict and train one job on a topology of this machine described by ``profile``."""
    from persia_planner import CostModel, ModelSpec, SearchConfig, Sharding, Tier
    from persia_planner.model.constraints import NO_CONSTRAINTS, TableConstraints
    from persia_planner.model.specs import DenseSpec, TableSpec
    from persia_planner.modules.data.criteo_format import NUM_INTEGER
    from persia_planner.modules.data.synthetic import ZIPF_ALPHA
    from persia_planner.modules.train.engine import train_local
    from persia_planner.modules.train.run_model import run_config
    from persia_planner.planner import Planner
    from persia_planner.search import GreedyLocalSearch
    from persia_planner.tiers import local_tiers, server_tiers

    job = STEP_JOBS[name]
    # A sharding job's tables are constrained to its type (the bound and the search both honour a constraint).
    allowed = NO_CONSTRAINTS if job.sharding is None else TableConstraints(frozenset({Sharding(job.sharding)}))
    tables = tuple(
        TableSpec(f"c{i + 1}", job.rows, job.dim, zipf_alpha=ZIPF_ALPHA, constraints=allowed) for i in range(job.tables)
    )
    dense = DenseSpec.dlrm(NUM_INTEGER, job.dim, job.tables)
    model = ModelSpec(f"calibrate-{name}", job.batch, tables, dense=dense, staleness=job.staleness)
    with tempfile.TemporaryDirectory() as tmp:
        topology = _topology(name, job, profile, tmp)

        def plan_on(tiers: frozenset[Tier]) -> dict[str, Any]:
            config = SearchConfig(seed=0, improve_time_s=1.0, tiers=tiers)
            return dict(Planner(GreedyLocalSearch(config)).plan(model, topology).tables)

        placements = plan_on(frozenset(local_tiers()[:1]))  # the fastest: the GPU's own memory
        if job.ps_tables:
            remote = plan_on(frozenset(server_tiers()[:1]))  # the servers' DDR
            placements |= {t.name: remote[t.name] for t in tables[: job.ps_tables]}
        cost = CostModel(model, topology)
        estimate, _ = cost.evaluate(placements)
        cfg = run_config(  # the model's K (job.staleness): sync mode at K = 0
            model, steps=steps, trainers=_TRAINERS, eval_batches=1, progress=False, teacher_rows_scale=1.0
        )
        result = train_local(cfg, model, placements, servers=len(topology.servers), topology=topology)

    def predict_with_scale(scale: float) -> float:
        """The job's predicted step (ms) with its sharding type's factor at ``scale``."""
        step = {**profile.get("step", {}), "sharding_scale": {job.sharding: scale}}
        with tempfile.TemporaryDirectory() as tmp:
            scaled = CostModel(model, _topology(name, job, {**profile, "step": step}, tmp))
            return scaled.evaluate(placements)[0].step_ms

    return {
        "measured_ms": result["step_ms"],
        "spread": halves_spread(_step_times_ms(result.get("history", []))),
        "predicted_ms": estimate.step_ms,
        "residual_ms": result["step_ms"] - estimate.step_ms,
        "ps_client_ms": cost.constants.ps_client_ms,
        "requests": 2 * job.ps_tables * max(1, len(topology.servers)),  # a lookup and a push per table and server
        "predict_with_scale": predict_with_scale,
    }
