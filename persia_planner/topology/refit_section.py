"""A hardware profile's ``refit:`` section: the factors refitted from training runs
(:mod:`persia_planner.cost.refit` fits them; ``persia train --log-dir`` and ``persia calibrate --from-runs`` write
them), read back for :class:`persia_planner.topology.profile.HardwareProfile`."""

from __future__ import annotations

from persia_planner.fields import Fields
from persia_planner.topology.cost_constants import REFIT_SHARDINGS, SCALE_RANGE, SCALED_TERMS
from persia_planner.units import Quantity

__all__ = ["read_refit"]


def read_refit(top: Fields) -> tuple[dict[str, float], dict[str, float]]:
    """``refit.factors`` (a factor per step term) and ``refit.sharding_factors`` (a factor per sharding type's
    exchange, optional), each in :data:`SCALE_RANGE`; the rest of the section (the runs, their terms, what they could
    not separate) is what the factors were fitted from, kept in the file."""
    refit = top.sub("refit")
    assert refit is not None
    found = _factors_in(refit, "factors", SCALED_TERMS, "is no step term")
    shardings = {}
    if refit.has("sharding_factors"):
        shardings = _factors_in(refit, "sharding_factors", REFIT_SHARDINGS, "is no sharding type with an exchange")
    for key in ("runs", "not_separable", "terms"):
        refit.take(key, default=None)
    refit.finish()
    return found, shardings


def _factors_in(refit: Fields, key: str, known: tuple[str, ...], unknown: str) -> dict[str, float]:
    """``refit.<key>``: a factor in :data:`SCALE_RANGE` for each of ``known`` it names (another name: ``unknown``)."""
    factors = refit.sub(key)
    assert factors is not None
    names = factors.names()
    for name in names:
        if name not in known:
            raise factors.error(name, unknown, fixes=(f"use one of {', '.join(known)}",))
    again = ("run persia calibrate --from-runs again",)
    found = {n: float(factors.take_in_range(n, Quantity.NUMBER, *SCALE_RANGE, fixes=again)) for n in names}
    factors.finish()
    return found
