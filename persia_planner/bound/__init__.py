"""The lower bound: what no plan of a model on a topology can beat under the cost model (a Lagrangian relaxation
over the tables' tier options, :mod:`persia_planner.bound.lower_bound`, of the terms :mod:`persia_planner.bound.terms`
computes), and the tiers of its best solution, a hint the search starts from."""

from persia_planner.bound.lower_bound import (
    MAX_WEIGHTINGS,
    BoundPart,
    LowerBound,
    bound_at,
    dense_bound,
    lower_bound,
    lower_bound_ms,
    table_terms_of,
)
from persia_planner.bound.terms import TierChoice

__all__ = [
    "MAX_WEIGHTINGS",
    "BoundPart",
    "LowerBound",
    "TierChoice",
    "bound_at",
    "dense_bound",
    "lower_bound",
    "lower_bound_ms",
    "table_terms_of",
]
