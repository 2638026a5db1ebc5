"""Whether the training stack (the ``train`` extra: torch, fbgemm, torchrec and torchrec's requirements) is installed.

The commands that run the runtime (``persia train``, ``persia ps``, ``persia calibrate``) call
:func:`require_training_stack` before they import it: without the check, a missing package surfaces as a
``ModuleNotFoundError`` deep in an import chain, which the CLI can only report as an internal error. It looks the
packages up with :func:`importlib.util.find_spec` and reads the installed versions from the packages' metadata, which
imports nothing, so it costs milliseconds and runs before torch is imported. Torch-free.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass

from persia_planner.errors import PlannerError

__all__ = [
    "INSTALL_FIXES",
    "PROFILE_STACK",
    "PS_STACK",
    "TRAINING_STACK",
    "StackPackage",
    "mismatch",
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
    # the Parquet / CSV reader (--data parquet: / csv:)
    StackPackage("pyarrow", "pyarrow"),
)
"""What ``persia train`` and ``persia calibrate`` import (pyproject.toml's ``train`` extra)."""

PROFILE_STACK: tuple[StackPackage, ...] = (
    StackPackage("pyarrow", "pyarrow"),
    StackPackage("datasketches", "datasketches"),
)
"""What ``persia data profile`` imports: pyarrow reads the log, DataSketches counts its distinct ids."""

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


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``"2.13.0+cpu"``), or None where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def mismatch() -> str | None:
    """What in the installed stack cannot work together, or None: read from the metadata, nothing imported.

    Two cases, the ones pip gets into when torchrec is installed without the constraints (README, "Install"): a CUDA
    build of fbgemm-gpu beside a CPU torch (it needs ``libtorch_cuda.so``), and an fbgemm or torchrec 1.X beside a
    torch other than 2.(X+5), the only one it is built for.
    """
    torch = installed_version("torch")
    fbgemm_cuda = installed_version("fbgemm-gpu")
    fbgemm = installed_version("fbgemm-gpu-cpu") or fbgemm_cuda
    if torch is None or fbgemm is None:
        return None
    if torch.endswith("+cpu") and fbgemm_cuda is not None and not fbgemm_cuda.endswith("+cpu"):
        return f"fbgemm-gpu {fbgemm_cuda} is the CUDA build, which does not load on torch {torch} (a CPU build)"
    want = _minor(torch)
    for name, version in (("fbgemm", fbgemm), ("torchrec", installed_version("torchrec"))):
        have = None if version is None else _minor(version)
        if want is not None and have is not None and have[0] == 1 and want[0] == 2 and have[1] + 5 != want[1]:
            return f"{name} {version} is built for torch 2.{have[1] + 5}, and torch {torch} is installed"
    return None


def require_training_stack(command: str, packages: Iterable[StackPackage] = TRAINING_STACK) -> None:
    """Raise one :class:`~persia_planner.errors.PlannerError` naming every missing package and the install command.

    Args:
        command: The command that needs the stack, for the message (``"persia train"``).
        packages: What it imports.

    Raises:
        PlannerError: At least one package is not installed, or the installed ones do not pair (:func:`mismatch`).
    """
    packages = tuple(packages)
    missing = missing_packages(packages)
    if missing:
        names = ", ".join(p.distribution for p in missing)
        raise PlannerError(
            f"{command} needs the training stack, and {names} {'is' if len(missing) == 1 else 'are'} not installed",
            fixes=INSTALL_FIXES,
        )
    wrong = mismatch() if any(p.module in ("fbgemm_gpu", "torchrec") for p in packages) else None
    if wrong is not None:
        raise PlannerError(
            f"{command} needs the training stack, and {wrong}",
            fixes=(f"pip uninstall -y fbgemm-gpu fbgemm-gpu-cpu torchrec, then {INSTALL_FIXES[0]}",),
        )
