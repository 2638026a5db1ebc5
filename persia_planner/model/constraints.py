"""What the planner may do with one table: model.yaml's per-table ``constraints:``, as TorchRec users write
``ParameterConstraints``.

A table may be held to some sharding types, some tiers, some devices and a fixed HBM-cache size. A constraint left
out allows everything; the plan must keep every one given (``persia validate`` checks it, and the search only builds
what it allows). Whether a topology can meet them is :mod:`persia_planner.placement.feasibility`'s question; this module
knows only the table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from persia_planner.errors import SpecError, abbreviate
from persia_planner.fields import Fields
from persia_planner.kinds import Sharding
from persia_planner.tiers import Tier, tier_of_kernel, tiers_of
from persia_planner.units import Quantity

__all__ = ["NO_CONSTRAINTS", "TORCHREC_SOURCE", "TableConstraints", "from_parameter_constraints", "read_constraints"]

TORCHREC_SOURCE = "ParameterConstraints"
"""What errors in TorchRec's constraints name as their source (there is no file)."""
_SHOWN_DEVICES = 4  # devices a message lists before "... (N in all)"


@dataclass(frozen=True)
class TableConstraints:
    """What a table allows (each None: anything).

    Attributes:
        sharding_types: The sharding types its placement may have.
        tiers: The tiers its shards may be on (without ``ps`` the table stays off the parameter servers).
        devices: The devices its shards may go to: trainer devices (``trainer0/gpu1``) and parameter servers
            (``ps0``) by name. A ``ps_hash`` table is hashed over every server, so it goes there only when every
            server is named.
        cache_fraction: The share of its rows cached in HBM on the ``hbm_cache`` tier, or in the servers' DDR on the
            ``ssd`` tier, fixed instead of searched.
    """

    sharding_types: frozenset[Sharding] | None = None
    tiers: frozenset[Tier] | None = None
    devices: frozenset[str] | None = None
    cache_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.cache_fraction is not None and not 0 < self.cache_fraction <= 1:
            raise ValueError(f"cache_fraction must be in (0, 1], got {self.cache_fraction}")

    @property
    def constrained(self) -> bool:
        """Whether any constraint is given."""
        return self != NO_CONSTRAINTS

    def allows(self, sharding: Sharding, tier: Tier) -> bool:
        """Whether a placement of ``sharding`` on ``tier`` keeps the sharding-type and tier constraints (and is a pair
        that runs at all: the tier's :attr:`.TierSpec.shardings`)."""
        return (
            sharding in tier.spec.shardings
            and (self.sharding_types is None or sharding in self.sharding_types)
            and (self.tiers is None or tier in self.tiers)
        )

    def allows_tier(self, tier: Tier) -> bool:
        """Whether some allowed sharding type runs on ``tier``."""
        return any(self.allows(s, tier) for s in Sharding)

    def allows_device(self, name: str) -> bool:
        return self.devices is None or name in self.devices

    def combinations(self) -> list[tuple[Sharding, Tier]]:
        """Every (sharding type, tier) pair allowed."""
        return [(s, t) for s in Sharding for t in Tier if self.allows(s, t)]

    def to_dict(self) -> dict[str, Any]:
        """The constraints given, as model.yaml writes them (``read_constraints`` reads it back)."""
        out: dict[str, Any] = {}
        if self.sharding_types is not None:
            out["sharding_types"] = [s.value for s in Sharding if s in self.sharding_types]
        if self.tiers is not None:
            out["tiers"] = [t.value for t in Tier if t in self.tiers]
        if self.devices is not None:
            out["devices"] = sorted(self.devices)
        if self.cache_fraction is not None:
            out["cache_fraction"] = self.cache_fraction
        return out

    def describe(self, *keys: str) -> str:
        """The constraints given (or only ``keys`` of them) as model.yaml writes them, e.g.
        ``sharding_types [row_wise], tiers [hbm, ddr]``."""
        parts = []
        for key in keys or ("sharding_types", "tiers", "devices", "cache_fraction"):
            value = getattr(self, key)
            if value is None:
                continue
            if key == "cache_fraction":
                parts.append(f"cache_fraction {value:g}")
            elif key == "devices":
                parts.append(f"devices {_listed(sorted(value))}")
            else:
                order = list(Sharding if key == "sharding_types" else Tier)
                parts.append(f"{key} [{', '.join(v.value for v in sorted(value, key=order.index))}]")
        return ", ".join(parts)


NO_CONSTRAINTS = TableConstraints()
"""A table that allows everything (the default)."""


def _listed(names: Sequence[str]) -> str:
    """``[a, b, c]``, the first few of a long list then how many there are."""
    shown = ", ".join(abbreviate(n, 40).strip("'") for n in names[:_SHOWN_DEVICES])
    more = f", ... ({len(names)} in all)" if len(names) > _SHOWN_DEVICES else ""
    return f"[{shown}{more}]"


def read_constraints(fields: Fields | None, table: str) -> TableConstraints:
    """A table's ``constraints:`` mapping (:data:`NO_CONSTRAINTS` when absent); errors name the file, the key path
    and the table.

    Raises:
        SpecError: An unknown key or value, an empty list, a cache fraction outside (0, 1], sharding types and tiers
            with no pair in common, or a cache fraction while the ``hbm_cache`` tier is not allowed.
    """
    if fields is None:
        return NO_CONSTRAINTS
    shardings = fields.take_enum_list("sharding_types", Sharding, default=None)
    tiers = fields.take_enum_list("tiers", Tier, default=None)
    devices = fields.take_str_list("devices", default=None)
    fraction = fields.take("cache_fraction", Quantity.NUMBER, default=None, maximum=1.0)
    fields.finish()
    if fraction is not None and fraction <= 0:
        raise fields.error(
            "cache_fraction", f"table {table!r}: must be > 0, got {abbreviate(fields.data['cache_fraction'])}"
        )
    constraints = TableConstraints(
        None if shardings is None else frozenset(shardings),
        None if tiers is None else frozenset(tiers),
        None if devices is None else frozenset(devices),
        None if fraction is None else float(fraction),
    )
    _check_consistent(constraints, table, lambda key, problem, fixes: fields.error(key, problem, fixes))
    return constraints


