"""The parameter-server tables in TorchRec's optimizer world: one ``KeyedOptimizer`` group per PS table.

:class:`PsTableOptimizer` is what :attr:`~.hybrid_tables.HybridTables.fused_optimizer` adds to the local
tables' fused (fbgemm) optimizer, so that ``dmp.fused_optimizer`` (DMP collects it: the collection is a TorchRec
``FusedOptimizerModule``) holds every table under TorchRec's key, ``<path>.embedding_bags.<table>.weight``:

- **Param groups**: one per PS table, holding its row optimizer's hyper-parameters under torch's names (``lr``,
  ``eps``, ``weight_decay``, ``betas``, ...). A torch or TorchRec LR scheduler over the ``KeyedOptimizer``, or
  ``param_groups[i]["lr"] = x``, changes the rate the servers apply to that table. The rate is read when a training
  batch's rows are looked up (its forward) and travels with that batch's gradient push
  (:meth:`PsTableOptimizer.row_optimizer`): under bounded staleness a push reaches the servers up to ``K`` steps
  after its gradient was computed, so a rate set on the servers would also apply to the pushes still in flight from
  earlier steps, and, with several trainers, whichever set it last would win; travelling with the push, each update
  uses the rate of the step its gradient is of, as a local table's fused backward does (decision 0029).
- **State**: per table, the row optimizer's state under fbgemm's names (``<table>.momentum1``: row-wise Adagrad's
  accumulator ``[rows]``, Adagrad's ``[rows, dim]``; Adam's ``momentum1``, ``exp_avg_sq`` and its per-row
  ``row_counter``). The values are :class:`PsRowState` objects of TorchRec's stateful protocol: the optimizer's
  ``state_dict()`` reads rows ``[0, num_embeddings)`` of the state from the servers (an id never trained reads as a
  new row's state) and ``load_state_dict()`` writes them back, as the module's ``state_dict()`` reads and writes the
  tables' weights. So ``torch.distributed.checkpoint`` saves and restores the PS optimizer state with the rest.

Parameters are meta tensors of each table's shape: TorchRec keys state by parameter, and a PS table has no rows on
the trainer. ``step()`` and ``zero_grad()`` do nothing: the servers step every push, and no gradient is kept here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.keyed import KeyedOptimizer

from persia_planner.errors import PlannerError
from persia_planner.modules.ps import optim as ps_optim

if TYPE_CHECKING:  # pragma: no cover
    from persia_planner.modules.ps.client import PsClient

__all__ = ["PsRowState", "PsTableOptimizer", "StateColumns", "parameter_key", "state_columns"]


def parameter_key(table: str, prefix: str = "embedding_bags") -> str:
    """TorchRec's key of a table's weight in its collection: ``embedding_bags.<table>.weight`` in an
    ``EmbeddingBagCollection``, ``embeddings.<table>.weight`` (``prefix``) in an ``EmbeddingCollection``."""
    return f"{prefix}.{table}.weight"


@dataclass(frozen=True)
class StateColumns:
    """One named optimizer state of a row optimizer: columns ``[start, stop)`` of the servers' state rows.

    Attributes:
        name: fbgemm's (TorchRec's) name of the state (``momentum1``, ``exp_avg_sq``, ``row_counter``).
        start: First column.
        stop: One past the last column.
        rowwise: One value per row: TorchRec keeps it as a ``[rows]`` tensor, not ``[rows, 1]``.
    """

    name: str
    start: int
    stop: int
    rowwise: bool


def state_columns(optimizer: ps_optim.RowOptimizer, dim: int) -> tuple[StateColumns, ...]:
    """The named states of ``optimizer``'s rows (its state layout, :mod:`persia_planner.modules.ps.optim`) for a
    table ``dim`` wide, under the names fbgemm's fused optimizers give theirs."""
    if isinstance(optimizer, ps_optim.RowWiseAdagrad):
        return (StateColumns("momentum1", 0, 1, True),)
    if isinstance(optimizer, ps_optim.Adagrad):
        return (StateColumns("momentum1", 0, dim, False),)
    if isinstance(optimizer, ps_optim.Adam):  # [m | v | t]: the per-row step count is the servers' own
        return (
            StateColumns("momentum1", 0, dim, False),
            StateColumns("exp_avg_sq", dim, 2 * dim, False),
            StateColumns("row_counter", 2 * dim, 2 * dim + 1, True),
        )
    return ()  # SGD keeps no state


