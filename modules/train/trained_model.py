"""A training checkpoint as the model ``persia predict`` scores with, checked whole against its plan before any
process starts.

Each problem is one line naming the file and the fix: every file the manifest names, with its size and sha256;
``plan.json`` and ``model.yaml`` there, readable, placing the same tables; with tables on the parameter servers,
``ps/``'s committed version holding every server's shard of each of them (and of no other table) at the model's dim,
saved with ``trainer.pt``; ``trainer.pt`` read as tensors only (a pickle of other objects is refused, never run),
holding every local table of the plan whole (trainer 0 saves the tables gathered from their shards, row-wise and
column-wise alike: ``rows x dim``) and no other, and the dense network's tensors as the model builds them (built on
the meta device: the shapes without the memory).
"""

from __future__ import annotations

import math
import pickle
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from persia_planner.errors import PlannerError, abbreviate, first_line
from persia_planner.fields import load_json
from persia_planner.kinds import Mode
from persia_planner.limits import MAX_SEED
from persia_planner.model.dense import DenseArch
from persia_planner.model.specs import ModelSpec, Optimizer, load_model
from persia_planner.modules.manifests import file_problem
from persia_planner.modules.ps.table_checkpoints import read_latest, read_manifest
from persia_planner.modules.train.best_checkpoint import read_best
from persia_planner.modules.train.job_checkpoints import (
    MANIFEST,
    MODEL_FILE,
    PLAN_FILE,
    PS_DIR,
    TRAINER_STATE,
    Checkpoint,
    complete_checkpoints,
    newest_complete,
    verify,
)
from persia_planner.modules.train.run_inputs import dlrm_embedding_dim
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.plan import placement_from_dict
from persia_planner.plan.validation import table_mismatch

__all__ = [
    "TrainedModel",
    "TrainerSettings",
    "best_checkpoint",
    "check_dense",
    "open_trained",
    "read_trainer_state",
]

# The layout job_checkpoints describes, as trainer_state writes it (it imports torchrec: the launcher checks first).
_ANOTHER = "point --checkpoint at a checkpoint persia train wrote"
_RESTORE = "restore the checkpoint from a copy, or point --checkpoint at another one"


@dataclass(frozen=True)
class TrainedModel:
    """What a checkpoint says of the model it trained.

    Attributes:
        checkpoint: The checkpoint (its ``step-*`` directory, step and world).
        spec: Its ``model.yaml``: the tables, the dense arch, and the columns with their measured statistics.
        tables: Its ``plan.json``: every table's placement.
        servers: The parameter servers its PS tables are on (0: none).
        ps_version: The committed version of its ``ps/`` (None: no PS tables).
    """

    checkpoint: Checkpoint
    spec: ModelSpec
    tables: dict[str, TablePlacement]
    servers: int
    ps_version: int | None = None

    @property
    def local_tables(self) -> dict[str, tuple[int, int]]:
        """The tables trained on the trainers, in model order, with the ``(rows, dim)`` trainer.pt holds of each."""
        return {t.name: (t.rows, t.dim) for t in self.spec.tables if self.tables[t.name].mode is not Mode.ASYNC}


@dataclass(frozen=True)
class TrainerSettings:
    """What ``trainer.pt`` records beside its tensors that scoring uses, checked.

    Attributes:
        seed: The run's seed (the model's initialisers).
        sparse_optimizer: The embedding tables' optimizer.
        sparse_lr: Its learning rate.
        dense_arch: The dense arch the run built, as it recorded it (None: not recorded).
        dense: The dense network's tensors' shapes, by name.
    """

    seed: int
    sparse_optimizer: Optimizer
    sparse_lr: float
    dense_arch: DenseArch | None
    dense: dict[str, tuple[int, ...]]


