"""What every ``persia`` command shares: the typer app, its one-line error edge and exit codes, and output.

The commands live in :mod:`persia_planner.cli.commands` (planning, checking, serving) and
:mod:`persia_planner.cli.train` (``persia train``); nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

from persia_planner.errors import ErrorKind, Interrupted, PlannerError, one_line
from persia_planner.tiers.plugins import load_failure

try:  # typer >= 0.22 vendors click; older typer depends on it.
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - depends on the installed typer
    from click.exceptions import ClickException  # type: ignore[no-redef]

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERNAL",
    "EXIT_INVALID_PLAN",
    "Exit",
    "app",
    "edge",
    "main",
    "make_console",
    "note",
    "print_error",
]

EXIT_INVALID_PLAN = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class Exit(Exception):
    """Leave with ``code`` after the message has been printed."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _OneLineErrors(TyperGroup):
    """Turns usage errors (missing argument, unknown option, bad integer) into one ``error:`` line, exit 2."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None, **extra: Any):
        standalone = extra.pop("standalone_mode", True)
        failed = load_failure()  # a tier module named by the environment: every command needs the tiers
        if failed is not None:
            code = print_error(str(failed), EXIT_BAD_INPUT)
            if standalone:
                sys.exit(code)
            return code
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = result if isinstance(result, int) else 0
        except Exit as done:
            code = done.code
        except ClickException as err:
            if type(err).__name__ == "NoArgsIsHelpError":  # bare `persia`: show the help, as click would
                typer.echo(err.format_message())
                code = 0
            else:
                ctx = getattr(err, "ctx", None)
                hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
                code = print_error(f"{err.format_message()}{hint}", err.exit_code)
        except typer.Abort:
            code = print_error("aborted", 130)
        if standalone:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=_OneLineErrors,
    help="Plan where embedding tables go (GPU HBM, host DDR, parameter servers), check plans, and train with them.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def main() -> None:
    """Entry point of the ``persia`` script."""
    app(prog_name="persia")


# ---- the error edge -----------------------------------------------------------------------------------------------
def print_error(message: str, code: int) -> int:
    """Print ``error: <message>`` as one line of readable length (:func:`~persia_planner.errors.one_line`) on
    stderr; return ``code``."""
    line = one_line(message)
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    return code


@contextlib.contextmanager
def edge() -> Iterator[None]:
    """Where PlannerError becomes a one-line message and an exit code (1 for an invalid plan, else 2), and an
    :class:`~persia_planner.errors.Interrupted` run one with ``128 + signum``."""
    try:
        yield
    except Interrupted as err:
        raise Exit(print_error(str(err), 128 + err.signum)) from None
    except PlannerError as err:
        code = EXIT_INVALID_PLAN if err.kind is ErrorKind.INVALID_PLAN else EXIT_BAD_INPUT
        if getattr(err, "internal", False):  # a trainer process hit a bug, not bad input
            code = EXIT_INTERNAL
            err = PlannerError(f"internal error ({err}); please report it, PERSIA_DEBUG=1 shows the traceback")
        raise Exit(print_error(str(err), code)) from None
    except (Exit, typer.Exit, ClickException, typer.Abort):
        raise
    except Exception as err:
        if os.environ.get("PERSIA_DEBUG"):
            raise
        message = f"internal error ({type(err).__name__}: {err}); please report it, PERSIA_DEBUG=1 shows the traceback"
        raise Exit(print_error(message, EXIT_INTERNAL)) from None


def make_console(stderr: bool = False):
    """The console every command prints through: text is shown as it is, never read as rich markup (a name such as
    ``dlrm[v2]`` or ``[/]`` is a name)."""
    from rich.console import Console

    width = None if (sys.stderr if stderr else sys.stdout).isatty() else 140
    return Console(stderr=stderr, width=width, highlight=False, markup=False)


def note(message: str, *, to_stderr: bool) -> None:
    typer.echo(message, err=to_stderr)
