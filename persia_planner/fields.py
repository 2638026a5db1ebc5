"""Reading input files (YAML and JSON) and their mappings field by field, so that every error names the file and the
key path.

Reading refuses what is not a plain, reasonably small text file before parsing it (a FIFO would block, ``/dev/zero``
never ends), turns nesting too deep to parse into an error, refuses a key given twice in one mapping (YAML and JSON
keep the last silently) and checks every number against its ceiling (:mod:`persia_planner.limits`).
"""

from __future__ import annotations

import difflib
import enum
import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from persia_planner.errors import SpecError, abbreviate, unprintable
from persia_planner.limits import MAX_INPUT_BYTES, MAX_OF_KIND
from persia_planner.units import Quantity, UnitError, format_bytes, parse

__all__ = ["Fields", "load_document", "load_json", "load_yaml", "read_text", "require_file_or_directory"]

_MISSING = object()
E = TypeVar("E", bound=enum.StrEnum)
_CEILING_UNITS = {Quantity.SIZE: " bytes", Quantity.BANDWIDTH: " B/s", Quantity.DURATION: " s"}

_SPECIAL_FILES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _refuse_special(mode: int, source: str) -> None:
    """A one-line error unless ``mode`` is a regular file's: reading a FIFO blocks until a writer comes, a device
    such as ``/dev/zero`` never ends, and a directory has no text."""
    if stat.S_ISREG(mode):
        return
    what = next((name for test, name in _SPECIAL_FILES if test(mode)), "a special file")
    raise SpecError(source, "", f"is {what}, not a regular file", fixes=("give the path of a regular file",))


def require_file_or_directory(path: str | Path, source: str) -> None:
    """Refuse ``path`` unless it is a regular file or a directory (through links): a FIFO would block its reader
    until a writer comes, a device never ends.

    Raises:
        SpecError: It does not exist, cannot be read, or is a FIFO, a device or a socket.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise SpecError(source, "", "file or directory not found", fixes=("check the path",)) from None
    except OSError as err:
        raise SpecError(source, "", f"cannot read it ({err.strerror or err})") from None
    if not stat.S_ISDIR(mode):
        _refuse_special(mode, source)


def _too_big(source: str) -> SpecError:
    return SpecError(
        source,
        "",
        f"is larger than {format_bytes(MAX_INPUT_BYTES)}, the most an input file may hold",
        fixes=("check the path (is it the right file?)",),
    )


def read_text(path: str | Path, source: str) -> str:
    """A UTF-8 input file's text; a missing, unreadable, special (FIFO, device, directory, socket), over-large
    (:data:`~persia_planner.limits.MAX_INPUT_BYTES`) or non-UTF-8 file is a one-line error naming ``source``."""
    try:
        _refuse_special(os.stat(path).st_mode, source)  # before opening: opening a FIFO blocks
        # O_NONBLOCK: should the path have become a FIFO since, opening returns at once and fstat refuses it.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as file:
            _refuse_special(os.fstat(file.fileno()).st_mode, source)
            if os.fstat(file.fileno()).st_size > MAX_INPUT_BYTES:
                raise _too_big(source)
            data = file.read(MAX_INPUT_BYTES + 1)  # the size can grow while reading: read one byte past the limit
        if len(data) > MAX_INPUT_BYTES:
            raise _too_big(source)
        return data.decode("utf-8")
    except FileNotFoundError:
        raise SpecError(source, "", "file not found", fixes=("check the path",)) from None
    except OSError as err:
        raise SpecError(source, "", f"cannot read file ({err.strerror or err})") from None
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


class _RepeatedKey(yaml.constructor.ConstructorError):
    """A mapping of a YAML file gives ``key`` twice."""

    def __init__(self, key: Any, mark: Any):
        super().__init__(None, None, f"key {abbreviate(key)} given twice in one mapping", mark)
        self.key = key


def _refuse_repeated_keys(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool) -> None:
    seen: set[Any] = set()
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str | int | float | bool):
            continue  # a list or mapping as a key: PyYAML's constructor refuses it next, as a YAML error
        if key in seen:
            raise _RepeatedKey(key, key_node.start_mark)
        seen.add(key)


def _yaml_key_path(text: str, mark: Any) -> str:
    """Key path of the key node that starts at ``mark`` in the YAML ``text`` ("" where it is not found)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return ""
    stack: list[tuple[Any, str]] = [(root, "")]
    # Each node once: aliases make the node graph a DAG, whose paths a few hundred bytes of nested aliases multiply
    # into billions (an alias's keys sit at its anchor's marks, found on the first path to it).
    seen: set[int] = set()
    while stack:  # iterative, as the document may be deep
        node, where = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = f"{where}.{key_node.value}" if where else str(key_node.value)
                if key_node.start_mark.index == mark.index:
                    return path
                stack.append((value_node, path))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(node.value))
    return ""


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


