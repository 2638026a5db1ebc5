"""A checkpoint resumed under another plan: every table's weights and optimizer state moved to where the new plan
keeps it (``persia train --resume`` with another ``--plan``, and each migration of ``persia train --adapt``, which
resumes its own checkpoint so).

A checkpoint holds its plan (``plan.json``), the local tables' full weights by name and their fused optimizer's
pieces by shard (``trainer.pt``), the data-parallel replicas' optimizer state beside the dense one's, and the
servers' tables (``ps/``). Each table moves by what the two plans make of it (:func:`table_moves`):

- **local -> local**, any sharding type or kernel: the full weights by name (TorchRec's state-dict keys), and the
  optimizer state made whole per table from the old shards' pieces, then cut for the new shards. Exact: the new
  shards hold what the old ones held. One exception is TorchRec's own: row-wise Adagrad keeps one accumulator per row
  *of each column shard*, so a table split by columns holds several per row; made whole, a row's accumulator is their
  mean (equal for the table-wise and row-wise splits that have one), and each new column shard starts from it.
- **ps -> ps**: the servers load the table from the checkpoint, as a resume under the same plan.
- **ps -> local**: a PS table keys rows by the raw 64-bit id, a local table by ``id mod rows``
  (:func:`persia_planner.modules.embedding.local.ids_in_range`). The rows the servers held are folded by
  ``id mod rows``: colliding ids give their mean (weights and optimizer state alike); a row no id reaches keeps the
  new local table's initial value (seeded, so the same on every run), or the table's seed where it has one.
- **local -> ps**: the new PS table starts empty, seeded with the local table (weights and row state:
  :meth:`persia_planner.modules.ps.store.EmbeddingStore.seed`): an id the servers never trained answers row
  ``id mod rows``, as the local table did, so the model computes the same function after the move. The seed is
  saved with the servers' checkpoints and loaded back.

The optimizer states carried across the trainers and the servers are those of the Adagrad family (a state per row or
per element); SGD has none, and Adam's moments start afresh on the other side.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from persia_planner.errors import PlannerError
from persia_planner.kinds import Mode, Sharding
from persia_planner.model.specs import Optimizer
from persia_planner.modules.embedding.hybrid_set import TrainedTables
from persia_planner.modules.train.job_checkpoints import PLAN_FILE, PS_DIR
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.plan import placement_from_dict

__all__ = [
    "TableMoves",
    "dense_optimizer_for",
    "fold_rows",
    "migrated_state",
    "replica_table",
    "saved_plan",
    "seed_moved_tables",
    "table_moves",
    "whole_optimizer_states",
]

# The name TorchRec's data-parallel replicas' torch optimizer gives a fused state (fbgemm's names are the keys).
_TORCH_NAMES = {"momentum1": ("sum", "exp_avg"), "momentum2": ("exp_avg_sq",)}


@dataclass(frozen=True)
class TableMoves:
    """What a change of plan does to each table.

    Attributes:
        local_to_local: Local in both plans (any sharding type or kernel).
        ps_to_ps: On the servers in both.
        ps_to_local: From the servers to the trainers.
        local_to_ps: From the trainers to the servers.
        placements_changed: The tables whose placement differs at all.
    """

    local_to_local: tuple[str, ...]
    ps_to_ps: tuple[str, ...]
    ps_to_local: tuple[str, ...]
    local_to_ps: tuple[str, ...]
    placements_changed: tuple[str, ...]


def saved_plan(checkpoint: Path) -> dict[str, TablePlacement] | None:
    """The plan a checkpoint was saved under (its ``plan.json``); None for a checkpoint without one.

    Raises:
        PlannerError: The file is not a plan's placements (one line naming it).
    """
    path = checkpoint / PLAN_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PlannerError(
            f"--resume: {path} is not readable JSON ({err})", fixes=("resume from another checkpoint",)
        ) from None
    if not isinstance(data, dict):
        raise PlannerError(f"--resume: {path} is not a table -> placement object", fixes=("resume from another one",))
    return {str(name): placement_from_dict(value, str(path), str(name)) for name, value in data.items()}


def table_moves(old: Mapping[str, TablePlacement], new: Mapping[str, TablePlacement]) -> TableMoves:
    """Where each of ``new``'s tables comes from under ``old``.

    Raises:
        PlannerError: The plans do not place the same tables (another model).
    """
    if set(old) != set(new):
        differ = sorted(set(old) ^ set(new))
        raise PlannerError(
            f"--resume: the checkpoint's plan and this run's place different tables ({', '.join(differ[:3])}): "
            "they are plans of different models",
            fixes=("resume with the model the checkpoint was trained with",),
        )
    on_ps = {name: p.mode is Mode.ASYNC for name, p in old.items()}
    moves: dict[tuple[bool, bool], list[str]] = {(a, b): [] for a in (False, True) for b in (False, True)}
    for name, placement in new.items():
        moves[(on_ps[name], placement.mode is Mode.ASYNC)].append(name)
    changed = tuple(name for name, placement in new.items() if not old[name].same_as(placement))
    return TableMoves(
        tuple(moves[(False, False)]),
        tuple(moves[(True, True)]),
        tuple(moves[(True, False)]),
        tuple(moves[(False, True)]),
        changed,
    )


# ---- optimizer state -----------------------------------------------------------------------------------------


def whole_optimizer_states(
    pieces: Mapping[tuple[str, str, tuple[int, ...]], torch.Tensor],
    rows: Mapping[str, int],
    dims: Mapping[str, int],
) -> dict[str, dict[str, torch.Tensor]]:
    """Each table's fused-optimizer state made whole from a checkpoint's pieces (``LocalEmbeddingBags
    .optimizer_pieces``): ``{table: {state: [rows, dim] or [rows]}}``.

    A row-wise state (one value per row) of a table split by columns holds ``k * rows`` values, one per row of each
    column shard (TorchRec's layout): made whole, a row's value is the mean of its ``k``.

    Args:
        pieces: ``(parameter, state, shard offsets) -> tensor``.
        rows: Each table's rows.
        dims: Each table's columns.
    """
    by_state: dict[tuple[str, str], list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    for (param, state, offsets), value in pieces.items():
        table = param.split(".")[-2]
        name = state[len(table) + 1 :] if state.startswith(f"{table}.") else state
        by_state.setdefault((table, name), []).append((tuple(offsets), value))
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for (table, name), parts in by_state.items():
        n = rows[table]
        if all(value.dim() == 1 for _, value in parts):
            total = max(offsets[0] + value.numel() for offsets, value in parts)
            flat = torch.zeros(total)
            for offsets, value in parts:
                flat[offsets[0] : offsets[0] + value.numel()] = value.float()
            if total % n:
                raise PlannerError(
                    f"--resume: table {table!r}'s optimizer state {name!r} holds {total} values, not a multiple of "
                    f"its {n} rows (saved with another model?)",
                    fixes=("resume with the model the checkpoint was trained with",),
                )
            whole.setdefault(table, {})[name] = flat.view(total // n, n).mean(dim=0)
        else:
            full = torch.zeros(n, dims[table])
            for offsets, value in parts:
                r, c = offsets[0], offsets[1]
                full[r : r + value.shape[0], c : c + value.shape[1]] = value.float()
            whole.setdefault(table, {})[name] = full
    return whole


def _replica_states(dense_optimizer: Mapping[str, Any], tables: set[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The data-parallel replicas' optimizer state (in the dense optimizer's, by parameter name), per table under
    fbgemm's state names."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, states in dense_optimizer.get("state", {}).items():
        table = replica_table(key)
        if table not in tables:
            continue
        for fused, names in _TORCH_NAMES.items():
            value = next((states[n] for n in names if n in states), None)
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                row_wise = value.dim() == 2 and value.shape[1] == 1  # torchrec's RowWiseAdagrad: [rows, 1]
                out.setdefault(table, {})[fused] = value.float().squeeze(1) if row_wise else value.float()
    return out


def replica_table(key: str) -> str | None:
    """The table of a replica's parameter name (``...embedding_bags.<table>.weight``, a sequence table's
    ``...embeddings.<table>.weight``), None for a dense one."""
    parts = key.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] in ("embedding_bags", "embeddings"):
        return parts[-2]
    return None


def dense_optimizer_for(
    saved: Mapping[str, Any], current: Mapping[str, Any], whole: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, Any]:
    """The dense optimizer's state (``CombinedOptimizer.state_dict()``) for the new plan: the dense parameters' and
    the replicas kept as saved; a table that becomes a replica gets ``current``'s fresh entry with its state from
    ``whole``; one that stops being a replica leaves."""
    state: dict[str, Any] = {}
    for key, entry in current.get("state", {}).items():
        if key in saved.get("state", {}):
            state[key] = saved["state"][key]
            continue
        table = replica_table(key)
        fresh = dict(entry)
        for fused, names in _TORCH_NAMES.items():
            value = whole.get(table or "", {}).get(fused)
            name = next((n for n in names if n in fresh), None)
            if value is None or name is None or not isinstance(fresh[name], torch.Tensor):
                continue
            target = fresh[name]
            fresh[name] = value.reshape(target.shape).to(target.dtype) if value.numel() == target.numel() else target
        state[key] = fresh
    return {**{k: v for k, v in current.items() if k != "state"}, "state": state}


# ---- the servers' rows ---------------------------------------------------------------------------------------


def fold_rows(ids: torch.Tensor, values: torch.Tensor, rows: int, default: torch.Tensor) -> torch.Tensor:
    """``values`` (one per id) folded into ``rows`` rows by ``id mod rows``: the mean of the ids of each row, and
    ``default``'s row where no id lands.

    Args:
        ids: int64 ids (uint64 bit patterns).
        values: ``[len(ids), width]``.
        rows: The local table's rows.
        default: ``[rows, width]``.
    """
    if ids.numel() == 0:
        return default.clone()
    at = torch.remainder(ids.to(torch.int64), rows)  # the local tables' own mapping (local.ids_in_range)
    sums = torch.zeros(rows, values.shape[1], dtype=torch.float64).index_add_(0, at, values.to(torch.float64))
    counts = torch.bincount(at, minlength=rows)
    folded = (sums / counts.clamp(min=1).unsqueeze(1).to(torch.float64)).to(default.dtype)
    return torch.where((counts > 0).unsqueeze(1), folded, default)


def _ps_tables_to_local(
    checkpoint: Path,
    tables: tuple[str, ...],
    hybrid: TrainedTables,
    optimizer: Optimizer,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The local weights and whole optimizer state of the PS tables that become local: the checkpoint's rows folded
    by ``id mod rows``."""
    from persia_planner.modules.ps.table_checkpoints import load_rows, load_seeds

    if not tables:
        return {}, {}
    assert hybrid.local is not None
    configs = {c.name: c for c in hybrid.local_tables}
    initial = {name: w for name, w in hybrid.local.initial_weights() if name in tables}
    held, _ = load_rows(checkpoint / PS_DIR, server=0, n_servers=1, tables=tables)  # one server: every row
    seeds = load_seeds(checkpoint / PS_DIR, tables)
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name in tables:
        rows, dim = configs[name].num_embeddings, configs[name].embedding_dim
        saved = held.get(name, {"ids": torch.empty(0, dtype=torch.int64), "weights": torch.empty(0, dim)})
        seed = seeds.get(name)
        seeded = seed is not None and tuple(seed["weights"].shape) == (rows, dim)
        default = seed["weights"].float() if seeded else initial[name]  # type: ignore[index]
        weights[name] = fold_rows(saved["ids"], saved["weights"].float(), rows, default)
        row_state = saved.get("state")
        if optimizer in (Optimizer.ROWWISE_ADAGRAD, Optimizer.ADAGRAD) and row_state is not None:
            width = 1 if optimizer is Optimizer.ROWWISE_ADAGRAD else dim
            base = seed.get("state") if seeded else None  # type: ignore[union-attr]
            base = base.float() if base is not None and base.shape[1] == width else torch.zeros(rows, width)
            folded = fold_rows(saved["ids"], row_state.float(), rows, base)
            states[name] = {"momentum1": folded.squeeze(1) if width == 1 else folded}
    return weights, states


