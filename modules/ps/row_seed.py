"""Where a parameter-server table's new ids start when the table came from the trainers' local tables (a plan
migration, :mod:`persia_planner.modules.train.migration`): row ``id mod rows`` of the local table's weights and
optimizer state, so that the servers answer every id as the local table did (which maps an id to that row,
:func:`persia_planner.modules.embedding.local.ids_in_range`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RowSeed"]


@dataclass(frozen=True)
class RowSeed:
    """A local table's rows that a store's new ids start from.

    Attributes:
        weights: ``[rows, dim]`` float32.
        state: ``[rows, state_width]`` float32 optimizer state, or None (a new row's state).
    """

    weights: torch.Tensor
    state: torch.Tensor | None = None

    @classmethod
    def of(cls, weights: torch.Tensor, state: torch.Tensor | None, dim: int, state_width: int) -> RowSeed:
        """A seed for a store of ``dim`` columns and ``state_width`` state values per row (copies, float32).

        Raises:
            ValueError: ``weights`` is not ``[rows, dim]`` or ``state`` not ``[rows, state_width]``.
        """
        if weights.dim() != 2 or weights.shape[1] != dim or weights.shape[0] < 1:
            raise ValueError(f"seed weights must be [rows, {dim}], got {tuple(weights.shape)}")
        if state is not None and tuple(state.shape) != (weights.shape[0], state_width):
            raise ValueError(f"seed state must be [{weights.shape[0]}, {state_width}], got {tuple(state.shape)}")

        def copy(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(torch.float32).contiguous().clone()

        return cls(copy(weights), None if state is None else copy(state))

    def rows_of(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weights and state (None without one) that ``ids`` start from."""
        # torch.remainder is the local tables' own mapping: never negative, whatever the id's sign.
        rows = torch.remainder(ids, self.weights.shape[0])
        return self.weights.index_select(0, rows), (None if self.state is None else self.state.index_select(0, rows))

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``weights`` and, where there is one, ``state`` (as checkpoints save it)."""
        return {"weights": self.weights} | ({"state": self.state} if self.state is not None else {})
