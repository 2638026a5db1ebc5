"""The names a placement is made of besides its tier (:mod:`persia_planner.tiers`): how a table is split
(:class:`Sharding`) and how it trains (:class:`Mode`).

They sit below the model's specs: plan.json and model.yaml's table ``constraints:`` both name them.
"""

from __future__ import annotations

import enum

__all__ = ["Mode", "Sharding"]


class Sharding(enum.StrEnum):
    """How a table is split (TorchRec's names, plus the parameter-server hash sharding)."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"
    DATA_PARALLEL = "data_parallel"
    PS_HASH = "ps_hash"


class Mode(enum.StrEnum):
    """How a table trains: synchronously with the dense step, or asynchronously on the parameter servers."""

    SYNC = "sync"
    ASYNC = "async"
