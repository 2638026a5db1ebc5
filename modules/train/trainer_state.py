"""What a trainer saves into the job's checkpoints and loads back (:mod:`persia_planner.modules.train.job_checkpoints`
lays them out): ``trainer.pt`` beside the parameter servers' tables, checked before a resume (it and the PS tables
belong together, the data layout is the same), and loaded back."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import yaml
from torch import nn

from persia_planner.errors import PlannerError, first_line
from persia_planner.kinds import Mode
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.atomic import atomic_json, atomic_torch_save, atomic_write
from persia_planner.modules.embedding.hybrid_set import TrainedTables
from persia_planner.modules.train.config import TrainConfig, data_identity, trainer_batch_size
from persia_planner.modules.train.job_checkpoints import (
    MODEL_FILE,
    PLAN_FILE,
    PS_DIR,
    TRAINER_STATE,
    Checkpoint,
    newest_complete,
    prune,
    publish,
    staging_dir,
    verify,
)
from persia_planner.modules.train.loop import dense_state_dict, load_dense_state_dict
from persia_planner.modules.train.run_inputs import data_schema, hyper_parameters
from persia_planner.plan.plan import placement_to_dict

if TYPE_CHECKING:
    from persia_planner.modules.train.batch_stream import Epochs
    from persia_planner.modules.train.job import Job

__all__ = [
    "TRAINER_STATE",
    "Saver",
    "check_layout",
    "check_resume",
    "data_layout",
    "load_trainer_state",
    "local_state",
    "require_dense_optimizer",
    "rng_states",
    "save_checkpoint",
    "save_trainer_state",
]


# ---- checkpoints ---------------------------------------------------------------------------------------------


def local_state(hybrid: TrainedTables) -> dict[str, Any]:
    """The local tables' full weights and every trainer's fused-optimizer state, on trainer 0 (collectives: every
    trainer calls it; the others get empty maps)."""
    return {
        "local": {k: v.detach().clone() for k, v in hybrid.local_weights(dst=0).items()},
        "local_optimizer": hybrid.local.optimizer_pieces(dst=0) if hybrid.local is not None else {},
    }


def rng_states() -> list[torch.Tensor]:
    """Every trainer's torch CPU random state, in rank order (a collective: every trainer calls it)."""
    own = torch.get_rng_state()
    states = [torch.empty_like(own) for _ in range(dist.get_world_size())]
    dist.all_gather(states, own)
    return states


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: nn.Module,
    hybrid: TrainedTables,
    opt: Any,
    client: Any,
    layout: dict[str, Any],
    lineage: str,
    plan: dict[str, Any],
    world: dict[str, int],
    keep: int,
    run_id: str | None = None,
    spec: ModelSpec | None = None,
    replacing: bool = False,
) -> Checkpoint | None:
    """Save the job's checkpoint of global step ``step`` into ``root`` (a collective: every trainer calls it, after
    the pushes of every step up to ``step`` are applied). Trainer 0 writes it into a staging directory (PS tables,
    ``trainer.pt``, ``plan.json`` and, given ``spec``, the ``model.yaml`` that scores new rows as the run did:
    :mod:`persia_planner.modules.train.prediction`), publishes it whole and prunes older ones (and, ``replacing``,
    those of the runs ``--overwrite`` replaces); returns it there, None elsewhere."""
    local = local_state(hybrid)  # gathers every trainer's shards
    rng = rng_states()
    published = None
    if dist.get_rank() == 0:
        staging = staging_dir(root.resolve(), step)  # absolute: the servers write into it from their own cwd
        version = client.save(staging / PS_DIR) if hybrid.ps is not None else None
        save_trainer_state(staging / TRAINER_STATE, step, model, local, opt, version, layout | {"rng": rng})
        atomic_json(plan, staging / PLAN_FILE)
        if spec is not None:
            text = yaml.safe_dump(spec.to_dict(), sort_keys=False, width=120).encode()  # the features keep their order
            atomic_write(staging / MODEL_FILE, lambda f: f.write(text))
        published = publish(staging, step=step, lineage=lineage, world=world, run_id=run_id)
        prune(root, published, keep, replacing=replacing)
    dist.barrier()  # nobody trains on (or ends) before the checkpoint is whole
    return published


