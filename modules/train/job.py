"""What every trainer of a run gets, and how a trainer process starts: shared by ``persia train``, the K = 0 check
against TorchRec (:mod:`persia_planner.modules.tools.torchrec_equivalence`) and the memory measurement
(:mod:`persia_planner.modules.tools.memory_audit`).

A :class:`Job` is pickled to every trainer (:func:`.launcher.launch.local_cluster`, or built in place under torchrun);
:func:`trainer_group` is a trainer's start-up: torch's and TorchRec's noise silenced, one thread, the trainers'
process group joined in the job's store (torchrun's agent store or ``local_cluster``'s, under a prefix).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from persia_planner.model.specs import ModelSpec
from persia_planner.modules.embedding.model_parallel import quiet_trainer
from persia_planner.modules.launcher.launch import trainers_store
from persia_planner.modules.train.config import TrainConfig
from persia_planner.placement.shards import TablePlacement
from persia_planner.topology.graph import Topology

__all__ = ["TRAINER_GROUP_TIMEOUT", "Job", "trainer_group", "trainers_group"]

TRAINER_GROUP_TIMEOUT = datetime.timedelta(seconds=300)
"""How long the trainers' collectives (and their rendezvous) wait for each other."""


@dataclass(frozen=True)
class Job:
    """What every trainer of a run gets (picklable).

    Attributes:
        cfg: The run's options (steps, batch size, staleness, optimizers, data, seed, ...).
        spec: The model.
        tables: The plan's placement of every table.
        topology: The plan's topology: trainer ``r`` runs what the plan put on ``topology.gpus[r]``.
        servers: Parameter-server processes (0 when no table is on the ``ps`` tier).
        trainers: Trainer processes.
        resume_from: The checkpoint directory (``step-*``) to resume from, when the launcher chose and checked it
            before the trainers started; None: each trainer finds the newest whole one itself (torchrun).
        restarted: torchrun restarted the job after a failure: it resumes and trains up to the step the first
            attempt was to reach.
        local_trainer: Under torchrun, this trainer's place among its node's trainers (its GPU there: a node may be
            several trainer hosts); None: its place on its host.
    """

    cfg: TrainConfig
    spec: ModelSpec
    tables: dict[str, TablePlacement]
    topology: Topology
    servers: int
    trainers: int
    resume_from: str | None = None
    restarted: bool = False
    local_trainer: int | None = None


@contextlib.contextmanager
def trainer_group(j: int, job: Job, *, nodes_from_topology: bool = True, backend: str = "gloo") -> Iterator[None]:
    """Start trainer ``j`` of ``job``: in the block it is rank ``j`` of the trainers' process group.

    Args:
        j: The trainer's rank.
        job: The job (its trainer count and topology).
        nodes_from_topology: Tell TorchRec the plan's nodes, the topology's hosts (``LOCAL_WORLD_SIZE`` /
            ``LOCAL_RANK``: table-row-wise and grid shardings group ranks by them; under torchrun they would count
            the server processes too). Off: TorchRec reads what the environment says.
        backend: The group's backend: gloo carries the CPU collectives (ids, lockstep, metrics); ``"cpu:gloo,
            cuda:nccl"`` lets nccl carry TorchRec's all-to-alls and DDP's on CUDA.
    """
    per_host = len(job.topology.trainers[0].gpus) if nodes_from_topology else None
    with trainers_group(j, job.trainers, per_host=per_host, backend=backend):
        yield


@contextlib.contextmanager
def trainers_group(j: int, trainers: int, *, per_host: int | None = None, backend: str = "gloo") -> Iterator[None]:
    """In the block, this process is rank ``j`` of the ``trainers`` trainers' process group, which rendezvous in the
    job's store (:func:`persia_planner.modules.launcher.launch.trainers_store`: a :func:`.engine.run_trainers` or
    ``persia train`` process, or torchrun's).

    Args:
        j: The trainer's rank.
        trainers: The trainers in the group.
        per_host: Trainers per host, which TorchRec reads as ``LOCAL_WORLD_SIZE`` (table-row-wise and grid shardings
            group ranks by host); None: what the environment says.
        backend: The group's backend (see :func:`trainer_group`).
    """
    quiet_trainer()
    torch.set_num_threads(1)
    if per_host is not None:
        os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(per_host), str(j % per_host)
    dist.init_process_group(backend, store=trainers_store(), rank=j, world_size=trainers, timeout=TRAINER_GROUP_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()
