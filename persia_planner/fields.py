"""Reading YAML mappings field by field, so that every error names the file and the key path."""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from persia_planner.errors import SpecError
from persia_planner.units import Quantity, UnitError, parse

_MISSING = object()
E = TypeVar("E", bound=enum.StrEnum)


def read_text(path: str | Path, source: str) -> str:
    """A UTF-8 input file's text; a missing, unreadable or non-UTF-8 file is a one-line error naming ``source``."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(source, "", "file not found", fixes=("check the path",)) from None
    except OSError as err:
        raise SpecError(source, "", f"cannot read file ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise SpecError(
            source,
            "",
            f"not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})",
            fixes=("save it as UTF-8",),
        ) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping: plain YAML keeps the last one, so a
    repeated ``rows:`` would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        _refuse_repeated_keys(self, node, deep)
        return super().construct_mapping(node, deep=deep)


def _refuse_repeated_keys(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool) -> None:
    seen: set[Any] = set()
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str | int | float | bool) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} given twice in one mapping", key_node.start_mark
            )
        seen.add(key)


if hasattr(yaml, "CSafeLoader"):

    class _FastUniqueKeyLoader(yaml.CSafeLoader):
        """:class:`_UniqueKeyLoader` on libyaml's parser: it reads a large model.yaml an order of magnitude faster,
        and builds values with the same Python constructor (the same data)."""

        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            _refuse_repeated_keys(self, node, deep)  # type: ignore[arg-type]
            return super().construct_mapping(node, deep=deep)

    _LOADERS: tuple[type, ...] = (_FastUniqueKeyLoader, _UniqueKeyLoader)
else:  # pragma: no cover - PyYAML built without libyaml
    _LOADERS = (_UniqueKeyLoader,)


def load_yaml(path: str | Path) -> tuple[Any, str]:
    """Read a YAML file; returns (data, source name for messages)."""
    source = str(path)
    text = read_text(path, source)
    try:
        try:
            data = yaml.load(text, Loader=_LOADERS[0])  # SafeLoader subclasses: no arbitrary objects
        except yaml.YAMLError:
            # libyaml words syntax errors differently: the pure-Python parser gives the message users see.
            data = yaml.load(text, Loader=_LOADERS[-1])
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise SpecError(source, "", f"malformed YAML at {where}{problem}", fixes=("fix the YAML syntax",)) from None
    return data, source


class Fields:
    """A mapping being read: ``take`` each known key, then ``finish`` rejects the unknown ones."""

    def __init__(self, data: Any, source: str, path: str):
        if not isinstance(data, Mapping):
            raise SpecError(source, path or "(top level)", f"expected a mapping, got {type(data).__name__}")
        self.data = data
        self.source = source
        self.path = path
        self._seen: set[str] = set()

    def key_path(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str | int, problem: str, fixes: tuple[str, ...] = ()) -> SpecError:
        return SpecError(self.source, self.key_path(key), problem, fixes=fixes)

    def has(self, key: str) -> bool:
        return key in self.data

    def take(self, key: str, kind: Quantity | None = None, default: Any = _MISSING) -> Any:
        """Read ``key``; with ``kind``, parse units. Without a default the key is required."""
        self._seen.add(key)
        if key not in self.data or self.data[key] is None:
            if default is _MISSING:
                raise self.error(key, "required key is missing", fixes=(f"add '{key}:'",))
            return default
        value = self.data[key]
        if kind is None:
            return value
        try:
            return parse(value, kind)
        except UnitError as err:
            raise self.error(key, str(err)) from None

    def take_str(self, key: str, default: Any = _MISSING) -> Any:
        value = self.take(key, default=default)
        if value is not default and not isinstance(value, str):
            raise self.error(key, f"expected a string, got {value!r}")
        return value

    def take_bool(self, key: str, default: Any = _MISSING) -> Any:
        value = self.take(key, default=default)
        if value is not default and not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}", fixes=(f"write {key}: true or false",))
        return value

    def take_enum(self, key: str, enum_type: type[E], default: Any = _MISSING) -> E:
        value = self.take(key, default=default)
        if isinstance(value, enum_type) or (value is default and default is not _MISSING):
            return value
        try:
            return enum_type(str(value).lower())
        except ValueError:
            allowed = " | ".join(member.value for member in enum_type)
            raise self.error(key, f"unknown value {value!r}", fixes=(f"use one of {allowed}",)) from None

    def take_positive(self, key: str, kind: Quantity, default: Any = _MISSING) -> Any:
        value = self.take(key, kind, default)
        if value is not default and value <= 0:
            raise self.error(key, f"must be > 0, got {self.data[key]!r}")
        return value

    def take_list(self, key: str, default: Any = _MISSING) -> Iterator[tuple[int, Fields]]:
        value = self.take(key, default=default)
        if value is default:
            return iter(())
        if not isinstance(value, list):
            raise self.error(key, f"expected a list, got {type(value).__name__}")
        return _indexed(value, self.source, self.key_path(key))

    def sub(self, key: str, default: Any = _MISSING) -> Fields | None:
        value = self.take(key, default=default)
        if value is default:
            return None
        return Fields(value, self.source, self.key_path(key))

    def finish(self) -> None:
        unknown = [k for k in self.data if k not in self._seen]
        if not unknown:
            return
        key = str(unknown[0])
        close = difflib.get_close_matches(key, sorted(self._seen), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(self._seen))}"
        raise self.error(key, "unknown key", fixes=(hint,))


def _indexed(items: list[Any], source: str, path: str) -> Iterator[tuple[int, Fields]]:
    for i, item in enumerate(items):
        yield i, Fields(item, source, f"{path}[{i}]")