def open_trained(path: str | Path) -> TrainedModel:
    """The checkpoint at ``path`` (a ``step-*`` directory, or ``--checkpoint``'s directory: the best evaluation's
    checkpoint its run kept (:mod:`.best_checkpoint`), else its newest whole one), its files checked whole and
    against each other (``trainer.pt`` is :func:`read_trainer_state`'s).

    Raises:
        PlannerError: No whole checkpoint there, or one whose files do not belong together (one line naming the file).
    """
    root = Path(path)
    if (root / MANIFEST).is_file() or root in complete_checkpoints(root.parent):  # a step-* folder: its manifest's
        ckpt = verify(root, checksums=True)
    else:
        ckpt = best_checkpoint(root) or newest_complete(root, option="--checkpoint", checksums=True)
    spec = _model(ckpt)
    tables = _plan(ckpt, spec)
    ps = [name for name, p in tables.items() if p.mode is Mode.ASYNC]
    if not ps:
        return TrainedModel(ckpt, spec, tables, 0)
    servers, version = _ps_tables(ckpt, spec, ps)
    return TrainedModel(ckpt, spec, tables, servers, version)


def best_checkpoint(root: Path) -> Checkpoint | None:
    """The best evaluation's checkpoint ``root``'s ``BEST.json`` names, if it is still there, whole and of the run
    that named it (a run that replaced the folder with ``--overwrite`` leaves an old mark behind)."""
    mark = read_best(root)
    if mark is None or not (root / mark.checkpoint).is_dir():
        return None
    try:
        ckpt = verify(root / mark.checkpoint, checksums=True)
    except PlannerError:
        return None
    return ckpt if ckpt.lineage == mark.lineage and ckpt.step == mark.step else None


def _model(ckpt: Checkpoint) -> ModelSpec:
    model_file = ckpt.path / MODEL_FILE
    if not model_file.is_file():
        raise PlannerError(
            f"--checkpoint: {ckpt.path} has no {MODEL_FILE} (written by an earlier version of persia train, or "
            "removed)",
            fixes=(_RESTORE, "train on with --resume for a step: its checkpoint holds one"),
        )
    return load_model(model_file)


def _plan(ckpt: Checkpoint, spec: ModelSpec) -> dict[str, TablePlacement]:
    plan_file = ckpt.path / PLAN_FILE
    if not plan_file.is_file():
        raise PlannerError(
            f"--checkpoint: {ckpt.path} has no {PLAN_FILE}, the placement its tables trained with",
            fixes=(_RESTORE,),
        )
    source = str(plan_file)
    plan = load_json(plan_file, source)
    if not isinstance(plan, dict):
        raise PlannerError(
            f"--checkpoint: {plan_file} holds a JSON {type(plan).__name__}, not the tables' placements",
            fixes=(_RESTORE,),
        )
    tables = {name: placement_from_dict(entry, source, name) for name, entry in plan.items()}
    missing, unknown = table_mismatch(tables, [t.name for t in spec.tables])
    if missing or unknown:
        what = f"places no table {missing[0]!r}" if missing else f"places table {abbreviate(unknown[0])}"
        raise PlannerError(
            f"--checkpoint: {plan_file} {what}, but {ckpt.path / MODEL_FILE} "
            + ("has it" if missing else "has no such table"),
            fixes=(_RESTORE,),
        )
    for name, placement in tables.items():
        if not placement.shards:
            raise PlannerError(f"--checkpoint: {plan_file}: table {name!r} has no shards", fixes=(_RESTORE,))
    return tables