def _check_consistent(constraints: TableConstraints, table: str, error: Any) -> None:
    """Raise ``error(key, problem, fixes)`` where the constraints contradict themselves."""
    if not constraints.combinations():
        runs = "; ".join(
            f"{s.value} runs on {' or '.join(t.value for t in Tier if t in tiers_of(s))}"
            for s in Sharding
            if constraints.sharding_types is None or s in constraints.sharding_types
        )
        raise error(
            "tiers",
            f"table {table!r}: {constraints.describe('sharding_types', 'tiers')} have no pair in common ({runs})",
            ("allow a tier that one of its sharding types runs on",),
        )
    if constraints.cache_fraction is not None and not any(constraints.allows_tier(t) for t in Tier if t.spec.cached):
        raise error(
            "cache_fraction",
            f"table {table!r}: cache_fraction sizes the cache of the hbm_cache or ssd tier, which its "
            f"{constraints.describe('sharding_types', 'tiers')} leave out",
            ("allow tier hbm_cache or ssd", "drop cache_fraction"),
        )


def from_parameter_constraints(
    table: str, constraints: Any, gpu_names: Sequence[str] | None = None
) -> tuple[TableConstraints, float | None]:
    """TorchRec's ``ParameterConstraints`` of ``table`` (read duck-typed: no torch import) as our constraints, and
    the pooling factor it gives (None where it gives none).

    ``sharding_types`` are TorchRec's names (ours but ``ps_hash``); ``compute_kernels`` map to tiers (``fused`` and
    ``dense`` -> hbm, ``fused_uvm`` -> ddr, ``fused_uvm_caching`` -> hbm_cache); ``cache_params.load_factor`` is the
    cache fraction (where hbm_cache is allowed); ``ranks`` are the devices ``gpu_names[rank]``; the pooling factor is
    the sum of ``pooling_factors`` (one per feature the table serves: each feature's ids are looked up in it). Names
    TorchRec has and we do not (``grid_shard``, ``key_value``) are left out while another one remains. Neither list
    names the parameter servers (TorchRec has none): a table constrained by either stays off them.

    Args:
        table: The table's name (for errors).
        constraints: A ``torchrec.distributed.planner.types.ParameterConstraints`` (or anything with its fields).
        gpu_names: The topology's trainer devices in rank order; needed only where ``ranks`` are given.

    Raises:
        SpecError: Nothing of a list maps to ours, a rank beyond ``gpu_names`` or without them, or constraints that
            contradict themselves; the message names the table and the field.
    """

    def error(key: str, problem: str, fixes: tuple[str, ...] = ()) -> SpecError:
        return SpecError(TORCHREC_SOURCE, f"{table}.{key}", problem, fixes=fixes)

    shardings = _mapped(
        getattr(constraints, "sharding_types", None),
        {s.value: s for s in Sharding if s is not Sharding.PS_HASH},
        lambda names: error("sharding_types", f"table {table!r}: none of {names} is a persia sharding type"),
    )
    tiers = _mapped(
        getattr(constraints, "compute_kernels", None),
        tier_of_kernel(),
        lambda names: error(
            "compute_kernels",
            f"table {table!r}: none of {names} has a persia tier",
            (f"use {', '.join(tier_of_kernel())}",),
        ),
    )
    fraction = None
    cache = getattr(constraints, "cache_params", None)
    factor = getattr(cache, "load_factor", None) if cache is not None else None
    if factor is not None and (tiers is None or any(t.spec.cached for t in tiers)):
        if not 0 < float(factor) <= 1:
            raise error("cache_params.load_factor", f"table {table!r}: must be in (0, 1], got {abbreviate(factor)}")
        fraction = float(factor)
    devices = None
    ranks = getattr(constraints, "ranks", None)
    if ranks is not None:
        if gpu_names is None:
            raise error(
                "ranks",
                f"table {table!r}: ranks name devices of a topology, and none was given",
                ("pass topology= to ModelSpec.from_torchrec",),
            )
        bad = [r for r in ranks if not 0 <= int(r) < len(gpu_names)]
        if bad:
            raise error("ranks", f"table {table!r}: rank {bad[0]} is beyond the topology's {len(gpu_names)} devices")
        devices = frozenset(gpu_names[int(r)] for r in ranks)
    result = TableConstraints(shardings, tiers, devices, fraction)
    _check_consistent(result, table, error)
    factors = getattr(constraints, "pooling_factors", None)
    pooling = float(sum(float(f) for f in factors)) if factors else None
    return result, pooling


def _mapped(values: Iterable[Any] | None, known: Any, none_known: Any) -> frozenset[Any] | None:
    """The members of ``known`` that ``values`` name (enum members or their values); None when ``values`` is;
    ``none_known(names)`` is raised where it names none of them."""
    if values is None:
        return None
    names = [str(getattr(v, "value", v)) for v in values]
    found = frozenset(known[n] for n in names if n in known)
    if not found:
        raise none_known(names)
    return found
