"""What a torchrun process settles before it starts, without torch: its role in the topology, whether a restarted
attempt resumes, the trainers the job has, the run's inputs, and that torchrun's store answers. ``persia train`` runs
it before importing torch (a mistake is answered at once) and :func:`persia_planner.modules.train.engine.train_torchrun`
where it starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.rpc_environment import DEFAULT_RPC_TIMEOUT_S, check_rpc_environment, wait_for_listener
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.job_checkpoints import written_by_run
from persia_planner.modules.train.run_inputs import check_before_start
from persia_planner.topology.graph import Topology
from persia_planner.topology.torchrun_nodes import ProcessKind, ProcessRole, TorchrunProcess, process_role

__all__ = ["JOB_STORE_TIMEOUT_S", "TorchrunStart", "elastic_resume", "require_job_store", "torchrun_start"]

JOB_STORE_TIMEOUT_S = DEFAULT_RPC_TIMEOUT_S
"""How long a process waits for torchrun's store at ``MASTER_ADDR:MASTER_PORT`` to accept a connection (the RPC
group's timeout: the README's "one line after --rpc-timeout")."""


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
        PlannerError: The world does not match the topology, an input every process would trip over, or nothing
            serves torchrun's store (:func:`require_job_store`).
    """
    process = TorchrunProcess.from_environ()
    role = process_role(topology, process, node_host)
    cfg = elastic_resume(cfg)
    # A restarted attempt that resumes this run's own checkpoint trains on to the step the first attempt was to reach.
    restarted = cfg.resume and written_by_run(cfg.checkpoint or "", os.environ.get("TORCHELASTIC_RUN_ID", ""))
    cfg = replace(cfg, trainers=len(topology.gpus))  # before the checks: the data's shards are for them
    cfg = check_before_start(cfg, spec, with_ps=with_ps, reads_data=role.kind is ProcessKind.TRAINER)
    require_job_store()  # last: every mistake above is answered at once, not after this wait
    return TorchrunStart(cfg, process, role, bool(restarted))


def require_job_store(environ: Mapping[str, str] | None = None, timeout_s: float | None = None) -> None:
    """Return once torchrun's store at ``MASTER_ADDR:MASTER_PORT`` accepts a connection.

    Under torchrun every process of the job, rank 0 included, is a client of the store its node's agent serves
    (``TORCHELASTIC_USE_AGENT_STORE``): the roles, the trainers' group and the RPC group all meet there. A process
    started by hand with torchrun's variables has no agent, and torch's client would wait silently for its own
    timeout (300 s here) whatever the port: ``MASTER_PORT=1`` included.

    Args:
        environ: The environment (default: this process's).
        timeout_s: How long to wait (default :data:`JOB_STORE_TIMEOUT_S`).

    Raises:
        PlannerError: ``MASTER_ADDR``/``MASTER_PORT`` or the RPC variables are wrong, or nothing accepted a
            connection there within ``timeout_s`` (one line naming the address).
    """
    timeout_s = JOB_STORE_TIMEOUT_S if timeout_s is None else timeout_s
    addr, port = check_rpc_environment("torchrun's job store", environ)
    refused = wait_for_listener(addr, port, timeout_s)
    if refused is not None:
        raise PlannerError(
            f"nothing served torchrun's job store at MASTER_ADDR:MASTER_PORT {addr}:{port} within {timeout_s:g} s "
            f"({refused})",
            fixes=(
                "launch persia train with torchrun: its agent serves that store and sets MASTER_ADDR, MASTER_PORT, "
                "RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID",
                "unset TORCHELASTIC_RUN_ID to train on this machine alone",
            ),
            kind=ErrorKind.UNAVAILABLE,
        )


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