def _ps_tables(ckpt: Checkpoint, spec: ModelSpec, names: list[str]) -> tuple[int, int]:
    """The servers and the committed version of ``ps/``, after checking that every server's manifest lists each of
    ``names`` (and no other table) at the model's dim, with its shard file whole."""
    directory = ckpt.path / PS_DIR
    if not directory.is_dir():
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise PlannerError(
            f"--checkpoint: {ckpt.path} has no {PS_DIR}/, the tables {PLAN_FILE} puts on the parameter servers "
            f"({names[0]!r}{more})",
            fixes=(_RESTORE,),
        )
    latest = read_latest(directory)  # CheckpointError: LATEST or a manifest unreadable
    if latest is None:
        raise PlannerError(
            f"--checkpoint: {directory} has no committed version (no LATEST): the servers' tables were not saved",
            fixes=(_RESTORE,),
        )
    n, path = latest["n_servers"], latest["path"]
    servers = ckpt.world.get("servers")
    if servers != n or isinstance(servers, bool):
        raise PlannerError(
            f"--checkpoint: {ckpt.path / MANIFEST} says the run had {abbreviate(servers)} parameter servers, "
            f"{directory / 'LATEST'} says {n}: they were not saved together",
            fixes=(_RESTORE,),
        )
    dims = {t.name: t.dim for t in spec.tables}
    for server in range(n):
        listed = read_manifest(path, server, n)["tables"]
        manifest = f"the manifest of server {server} of {n} in {path}"
        unknown = sorted(set(listed) - set(names), key=str)
        if unknown:
            raise PlannerError(
                f"--checkpoint: {manifest} holds table {abbreviate(unknown[0])}, which {PLAN_FILE} does not place on "
                "the parameter servers",
                fixes=(_RESTORE,),
            )
        for name in names:
            entry = listed.get(name)
            if not isinstance(entry, dict):
                raise PlannerError(
                    f"--checkpoint: {manifest} lists no shard of table {name!r}, which {PLAN_FILE} places on the "
                    "parameter servers",
                    fixes=(_RESTORE,),
                )
            file, config = entry.get("file"), entry.get("config")
            dim = config.get("dim") if isinstance(config, dict) else None
            if dim != dims[name] or isinstance(dim, bool):
                raise PlannerError(
                    f"--checkpoint: {manifest}: table {name!r} has dim {abbreviate(dim)}, {MODEL_FILE} says "
                    f"{dims[name]}",
                    fixes=(_RESTORE,),
                )
            if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                raise PlannerError(
                    f"--checkpoint: {manifest}: table {name!r} names shard file {abbreviate(file)}, not a file "
                    "of its directory",
                    fixes=(_RESTORE,),
                )
            problem = file_problem(path / file, entry, checksums=False)  # its bytes: the job's manifest has them
            if problem is not None:
                raise PlannerError(f"--checkpoint: {path / file}: {problem}", fixes=(_RESTORE,))
            _check_shard(path / file, name, entry.get("rows"), dims[name])
    return n, int(latest["version"])


