"""How the row of an id a store does not hold starts, one rule for every path (decision 0029): the training lookup
that inserts it, an evaluation lookup, a read (state dicts, export) and a read of its optimizer state.

A seeded table (:class:`.row_seed.RowSeed`: it came from the trainers' local tables) starts an id from its seed's
row; any other from the init policy (:mod:`.policies`): ``init.rows_for(ids, dim, init_seed)``, a value of the id
alone, or without ``init_seed`` a draw from the store's generator in insertion order (which has no value before the
insertion, so reads see zeros). The optimizer state starts as the seed's, else the optimizer's ``init_state``.
"""

from __future__ import annotations

import torch

from persia_planner.modules.ps.optim import RowOptimizer
from persia_planner.modules.ps.policies import Normal, Uniform
from persia_planner.modules.ps.row_seed import RowSeed

__all__ = ["NewRows"]


class NewRows:
    """The starting weights and optimizer state of the ids a store does not hold.

    Args:
        dim: Embedding width.
        optimizer: The table's row optimizer (a new row's state).
        init: Initialiser of new rows.
        init_seed: If set, an id's initial value depends only on ``(init_seed, id)``; if None, rows are drawn from
            ``generator`` as they are inserted.
        generator: The store's seeded generator.

    Attributes:
        seed: The seed new ids start from instead (a table moved from the trainers' local tables), or None.
    """

    def __init__(
        self,
        dim: int,
        optimizer: RowOptimizer,
        init: Uniform | Normal,
        init_seed: int | None,
        generator: torch.Generator,
    ) -> None:
        self.dim, self.optimizer, self.init, self.init_seed = dim, optimizer, init, init_seed
        self.generator = generator
        self.seed: RowSeed | None = None

    def inserted(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 weights ``[len(ids), dim]`` and optimizer state of the new ``ids`` a lookup inserts now (rows
        drawn in insertion order are drawn here)."""
        weights, state = self.seed.rows_of(ids) if self.seed is not None else (None, None)
        if weights is None:
            if self.init_seed is None:
                weights = self.init.sample(ids.numel(), self.dim, self.generator)
            else:
                weights = self.init.rows_for(ids, self.dim, self.init_seed)
        return weights, state if state is not None else self.optimizer.init_state(ids.numel(), self.dim)

    def initial(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The float32 rows a training lookup would insert for ``ids``, without drawing anything: the seed's rows,
        else ``init.rows_for``; None without ``init_seed`` (rows drawn in insertion order have no value before it)."""
        if self.seed is not None:
            return self.seed.rows_of(ids)[0]
        if self.init_seed is not None:
            return self.init.rows_for(ids, self.dim, self.init_seed)
        return None

    def state(self, ids: torch.Tensor) -> torch.Tensor:
        """The optimizer state a training lookup would start ``ids`` with: the seed's, else the optimizer's new
        row's."""
        state = self.seed.rows_of(ids)[1] if self.seed is not None else None
        return state if state is not None else self.optimizer.init_state(ids.numel(), self.dim)