class PsRowState:
    """One named optimizer state of a PS table, rows ``[0, num_embeddings)``, read from and written to the servers
    (TorchRec's stateful protocol: ``KeyedOptimizer.state_dict()`` calls :meth:`state_dict`, its
    ``load_state_dict()`` calls :meth:`load_state_dict`).

    Args:
        client: The servers' client.
        config: The table.
        columns: Which state.
    """

    def __init__(self, client: PsClient, config: EmbeddingBagConfig, columns: StateColumns) -> None:
        self.client, self.config, self.columns = client, config, columns

    @property
    def shape(self) -> tuple[int, ...]:
        """The state's shape, as TorchRec's unsharded table would hold it."""
        width = self.columns.stop - self.columns.start
        return (self.config.num_embeddings,) if self.columns.rowwise else (self.config.num_embeddings, width)

    def state_dict(self) -> torch.Tensor:
        """Every row's state as the servers hold it (a new row's for ids never trained)."""
        ids = torch.arange(self.config.num_embeddings, dtype=torch.int64)
        state = self.client.read_state(self.config.name, ids)[:, self.columns.start : self.columns.stop]
        return state.reshape(self.shape).clone()

    def load_state_dict(self, value: Any) -> None:
        """Write every row's state to the servers (rows not held are inserted, as a training lookup would).

        Raises:
            PlannerError: ``value`` is not a full tensor of :attr:`shape`, or the servers lack room for every row.
        """
        key = f"{self.config.name}.{self.columns.name}"
        if not isinstance(value, torch.Tensor) or hasattr(value, "local_shards"):
            raise PlannerError(
                f"load_state_dict: optimizer state {key} is {type(value).__name__}; a PS table loads a full tensor",
                fixes=("save the optimizer state unsharded (or gather its ShardedTensor) first",),
            )
        if tuple(value.shape) != self.shape:
            raise PlannerError(
                f"load_state_dict: optimizer state {key} has shape {tuple(value.shape)}, PS table "
                f"{self.config.name!r} keeps {self.shape} (saved with another optimizer or table size?)"
            )
        rows = self.config.num_embeddings
        ids = torch.arange(rows, dtype=torch.int64)
        written = self.client.assign_state(self.config.name, ids, value.detach().reshape(rows, -1), self.columns.start)
        if written != rows:
            raise PlannerError(
                f"load_state_dict: the servers hold {written:,} of PS table {self.config.name!r}'s {rows:,} rows "
                "(their stores' capacity)",
                fixes=("give the servers' stores room for every row (ps_capacity)",),
            )


def hyper_parameters(optimizer: ps_optim.RowOptimizer) -> dict[str, Any]:
    """A row optimizer's hyper-parameters under its own (torch's) names: a param group's values."""
    return {f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)}  # type: ignore[arg-type]


class PsTableOptimizer(KeyedOptimizer):
    """The PS tables' ``KeyedOptimizer``: one param group per table, state read from the servers (see the module
    docstring).

    Args:
        tables: The PS tables.
        client: The servers' client (the tables registered with it).
        optimizers: Each table's row optimizer, as registered with the servers.
        key_prefix: The collection's state-dict prefix of its tables (``embeddings`` for sequence tables).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        client: PsClient,
        optimizers: Mapping[str, ps_optim.RowOptimizer],
        key_prefix: str = "embedding_bags",
    ) -> None:
        self._registered = {c.name: optimizers[c.name] for c in tables}
        params: dict[str, torch.Tensor] = {}
        state: dict[torch.Tensor, dict[str, PsRowState]] = {}
        groups: list[dict[str, Any]] = []
        self._group_of: dict[str, dict[str, Any]] = {}
        for c in tables:
            # A meta tensor of the table's shape: a key for TorchRec's state, no rows on the trainer.
            param = torch.empty(c.num_embeddings, c.embedding_dim, device="meta")
            params[parameter_key(c.name, key_prefix)] = param
            opt = self._registered[c.name]
            state[param] = {
                f"{c.name}.{col.name}": PsRowState(client, c, col) for col in state_columns(opt, c.embedding_dim)
            }
            group = {"params": [param], **hyper_parameters(opt)}
            groups.append(group)
            self._group_of[c.name] = group
        self._latched: dict[str, tuple[tuple[Any, ...], ps_optim.RowOptimizer | None]] = {}
        super().__init__(params, state, groups)

    def row_optimizer(self, table: str) -> ps_optim.RowOptimizer | None:
        """``table``'s row optimizer with its param group's current hyper-parameters, to travel with a push; None
        while they are the ones the table was registered with (the servers' own: nothing to send).

        Raises:
            PlannerError: A param group holds a value the row optimizer refuses (a negative ``lr``).
        """
        base, group = self._registered[table], self._group_of[table]
        names = [f.name for f in dataclasses.fields(base)]  # type: ignore[arg-type]
        values = tuple(group[n] for n in names)
        latched = self._latched.get(table)
        if latched is not None and latched[0] == values:
            return latched[1]
        try:
            current = dataclasses.replace(base, **dict(zip(names, values, strict=True)))  # type: ignore[type-var]
        except ValueError as err:
            raise PlannerError(
                f"PS table {table!r}: param group {err}", fixes=("give the param group valid values",)
            ) from None
        chosen = None if current == base else current
        self._latched[table] = (values, chosen)
        return chosen

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Nothing: the PS tables' gradients are pushed to the servers, none is kept."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing: the servers step every push, with the rate its batch's forward read."""
