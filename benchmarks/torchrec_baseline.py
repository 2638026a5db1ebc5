"""TorchRec 1.8's own planner as a baseline: its planning time, its plan, and both plans under both cost models.

TorchRec's ``EmbeddingShardingPlanner`` runs in a child process (``python torchrec_baseline.py --worker CONFIG``)
that is killed when it overruns, so a slow planner cannot hang the benchmark. The child plans on the meta device
(no memory is allocated, no GPU is needed) for ``compute_device="cuda"`` (or ``"cpu"``: CPU trainers, whose
tables TorchRec keeps in each rank's DDR), with TorchRec's default enumerator,
proposers, partitioner, storage reservation and perf model; the only constraints are the tables' pooling factors
and the sharding types our plans can represent (every TorchRec type but ``grid_shard``). Its chosen plan crosses
the process boundary as JSON (:class:`persia_planner.plan.torchrec_export.TorchRecSharding` dicts).

    python benchmarks/torchrec_baseline.py        # self-check: 10 tables on 8 ranks, a few seconds
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from persia_planner import CostModel, ModelSpec, Plan, Sharding, TablePlacement, Topology, validate  # noqa: E402
from persia_planner.plan.torchrec_export import TorchRecSharding, gpu_tables  # noqa: E402
from persia_planner.plan.torchrec_scoring import from_sharding_options, torchrec_topology_kwargs  # noqa: E402
from persia_planner.synthetic import model_dict  # noqa: E402

__all__ = [
    "compare_plans",
    "model_to_dict",
    "over_capacity",
    "score_ours",
    "score_torchrec",
    "time_torchrec_planner",
    "torchrec_plan_placements",
    "torchrec_topology_args",
]

# Sharding types our placements can represent: TorchRec's planner is constrained to these (grid_shard is not one).
SUPPORTED_SHARDING_TYPES = tuple(s.value for s in Sharding if s is not Sharding.PS_HASH)
DEFAULT_STARTUP_TIMEOUT_S = 180.0  # importing torch + torchrec and building the meta collection
COMPUTE_DEVICES = ("cuda", "cpu")


def model_to_dict(model: ModelSpec) -> dict[str, Any]:
    """``model`` as model.yaml content (``ModelSpec.from_dict`` reads it back), to send to the child process."""
    return model_dict(model)


def torchrec_topology_args(
    *, world_size: int, local_world_size: int, hbm_bytes: int, ddr_bytes: int, topology: Topology | None = None
) -> dict[str, Any]:
    """Keyword arguments of TorchRec's ``Topology`` (without ``compute_device``).

    Args:
        world_size: Number of ranks (GPUs).
        local_world_size: Ranks per host.
        hbm_bytes: HBM per rank, before TorchRec's own storage reservation.
        ddr_bytes: Host DDR per rank, before TorchRec's own storage reservation.
        topology: When given, its bandwidths (HBM, DDR, PCIe, NVLink, NIC) replace TorchRec's defaults, so both
            planners price the same hardware; capacities still come from ``hbm_bytes`` / ``ddr_bytes``.
    """
    args: dict[str, Any] = {}
    if topology is not None:
        args = torchrec_topology_kwargs(topology)
        if args["world_size"] != world_size or args["local_world_size"] != local_world_size:
            raise ValueError(
                f"topology {topology.name!r} has {args['world_size']} GPUs, {args['local_world_size']} per host; "
                f"asked for world_size={world_size}, local_world_size={local_world_size}"
            )
    args.update(
        world_size=int(world_size),
        local_world_size=int(local_world_size),
        hbm_cap=int(hbm_bytes),
        ddr_cap=int(ddr_bytes),
    )
    return args


def time_torchrec_planner(
    model: ModelSpec,
    *,
    world_size: int,
    local_world_size: int = 8,
    hbm_bytes: int,
    ddr_bytes: int,
    timeout_s: float,
    topology: Topology | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    compute_device: str = "cuda",
) -> dict[str, Any]:
    """Run TorchRec's ``EmbeddingShardingPlanner`` on ``model`` in a child process killed at ``timeout_s``.

    The planner gets TorchRec's defaults (proposers, partitioner, storage reservation, perf model),
    ``compute_device``, a batch of ``model.batch_size // world_size`` per rank, and per table its pooling
    factor, its optimizer (so optimizer state counts in storage) and the sharding types our plans represent.

    Args:
        model: The model to plan.
        world_size: Ranks (GPUs).
        local_world_size: Ranks per host.
        hbm_bytes: HBM per rank (TorchRec applies its own reservation on top).
        ddr_bytes: DDR per rank (TorchRec applies its own reservation on top).
        timeout_s: Limit on planning (``planner.plan``); the child is killed when it passes. The clock starts once
            torch is imported and the meta collection is built (``startup_timeout_s`` bounds that part).
        topology: Optional: take bandwidths from our topology (see :func:`torchrec_topology_args`).
        startup_timeout_s: Limit on the child's start-up.
        compute_device: TorchRec's ``compute_device``: ``"cuda"``, or ``"cpu"`` for CPU trainers (TorchRec then
            ignores ``hbm_bytes`` and places every table in the rank's ``ddr_bytes``; its CPU sharder offers
            table-wise, column-wise, table-column-wise and data-parallel only).

    Returns:
        ``status``: ``"ok"``, ``"timeout"`` or ``"failed"``; ``seconds``: planning time (``timeout_s`` on timeout);
        ``error``: one line, or None; ``options``: the chosen plan as :class:`TorchRecSharding` dicts, or None.
        Also ``objective_ms`` (TorchRec's perf-model objective of its plan), ``startup_s`` and ``wall_s``.
    """
    if compute_device not in COMPUTE_DEVICES:
        raise ValueError(f"compute_device must be one of {COMPUTE_DEVICES}, got {compute_device!r}")
    config = {
        "compute_device": compute_device,
        "model": model_to_dict(model),
        "topology": torchrec_topology_args(
            world_size=world_size,
            local_world_size=local_world_size,
            hbm_bytes=hbm_bytes,
            ddr_bytes=ddr_bytes,
            topology=topology,
        ),
        "batch_size_per_rank": max(1, model.batch_size // world_size),
        "sharding_types": list(SUPPORTED_SHARDING_TYPES),
    }
    result: dict[str, Any] = {
        "status": "failed",
        "seconds": 0.0,
        "error": None,
        "options": None,
        "objective_ms": None,
        "startup_s": None,
        "wall_s": 0.0,
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="torchrec-baseline-") as tmp:
        config_path = Path(tmp, "config.json")
        config_path.write_text(json.dumps(config))
        stderr_path = Path(tmp, "stderr.txt")
        with open(stderr_path, "w") as stderr:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker", str(config_path)],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
            )
            lines = _read_lines(proc)
            try:
                line, ready_at = _wait_for_line(lines, ("READY", "RESULT "), started + startup_timeout_s)
                if line is None:
                    result["error"] = _child_failure(proc, stderr_path, f"did not start within {startup_timeout_s:g} s")
                    if proc.poll() is None:
                        result["status"] = "timeout"
                    return result
                result["startup_s"] = round(ready_at - started, 3)
                if line == "READY":
                    line, _ = _wait_for_line(lines, ("RESULT ",), ready_at + timeout_s)
                if line is None:
                    if proc.poll() is None:
                        result.update(status="timeout", seconds=float(timeout_s), error=f"killed after {timeout_s:g} s")
                    else:
                        result["error"] = _child_failure(proc, stderr_path, "exited without a result")
                    return result
                result.update(json.loads(line[len("RESULT ") :]))
                return result
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                result["wall_s"] = round(time.perf_counter() - started, 3)


def _read_lines(proc: subprocess.Popen) -> queue.Queue[str | None]:
    """The child's stdout lines, read by a daemon thread into a queue (None marks the end of output)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, name="torchrec-baseline-stdout", daemon=True).start()
    return lines


def _wait_for_line(
    lines: queue.Queue[str | None], prefixes: tuple[str, ...], deadline: float
) -> tuple[str | None, float]:
    """Wait for a line starting with one of ``prefixes``.

    Returns:
        ``(line, arrival time)``; ``(None, now)`` at the deadline or when the child's output ends.
    """
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return None, time.perf_counter()
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return None, time.perf_counter()
        if line is None:
            lines.put(None)  # keep the end marker for a later wait
            return None, time.perf_counter()
        if line.startswith(prefixes):
            return line, time.perf_counter()


def _child_failure(proc: subprocess.Popen, stderr_path: Path, what: str) -> str:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
    tail = [ln for ln in stderr_path.read_text(errors="replace").splitlines() if ln.strip()][-1:]
    code = proc.returncode
    return f"TorchRec planner child {what} (exit code {code}){': ' + tail[0][:300] if tail else ''}"


def torchrec_plan_placements(
    model: ModelSpec,
    *,
    world_size: int,
    local_world_size: int = 8,
    hbm_bytes: int,
    ddr_bytes: int,
    timeout_s: float,
    topology: Topology | None = None,
    compute_device: str = "cuda",
) -> tuple[dict[str, TablePlacement] | None, dict[str, Any]]:
    """TorchRec's plan for ``model`` as our placements (None unless it planned in time), and the run's status.

    Args:
        model: The model to plan.
        world_size: Ranks (GPUs).
        local_world_size: Ranks per host.
        hbm_bytes: HBM per rank.
        ddr_bytes: DDR per rank.
        timeout_s: Planning limit (see :func:`time_torchrec_planner`).
        topology: Our topology, whose GPUs name TorchRec's ranks (rank r = ``topology.gpus[r]``) and whose
            bandwidths TorchRec then uses; default a homogeneous cluster of ``world_size // local_world_size`` hosts.
        compute_device: TorchRec's ``compute_device`` (see :func:`time_torchrec_planner`).

    Returns:
        ``(placements, status)`` where ``status`` is :func:`time_torchrec_planner`'s dict.
    """
    status = time_torchrec_planner(
        model,
        world_size=world_size,
        local_world_size=local_world_size,
        hbm_bytes=hbm_bytes,
        ddr_bytes=ddr_bytes,
        timeout_s=timeout_s,
        topology=topology,
        compute_device=compute_device,
    )
    if status["status"] != "ok":
        return None, status
    if topology is None:
        topology = Topology.simple(
            trainers=world_size // local_world_size,
            gpus_per_trainer=local_world_size,
            hbm_bytes=hbm_bytes,
            ddr_bytes=ddr_bytes * local_world_size,
            name=f"torchrec-{world_size}",
        )
    entries = [TorchRecSharding.from_dict(d) for d in status["options"]]
    return from_sharding_options(entries, model, topology), status


def score_ours(placements: dict[str, TablePlacement], model: ModelSpec, topology: Topology) -> float:
    """Step time (ms) of a full placement under our cost model."""
    return float(CostModel(model, topology).evaluate(placements)[0].step_ms)


def score_torchrec(
    placements: Plan | dict[str, TablePlacement], model: ModelSpec, topology: Topology, torchrec_args: dict[str, Any]
) -> float:
    """TorchRec's perf-model objective (ms) of the GPU-resident part of a placement (imports torchrec).

    Args:
        placements: A plan or placements; ``ps`` tables are left out (TorchRec cannot price them).
        model: The model.
        topology: Our topology (rank r = ``topology.gpus[r]``).
        torchrec_args: TorchRec ``Topology`` arguments (:func:`torchrec_topology_args`).
    """
    from torchrec.distributed.planner import Topology as TorchRecTopology

    from persia_planner.plan.torchrec_scoring import score_with_torchrec, to_sharding_options

    tr_topology = TorchRecTopology(compute_device="cuda", **torchrec_args)
    batch = max(1, model.batch_size // tr_topology.world_size)
    options = to_sharding_options(placements, model, topology, batch_size_per_rank=batch, torchrec_topology=tr_topology)
    return score_with_torchrec(options, tr_topology, model)


def over_capacity(placements: Mapping[str, TablePlacement], model: ModelSpec, topology: Topology) -> dict[str, Any]:
    """How far a placement overfills the devices, as our runtime allocates (``validate``'s memory rule).

    Returns:
        ``bytes``: the sum over devices of what they hold beyond their usable capacity; ``devices``: how many are
        over; ``worst``: the device over by the most, or None.
    """
    cost = CostModel(model, topology)
    _, mem = cost.evaluate(placements)
    over = mem - cost.capacities() - 0.5  # validate() allows half a byte
    names = [g.name for g in topology.gpus] + [h.name for h in topology.trainers] + [s.name for s in topology.servers]
    worst = int(np.argmax(over)) if len(over) else 0
    return {
        "bytes": int(np.maximum(over, 0).sum()),
        "devices": int((over > 0).sum()),
        "worst": names[worst] if len(over) and over[worst] > 0 else None,
    }


def compare_plans(model: ModelSpec, topology: Topology, ours: Plan | None, *, timeout_s: float) -> dict[str, Any]:
    """Plan ``model`` with TorchRec on ``topology``'s hardware and score both plans under both cost models.

    TorchRec gets the topology's raw per-rank capacities (HBM, host DDR / GPUs per host; it applies its own
    reservation) and bandwidths, one rank per GPU. Under TorchRec's model only GPU-resident tables are priced
    (``ps`` tables, if our plan has any, are counted in ``ours_ps_tables``): give ``ours`` a plan without the PS tier
    to compare the same problem. A plan that overfills a device under our memory accounting is still scored, with
    its shortfall.

    Args:
        model: The model.
        topology: The cluster (its GPUs are TorchRec's ranks).
        ours: Our plan, or None where ours found none (then only TorchRec's plan is scored).
        timeout_s: TorchRec's planning limit.

    Returns:
        ``status``/``error``/``torchrec_seconds`` of the TorchRec run and, when it planned:
        ``ours_ms_ours`` / ``torchrec_ms_ours`` (step ms under our cost model), ``ours_ms_torchrec`` /
        ``torchrec_ms_torchrec`` (TorchRec's objective, ms), ``torchrec_objective_ms`` (as its planner reported it),
        ``torchrec_problems`` (our capacity/validity checks failed by TorchRec's plan), ``torchrec_over_capacity``
        / ``ours_over_capacity`` (:func:`over_capacity`) and each plan's choices.
    """
    local = len(topology.trainers[0].gpus)
    world = len(topology.gpus)
    args = torchrec_topology_args(
        world_size=world,
        local_world_size=local,
        hbm_bytes=min(g.hbm_bytes for g in topology.gpus),
        ddr_bytes=min(h.ddr_bytes for h in topology.trainers) // local,
        topology=topology,
    )
    theirs, status = torchrec_plan_placements(
        model,
        world_size=world,
        local_world_size=local,
        hbm_bytes=args["hbm_cap"],
        ddr_bytes=args["ddr_cap"],
        timeout_s=timeout_s,
        topology=topology,
    )
    out: dict[str, Any] = {"status": status["status"], "error": status["error"], "torchrec_seconds": status["seconds"]}
    if ours is not None:
        out.update(
            ours_ms_ours=float(ours.step_ms),
            ours_ps_tables=len(ours.tables) - len(gpu_tables(ours)),
            ours_over_capacity=over_capacity(ours.tables, model, topology),
        )
    if theirs is None:
        return out
    their_plan = Plan(model.name, topology.name, theirs, {}, 0.0, 0.0, 0.0)
    out.update(
        torchrec_ms_ours=score_ours(theirs, model, topology),
        torchrec_ms_torchrec=score_torchrec(theirs, model, topology, args),
        torchrec_objective_ms=status.get("objective_ms"),
        torchrec_problems=validate(their_plan, model, topology),
        torchrec_over_capacity=over_capacity(theirs, model, topology),
        torchrec_choices=_choices(theirs),
    )
    if ours is not None:
        out.update(ours_ms_torchrec=score_torchrec(ours, model, topology, args), ours_choices=_choices(ours.tables))
    return out


def _choices(placements: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in placements.values():
        key = f"{p.sharding.value}/{p.tier.value}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


# ---- the child process -----------------------------------------------------------------------------------------
def _worker(config_path: str) -> int:
    logging.disable(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    config = json.loads(Path(config_path).read_text())
    try:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner import Topology as TorchRecTopology
        from torchrec.distributed.planner.perf_models import NoopPerfModel

        from persia_planner.plan.torchrec_scoring import meta_collection, shardings_from_plan, torchrec_constraints

        model = ModelSpec.from_dict(config["model"], "model")
        topology = TorchRecTopology(compute_device=config.get("compute_device", "cuda"), **config["topology"])
        collection = meta_collection(model)
        planner = EmbeddingShardingPlanner(
            topology=topology,
            batch_size=int(config["batch_size_per_rank"]),
            constraints=torchrec_constraints(model, sharding_types=config["sharding_types"]),
            stats=[],
            debug=False,
        )
    except Exception as err:  # reported to the parent as one line
        print("RESULT " + json.dumps({"status": "failed", "error": _one_line(err)}), flush=True)
        return 0
    print("READY", flush=True)
    started = time.perf_counter()
    try:
        sharding_plan = planner.plan(module=collection, sharders=[EmbeddingBagCollectionSharder()])
    except Exception as err:  # PlannerError (storage), RuntimeError (no option), ...
        reply = {"status": "failed", "seconds": time.perf_counter() - started, "error": _one_line(err)}
        print("RESULT " + json.dumps(reply), flush=True)
        return 0
    seconds = time.perf_counter() - started
    best = getattr(planner, "_best_plan", None)  # private, only for the objective TorchRec itself reported
    objective = float(NoopPerfModel(topology=topology).rate(plan=best)) if best else None
    options = [entry.to_dict() for entry in shardings_from_plan(sharding_plan, model)]
    reply = {"status": "ok", "seconds": seconds, "error": None, "options": options, "objective_ms": objective}
    print("RESULT " + json.dumps(reply), flush=True)
    return 0


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def _self_check() -> int:
    """10 generated tables on 1 host x 8 GPUs: both plans under both cost models."""
    from persia_planner import plan
    from persia_planner.synthetic import random_model, random_topology

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    model = random_model(10, seed=0, rows_range=(1e3, 1e8), batch_size=8 * 8192)
    topology = random_topology(trainers=1, gpus_per_trainer=8, servers=0)
    started = time.perf_counter()
    ours = plan(model, topology, improve_time_s=1.0)
    ours_s = time.perf_counter() - started
    result = compare_plans(model, topology, ours, timeout_s=60.0)
    print(f"model {model.name}: {len(model.tables)} tables on {topology.name}")
    print(f"TorchRec planner: {result['status']} in {result['torchrec_seconds']:.2f} s; ours {ours_s:.2f} s")
    if result["status"] != "ok":
        print(f"error: {result['error']}")
        return 1
    print(f"{'plan':10s} {'our model (step ms)':>20s} {'TorchRec model (ms)':>20s}  choices")
    print(f"{'ours':10s} {result['ours_ms_ours']:20.3f} {result['ours_ms_torchrec']:20.4f}  {result['ours_choices']}")
    print(
        f"{'torchrec':10s} {result['torchrec_ms_ours']:20.3f} {result['torchrec_ms_torchrec']:20.4f}  "
        f"{result['torchrec_choices']}"
    )
    reported = result["torchrec_objective_ms"]
    print(f"TorchRec's own objective for its plan: {reported:.4f} ms (re-scored: {result['torchrec_ms_torchrec']:.4f})")
    if result["torchrec_problems"]:
        print(f"TorchRec's plan breaks our capacity rules: {result['torchrec_problems'][0]}")
    ok = math.isclose(reported, result["torchrec_ms_torchrec"], rel_tol=1e-6)
    print("self-check", "OK" if ok else "FAILED: re-scoring TorchRec's plan does not reproduce its objective")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2]))
    sys.exit(_self_check())
