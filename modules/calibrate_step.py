"""The last phase of ``persia calibrate``: whole training steps, set against the cost model's prediction of them.

The other benchmarks time the engines one by one (fbgemm's kernels, the dense network, gloo, one RPC); a step also
spends time none of them sees: TorchRec's input distribution, Python and autograd, the client's work for each PS
table, and the waits of trainers that share the machine in their collectives. Three small ``persia train`` jobs,
predicted from the figures just measured, fit what the model lacks:

- ``small`` (all tables local, K = 0) gives a fixed time per step (``overhead_ms``, the cost model's
  ``step_overhead_ms``);
- ``ps`` (two of its tables on one server, K = 4), predicted with that, gives what one PS request costs the trainer
  in a step (``ps_client_ms``), in place of the bare RPC round trip;
- ``large`` (the small job at 8x the batch) is predicted with both and kept as a check of the fit
  (``check_error``: predicted / measured - 1), not fitted to.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

__all__ = ["STEP_JOBS", "calibrate_step"]

# Each job: 4 tables of 2,000 rows, dim 16, on two trainers of this machine (Zipf ids over every row).
STEP_JOBS: dict[str, dict[str, int]] = {
    "small": {"batch": 512, "ps_tables": 0, "staleness": 0},
    "large": {"batch": 4096, "ps_tables": 0, "staleness": 0},
    "ps": {"batch": 512, "ps_tables": 2, "staleness": 4},
}
_TABLES, _ROWS, _DIM, _TRAINERS = 4, 2000, 16, 2


def calibrate_step(measured: dict[str, Any], steps: int) -> dict[str, Any]:
    """Run :data:`STEP_JOBS` and fit the step's terms the other benchmarks cannot see.

    Args:
        measured: The profile so far (every other benchmark's results).
        steps: Steps of each job (its median step after warm-up is measured).

    Returns:
        The profile's ``step`` section: ``overhead_ms``, ``ps_client_ms``, ``check_error`` and each job's
        ``measured_ms`` and ``predicted_ms`` (with the fit as far as it had come when the job ran).
    """
    jobs: dict[str, dict[str, Any]] = {"small": _run("small", measured, steps)}
    fitted: dict[str, float] = {"overhead_ms": max(0.0, jobs["small"]["residual_ms"])}
    # The PS job, predicted with the fixed time: what is left is the trainer's cost of its PS requests.
    jobs["ps"] = _run("ps", {**measured, "step": fitted}, steps)
    ps = jobs["ps"]
    fitted["ps_client_ms"] = max(0.0, ps["ps_client_ms"] + ps["residual_ms"] / ps["requests"])
    jobs["large"] = _run("large", {**measured, "step": fitted}, steps)
    return {
        **fitted,
        "check_error": jobs["large"]["predicted_ms"] / jobs["large"]["measured_ms"] - 1,
        "jobs": {
            name: {k: job[k] for k in ("batch", "ps_tables", "staleness", "measured_ms", "predicted_ms")}
            for name, job in jobs.items()
        },
    }


def _run(name: str, profile: dict[str, Any], steps: int) -> dict[str, Any]:
    """Plan, predict and train one job on a topology of this machine described by ``profile``."""
    import yaml

    from persia_planner import CostModel, ModelSpec, SearchConfig, Tier, Topology
    from persia_planner.planner import Planner
    from persia_planner.search import GreedyLocalSearch
    from persia_planner.specs import DenseSpec, TableSpec

    from .data.criteo_format import NUM_INTEGER
    from .data.synthetic import ZIPF_ALPHA
    from .train import TrainConfig, train_local

    job = STEP_JOBS[name]
    tables = tuple(TableSpec(f"c{i + 1}", _ROWS, _DIM, zipf_alpha=ZIPF_ALPHA) for i in range(_TABLES))
    dense = DenseSpec.dlrm(NUM_INTEGER, _DIM, _TABLES)
    model = ModelSpec(f"calibrate-{name}", job["batch"], tables, dense=dense, staleness=job["staleness"])
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "profile.yaml").write_text(yaml.safe_dump(profile))
        hosts: list[dict[str, Any]] = [
            {
                "name": "trainer",
                "ddr": "8GiB",
                "profile": "profile.yaml",
                "cpus": {"count": _TRAINERS, "memory": "256MiB"},
            }
        ]
        if job["ps_tables"]:
            hosts.append({"name": "ps", "role": "parameter_server", "ddr": "2GiB", "profile": "profile.yaml"})
        topology = Topology.from_dict({"name": f"calibrate-{name}", "hosts": hosts}, base_dir=tmp)

        def plan_on(tiers: frozenset[Tier]) -> dict[str, Any]:
            config = SearchConfig(seed=0, improve_time_s=1.0, tiers=tiers)
            return dict(Planner(GreedyLocalSearch(config)).plan(model, topology).tables)

        placements = plan_on(frozenset({Tier.HBM}))
        if job["ps_tables"]:
            remote = plan_on(frozenset({Tier.PS}))
            placements |= {t.name: remote[t.name] for t in tables[: job["ps_tables"]]}
        cost = CostModel(model, topology)
        estimate, _ = cost.evaluate(placements)
        mode = "sync" if job["staleness"] == 0 else "hybrid"
        cfg = TrainConfig(
            steps=steps,
            mode=mode,
            staleness=job["staleness"],
            trainers=_TRAINERS,
            eval_batches=1,
            progress=False,
            teacher_rows_scale=1.0,
        )
        result = train_local(cfg, model, placements, servers=len(topology.servers), topology=topology)
    return {
        **job,
        "measured_ms": result["step_ms"],
        "predicted_ms": estimate.step_ms,
        "residual_ms": result["step_ms"] - estimate.step_ms,
        "ps_client_ms": cost.constants.ps_client_ms,
        "requests": 2 * job["ps_tables"] * max(1, len(topology.servers)),  # a lookup and a push per table and server
    }
