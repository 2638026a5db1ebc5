"""Decoupled weight decay of the local tables' rows that a step updates, with the parameter servers' formula.

``SparseOptimizer(weight_decay=...)`` decays every table alike: ``w <- w * (1 - lr * wd)`` on each row a batch
touches, before its update (:func:`persia_planner.modules.ps.optim.decoupled_decay`, the formula's one home). The
servers apply it inside their row optimizers. fbgemm's fused kernels would take a ``weight_decay`` argument, but its
CPU kernels (fbgemm-gpu-cpu 1.8) ignore it for ``EXACT_SGD``, ``EXACT_ADAGRAD`` and ``EXACT_ROWWISE_ADAGRAD``
(decision 0023), and its CUDA ``DECOUPLE`` mode is another formula than the servers', so this module applies the
decay to the local tables itself, on every device:

- fused tables (:func:`decay_fused_rows`): a forward hook on each of the trainer's fbgemm table-batched modules reads
  the ids it looked up (after TorchRec's input all-to-all: every trainer's ids of this trainer's shards, in shard
  coordinates) and hooks the output's gradient, which autograd computes just before the fused backward updates the
  rows: the touched rows shrink there, then fbgemm steps them at the learning rate it holds (a schedule's current one).
- data-parallel replicas (and unsharded tables), trained by a ``torch.optim`` optimizer after DDP's all-reduce
  (:func:`decay_before_step`): before the optimizer's step, the rows whose averaged gradient is not zero (the rows any
  trainer touched, alike on every replica) shrink at the param group's learning rate.

The update itself reads no weight for SGD, Adagrad and row-wise Adagrad, so a row ends where the servers' row
optimizer puts it: ``w * (1 - lr * wd) - lr * update(g)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from persia_planner.errors import PlannerError
from persia_planner.modules.ps.optim import decoupled_decay

__all__ = ["decay_before_step", "decay_fused_rows", "touched_rows"]


def decay_fused_rows(tbes: Iterable[nn.Module], weight_decay: Mapping[str, float]) -> list[RemovableHandle]:
    """Decay the rows each fused fbgemm module of ``tbes`` updates, as its backward runs (see the module docstring).

    Data-parallel modules (fbgemm's dense kernel, no fused optimizer) are left to :func:`decay_before_step`.

    Args:
        tbes: The trainer's fbgemm modules (:meth:`.local.LocalEmbeddingBags.tbes`).
        weight_decay: Each table's decay, by name (a table it lacks: none).

    Returns:
        The hooks' handles (``remove()`` ends the decay), one per module with a table to decay.

    Raises:
        PlannerError: A module with an HBM cache of its rows (``fused_uvm_caching``), whose cached rows the decay
            would miss.
    """
    handles = []
    for tbe in tbes:
        if not hasattr(tbe, "get_learning_rate"):  # fbgemm's dense kernel: a torch optimizer steps it
            continue
        decays = [float(weight_decay.get(name, 0.0)) for name in tbe.table_names]
        if not any(decays):
            continue
        cache = getattr(tbe, "lxu_cache_weights", None)
        if cache is not None and cache.numel() > 0:
            raise PlannerError(
                "--sparse-weight-decay: a local table is kept in an HBM cache (hbm_cache tier), whose cached rows "
                "the decay cannot reach",
                fixes=("--sparse-weight-decay 0", "place the table on the hbm, ddr or ps tier"),
            )
        handles.append(tbe.register_forward_hook(_fused_hook(decays), with_kwargs=True))
    return handles


class _Views:
    """A module's tables' weights as ``[rows, dim]`` views (fbgemm's ``split_embedding_weights``, which costs as much
    as the decay itself when called every step), fetched again when the module's weights were reallocated."""

    def __init__(self) -> None:
        self.key: tuple[int, ...] = ()
        self.views: list[torch.Tensor] = []

    def of(self, tbe: nn.Module) -> list[torch.Tensor]:
        key = tuple(
            int(w.data_ptr()) for w in (getattr(tbe, n, None) for n in _WEIGHT_TENSORS) if isinstance(w, torch.Tensor)
        )
        if key != self.key or not self.views:
            # .data: the fused backward saved these weights and checks they are unchanged, which they are to it
            # (the update reads no weight); a detached view would share the version counter it checks.
            self.views, self.key = [w.data for w in tbe.split_embedding_weights()], key
        return self.views


# Where fbgemm's table-batched module keeps its weights (device, host, unified memory).
_WEIGHT_TENSORS = ("weights_dev", "weights_host", "weights_uvm")


def _fused_hook(decays: list[float]) -> Any:
    """The forward hook of a module whose table ``t`` decays by ``decays[t]``."""
    views = _Views()

    def hook(tbe: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return  # an evaluation: nothing is updated
        indices = kwargs["indices"] if "indices" in kwargs else args[0]
        offsets = kwargs["offsets"] if "offsets" in kwargs else args[1]
        batches = kwargs.get("batch_size_per_feature_per_rank")
        rows = touched_rows(indices, offsets, list(tbe.feature_table_map), batches)
        rows = {table: ids for table, ids in rows.items() if decays[table]}

        def decay(grad: torch.Tensor) -> None:
            lr = float(tbe.get_learning_rate())  # the rate this backward's fused update applies
            weights = views.of(tbe)
            with torch.no_grad():
                for table, ids in rows.items():
                    shard = weights[table]
                    decayed = decoupled_decay(shard.index_select(0, ids).float(), lr, decays[table])
                    # A row read twice is written twice with the same value: once decayed, as the servers decay it.
                    shard.index_copy_(0, ids, decayed.to(shard.dtype))

        output.register_hook(decay)

    return hook


def touched_rows(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_table_map: list[int],
    batch_size_per_feature_per_rank: list[list[int]] | None = None,
) -> dict[int, torch.Tensor]:
    """The rows of each table that an fbgemm lookup reads, by the table's index in the module (a row read twice is
    there twice: sorting them out would cost more than the decay's second write).

    Args:
        indices: The lookup's ids, all features' bags one after the other.
        offsets: Where each bag starts in ``indices`` (one more than the bags).
        feature_table_map: The table of each feature (fbgemm's ``feature_table_map``).
        batch_size_per_feature_per_rank: A variable-batch lookup's bags per feature and rank (None: every feature
            has ``(len(offsets) - 1) / features`` bags).
    """
    features = len(feature_table_map)
    if batch_size_per_feature_per_rank is None:
        bags = [(offsets.numel() - 1) // max(1, features)] * features
    else:
        bags = [sum(ranks) for ranks in batch_size_per_feature_per_rank]
    firsts = [0]
    for count in bags:
        firsts.append(firsts[-1] + count)
    bounds = offsets[torch.tensor(firsts)].tolist()  # each feature's first id, and the end
    by_table: dict[int, list[torch.Tensor]] = {}
    for feature, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            by_table.setdefault(feature_table_map[feature], []).append(indices[start:end])
    return {table: torch.cat(parts).long() for table, parts in by_table.items()}


def decay_before_step(optimizer: torch.optim.Optimizer, weight_decay: float) -> RemovableHandle | None:
    """Before each step of ``optimizer`` (the data-parallel replicas' or unsharded tables' ``torch.optim`` one), decay
    the rows of its ``[rows, dim]`` parameters whose gradient is not zero, at each param group's learning rate.

    Returns:
        The hook's handle; None when ``weight_decay`` is 0.
    """
    if weight_decay == 0.0:
        return None

    def hook(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        with torch.no_grad():
            for group in opt.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None or param.dim() != 2:
                        continue
                    grad = grad.to_dense() if grad.is_sparse else grad
                    ids = grad.ne(0).any(dim=1).nonzero().squeeze(1)
                    decayed = decoupled_decay(param.index_select(0, ids).float(), float(group["lr"]), weight_decay)
                    param.index_copy_(0, ids, decayed.to(param.dtype))

    return optimizer.register_step_pre_hook(hook)
