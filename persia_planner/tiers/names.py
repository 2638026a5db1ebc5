"""Open registries of names: :class:`.tier.Tier` and :class:`.memory.Memory` are strings a module registers at import,
not enum members fixed in the code, so that a tier (and the memory it keeps its rows in) is added in one file.

A member compares, hashes, sorts and prints as its name (``Tier.HBM == "hbm"``), is iterated in registration order,
pickles by name (a process that registered the same modules reads it back) and is found as a class attribute
(``Tier.HBM``) while registered, as an enum member is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Self

__all__ = ["Registered"]


class _Registry(type):
    """Iteration, length and membership over a class's registered members."""

    def __iter__(cls) -> Iterator[Any]:
        return iter(list(cls._members.values()))  # type: ignore[attr-defined]  # a copy: one added meanwhile is not iterated

    def __len__(cls) -> int:
        return len(cls._members)  # type: ignore[attr-defined]


class Registered(str, metaclass=_Registry):
    """A registered name. ``Cls("name")`` returns the registered member (ValueError for an unknown name), so members
    compare with ``is`` as enum members do. Each subclass keeps its own members and their descriptors."""

    __slots__ = ()
    _members: ClassVar[dict[str, Any]]
    _specs: ClassVar[dict[str, Any]]
    # Called once before a name is refused: loads the modules that may register it (tiers.plugins.load_missing).
    on_missing: ClassVar[Callable[[], None] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._members, cls._specs = {}, {}

    def __new__(cls, value: str) -> Self:
        member = cls._members.get(str(value)) if isinstance(value, str) else None
        if member is None and isinstance(value, str) and Registered.on_missing is not None:
            Registered.on_missing()
            member = cls._members.get(str(value))
        if member is None:
            raise ValueError(f"{value!r} is not a valid {cls.__name__}")
        return member

    @classmethod
    def _add(cls, name: str, spec: Any) -> Self:
        """Register ``name`` with its descriptor ``spec`` and return the new member.

        Raises:
            ValueError: ``name`` is registered already, or is not a lower-case word.
        """
        if not name or name != name.lower() or not name.replace("_", "").isalnum():
            raise ValueError(f"a {cls.__name__.lower()}'s name is a lower-case word, got {name!r}")
        if name in cls._members:
            raise ValueError(f"{cls.__name__.lower()} {name!r} is registered already")
        member = str.__new__(cls, name)
        cls._members[name], cls._specs[name] = member, spec
        setattr(cls, member.name, member)
        return member

    @classmethod
    def _remove(cls, member: Registered) -> None:
        del cls._members[member.value], cls._specs[member.value]
        delattr(cls, member.name)

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def name(self) -> str:
        return self.value.upper()

    @property
    def spec(self) -> Any:
        """The member's descriptor."""
        return type(self)._specs[self.value]

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value!r}>"

    def __reduce__(self) -> tuple[type[Registered], tuple[str]]:
        return type(self), (self.value,)

    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, memo: object) -> Self:
        return self