def save_trainer_state(
    path: Path,
    step: int,
    model: nn.Module,
    local: dict[str, Any],
    opt: Any,
    ps_version: int | None,
    layout: dict[str, Any],
) -> None:
    """Write ``trainer.pt`` atomically: the step, the data layout, the PS checkpoint version saved with it, the dense
    model and its optimizer, and the local tables (:func:`local_state`)."""
    state = {
        "step": step,
        **layout,  # trainers, per-trainer batch size, data, seed: what `step` points at in the data stream
        "ps_version": ps_version,  # the PS checkpoint version saved with this state (see check_resume)
        "dense": {k: v.clone() for k, v in dense_state_dict(model).items()},
        "dense_optimizer": opt.state_dict(),
        **local,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(state, path)


def check_resume(
    directory: Path,
    with_ps: bool,
    on_skip: Callable[[str], None] | None = None,
    *,
    chosen: Path | None = None,
) -> tuple[Checkpoint, dict[str, Any]]:
    """The newest whole checkpoint of ``directory`` and its trainer state, after checking that the state and the PS
    tables saved with it belong together; each newer checkpoint found damaged is reported to ``on_skip`` and skipped.
    ``chosen``: the checkpoint already chosen (and its checksums checked) by the launcher; its sizes are checked.

    Raises:
        PlannerError: No whole checkpoint, or one whose trainer state is not persia train's (one line naming the
            file; :class:`.ps.protocol.CheckpointError`: a damaged PS file).
    """
    from persia_planner.modules.ps.table_checkpoints import verify as verify_ps

    ckpt = verify(chosen, checksums=False) if chosen is not None else newest_complete(directory, on_skip=on_skip)
    path = ckpt.path / TRAINER_STATE
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # a foreign file: torch raises RuntimeError, pickle errors, EOFError...
        raise PlannerError(
            f"--resume: {path} is not a readable trainer checkpoint ({first_line(err, with_type=True)})",
            fixes=("resume from another checkpoint directory", "train from scratch without --resume"),
        ) from None
    if not isinstance(state, dict) or not {"step", "dense", "local", "local_optimizer"} <= state.keys():
        raise PlannerError(
            f"--resume: {path} is not a trainer checkpoint of persia train (it lacks step/dense/local)",
            fixes=("resume from another checkpoint directory", "train from scratch without --resume"),
        )
    saved_ps = state.get("ps_version") is not None
    # A run whose plan has PS tables resuming a checkpoint whose plan had none (a migration) has no PS files to load.
    if saved_ps or (with_ps and _plan_had_ps(ckpt.path)):
        latest = verify_ps(ckpt.path / PS_DIR)  # every shard there and whole, before any server starts
        have = latest["version"] if latest else None
        if have is None or have != state.get("ps_version"):
            raise PlannerError(
                f"--resume: {ckpt.path} holds trainer state for PS version {state.get('ps_version')} but its "
                f"parameter-server tables are at version {have}: they were not saved together",
                fixes=("resume with the plan the checkpoint was trained with", "train from scratch without --resume"),
            )
    return ckpt, state


def _plan_had_ps(checkpoint: Path) -> bool:
    """Whether the checkpoint's ``plan.json`` put a table on the servers (True where it cannot tell)."""
    try:
        plan = json.loads((checkpoint / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return True
    if not isinstance(plan, dict) or not plan:
        return True
    return any(isinstance(p, dict) and p.get("mode") == Mode.ASYNC.value for p in plan.values())


def data_layout(cfg: TrainConfig, spec: ModelSpec, trainers: int) -> dict[str, Any]:
    """What a step of the data stream is: the trainer count, the per-trainer batch size, the data and the seed
    (synthetic data: the teacher that labels the samples, and the samples) (saved, then checked on resume)."""
    layout = {
        "trainers": trainers,
        "batch_size": trainer_batch_size(cfg, spec, trainers),
        "data": data_identity(cfg.data),
        "seed": cfg.seed,
    }
    if cfg.data != "synthetic":  # a file source's batch order depends on how many workers read each trainer's shards
        layout |= {
            "data_workers": cfg.data_workers,
            "shuffle_buffer": cfg.shuffle_buffer,  # and on the shuffle, and on which rows are held out
            "eval_split": cfg.held_out_share,
        }
    return layout


def check_layout(path: Path, state: dict[str, Any], layout: dict[str, Any]) -> None:
    """Refuse to resume ``state`` (read from ``path``) with another data layout.

    A resumed run skips ``step`` global batches of trainers x batch_size samples: with another layout it would
    train on samples the checkpoint has seen, or skip some; with other data or another seed it would go on with
    another task. (Checkpoints from before these checks lack the keys.)
    """
    changed = {k: (state[k], v) for k, v in layout.items() if k in state and state[k] != v}
    if changed:
        what = ", ".join(f"{k} {was} (now {now})" for k, (was, now) in changed.items())
        raise PlannerError(
            f"--resume: checkpoint {path} was trained with {what}; resuming would replay or skip training data",
            fixes=(
                "resume with the --trainers, --batch-size, --data, --data-workers and --seed of the checkpointed run",
                "train from scratch",
            ),
        )


def require_dense_optimizer(state: dict[str, Any], kind: str, path: Path) -> None:
    """The checkpoint's dense optimizer (its ``state``, from ``path``) is ``kind``, whose state it is to load.

    Raises:
        PlannerError: It trained with another one (the default changed from adagrad to adam with issue 57).
    """
    trained = (state.get("hyper_parameters") or {}).get("dense_optimizer")
    if trained is not None and trained != kind:
        raise PlannerError(
            f"--resume: checkpoint {path} trained the dense network with {trained}, this run would with {kind} (the "
            "default is adam)",
            fixes=(f"resume with --dense-optimizer {trained}",),
        )


def load_trainer_state(
    ckpt: Checkpoint,
    state: dict[str, Any],
    model: nn.Module,
    hybrid: TrainedTables,
    opt: Any,
    layout: dict[str, Any],
) -> int:
    """Load ``state`` (:func:`check_resume`'s, of checkpoint ``ckpt``) into the model, its optimizer, the local tables
    and this trainer's random state; returns the step to continue from."""
    path = ckpt.path / TRAINER_STATE
    check_layout(path, state, layout)  # again: under torchrun no launcher checked it before the processes started
    own = dense_state_dict(model)
    reshaped = [k for k, v in state["dense"].items() if k in own and tuple(own[k].shape) != tuple(v.shape)]
    if reshaped:
        k = reshaped[0]
        raise PlannerError(
            f"--resume: checkpoint {path} holds {k} of shape {tuple(state['dense'][k].shape)}, this model's is "
            f"{tuple(own[k].shape)} (saved with another model.yaml?)",
            fixes=("resume with the model the checkpoint was trained with", "train from scratch without --resume"),
        )
    missing, unexpected = load_dense_state_dict(model, state["dense"])
    if unexpected:
        raise PlannerError(f"--resume: checkpoint {path} holds parameters {unexpected[:3]} this model lacks")
    dense_keys = dense_state_dict(model).keys()
    missing = [k for k in missing if k in dense_keys]  # the collection's own state is loaded below
    if missing:
        raise PlannerError(
            f"--resume: checkpoint {path} lacks this model's {missing[:3]} (saved with another dense arch?)",
            fixes=("resume with the model the checkpoint was trained with", "train from scratch without --resume"),
        )
    opt.init_state()  # a zero-gradient step: every state exists (Adam creates its own at the first step) to load into
    opt.load_state_dict(state["dense_optimizer"])
    hybrid.load_local_weights(state["local"])
    if hybrid.local is not None and "local_optimizer_tables" in state:  # resumed under another plan (.migration)
        hybrid.local.load_optimizer_tables(state["local_optimizer_tables"])
    elif hybrid.local is not None:
        hybrid.local.load_optimizer_pieces(state["local_optimizer"])
    rng = state.get("rng")
    if isinstance(rng, list) and len(rng) == dist.get_world_size():  # the layout check makes the counts equal
        torch.set_rng_state(rng[dist.get_rank()])
    return int(state["step"])


class Saver:
    """A trainer's part in the job's checkpoints (:func:`save_checkpoint`) during a run; a no-op without a root.

    Args:
        root: ``--checkpoint``, or None.
        job: The run (its trainers, servers, tables and ``--keep``).
        model, hybrid, opt, client: What the checkpoint holds (and the PS client of trainer 0).
        layout: The data layout (:func:`data_layout`).
        lineage: The lineage the checkpoints continue (:mod:`persia_planner.modules.train.job_checkpoints`).
        target_step: The global step the run is to reach (a restarted torchrun attempt trains on to it); None: the
            end of its epochs.
        epochs: The data stream's epochs so far: each checkpoint records their lengths, where a resume finds its place.
    """

    def __init__(
        self,
        root: Path | None,
        job: Job,
        model: Any,
        hybrid: Any,
        opt: Any,
        client: Any,
        layout: dict[str, Any],
        lineage: str,
        *,
        target_step: int | None,
        epochs: Epochs | None = None,
    ) -> None:
        self.root, self.job, self.model, self.hybrid, self.opt, self.client = root, job, model, hybrid, opt, client
        # The hyper-parameters ride along for whoever reads the checkpoint; resuming does not compare them.
        hyper = hyper_parameters(job.cfg, job.spec, job.trainers)
        self.layout = layout | {"target_step": target_step, "hyper_parameters": hyper}
        self.lineage = lineage
        self.epochs = epochs
        self.plan = {name: placement_to_dict(p) for name, p in job.tables.items()}
        # The columns as this run read them (--schema's, else the model's), with the statistics it measured.
        self.spec = replace(job.spec, data=data_schema(job.spec, job.cfg))
        self.last: Checkpoint | None = None
        self.last_step: int | None = None
        self.last_save_s = 0.0  # what the last checkpoint took: --adapt prices a migration with it

    def save(self, step: int) -> float:
        """Checkpoint global step ``step`` (every trainer calls it); returns the seconds it took."""
        started = time.perf_counter()
        if self.root is None:
            return 0.0
        self.hybrid.flush()
        dist.barrier()  # every trainer's pushes of the steps up to `step` are applied
        self.last = (
            save_checkpoint(
                self.root,
                step,
                model=self.model,
                hybrid=self.hybrid,
                opt=self.opt,
                client=self.client,
                layout=self.layout | {"epoch_lengths": list(self.epochs.lengths) if self.epochs else []},
                lineage=self.lineage,
                plan=self.plan,
                world={"trainers": self.job.trainers, "servers": self.job.servers},
                keep=self.job.cfg.keep,
                run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
                spec=self.spec,
                replacing=self.job.cfg.overwrite,
            )
            or self.last
        )
        self.last_step = step
        self.last_save_s = time.perf_counter() - started
        return self.last_save_s

    @property
    def last_path(self) -> Path | None:
        """The newest checkpoint this run published (trainer 0 publishes; None on the others, or before one)."""
        return self.last.path if self.last is not None else None
