"""Whether the training stack (the ``train`` extra: torch, fbgemm, torchrec and torchrec's requirements) is installed.

The commands that run the runtime (``persia train``, ``persia ps``, ``persia calibrate``) call
:func:`require_training_stack` before they import it: without the check, a missing package surfaces as a
``ModuleNotFoundError`` deep in an import chain, which the CLI can only report as an internal error. It looks the
packages up with :func:`importlib.util.find_spec`, which imports nothing, so it costs milliseconds and runs before
torch is imported. Torch-free.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass

from persia_planner.errors import PlannerError

__all__ = [
    "INSTALL_FIXES",
    "PS_STACK",
    "TRAINING_STACK",
    "StackPackage",
    "missing_packages",
    "require_training_stack",
]


@dataclass(frozen=True)
class StackPackage:
    """One package of the training stack.

    Attributes:
        module: The top-level module the runtime imports (``fbgemm_gpu``).
        distribution: What pip installs it as, for the message (``fbgemm-gpu-cpu``).
    """

    module: str
    distribution: str


TRAINING_STACK: tuple[StackPackage, ...] = (
    StackPackage("torch", "torch"),
    StackPackage("fbgemm_gpu", "fbgemm-gpu-cpu / fbgemm-gpu"),
    StackPackage("torchrec", "torchrec"),
    # torchrec imports these when it is imported
    StackPackage("tensordict", "tensordict"),
    StackPackage("torchmetrics", "torchmetrics"),
    StackPackage("pyre_extensions", "pyre-extensions"),
    StackPackage("tqdm", "tqdm"),
)
"""What ``persia train`` and ``persia calibrate`` import (pyproject.toml's ``train`` extra)."""

PS_STACK: tuple[StackPackage, ...] = (StackPackage("torch", "torch"),)
"""What ``persia ps`` imports: a parameter server runs on torch.distributed.rpc alone."""

INSTALL_FIXES: tuple[str, ...] = (
    "install the train extra with its constraints: pip install -c constraints/train-cpu.txt '.[train]' in a checkout"
    " (without -c on a CUDA machine), or ./scripts/setup.sh",
)
"""The install command, as in README's "Install" section."""


def missing_packages(packages: Iterable[StackPackage] = TRAINING_STACK) -> tuple[StackPackage, ...]:
    """The packages of ``packages`` that cannot be found, in order; imports none of them.

    Args:
        packages: The packages to look for.

    Returns:
        Those whose top-level module :func:`importlib.util.find_spec` does not find.
    """
    return tuple(p for p in packages if importlib.util.find_spec(p.module) is None)


def require_training_stack(command: str, packages: Iterable[StackPackage] = TRAINING_STACK) -> None:
    """Raise one :class:`~persia_planner.errors.PlannerError` naming every missing package and the install command.

    Args:
        command: The command that needs the stack, for the message (``"persia train"``).
        packages: What it imports.

    Raises:
        PlannerError: At least one package is not installed.
    """
    missing = missing_packages(packages)
    if missing:
        names = ", ".join(p.distribution for p in missing)
        raise PlannerError(
            f"{command} needs the training stack, and {names} {'is' if len(missing) == 1 else 'are'} not installed",
            fixes=INSTALL_FIXES,
        )
