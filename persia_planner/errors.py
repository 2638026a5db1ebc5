"""Typed errors. Raised deep, printed once at the edge (the CLI prints ``str(err)``: one line, with the fix)."""

from __future__ import annotations

import enum

__all__ = ["CapacityError", "ErrorKind", "Interrupted", "PlannerError", "SpecError"]


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
        if not self.fixes:
            return self.message
        return f"{self.message}; fix: {' or '.join(self.fixes)}"


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


class Interrupted(Exception):
    """A signal (SIGINT, SIGTERM) stopped a run; its processes were stopped first.

    Not a :class:`PlannerError`: nothing was wrong with the input, and code that handles those must not take it for
    one. The CLI prints it as one line and exits ``128 + signum`` (130, 143), as a shell reports a signal.

    Attributes:
        signum: The signal's number.
    """

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