def _check_shard(path: Path, table: str, rows: Any, dim: int) -> None:
    """A server's shard of ``table`` holds the ``rows`` its manifest says, ``dim`` wide and finite, with their ids."""
    import torch

    state = _load_tensors(path)
    ids, weights = (state.get("ids"), state.get("weights")) if isinstance(state, dict) else (None, None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.numel() != rows:
        raise _not_ours(path, f"its ids are not the {abbreviate(rows)} its manifest lists")
    _check_tensor(path, f"the rows of table {table!r}", weights, (ids.numel(), dim))


def read_trainer_state(trained: TrainedModel) -> TrainerSettings:
    """``trainer.pt``'s settings, after checking it against the plan and the model: tensors only (never unpickled
    beyond them), every local table with its ``rows x dim``, finite, and no other table, the PS version saved with
    ``ps/``. Its tensors are mapped into memory (and read once, for the finite check), not kept: a trainer loads them
    again, rather than receive a pickled copy of every local table.

    Raises:
        PlannerError: One line naming ``trainer.pt`` and what it lacks or holds.
    """
    path = trained.checkpoint.path / TRAINER_STATE
    state = _load_tensors(path)
    if not isinstance(state, dict) or not all(isinstance(state.get(k), dict) for k in ("dense", "local")):
        raise _not_ours(path, "it lacks the dense network and the local tables")
    local = state["local"]
    for name, (rows, dim) in trained.local_tables.items():
        if name not in local:
            raise PlannerError(
                f"--checkpoint: {path} holds no weights of table {name!r}, which {PLAN_FILE} places on the trainers",
                fixes=(_RESTORE,),
            )
        _check_tensor(path, f"table {name!r}", local[name], (rows, dim))
    unknown = sorted((k for k in local if k not in trained.local_tables), key=str)
    if unknown:
        raise PlannerError(
            f"--checkpoint: {path} holds weights of table {abbreviate(unknown[0])}, which {PLAN_FILE} does not place "
            "on the trainers",
            fixes=(_RESTORE,),
        )
    dense: dict[str, tuple[int, ...]] = {}
    for key, value in state["dense"].items():
        _check_tensor(path, f"dense tensor {abbreviate(key)}", value, None)
        dense[str(key)] = tuple(value.shape)
    if trained.ps_version is not None and state.get("ps_version") != trained.ps_version:
        raise PlannerError(
            f"--checkpoint: {path} was saved with parameter-server version {abbreviate(state.get('ps_version'))}, "
            f"{trained.checkpoint.path / PS_DIR} holds version {trained.ps_version}: they were not saved together",
            fixes=(_RESTORE,),
        )
    return _settings(path, state, trained.spec, dense)


def _load_tensors(path: Path) -> Any:
    """``path`` read as torch.save's tensors and containers only, mapped into memory."""
    import torch

    if not path.is_file():
        raise PlannerError(f"--checkpoint: {path.parent} has no {path.name}", fixes=(_RESTORE,))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns of an old pickle protocol: the error says all
            return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError:  # the weights-only unpickler met a class, a function or a reduce
        raise _not_ours(path, "it holds objects other than tensors") from None
    except Exception as err:  # torch raises RuntimeError, EOFError, ValueError... for a foreign file
        text = first_line(err, with_type=True)
        why = "not a file torch.save writes" if "mmap can only be used" in text else f"unreadable: {text[:160]}"
        raise _not_ours(path, why) from None


def _not_ours(path: Path, why: str) -> PlannerError:
    return PlannerError(
        f"--checkpoint: {path} is not a checkpoint persia train wrote ({why})",
        fixes=(f"{_ANOTHER}; never load this file with torch.load(weights_only=False)",),
    )


_FINITE_CHECK_VALUES = 1 << 24
"""Weights checked for NaN and infinity at a time."""


def _check_tensor(path: Path, what: str, value: Any, shape: tuple[int, ...] | None) -> None:
    import torch

    if not isinstance(value, torch.Tensor) or value.layout is not torch.strided or not value.is_floating_point():
        kind = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
        raise _not_ours(path, f"its {what} is {kind}, not floating-point weights")
    if shape is not None and tuple(value.shape) != shape:
        raise PlannerError(
            f"--checkpoint: {path} holds {what} of shape {tuple(value.shape)}, {MODEL_FILE} gives it {shape} "
            "(rows x dim)",
            fixes=(_RESTORE,),
        )
    # In slices: a whole table's mask would take a byte per weight of the launcher's memory.
    flat = value.reshape(-1)
    if not all(bool(torch.isfinite(part).all()) for part in flat.split(_FINITE_CHECK_VALUES)):
        raise PlannerError(
            f"--checkpoint: {path} holds NaN or infinite weights in {what}: the run diverged, or the file was changed",
            fixes=("score with an earlier checkpoint of the run", _RESTORE),
        )


def _settings(path: Path, state: dict[str, Any], spec: ModelSpec, dense: dict[str, tuple[int, ...]]) -> TrainerSettings:
    hyper = state.get("hyper_parameters") or {}
    seed = state.get("seed", 0)
    if not isinstance(hyper, dict) or not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise _not_ours(path, "its seed or hyper_parameters are not persia train's")
    try:
        optimizer = Optimizer(hyper.get("sparse_optimizer", spec.tables[0].optimizer.value))
        lr = float(hyper.get("sparse_lr", 0.1))
        recorded = hyper.get("dense_arch")
        arch = None if recorded is None else DenseArch(**_arch_fields(recorded))
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError):  # ArchError is a ValueError
        raise _not_ours(path, "its hyper_parameters are not persia train's") from None
    if not math.isfinite(lr):
        raise _not_ours(path, f"its sparse learning rate is {lr}")
    return TrainerSettings(seed, optimizer, lr, arch, dense)


