"""TorchRec's state-dict keys for the hybrid collections (:class:`~.hybrid_tables.HybridTables`): their hooks.

A TorchRec ``EmbeddingBagCollection`` saves ``embedding_bags.<table>.weight`` (an ``EmbeddingCollection``
``embeddings.<table>.weight``); the bag collection holds its local tables at
``local.ebc.embedding_bags.<table>.weight`` (the sequence collection at ``local.ec.embeddings.<table>.weight``) and
its PS tables on the servers. :func:`torchrec_keys` (a state-dict post hook) gives every table TorchRec's key, reading
the PS tables' rows from the servers, and :func:`own_keys` (a load pre hook) undoes it, writing the PS rows to the
servers, so TorchRec checkpoints load both ways.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from persia_planner.errors import PlannerError

__all__ = ["own_keys", "torchrec_keys"]


def _prefixes(module: nn.Module) -> tuple[str, str]:
    """The keys' prefixes of ``module``'s local tables as it holds them and as TorchRec's collection saves them."""
    kind = module.KEY_PREFIX
    return f"local.{module.LOCAL.COLLECTION}.{kind}.", f"{kind}."


def torchrec_keys(module: nn.Module, state: dict[str, Any], prefix: str, _metadata: Any) -> None:
    """TorchRec's keys in ``state``, in place: ``local.ebc.embedding_bags.<t>.weight`` ->
    ``embedding_bags.<t>.weight`` (a sequence collection's ``local.ec.embeddings.<t>.weight`` ->
    ``embeddings.<t>.weight``), and each PS table's rows ``[0, num_embeddings)`` read from the servers under its key,
    every table in config order where the first one was."""
    local, torchrec = _prefixes(module)
    own = prefix + local
    tables: dict[str, Any] = {}
    if module.remote is not None and module.ps_rows_in_state_dict:
        for c in module.ps_tables:
            ids = torch.arange(c.num_embeddings, dtype=torch.int64)
            tables[f"{prefix}{torchrec}{c.name}.weight"] = module.remote.ps.read_rows(c.name, ids)
    if not tables and not any(k.startswith(own) for k in state):
        return
    for key, value in state.items():
        if key.startswith(own):
            tables[prefix + torchrec + key[len(own) :]] = value
    names = (f"{prefix}{torchrec}{c.name}.weight" for c in module.table_configs())
    ordered = {k: tables[k] for k in names if k in tables}
    items = list(state.items())
    state.clear()
    for key, value in items:
        if not key.startswith(own):
            state[key] = value
        elif ordered:  # every table at the first local one's place, in the collection's config order
            state.update(ordered)
            ordered = {}
    state.update(ordered)  # no local table: the PS ones at the end


def own_keys(module: nn.Module, state: dict[str, Any], prefix: str, _metadata: Any, *_args: Any) -> None:
    """The inverse of :func:`torchrec_keys`, before ``load_state_dict`` matches keys (TorchRec's checkpoints): the
    local tables' keys renamed, the PS tables' rows written to the servers (and their keys taken out)."""
    local, torchrec = _prefixes(module)
    theirs = prefix + torchrec
    ps = {c.name: c for c in module.ps_tables}
    for key in [k for k in state if k.startswith(theirs)]:
        table = key[len(theirs) :].removesuffix(".weight")
        if table not in ps or module.remote is None:
            state[prefix + local + key[len(theirs) :]] = state.pop(key)
            continue
        value, config = state.pop(key), ps[table]
        if not isinstance(value, torch.Tensor) or (type(value) is not torch.Tensor and hasattr(value, "local_shards")):
            raise PlannerError(
                f"load_state_dict: {key} is {type(value).__name__}; a PS table loads from a full tensor",
                fixes=("save the TorchRec collection unsharded (or gather its ShardedTensor) first",),
            )
        if tuple(value.shape) != (config.num_embeddings, config.embedding_dim):
            raise PlannerError(
                f"load_state_dict: {key} has shape {tuple(value.shape)}, PS table {table!r} is "
                f"{(config.num_embeddings, config.embedding_dim)}"
            )
        written = module.remote.ps.assign_rows(table, torch.arange(config.num_embeddings), value.detach())
        if written != config.num_embeddings:
            raise PlannerError(
                f"load_state_dict: the servers hold {written:,} of PS table {table!r}'s {config.num_embeddings:,} "
                "rows (their stores' capacity)",
                fixes=("give the servers' stores room for every row (ps_capacity)",),
            )
