"""Typed errors. Raised deep, printed once at the edge (the CLI prints ``str(err)``: one line, with the fix)."""

from __future__ import annotations

import enum
import reprlib
import unicodedata
from typing import Any

__all__ = [
    "MAX_LINE_CHARS",
    "CapacityError",
    "ConstraintError",
    "ErrorKind",
    "Interrupted",
    "PlannerError",
    "SpecError",
    "abbreviate",
    "clip",
    "first_line",
    "one_line",
    "printable",
    "unprintable",
]

MAX_LINE_CHARS = 600
"""The longest error line printed. Values from input files are shown abbreviated where the message is made (a
300-digit number, a list of 200,000 shards); this cap is the backstop for any message. The planner's own longest
messages (a table that fits nowhere, with the numbers and the fix) reach about 410 characters plus the table's name
(up to 200), so the cap sits above that: a readable few lines, never a megabyte."""
_FIX_CHARS = 200  # of MAX_LINE_CHARS, the most the fixes may take when the whole is too long

_REPR = reprlib.Repr()
# Bounded in depth and width, so that showing a value costs little even when it is huge or a YAML alias bomb.
_REPR.maxlevel = 3
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlong = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = 6
_REPR.maxdict = 4


def abbreviate(value: Any, limit: int = 80) -> str:
    """``repr(value)``, shortened to about ``limit`` characters (long strings, numbers and lists cut with ``...``).

    Costs little whatever ``value`` is: only the first few items of each level are looked at.
    """
    return clip(_REPR.repr(value), limit)


def clip(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and end joined by ``...``."""
    if len(text) <= limit:
        return text
    tail = max(limit // 4, 0)
    head = max(limit - tail - 3, 0)
    return text[:head] + "..." + (text[-tail:] if tail else "")


def first_line(err: BaseException, *, with_type: bool = False) -> str:
    """The first line of ``err``'s message, after its type's name with ``with_type``; the name alone where the message
    is empty."""
    message = str(err).strip()
    first = message.splitlines()[0] if message else ""
    if not first:
        return type(err).__name__
    return f"{type(err).__name__}: {first}" if with_type else first


def one_line(text: str, limit: int = MAX_LINE_CHARS) -> str:
    """``text`` as one line (runs of whitespace become one space) of at most ``limit`` characters, every character a
    terminal would act on escaped (:func:`printable`)."""
    return clip(printable(" ".join(str(text).split())), limit)


# Control characters (ESC starts a terminal's escape sequences), lone surrogates (no encoder writes them) and format
# characters (a right-to-left override reorders what follows): shown escaped, never written as they are.
_UNPRINTABLE = frozenset({"Cc", "Cs", "Cf"})


def unprintable(text: str) -> str | None:
    """The first character of ``text`` a terminal would act on or cannot show, escaped (``'\\x1b'``); None if
    none."""
    for char in text:
        if unicodedata.category(char) in _UNPRINTABLE:
            return char.encode("unicode_escape", "backslashreplace").decode("ascii")
    return None


def printable(text: str) -> str:
    """``text`` with every character :func:`unprintable` finds escaped (``\\x1b``, ``\\u202e``, ``\\ud800``):
    a name from an input file can then reach the terminal only as the text it is."""
    if text.isprintable():  # the common case, checked in C
        return text
    return "".join(
        char.encode("unicode_escape", "backslashreplace").decode("ascii")
        if unicodedata.category(char) in _UNPRINTABLE
        else char
        for char in text
    )


class ErrorKind(enum.StrEnum):
    """What went wrong, for callers that branch on it."""

    INPUT = "input"  # a YAML/JSON file or an argument is malformed
    CAPACITY = "capacity"  # the model does not fit the topology
    INVALID_PLAN = "invalid_plan"  # a plan.json breaks coverage or capacity rules
    UNSUPPORTED = "unsupported"  # a valid request this build cannot serve
    UNAVAILABLE = "unavailable"  # a peer (a parameter server) did not answer


class PlannerError(Exception):
    """Base error of the planner.

    Attributes:
        kind: The category of the error.
        message: What is wrong, naming the field / device and the numbers.
        fixes: Suggested changes that would make the request succeed.
    """

    def __init__(self, message: str, *, kind: ErrorKind = ErrorKind.INPUT, fixes: tuple[str, ...] = ()):
        self.kind = kind
        self.message = message
        self.fixes = tuple(fixes)
        super().__init__(self.__str__())

    def __str__(self) -> str:
        """One line of at most :data:`MAX_LINE_CHARS`: what is wrong, then the fix; when too long, each part is cut
        in its middle, so that the file, the key path and the fix stay readable. What a terminal would act on (a
        name's escape sequence) is escaped (:func:`printable`), wherever the line is printed."""
        message = printable(" ".join(self.message.split()))
        fix = f"; fix: {' or '.join(self.fixes)}" if self.fixes else ""
        fix = printable(" ".join(fix.split()))
        if len(message) + len(fix) <= MAX_LINE_CHARS:
            return message + fix
        fix = clip(fix, _FIX_CHARS)
        return clip(message, MAX_LINE_CHARS - len(fix)) + fix


class SpecError(PlannerError):
    """An input file is malformed. The message names the file, the key path and the bad value."""

    def __init__(self, source: str, path: str, problem: str, *, fixes: tuple[str, ...] = ()):
        self.source = source
        self.path = path
        self.problem = problem
        where = f"{source}: {path}: " if path else f"{source}: "
        super().__init__(where + problem, kind=ErrorKind.INPUT, fixes=fixes)


class CapacityError(PlannerError):
    """Nothing fits: names the short resource and by how many bytes.

    Attributes:
        resource: The capacity that is short (e.g. ``"PS DDR"``, ``"trainer0 DDR"``).
        short_bytes: How many bytes are missing after the stated reservation.
        table: The table that found no room, where one did (None where the tables do not fit in total).
    """

    def __init__(
        self, resource: str, short_bytes: int, message: str, fixes: tuple[str, ...], *, table: str | None = None
    ):
        self.resource = resource
        self.short_bytes = int(short_bytes)
        self.table = table
        super().__init__(message, kind=ErrorKind.CAPACITY, fixes=fixes)


class ConstraintError(PlannerError):
    """A table's ``constraints:`` cannot be met on this topology (an unknown device, no parameter server for a table
    that may only go there, no sharding the named devices can hold). The message names the table and what it asked.

    Attributes:
        table: The table whose constraints cannot be met.
    """

    def __init__(self, table: str, message: str, fixes: tuple[str, ...] = ()):
        self.table = table
        super().__init__(message, kind=ErrorKind.INPUT, fixes=fixes)


class Interrupted(Exception):
    """A signal (SIGINT, SIGTERM) stopped a run; its processes were stopped first.

    Not a :class:`PlannerError`: nothing was wrong with the input, and code that handles those must not take it for
    one. The CLI prints it as one line and exits ``128 + signum`` (130, 143), as a shell reports a signal.

    Attributes:
        signum: The signal's number.
        results: What the run's processes returned, when they stopped by themselves at the signal (a final
            checkpoint); None when they were stopped.
    """

    def __init__(self, signum: int, message: str, results: Any = None) -> None:
        super().__init__(message)
        self.signum = signum
        self.results = results