def _arch_fields(recorded: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``hyper_parameters.dense_arch`` as :class:`DenseArch` fields."""
    fields = {k: v for k, v in recorded.items() if k != "arch"}
    return {"kind": recorded["arch"], **fields}


def check_dense(trained: TrainedModel, settings: TrainerSettings, arch: DenseArch, data: str) -> None:
    """The dense network of ``trainer.pt`` is the one the model builds over ``data`` (``arch``): the arch the run
    recorded, and every tensor of it with its shape, and no other.

    Raises:
        PlannerError: One line naming the first difference.
    """
    path = trained.checkpoint.path / TRAINER_STATE
    recorded = settings.dense_arch
    if recorded is not None and recorded.num_dense != arch.num_dense:
        raise PlannerError(
            f"--data {data}: the model's dense arch reads {recorded.num_dense} dense features, this data gives "
            f"{arch.num_dense}",
            fixes=("score rows of the kind and columns the model was trained on",),
        )
    if recorded is not None and recorded != replace(arch, inputs_from_data=False):
        raise PlannerError(
            f"--checkpoint: {path} was trained with dense arch {recorded.to_dict()}, {MODEL_FILE} builds "
            f"{replace(arch, inputs_from_data=False).to_dict()}",
            fixes=(_RESTORE,),
        )
    built = _dense_shapes(trained, arch)
    missing = [k for k in built if k not in settings.dense]
    if missing:
        raise PlannerError(
            f"--checkpoint: {path} lacks the dense network's {missing[0]} ({len(missing)} of its {len(built)} tensors "
            "missing)",
            fixes=(_RESTORE,),
        )
    unknown = [k for k in settings.dense if k not in built]
    if unknown:
        raise PlannerError(
            f"--checkpoint: {path} holds dense tensor {abbreviate(unknown[0])}, which the model of {MODEL_FILE} does "
            "not have",
            fixes=(_RESTORE,),
        )
    for key, shape in built.items():
        if settings.dense[key] != shape:
            raise PlannerError(
                f"--checkpoint: {path} holds {key} of shape {settings.dense[key]}, the model of {MODEL_FILE} builds "
                f"{shape}",
                fixes=(_RESTORE,),
            )


def _dense_shapes(trained: TrainedModel, arch: DenseArch) -> dict[str, tuple[int, ...]]:
    """The dense network's tensors' shapes as the trainer builds it (TorchRec's DLRM, or DIN, on the meta
    device)."""
    import torch
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from persia_planner.modules.train.loop import torchrec_model
    from persia_planner.plan.torchrec_export import to_embedding_bag_configs

    dim = dlrm_embedding_dim(trained.spec)
    meta = torch.device("meta")
    if any(t.sequence for t in trained.spec.tables):  # DIN over both collections, as the trainer builds it
        from persia_planner.modules.train.loop import build_model, dense_state_dict

        with meta:
            built, _ = build_model(trained.spec, None, arch=arch, device=meta, local_device=meta)
        return {k: tuple(v.shape) for k, v in dense_state_dict(built).items()}
    try:
        with meta:
            collection = EmbeddingBagCollection(to_embedding_bag_configs(trained.spec), device=meta)
            model = torchrec_model(collection, arch, dim)
    except Exception as err:  # TorchRec asserts on what model.yaml's checks let through
        raise PlannerError(
            f"--checkpoint: the model of {trained.checkpoint.path / MODEL_FILE} does not build "
            f"({first_line(err, with_type=True)[:160]})",
            fixes=(_RESTORE,),
        ) from None
    prefix = next(name for name, module in model.named_modules() if module is collection) + "."
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(prefix)}
