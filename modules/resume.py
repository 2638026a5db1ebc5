"""A trainer's checkpoint (``trainer.pt``): saved beside the parameter servers' checkpoint, checked before a resume
(it and the PS checkpoint belong together, the data layout is the same), and loaded back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from persia_planner.errors import PlannerError
from persia_planner.specs import ModelSpec

from .config import TrainConfig, check_resume_exists, data_identity
from .hybrid import HybridEmbeddingBagCollection
from .loop import dense_state_dict
from .ps.atomic import atomic_torch_save

__all__ = ["check_layout", "check_resume", "data_layout", "load_trainer_state", "local_state", "save_trainer_state"]


# ---- checkpoints ---------------------------------------------------------------------------------------------


def local_state(hybrid: HybridEmbeddingBagCollection) -> dict[str, Any]:
    """The local tables' full weights and every trainer's fused-optimizer state, on trainer 0 (collectives: every
    trainer calls it; the others get empty maps)."""
    return {
        "local": {k: v.detach().clone() for k, v in hybrid.local_weights(dst=0).items()},
        "local_optimizer": hybrid.local.optimizer_pieces(dst=0) if hybrid.local is not None else {},
    }


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


def check_resume(directory: Path, with_ps: bool) -> dict[str, Any]:
    """The trainer state in ``directory``, after checking that it and the PS checkpoint belong together.

    ``client.save`` commits the PS version before ``trainer.pt`` is replaced, so a crash between the two leaves a
    newer PS version than the trainer state: resuming from that pair would replay updates onto rows that have them.

    Raises:
        PlannerError: No checkpoint, or a mismatched pair (:class:`.ps.protocol.CheckpointError`: a damaged PS file).
    """
    from .ps.checkpoint import verify

    path = check_resume_exists(directory)
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # a truncated or foreign file: torch raises RuntimeError, pickle errors, EOFError...
        raise PlannerError(
            f"--resume: {path} is not a readable trainer checkpoint ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'})",
            fixes=("resume from another checkpoint directory", "train from scratch without --resume"),
        ) from None
    if not isinstance(state, dict) or not {"step", "dense", "local"} <= state.keys():
        raise PlannerError(
            f"--resume: {path} is not a trainer checkpoint of persia train (it lacks step/dense/local)",
            fixes=("resume from another checkpoint directory", "train from scratch without --resume"),
        )
    if not isinstance(state.get("local_optimizer"), dict):
        raise PlannerError(
            f"--resume: {path} was written by an earlier version of persia train (its local tables' optimizer "
            "state is not per shard)",
            fixes=("train from scratch without --resume",),
        )
    if with_ps:
        latest = verify(directory / "ps")  # every shard there and whole, before any server starts
        have = latest["version"] if latest else None
        if have is None or have != state.get("ps_version"):
            raise PlannerError(
                f"--resume: {directory} holds trainer state for PS version {state.get('ps_version')} but the "
                f"parameter-server checkpoint is at version {have} (a save was interrupted?)",
                fixes=("resume from another checkpoint directory", "train from scratch without --resume"),
            )
    return state


def data_layout(cfg: TrainConfig, spec: ModelSpec, trainers: int) -> dict[str, Any]:
    """What a step of the data stream is: the trainer count, the per-trainer batch size, the data and the seed
    (synthetic data: the teacher that labels the samples, and the samples) (saved, then checked on resume)."""
    return {
        "trainers": trainers,
        "batch_size": cfg.batch_size or max(1, spec.batch_size // trainers),
        "data": data_identity(cfg.data),
        "seed": cfg.seed,
    }


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
                "resume with the --trainers, --batch-size, --data and --seed of the checkpointed run",
                "train from scratch",
            ),
        )


def load_trainer_state(
    directory: Path, model: nn.Module, hybrid: HybridEmbeddingBagCollection, opt: Any, layout: dict[str, Any]
) -> int:
    """Load ``directory``'s ``trainer.pt`` into the model, its optimizer and the local tables, after
    :func:`check_resume` and :func:`check_layout`; returns the step to continue from."""
    path = directory / "trainer.pt"
    state = check_resume(directory, hybrid.ps is not None)
    check_layout(path, state, layout)  # again: under torchrun no launcher checked it before the processes started
    own = model.state_dict()
    reshaped = [k for k, v in state["dense"].items() if k in own and tuple(own[k].shape) != tuple(v.shape)]
    if reshaped:
        k = reshaped[0]
        raise PlannerError(
            f"--resume: checkpoint {path} holds {k} of shape {tuple(state['dense'][k].shape)}, this model's is "
            f"{tuple(own[k].shape)} (saved with another model.yaml?)",
            fixes=("resume with the model the checkpoint was trained with", "train from scratch without --resume"),
        )
    _missing, unexpected = model.load_state_dict(state["dense"], strict=False)
    if unexpected:
        raise PlannerError(f"--resume: checkpoint {path} holds parameters {unexpected[:3]} this model lacks")
    opt.init_state()  # a zero-gradient step: every state exists (Adam creates its own at the first step) to load into
    opt.load_state_dict(state["dense_optimizer"])
    hybrid.load_local_weights(state["local"])
    if hybrid.local is not None:
        hybrid.local.load_optimizer_pieces(state["local_optimizer"])
    return int(state["step"])
