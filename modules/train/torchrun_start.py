"""What a torchrun process settles before it starts, without torch: its role in the topology, whether a restarted
attempt resumes, the trainers the job has, and the run's inputs. ``persia train`` runs it before importing torch (a
mistake is answered at once) and :func:`persia_planner.modules.train.engine.train_torchrun` where it starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from persia_planner.model.specs import ModelSpec
from persia_planner.modules.train.config import TrainConfig, check_before_start
from persia_planner.modules.train.job_checkpoints import written_by_run
from persia_planner.topology.graph import Topology
from persia_planner.topology.torchrun_nodes import ProcessRole, TorchrunProcess, process_role

__all__ = ["TorchrunStart", "elastic_resume", "torchrun_start"]


@dataclass(frozen=True)
class TorchrunStart:
    """A torchrun process's start, checked.

    Attributes:
        cfg: The run's options for this attempt: resumed after a restart, with the topology's trainer devices.
        process: This process in torchrun's world.
        role: What it runs: a server or a trainer of the topology.
        restarted: Whether this attempt goes on from a checkpoint that its own run wrote.
    """

    cfg: TrainConfig
    process: TorchrunProcess
    role: ProcessRole
    restarted: bool


def torchrun_start(
    cfg: TrainConfig, spec: ModelSpec, topology: Topology, *, with_ps: bool, node_host: str | None = None
) -> TorchrunStart:
    """This torchrun process's role, options and inputs, checked before anything starts.

    Raises:
        PlannerError: The world does not match the topology, or an input every process would trip over.
    """
    process = TorchrunProcess.from_environ()
    role = process_role(topology, process, node_host)
    cfg = elastic_resume(cfg)
    # A restarted attempt that resumes this run's own checkpoint trains on to the step the first attempt was to reach.
    restarted = cfg.resume and written_by_run(cfg.checkpoint or "", os.environ.get("TORCHELASTIC_RUN_ID", ""))
    cfg = replace(cfg, trainers=len(topology.gpus))  # before the checks: the data's shards are for them
    cfg = check_before_start(cfg, spec, with_ps=with_ps)
    return TorchrunStart(cfg, process, role, bool(restarted))


def elastic_resume(cfg: TrainConfig, environ: Mapping[str, str] | None = None) -> TrainConfig:
    """``cfg`` for this attempt of a torchrun job: where its run (``TORCHELASTIC_RUN_ID``) already wrote the newest
    checkpoint of ``--checkpoint``, the job resumes from it: after a restart (``--max-restarts``), and when the job
    is launched again with the same ``--rdzv-id`` after it lost a host (its agents count no restart; decision 0024).
    A restart before any checkpoint starts over into the directory its first attempt was allowed to use. A first
    attempt runs ``cfg`` as given."""
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if cfg.checkpoint and run_id and written_by_run(cfg.checkpoint, run_id):
        return replace(cfg, resume=True, overwrite=False)
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
        return cfg
    if not cfg.checkpoint:  # it starts over: its metrics replace the first attempt's
        return replace(cfg, overwrite=True) if cfg.log_dir else cfg
    return cfg if cfg.resume else replace(cfg, overwrite=True)