def load_document(path: str | Path, fix: str) -> tuple[Any, str]:
    """:func:`load_yaml` of an input file that must hold something: an empty one is refused with ``fix``.

    Raises:
        SpecError: The file is missing, malformed or empty (the message names the file).
    """
    data, source = load_yaml(path)
    if data is None:
        raise SpecError(source, "", "file is empty", fixes=(fix,))
    return data, source


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
    except _RepeatedKey as err:
        mark = err.problem_mark
        path = _yaml_key_path(text, mark) or f"line {mark.line + 1}"
        raise SpecError(
            source, path, f"key given twice in one mapping (line {mark.line + 1})", fixes=("keep one of them",)
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise SpecError(source, "", f"malformed YAML at {where}{problem}", fixes=("fix the YAML syntax",)) from None
    except ValueError as err:
        # An integer of more than 4,300 digits (Python's int() refuses it), or a date out of range.
        raise SpecError(source, "", f"malformed YAML: {_value_problem(err)}", fixes=("fix the value",)) from None
    except RecursionError:
        # PyYAML parses and builds nested collections recursively: a few hundred levels exhaust Python's stack.
        raise _too_deep(source, "YAML") from None
    return data, source


def _value_problem(err: ValueError) -> str:
    """What a ValueError raised while parsing says, in the user's terms."""
    if "integer string conversion" in str(err):
        return "a number has more than 4,300 digits"
    return abbreviate(str(err), 100).strip("'")


def _too_deep(source: str, what: str) -> SpecError:
    return SpecError(
        source, "", f"{what} nested too deeply to read", fixes=("an input file nests a few levels, not hundreds",)
    )


class _RepeatedKeys(dict):
    """A JSON object that had a key twice: the first such key is kept, for the error to name its path."""

    repeated: str


def _repeated_key_path(value: Any) -> str | None:
    """Key path of the first key given twice in one object of ``value`` (a parsed JSON document), if any."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:  # iterative: the document may be deep
        node, where = stack.pop()
        if isinstance(node, _RepeatedKeys):
            return f"{where}.{node.repeated}" if where else node.repeated
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(node))))
    return None


def load_json(path: str | Path, source: str) -> Any:
    """Read a JSON file (with :func:`read_text`'s checks); a syntax error, nesting too deep to read or a key given
    twice in one object (plain ``json`` keeps the last) is a one-line :class:`SpecError` naming ``source``."""
    text = read_text(path, source)
    repeats: list[bool] = []

    def object_of(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        marked = _RepeatedKeys(obj)
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                marked.repeated = key
                break
            seen.add(key)
        repeats.append(True)
        return marked

    try:
        data = json.loads(text, object_pairs_hook=object_of)
    except json.JSONDecodeError as err:
        raise SpecError(source, "", f"malformed JSON at line {err.lineno}: {err.msg}") from None
    except ValueError as err:  # an integer of more than 4,300 digits (Python's int() refuses it)
        raise SpecError(source, "", f"malformed JSON: {_value_problem(err)}", fixes=("fix the value",)) from None
    except RecursionError:
        raise _too_deep(source, "JSON") from None
    if repeats:  # walked only then: the walk costs seconds for a plan of 200,000 shards
        raise SpecError(
            source, _repeated_key_path(data) or "", "key given twice in one object", fixes=("keep one of them",)
        )
    return data


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

    def names(self) -> list[str]:
        """The mapping's keys where they are names (tables, devices, features): as strings, each one a terminal shows
        as it is (see :meth:`take_str`)."""
        keys = [str(key) for key in self.data]
        for key in keys:
            self.refuse_unprintable(key, key)
        return keys

    def take(
        self, key: str, kind: Quantity | None = None, default: Any = _MISSING, maximum: float | None = None
    ) -> Any:
        """Read ``key``; with ``kind``, parse units and check the value is at most ``maximum`` (default: the kind's
        backstop, :data:`~persia_planner.limits.MAX_OF_KIND`). Without a default the key is required."""
        self._seen.add(key)
        if key not in self.data or self.data[key] is None:
            if default is _MISSING:
                raise self.error(key, "required key is missing", fixes=(f"add '{key}:'",))
            return default
        value = self.data[key]
        if kind is None:
            return value
        try:
            number = parse(value, kind)
        except UnitError as err:
            raise self.error(key, str(err)) from None
        ceiling = MAX_OF_KIND[kind] if maximum is None else maximum
        if number > ceiling:
            shown = f"{ceiling:,}" if isinstance(ceiling, int) else f"{ceiling:g}"
            shown += _CEILING_UNITS.get(kind, "")
            if kind is Quantity.SIZE:
                shown += f" ({format_bytes(ceiling)})"
            raise self.error(key, f"must be <= {shown}, got {abbreviate(value, 40)}", fixes=(f"use at most {shown}",))
        return number

    def take_str(self, key: str, default: Any = _MISSING) -> Any:
        """Read a string at ``key``: one a terminal shows as it is (no control, format or lone surrogate character,
        which names and paths never need and which would reach the terminal with them)."""
        value = self.take(key, default=default)
        if value is not default and not isinstance(value, str):
            raise self.error(key, f"expected a string, got {abbreviate(value)}")
        if value is not default:
            self.refuse_unprintable(key, value)
        return value

    def refuse_unprintable(self, key: str, value: str) -> None:
        """Raise the error at ``key`` where ``value`` holds a character a terminal would act on or cannot show."""
        bad = unprintable(value)
        if bad is not None:
            raise self.error(
                key,
                f"{abbreviate(value)} holds the character {bad}, which a terminal would act on or cannot show",
                fixes=("use printable characters only",),
            )

    def take_bool(self, key: str, default: Any = _MISSING) -> Any:
        value = self.take(key, default=default)
        if value is not default and not isinstance(value, bool):
            raise self.error(
                key, f"expected true or false, got {abbreviate(value)}", fixes=(f"write {key}: true or false",)
            )
        return value

    def take_enum(self, key: str, enum_type: type[E], default: Any = _MISSING) -> E:
        value = self.take(key, default=default)
        if isinstance(value, enum_type) or (value is default and default is not _MISSING):
            return value
        try:
            if not isinstance(value, str):  # str() of a huge list or mapping would cost more than it could match
                raise ValueError(value)
            return enum_type(value.lower())
        except ValueError:
            allowed = " | ".join(member.value for member in enum_type)
            raise self.error(key, f"unknown value {abbreviate(value)}", fixes=(f"use one of {allowed}",)) from None

    def take_enum_list(self, key: str, enum_type: type[E], default: Any = _MISSING) -> Any:
        """Read a non-empty list of ``enum_type`` values at ``key`` as a tuple (each once, in the file's order); an
        unknown value is named by its index (``tiers[1]``)."""
        items = self._take_items(key, "names", default)
        if items is default:
            return default
        allowed = "use one of " + " | ".join(member.value for member in enum_type)
        values: list[E] = []
        for i, item in enumerate(items):
            try:
                if not isinstance(item, str):
                    raise ValueError(item)
                values.append(enum_type(item.lower()))
            except ValueError:
                raise SpecError(
                    self.source, f"{self.key_path(key)}[{i}]", f"unknown value {abbreviate(item)}", fixes=(allowed,)
                ) from None
        return tuple(dict.fromkeys(values))

    def take_str_list(self, key: str, default: Any = _MISSING) -> Any:
        """Read a non-empty list of non-empty strings at ``key`` as a tuple (each once, in the file's order)."""
        items = self._take_items(key, "names", default)
        if items is default:
            return default
        for i, item in enumerate(items):
            if isinstance(item, str) and item:
                self.refuse_unprintable(f"{key}[{i}]", item)
            if not isinstance(item, str) or not item:
                raise SpecError(
                    self.source, f"{self.key_path(key)}[{i}]", f"expected a non-empty string, got {abbreviate(item)}"
                )
        return tuple(dict.fromkeys(items))

    def _take_items(self, key: str, what: str, default: Any) -> Any:
        """The list at ``key`` (``default`` when absent); refuses another type and an empty list."""
        value = self.take(key, default=default)
        if value is default:
            return default
        if not isinstance(value, list):
            fix = f"write {key}: [{value}]" if isinstance(value, str) and len(value) <= 60 else f"write {key}: [...]"
            raise self.error(key, f"expected a list of {what}, got {abbreviate(value)}", fixes=(fix,))
        if not value:
            raise self.error(key, "is an empty list, which allows nothing", fixes=(f"name one or more, or drop {key}",))
        return value

    def take_positive(self, key: str, kind: Quantity, default: Any = _MISSING, maximum: float | None = None) -> Any:
        """``take`` a value that must be > 0 (and at most ``maximum``)."""
        value = self.take(key, kind, default, maximum)
        if value is not default and value <= 0:
            raise self.error(key, f"must be > 0, got {abbreviate(self.data[key])}")
        return value

    def take_in_range(
        self, key: str, kind: Quantity, low: float, high: float, default: Any = _MISSING, fixes: tuple[str, ...] = ()
    ) -> Any:
        """``take`` a value in ``[low, high]``: a floor as well as a ceiling, for a rate the cost model divides by (a
        rate of ``1e-300`` would give a 300-digit step time)."""
        value = self.take(key, kind, default, maximum=float("inf"))
        if value is not default and not low <= value <= high:
            shown = f"{format_bytes(low)}, {format_bytes(high)}" if kind is Quantity.SIZE else f"{low:g}, {high:g}"
            shown += _CEILING_UNITS.get(kind, "") if kind is not Quantity.SIZE else ""
            raise self.error(key, f"must be in [{shown}], got {abbreviate(self.data[key], 40)}", fixes=fixes)
        return value

    def take_list(
        self, key: str, default: Any = _MISSING, max_items: int | None = None
    ) -> Iterator[tuple[int, Fields]]:
        """Read the list of mappings at ``key``, each as :class:`Fields`; a list of more than ``max_items`` is
        refused before any item is read."""
        value = self.take(key, default=default)
        if value is default:
            return iter(())
        if not isinstance(value, list):
            raise self.error(key, f"expected a list, got {type(value).__name__}")
        if max_items is not None and len(value) > max_items:
            raise self.error(
                key, f"has {len(value):,} items, more than {max_items:,}", fixes=(f"give at most {max_items:,}",)
            )
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
        key = abbreviate(unknown[0], 60) if not isinstance(unknown[0], str) else unknown[0]
        close = difflib.get_close_matches(key, sorted(self._seen), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(self._seen))}"
        raise self.error(key, "unknown key", fixes=(hint,))


def _indexed(items: list[Any], source: str, path: str) -> Iterator[tuple[int, Fields]]:
    for i, item in enumerate(items):
        yield i, Fields(item, source, f"{path}[{i}]")
