"""The plan's local tables: a TorchRec ``EmbeddingBagCollection`` that ``DistributedModelParallel`` shards.

:class:`LocalEmbeddingBags` is the synchronous half of :class:`~.hybrid.HybridEmbeddingBagCollection`. It holds the
local tables in a plain TorchRec ``EmbeddingBagCollection`` (attribute ``ebc``);
:func:`persia_planner.modules.embedding.model_parallel.distribute` hands the model to ``DistributedModelParallel`` with
the plan's exported ``ShardingPlan``, which replaces ``ebc`` by TorchRec's ``ShardedEmbeddingBagCollection``: its input
and output all-to-alls and fbgemm's fused kernels do the sparse work, each trainer computing only its shards for the
whole batch. Unsharded (one process, no DMP) it is that plain ``EmbeddingBagCollection``.

A step equals an ``EmbeddingBagCollection`` + DDP reference: TorchRec divides the pooled gradients by the number of
trainers in its output all-to-all's backward (``comm_ops`` gradient division, on by default), so model-parallel
tables see the trainers' average as DDP's dense gradients do, and its own DDP averages the data-parallel replicas.
One thing differs from TorchRec's module: ids are mapped into the table with ``id mod num_embeddings`` (a no-op for
ids in range), so raw 64-bit feature ids work and the plan may move a table between tiers without touching the data.

The weights and optimizer state are read and written as *pieces*: ``(table, offsets) -> tensor`` for this trainer's
shards. Full TorchRec keys (``embedding_bags.<table>.weight``) come out of
:meth:`~LocalEmbeddingBags.torchrec_state_dict` and go in through :meth:`~LocalEmbeddingBags.load_torchrec_state_dict`,
sharded or not, so a TorchRec ``EmbeddingBagCollection`` checkpoint loads into it and back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from persia_planner.errors import PlannerError

__all__ = ["ExecutedTable", "IdsInRange", "LocalEmbeddingBags", "ids_in_range", "int64_ids"]


@dataclass(frozen=True)
class ExecutedTable:
    """How TorchRec runs one local table, read from the built module.

    Attributes:
        sharding: TorchRec ``ShardingType`` value.
        kernel: TorchRec ``EmbeddingComputeKernel`` value of the kernel that computes it.
        ranks: Trainer ranks holding its shards, in shard order (data-parallel: every replica's rank).
        dtype: The torch dtype of its weights (``float16``).
        comms: The torch dtypes its pooled output and their gradients travel in between trainers (forward,
            backward: TorchRec's quantized-communication codecs), None where nothing travels (a data-parallel
            replica, an unsharded table).
    """

    sharding: str
    kernel: str
    ranks: tuple[int, ...]
    dtype: str
    comms: tuple[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"sharding": self.sharding, "kernel": self.kernel, "ranks": list(self.ranks), "dtype": self.dtype}
        if self.comms is not None:
            out["comms"] = {"forward": self.comms[0], "backward": self.comms[1]}
        return out


def _dtype_name(weight: Any) -> str:
    """``float16`` for a weight in float16: a tensor's, or a ``ShardedTensor``'s (its metadata's)."""
    dtype = weight.metadata().tensor_properties.dtype if hasattr(weight, "metadata") else weight.dtype
    return _dtype_name_of(dtype)


def _dtype_name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def int64_ids(values: torch.Tensor) -> torch.Tensor:
    """Feature ids as int64: uint64 as the same bit patterns (what the servers hash), narrower integers widened."""
    if values.dtype == torch.int64:
        return values
    if values.dtype == torch.uint64:
        return values.view(torch.int64)
    return values.to(torch.int64)


@torch.fx.wrap
def ids_in_range(
    features: KeyedJaggedTensor, order: list[str], rows: torch.Tensor, weighted: bool
) -> KeyedJaggedTensor:
    """The KJT of ``order``'s features (each once), their ids as int64 mapped into the tables (``id mod rows``,
    ``rows`` per feature) and their weights as float32 (None unless ``weighted``: unweighted collections ignore
    weights, as TorchRec's do). One call in a traced graph (``fx.wrap``), scriptable, shape-only on the meta device.
    """
    weights = features.weights_or_none()
    weights = weights.to(torch.float32) if weighted and weights is not None else None
    kjt = KeyedJaggedTensor(
        keys=features.keys(), values=int64_ids(features.values()), lengths=features.lengths(), weights=weights
    )
    keys = kjt.keys()
    if keys != order:
        kjt = kjt.permute([keys.index(f) for f in order])
    ids = kjt.values()
    per_key = kjt.lengths().view(len(order), kjt.stride()).sum(dim=1)
    bound = torch.repeat_interleave(rows.to(ids.device), per_key, output_size=ids.numel())
    return KeyedJaggedTensor(
        keys=order, values=torch.remainder(ids, bound), lengths=kjt.lengths(), weights=kjt.weights_or_none()
    )


class IdsInRange(nn.Module):
    """:func:`ids_in_range` as a module without parameters: TorchRec's train pipeline runs it ahead of the step, with
    the sharded collection's input all-to-all (a "postproc" module of its tracer).

    Args:
        order: The features, each once, in the collection's order.
        rows: Each feature's table rows (the smallest of its tables).
        weighted: Keep the per-id weights (float32).
    """

    def __init__(self, order: list[str], rows: list[int], weighted: bool) -> None:
        super().__init__()
        self.order = list(order)
        # A plain tensor, not a buffer: nothing to save or synchronise (ids_in_range moves it to the ids' device).
        self.rows = torch.tensor(rows, dtype=torch.int64)
        self.weighted = bool(weighted)

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return ids_in_range(features, self.order, self.rows, self.weighted)


class LocalEmbeddingBags(nn.Module):
    """The local tables of a plan, in a TorchRec ``EmbeddingBagCollection`` (``ebc``) that DMP shards.

    Args:
        tables: The local tables' configs (sum or mean pooling; dims multiples of 4 for fbgemm).
        is_weighted: Pool with the batch's per-id weights (TorchRec's ``is_weighted``).
        device: Where the unsharded collection is built; ``meta`` defers the allocation to DMP's shards.
        seed: Seed of the initial weights, uniform in ``+-sqrt(1 / num_embeddings)`` as TorchRec's default.

    Raises:
        PlannerError: A dim fbgemm's kernels cannot run.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        *,
        is_weighted: bool = False,
        device: torch.device | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.configs = list(tables)
        # Each feature once (TorchRec's collection reads a feature that feeds several tables once); its ids are
        # brought into the smallest of those tables, in range for each.
        rows: dict[str, int] = {}
        for c in self.configs:
            for f in c.feature_names:
                rows[f] = min(rows.get(f, c.num_embeddings), c.num_embeddings)
        self.features: list[str] = list(rows)
        self._is_weighted = bool(is_weighted)
        self.to_range = IdsInRange(self.features, list(rows.values()), self._is_weighted)
        self.seed = int(seed)
        device = device or torch.get_default_device()
        setattr(self, self.COLLECTION, self.build_collection(device))
        self.group: Any = None  # the trainers' group DMP shards over (None: the default group)
        if device.type != "meta":
            self.reset_parameters()

    COLLECTION: ClassVar[str] = "ebc"  # the attribute of the TorchRec collection (its sharded module once sharded)
    KEY_PREFIX: ClassVar[str] = "embedding_bags"  # its tables' state-dict prefix: embedding_bags.<table>.weight

    def build_collection(self, device: torch.device) -> nn.Module:
        """The unsharded TorchRec collection of :attr:`configs` on ``device``: an ``EmbeddingBagCollection``."""
        return EmbeddingBagCollection(tables=self.configs, is_weighted=self._is_weighted, device=device)

    @property
    def collection(self) -> nn.Module:
        """The TorchRec collection, sharded (once DMP sharded it) or not."""
        return getattr(self, self.COLLECTION)

    def set_collection(self, sharded: nn.Module) -> None:
        """Hold ``sharded`` (the collection's sharded module, from its TorchRec sharder) in place of the collection."""
        setattr(self, self.COLLECTION, sharded)

    # ---- forward ----------------------------------------------------------------------------------------------

    # Properties TorchScript must not compile (they ask torch.distributed): the unsharded module scripts without them.
    __jit_unused_properties__ = ("sharded", "world_size", "collection")

    @property
    def sharded(self) -> bool:
        """Whether DMP replaced the collection by TorchRec's sharded module."""
        return not isinstance(self.collection, EmbeddingBagCollection | EmbeddingCollection)

    @property
    def world_size(self) -> int:
        """Trainers the tables are sharded over (1 unsharded)."""
        return dist.get_world_size(self.group) if self.sharded and dist.is_initialized() else 1

    def check_shardable(self) -> None:
        """What fbgemm's kernels need of the tables before DMP shards them (the unsharded collection runs torch's
        ``EmbeddingBag``, which takes any dim).

        Raises:
            PlannerError: A dim that is not a multiple of 4.
        """
        odd = [c.name for c in self.configs if c.embedding_dim % 4]
        if odd:
            raise PlannerError(
                f"local tables {odd[:3]} have an embedding_dim that is not a multiple of 4, which fbgemm's "
                "table-batched embedding kernels require",
                fixes=("round embedding_dim up to a multiple of 4", "place these tables on the ps tier"),
            )

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of the local features of ``features`` (a KJT holding at least those keys).

        Returns:
            TorchRec's ``KeyedTensor`` (sharded: its keys grouped by rank; read it by key).
        """
        if torch.jit.is_scripting():  # unsharded: TorchRec's collection, checks and all
            return self.ebc(self.to_range(features))
        if is_fx_symbolic_tracing():  # the sharded module's awaitable is the tracer's to resolve
            return self.ebc(self.to_range(features))
        return self._forward_eager(features)

    @torch.jit.unused
    def _forward_eager(self, features: KeyedJaggedTensor) -> KeyedTensor:
        self._check_weights(features)
        out = self.ebc(self.to_range(features))
        return out.wait() if hasattr(out, "wait") else out  # the sharded module answers with an awaitable

    @torch.jit.unused
    def _check_weights(self, features: KeyedJaggedTensor) -> None:
        weights = features.weights_or_none()
        if self._is_weighted and weights is not None and weights.requires_grad and self.world_size > 1:
            raise PlannerError(
                "learnable per-id weights (weights that require grad) cannot train sharded local tables across "
                "trainers: TorchRec's input all-to-all of the weights has no backward",
                fixes=("place the weighted tables on the ps tier", "pass the weights detached"),
            )

    # ---- what runs --------------------------------------------------------------------------------------------

    def executed(self) -> dict[str, ExecutedTable]:
        """Each table's sharding type, kernel and ranks as the built module runs them (a collective when sharded:
        each trainer knows the kernels of its own shards only)."""
        if not self.sharded:
            state = self.collection.state_dict()
            return {
                c.name: ExecutedTable(
                    "unsharded", "dense", (0,), _dtype_name(state[f"{self.KEY_PREFIX}.{c.name}.weight"])
                )
                for c in self.configs
            }
        kernels = {}
        for lookup in self.collection._lookups:  # TorchRec keeps the built kernels here; no public accessor exists
            for emb in getattr(lookup, "module", lookup)._emb_modules:
                for table in emb.config.embedding_tables:
                    kernels[table.name] = emb.config.compute_kernel.value
        everyone: list[dict[str, str]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(everyone, kernels, group=self.group)
        merged: dict[str, set[str]] = {}
        for part in everyone:
            for name, kernel in part.items():
                merged.setdefault(name, set()).add(kernel)
        plan = self.collection.module_sharding_plan
        state = self.collection.state_dict()
        comms = {}  # by sharding type: TorchRec keeps each type's codecs on its sharding only, in type order
        module = self.collection
        # TorchRec's bag collection lists its shardings in type order; its sequence collection keys them by type.
        shardings = getattr(module, "_embedding_shardings", None) or list(module._sharding_type_to_sharding.values())
        for sharding_type, sharding in zip(module._sharding_types, shardings, strict=True):
            codecs = list((sharding.qcomm_codecs_registry or {}).values())
            wire = [_dtype_name_of(c.forward.quantized_dtype) for c in codecs] or ["float32"]
            back = [_dtype_name_of(c.backward.quantized_dtype) for c in codecs] or ["float32"]
            comms[sharding_type] = ("/".join(sorted(set(wire))), "/".join(sorted(set(back))))
        out = {}
        for c in self.configs:
            value = state[f"{self.KEY_PREFIX}.{c.name}.weight"]
            if hasattr(value, "metadata"):
                ranks = tuple(m.placement.rank() for m in value.metadata().shards_metadata)
            else:
                ranks = tuple(range(self.world_size))
            kernel = "/".join(sorted(merged.get(c.name, {"none"})))
            sharding = plan[c.name].sharding_type
            travels = comms.get(sharding) if sharding != "data_parallel" else None
            out[c.name] = ExecutedTable(sharding, kernel, ranks, _dtype_name(value), travels)
        return out

    # ---- weights and optimizer state ---------------------------------------------------------------------------

    def pieces(self) -> Iterator[tuple[str, tuple[int, ...], torch.Tensor, bool]]:
        """This trainer's weights: ``(table, (row, col) offset, tensor view, replicated)`` per shard or replica."""
        for key, value in self.collection.state_dict(keep_vars=True).items():
            table = key.split(".")[-2]
            if hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    yield table, tuple(shard.metadata.shard_offsets), shard.tensor, False
            else:
                yield table, (0, 0), value, True

    def reset_parameters(self) -> None:
        """TorchRec's default initialisation, seeded: the same full tables on every trainer, whatever the sharding."""
        for name, full in self.initial_weights():  # one full table at a time: the largest bounds the memory
            self.load_torchrec_state_dict({f"{self.KEY_PREFIX}.{name}.weight": full}, strict=False)

    def initial_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each table's full initial weights, in config order, as :meth:`reset_parameters` sets them (uniform in
        ``+-sqrt(1 / num_embeddings)``, drawn from one generator seeded ``seed``)."""
        gen = torch.Generator().manual_seed(self.seed)
        for c in self.configs:
            bound = (1.0 / c.num_embeddings) ** 0.5
            yield c.name, torch.empty(c.num_embeddings, c.embedding_dim).uniform_(-bound, bound, generator=gen)

    def load_torchrec_state_dict(self, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        """Copy full tables (a TorchRec ``EmbeddingBagCollection`` state dict) into this trainer's shards.

        Args:
            state: ``embedding_bags.<table>.weight -> [rows, dim]``; keys of other tables are ignored.
            strict: Every local table must be in ``state``.

        Raises:
            PlannerError: A table is missing (strict) or has another shape.
        """
        by_table = {c.name: c for c in self.configs}
        missing = [n for n in by_table if f"{self.KEY_PREFIX}.{n}.weight" not in state]
        if strict and missing:
            raise PlannerError(f"the state dict has no weights for local tables {missing[:3]}")
        for name, c in by_table.items():
            value = state.get(f"{self.KEY_PREFIX}.{name}.weight")
            if value is not None and tuple(value.shape) != (c.num_embeddings, c.embedding_dim):
                raise PlannerError(
                    f"local table {name!r} has shape {(c.num_embeddings, c.embedding_dim)}, the state dict's is "
                    f"{tuple(value.shape)} (saved with another model?)"
                )
        with torch.no_grad():
            for table, (row, col), piece, _ in self.pieces():
                value = state.get(f"{self.KEY_PREFIX}.{table}.weight")
                if value is not None:
                    rows, cols = piece.shape
                    piece.copy_(value[row : row + rows, col : col + cols])
        self._reset_caches()

    def torchrec_state_dict(self, dst: int | None = None) -> dict[str, torch.Tensor]:
        """Full tables under TorchRec's keys (a collective when sharded).

        Args:
            dst: Only this trainer gets the tables (the others get ``{}``); None: every trainer does.
        """
        self._flush_caches()
        mine = []
        replicas = {}
        for table, (row, col), piece, replicated in self.pieces():
            if replicated:
                replicas[table] = piece.detach().float().cpu().clone()
            else:
                mine.append((table, row, col, piece.detach().float().cpu()))
        if self.world_size > 1:
            mine = self._collect(mine, dst)
            if mine is None:
                return {}
        full = {c.name: replicas.get(c.name, torch.zeros(c.num_embeddings, c.embedding_dim)) for c in self.configs}
        for table, row, col, piece in mine:
            full[table][row : row + piece.shape[0], col : col + piece.shape[1]] = piece
        return {f"{self.KEY_PREFIX}.{name}.weight": weight for name, weight in full.items()}

    def _collect(self, mine: list[Any], dst: int | None) -> list[Any] | None:
        """Every trainer's ``mine``, concatenated in rank order, on ``dst`` (None: on all); None elsewhere."""
        everyone: list[Any] = [None] * self.world_size
        if dst is None:
            dist.all_gather_object(everyone, mine, group=self.group)
        else:
            rank = dist.get_rank(self.group)
            dist.gather_object(mine, everyone if rank == dst else None, dst=dst, group=self.group)
            if rank != dst:
                return None
        return [p for part in everyone for p in part]

    def optimizer_pieces(self, dst: int | None = None) -> dict[tuple[str, str, tuple[int, ...]], torch.Tensor]:
        """Every trainer's fused-optimizer state, by (parameter, state, shard offset) (a collective when sharded).

        Keyed by shard offsets: row-wise states of column-wise shards are per shard, not one per table row.

        Args:
            dst: Only this trainer gets them (the others get ``{}``); None: every trainer does.
        """
        if not self.sharded:
            return {}
        self._flush_caches()
        mine = []
        for param, states in self.collection.fused_optimizer.state_dict()["state"].items():
            for name, value in states.items():
                for shard in value.local_shards() if hasattr(value, "local_shards") else ():
                    mine.append(
                        ((param, name, tuple(shard.metadata.shard_offsets)), shard.tensor.detach().clone().cpu())
                    )
        if self.world_size > 1:
            mine = self._collect(mine, dst)
            if mine is None:
                return {}
        return dict(mine)

    def load_optimizer_pieces(self, saved: Mapping[tuple[str, str, tuple[int, ...]], torch.Tensor]) -> None:
        """Restore :meth:`optimizer_pieces` (saved under the same sharding plan).

        Raises:
            PlannerError: A shard's state is missing or has another shape (another plan or optimizer), checked
                before anything is copied.
        """
        if not self.sharded:
            return
        targets = []
        for param, states in self.collection.fused_optimizer.state_dict()["state"].items():
            for name, value in states.items():
                for shard in value.local_shards() if hasattr(value, "local_shards") else ():
                    key = (param, name, tuple(shard.metadata.shard_offsets))
                    source = saved.get(key)
                    if source is None or tuple(source.shape) != tuple(shard.tensor.shape):
                        raise PlannerError(
                            f"the checkpoint has no optimizer state {name!r} of shape {tuple(shard.tensor.shape)} "
                            f"at offset {list(key[2])} of local table {param.split('.')[-2]!r} (saved under another "
                            "plan or sparse optimizer?)",
                            fixes=("resume with the plan and sparse optimizer of the checkpointed run",),
                        )
                    targets.append((shard.tensor, source))
        with torch.no_grad():
            for dst, src in targets:
                dst.copy_(src)
        self._reset_caches()

    def load_optimizer_tables(self, whole: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Set the fused optimizers' state from whole tables' state, whatever this trainer's shards of them:
        ``whole[table][state]`` is ``[rows, dim]`` (element-wise, cut by the shard's box) or ``[rows]`` (row-wise,
        one value per row; a table split by columns keeps one per row of each column shard, TorchRec's state of
        ``k * rows`` values, and each gets the row's). States or tables ``whole`` lacks keep their values.

        Raises:
            PlannerError: A state whose shape fits neither form (another optimizer), checked before anything is
                copied.
        """
        if not self.sharded:
            return
        rows = {c.name: c.num_embeddings for c in self.configs}
        targets = []
        for param, states in self.collection.fused_optimizer.state_dict()["state"].items():
            table = param.split(".")[-2]
            for key, value in states.items():
                name = key[len(table) + 1 :] if key.startswith(f"{table}.") else key
                source = whole.get(table, {}).get(name)
                if source is None or not hasattr(value, "local_shards"):
                    continue
                size = tuple(value.metadata().size)
                if len(size) == 1 and source.dim() == 1 and size[0] % rows[table] == 0:
                    source = source.repeat(size[0] // rows[table])  # one copy per column shard
                elif tuple(source.shape) != size:
                    raise PlannerError(
                        f"local table {table!r}: optimizer state {name!r} of shape {tuple(source.shape)} does not "
                        f"fit this plan's {size} (another sparse optimizer?)",
                        fixes=("resume with the sparse optimizer of the checkpointed run",),
                    )
                for shard in value.local_shards():
                    box = tuple(
                        slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.tensor.shape, strict=True)
                    )
                    targets.append((shard.tensor, source[box]))
        with torch.no_grad():
            for dst, src in targets:
                dst.copy_(src)
        self._reset_caches()

    def tbes(self) -> Iterator[nn.Module]:
        """This trainer's fbgemm table-batched embedding modules (fused kernels and data-parallel replicas alike),
        which hold its shards' weights, optimizer state and caches. TorchRec keeps them outside the module tree (and
        its fused modules list only their weights as parameters), so :meth:`~torch.nn.Module.parameters` does not
        reach them. None before DMP has sharded the collection."""
        if not self.sharded:
            return
        for lookup in self.collection._lookups:
            for emb in getattr(lookup, "module", lookup)._emb_modules:
                yield emb._emb_module

    def _flush_caches(self) -> None:
        # An HBM cache (fused_uvm_caching) holds updated rows that its backing store has not seen yet.
        for tbe in self.tbes():
            if hasattr(tbe, "flush"):
                tbe.flush()

    def _reset_caches(self) -> None:
        # Cached rows would shadow what was just written to the backing store.
        for tbe in self.tbes():
            if hasattr(tbe, "reset_cache_states"):
                tbe.reset_cache_states()


# fx writes a traced graph's signature from forward's annotations, which `from __future__ import annotations` leaves
# as strings that TorchScript cannot resolve in the generated code: the classes themselves.
LocalEmbeddingBags.forward.__annotations__.update(features=KeyedJaggedTensor, **{"return": KeyedTensor})
IdsInRange.forward.__annotations__.update(features=KeyedJaggedTensor, **{"return": KeyedJaggedTensor})
