"""What both hybrid collections share: a plan's tables split into the local ones (TorchRec's collection that DMP
shards, trained synchronously) and the parameter-server ones (trained asynchronously with bounded staleness K), the
PS step protocol, the tables' fused optimizers and their weights.

:class:`HybridTables` is the base of :class:`~.hybrid.HybridEmbeddingBagCollection` (pooled bags, TorchRec's
``EmbeddingBagCollection`` interface) and :class:`~.sequence_hybrid.HybridEmbeddingCollection` (sequences, one row
per id, TorchRec's ``EmbeddingCollection`` interface); each adds its interface, its output and its state-dict keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import ErrorKind, PlannerError
from persia_planner.kinds import Mode
from persia_planner.modules.embedding.local import LocalEmbeddingBags
from persia_planner.modules.embedding.remote import RemoteEmbeddingBags
from persia_planner.modules.embedding.sparse_optimizer import SparseOptimizer
from persia_planner.modules.embedding.state_keys import own_keys, torchrec_keys
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.plan import Plan
from persia_planner.plan.validation import require_same_tables

if TYPE_CHECKING:  # pragma: no cover
    from persia_planner.modules.ps.client import PsClient

__all__ = ["HybridTables", "check_kjt", "managed_collisions_refused", "placements_of"]


class HybridTables(nn.Module):
    """A plan's tables, local or on the parameter servers (see the module docstring; the collections' docstrings
    describe the arguments).

    Raises:
        PlannerError: The plan misses a table or names an unknown one, PS tables without a client, an optimizer
            fbgemm's kernels lack for local tables, a negative staleness.
    """

    POOLED: ClassVar[bool] = True
    """Whether the collection pools a sample's rows (bags) or returns one per id (sequences)."""
    KEY_PREFIX: ClassVar[str] = "embedding_bags"
    """TorchRec's state-dict prefix of the collection's tables."""
    LOCAL: ClassVar[type[LocalEmbeddingBags]] = LocalEmbeddingBags
    """The module of the local tables (its ``COLLECTION`` holds TorchRec's collection)."""

    def __init__(
        self,
        tables: Sequence[Any],
        plan: Plan | Mapping[str, TablePlacement] | None = None,
        *,
        ps: PsClient | None = None,
        optimizer: SparseOptimizer | None = None,
        table_optimizers: Mapping[str, SparseOptimizer] | None = None,
        staleness: int = 0,
        process_group: Any = None,
        device: torch.device | None = None,
        local_device: torch.device | str | None = None,
        ps_capacity: int | Mapping[str, int] | None = None,
        ps_backing: Mapping[str, int] | None = None,
        ps_store_dir: str | None = None,
        ps_init: Any = None,
        seed: int = 0,
        is_weighted: bool = False,
    ) -> None:
        super().__init__()
        kind = type(self).__name__
        if not tables:
            raise PlannerError(f"{kind} needs at least one table")
        if staleness < 0:
            raise PlannerError(f"staleness must be >= 0, got {staleness}", fixes=("use 0 for synchronous training",))
        names = [c.name for c in tables]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:  # a ValueError, as TorchRec's collections raise
            raise ValueError(f"{kind}: table name {duplicate!r} is used twice")
        self._is_weighted = bool(is_weighted)
        self._configs = list(tables)
        self.optimizer = optimizer or SparseOptimizer()
        unknown = sorted(set(table_optimizers or {}) - set(names))
        if unknown:
            raise PlannerError(f"table_optimizers names {unknown[:3]}, which are not tables of the collection")
        self.table_optimizers = {n: (table_optimizers or {}).get(n, self.optimizer) for n in names}
        self.max_staleness = int(staleness)
        self.device = torch.device(device) if device is not None else torch.get_default_device()
        placements = placements_of(plan, self._configs, pooled=self.POOLED)
        self.ps_tables = [
            c for c in self._configs if placements.get(c.name) is not None and placements[c.name].mode is Mode.ASYNC
        ]
        ps_names = {c.name for c in self.ps_tables}
        self.local_tables = [c for c in self._configs if c.name not in ps_names]
        if self.ps_tables and ps is None:
            raise PlannerError(
                f"tables {[c.name for c in self.ps_tables]} are on the ps tier but no parameter-server client "
                "was given",
                fixes=("pass ps=connect(...) (persia_planner.modules.ps.client)", "plan without a ps tier"),
            )
        self.ps = ps if self.ps_tables else None
        # TorchRec's output keys: a feature's name, or "feature@table" where the feature feeds several tables.
        self.names_by_table = dict(zip(names, get_embedding_names_by_table(self._configs), strict=True))
        self._inputs = list(dict.fromkeys(f for c in self._configs for f in c.feature_names))
        self.local: LocalEmbeddingBags | None = None
        if self.local_tables:
            for c in self.local_tables:  # refuses what fbgemm's fused kernels lack, now
                self.table_optimizers[c.name].fbgemm(self.device.type == "cuda")
            built_on = torch.device(local_device) if local_device is not None else self.device
            weighted = {"is_weighted": is_weighted} if self.POOLED else {}  # sequences have no per-id weights
            self.local = self.LOCAL(self.local_tables, device=built_on, seed=seed, **weighted)
        self.remote: RemoteEmbeddingBags | None = None
        if self.ps is not None:
            group = process_group
            if group is None and dist.is_available() and dist.is_initialized():
                group = dist.new_group(backend="gloo")  # ids and gradients of the K = 0 update live on CPU
            self.remote = RemoteEmbeddingBags(
                self.ps_tables,
                self.ps,
                optimizer={c.name: self.table_optimizers[c.name].ps() for c in self.ps_tables},
                staleness=staleness,
                process_group=group,
                device=self.device,
                capacity=ps_capacity,
                stores={c.name: placements[c.name].tier.spec.store for c in self.ps_tables},
                backing=ps_backing,
                store_dir=ps_store_dir,
                init=ps_init,
                seed=seed,
                is_weighted=is_weighted,
                check=self.check_batch,
                output_names={c.name: self.names_by_table[c.name] for c in self.ps_tables},
                pooled=self.POOLED,
            )
        # The local collection names its outputs among its own tables: a feature it shares with a PS table is "f"
        # there and "f@table" here. None to rename, usually: the join then skips the renaming (it runs every step).
        own = get_embedding_names_by_table(self.local_tables) if self.local_tables else []
        renames = [
            (mine, self.names_by_table[c.name][k])
            for c, theirs in zip(self.local_tables, own, strict=True)
            for k, mine in enumerate(theirs)
        ]
        self.local_renames = renames if any(mine != theirs for mine, theirs in renames) else []
        # TorchRec's state_dict keys (embedding_bags.<table>.weight, a sequence collection's embeddings.<table>.weight)
        # for every table: local ones wherever they are held, PS ones read from (and loaded into) the servers.
        self.ps_rows_in_state_dict = True
        self.register_state_dict_post_hook(torchrec_keys)
        self.register_load_state_dict_pre_hook(own_keys)

    # Properties TorchScript must not compile (they read the servers' client or the sharded module).
    __jit_unused_properties__ = (
        "embedding_bags",
        "embeddings",
        "staleness",
        "staleness_max_seen",
        "pending_pushes",
        "fused_optimizer",
    )

    def table_configs(self) -> list[Any]:
        """Every table's config, local and PS, in the collection's order."""
        return list(self._configs)

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """TorchRec's ``KeyedOptimizer`` of every table whose optimizer is not the caller's: the local tables' fused
        (fbgemm) optimizers once DMP sharded them, and the PS tables' (one param group per table,
        :class:`~.ps_optimizer.PsTableOptimizer`), under TorchRec's keys (``embedding_bags.<table>.weight``, a
        sequence collection's ``embeddings.<table>.weight``). DMP collects it into ``dmp.fused_optimizer`` (the
        collection is a ``FusedOptimizerModule``), so an LR scheduler over that optimizer, or a param group's ``lr``
        set by hand, moves local and PS tables alike from the next training forward on; its ``state_dict()`` reads
        the PS tables' optimizer state from the servers. Unsharded local tables are plain parameters, trained by the
        caller's optimizer, and not in it."""
        parts: list[tuple[str, KeyedOptimizer]] = []
        if self.local is not None and self.local.sharded:
            parts.append(("", self.local.collection.fused_optimizer))
        if self.remote is not None:
            parts.append(("", self.remote.optimizer))
        return CombinedOptimizer(parts)

    @contextlib.contextmanager
    def ps_rows_left_out(self) -> Iterator[None]:
        """In the block, ``state_dict()`` leaves the PS tables out (it reads every row of them from the servers
        otherwise, as TorchRec's full tables): for the dense state, or checkpoints that save the servers' own way."""
        before, self.ps_rows_in_state_dict = self.ps_rows_in_state_dict, False
        try:
            yield
        finally:
            self.ps_rows_in_state_dict = before

    def reset_parameters(self) -> None:
        """The local tables' initialisation again (TorchRec's default, seeded); the servers initialise a PS row when
        its id is first seen."""
        if self.local is not None:
            self.local.reset_parameters()

    @torch.jit.unused
    def zero_fused_grads(self) -> None:
        """Before a training forward: fbgemm takes its fused optimizers' param-group rates when they ``zero_grad()``
        (only that), so the local tables follow a schedule from this forward on, as the PS tables' pushes do, whether
        or not the caller steps the fused optimizer."""
        if self.training and self.local is not None and self.local.sharded:
            self.local.collection.fused_optimizer.zero_grad()

    # ---- the PS step protocol --------------------------------------------------------------------------------------

    def prefetch(self, features: KeyedJaggedTensor, *, block: bool = True) -> bool:
        """Request the PS rows of a coming batch now (see :meth:`.remote.RemoteEmbeddingBags.prefetch`).

        Returns:
            True if the request was sent (or there are no PS tables), False if ``block=False`` and it would wait.
        """
        return True if self.remote is None else self.remote.prefetch(features, block=block)

    def release(self) -> None:
        """Give up this collection's hold on its PS tables on the client (:meth:`.remote.RemoteEmbeddingBags.release`):
        another collection may register them from now on. Call it once it is flushed and trains no more."""
        if self.remote is not None:
            self.remote.release()

    def can_prefetch(self) -> bool:
        """Whether :meth:`prefetch` would send a batch's request now without waiting (no PS tables: always)."""
        return True if self.remote is None else self.remote.can_prefetch()

    def ps_time_ms(self) -> dict[str, float]:
        """Milliseconds spent so far waiting on the parameter servers and sending pushes, by label
        (:data:`persia_planner.modules.step_breakdown.PS_WAIT`, :data:`persia_planner.modules.step_breakdown.PS_PUSH`);
        empty without PS tables."""
        return self.remote.stopwatch.snapshot() if self.remote is not None else {}

    def flush(self) -> None:
        """Wait until every PS gradient push was acknowledged (with K = 0 and several trainers: a collective)."""
        if self.remote is not None:
            self.remote.flush()

    @property
    def staleness(self) -> int:
        """How many earlier batches had unacknowledged pushes when the current batch's PS rows were requested."""
        return self.remote.staleness if self.remote is not None else 0

    @property
    def staleness_max_seen(self) -> int:
        return self.remote.staleness_max_seen if self.remote is not None else 0

    @property
    def pending_pushes(self) -> int:
        """Batches whose gradient pushes are not acknowledged yet."""
        return self.remote.pending_pushes if self.remote is not None else 0

    # ---- local tables' state ------------------------------------------------------------------------------------

    def local_weights(self, dst: int | None = None) -> dict[str, torch.Tensor]:
        """The local tables' full weights, by table name (a collective once sharded; ``dst``: only that trainer
        gets them, the others ``{}``)."""
        if self.local is None:
            return {}
        return {k.split(".")[-2]: v for k, v in self.local.torchrec_state_dict(dst).items()}

    def load_local_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy ``weights`` (table name -> ``[rows, dim]``) into the local tables (e.g. from a checkpoint)."""
        names = {c.name for c in self.local_tables}
        unknown = sorted(set(weights) - names)
        if unknown:
            raise PlannerError(f"load_local_weights: {unknown[0]!r} is not a local table; local: {sorted(names)}")
        if self.local is not None:
            state = {f"{self.KEY_PREFIX}.{k}.weight": v for k, v in weights.items()}
            self.local.load_torchrec_state_dict(state, strict=False)

    @torch.jit.unused
    def check_batch(self, features: KeyedJaggedTensor) -> None:
        """One-line errors for a batch that lacks a feature of the tables or whose parts disagree."""
        present = set(features.keys())
        missing = [f for f in self._inputs if f not in present]
        if missing:
            raise PlannerError(
                f"features {missing[:3]} of the embedding tables are not keys of the KeyedJaggedTensor "
                f"(it has {list(features.keys())[:5]}...)",
                fixes=("build the batch with every feature of the tables",),
            )
        check_kjt(features, weighted=self._is_weighted)


def check_kjt(features: KeyedJaggedTensor, *, weighted: bool = False) -> None:
    """One-line errors for a KeyedJaggedTensor whose parts disagree (fbgemm and the PS would read past its ids), or
    that lacks the per-id weights a weighted collection pools with."""
    values, lengths = features.values(), features.lengths()
    if values.device.type == "meta":  # shapes only: nothing to read
        return
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise PlannerError(
            f"KeyedJaggedTensor values must be integer ids, got {values.dtype}",
            fixes=("pass int64 feature ids (hash strings to int64 first)",),
        )
    expected = len(features.keys()) * features.stride()
    if lengths.dim() != 1 or lengths.numel() != expected:
        raise PlannerError(
            f"KeyedJaggedTensor lengths has shape {tuple(lengths.shape)}, expected [{expected}] "
            f"({len(features.keys())} keys x batch {features.stride()})",
            fixes=("give one length per key and sample, key-major",),
        )
    if lengths.numel() and int(lengths.min()) < 0:
        raise PlannerError("KeyedJaggedTensor lengths must be >= 0", fixes=("check how the batch's lengths are built",))
    total = int(lengths.sum())
    if total != values.numel():
        raise PlannerError(
            f"KeyedJaggedTensor lengths sum to {total} but it holds {values.numel()} values",
            fixes=("make sum(lengths) equal len(values)",),
        )
    if not weighted:
        return
    weights = features.weights_or_none()
    if weights is None:
        raise PlannerError(
            "the collection is weighted (is_weighted=True) but the KeyedJaggedTensor has no weights",
            fixes=("build it with weights= (one float per id)", "construct the collection with is_weighted=False"),
        )
    if not weights.is_floating_point() or tuple(weights.shape) != (values.numel(),):
        raise PlannerError(
            f"KeyedJaggedTensor weights are {weights.dtype} {tuple(weights.shape)}, expected floating point "
            f"[{values.numel()}] (one per id)",
            fixes=("give one float weight per value",),
        )


def placements_of(
    plan: Plan | Mapping[str, TablePlacement] | None, configs: Sequence[Any], *, pooled: bool = True
) -> dict[str, TablePlacement | None]:
    """Each config's placement in ``plan`` (None: no plan, every table local). A model's plan also places the
    tables of its other kind (its sequence tables, for the bag collection): those are not this collection's.

    Raises:
        PlannerError: The plan misses a table of ``configs`` or names another one of its kind.
    """
    if plan is None:
        return {c.name: None for c in configs}
    tables = plan.tables if isinstance(plan, Plan) else plan
    names = {c.name for c in configs}
    own = {n: p for n, p in tables.items() if n in names or p.sequence is not pooled}
    require_same_tables(own, (c.name for c in configs), holder="the collection")
    return {c.name: tables[c.name] for c in configs}


def managed_collisions_refused(holder: str) -> PlannerError:
    """The one line that refuses a hybrid collection (``holder``) under TorchRec's managed-collision wrappers
    (``ManagedCollision{EmbeddingBag,Embedding}Collection``): their remapping and eviction assume TorchRec's own
    collections and sharders, and the parameter servers already take any 64-bit id."""
    return PlannerError(
        f"{holder} does not run under TorchRec's managed-collision (MCH) wrappers: its ps tables already take "
        "unbounded ids (hashed onto the servers, a row made on first sight)",
        fixes=(
            "drop the MCH wrapper and place the table on the ps tier: its zch_size becomes the table's rows "
            "(ps_capacity), its eviction policy the servers' LRU / LFU eviction",
        ),
        kind=ErrorKind.UNSUPPORTED,
    )