def seed_moved_tables(
    client: Any,
    tables: tuple[str, ...],
    local: Mapping[str, torch.Tensor],
    whole: Mapping[str, Mapping[str, torch.Tensor]],
    optimizer: Optimizer,
) -> None:
    """Seed each table that moves to the servers with its local rows (and row state): the servers answer an id they
    never trained with row ``id mod rows``, as the local table did (one client: trainer 0's)."""
    for name in tables:
        state = whole.get(name, {}).get("momentum1")
        if optimizer is Optimizer.ROWWISE_ADAGRAD and state is not None and state.dim() == 1:
            state = state.unsqueeze(1)
        elif optimizer is not Optimizer.ADAGRAD or state is None or state.dim() != 2:
            state = None  # SGD keeps none; Adam's moments start afresh on the servers
        client.seed(name, local[name], state)


# ---- the whole trainer state ---------------------------------------------------------------------------------


def migrated_state(
    checkpoint: Path,
    state: Mapping[str, Any],
    old: Mapping[str, TablePlacement],
    new: Mapping[str, TablePlacement],
    hybrid: TrainedTables,
    opt: Any,
    optimizer: Optimizer,
) -> tuple[dict[str, Any], TableMoves, dict[str, dict[str, torch.Tensor]]]:
    """``state`` (a checkpoint's ``trainer.pt``, saved under ``old``) as the same trainer state under ``new``.

    Returns:
        The state :func:`persia_planner.modules.train.trainer_state.load_trainer_state` loads (the local tables'
        optimizer state whole, under ``local_optimizer_tables``), the moves, and every formerly local table's
        whole optimizer state (what the tables that move to the servers are seeded with).
    """
    moves = table_moves(old, new)
    configs = {c.name: c for c in hybrid.table_configs()}
    rows = {name: c.num_embeddings for name, c in configs.items()}
    dims = {name: c.embedding_dim for name, c in configs.items()}
    was_local = set(moves.local_to_local) | set(moves.local_to_ps)
    whole = whole_optimizer_states(state["local_optimizer"], rows, dims)
    replicas_before = {n for n in was_local if old[n].sharding is Sharding.DATA_PARALLEL}
    whole |= _replica_states(state["dense_optimizer"], replicas_before)
    folded, folded_states = _ps_tables_to_local(checkpoint, moves.ps_to_local, hybrid, optimizer)
    local = {name: state["local"][name] for name in moves.local_to_local} | folded
    tables_state = {name: whole[name] for name in moves.local_to_local if name in whole} | folded_states
    opt.init_state()  # every state exists: the new replicas' entries are its own, filled below
    dense = dense_optimizer_for(state["dense_optimizer"], opt.state_dict(), tables_state)
    out = {
        **state,
        "dense_optimizer": dense,
        "local": local,
        "local_optimizer": {},
        "local_optimizer_tables": tables_state,
    }
    return out, moves, whole
