"""modules/train_extra.py: a command that needs torch, run where part of the training stack is missing, says which part
and how to install it in one line, exit 2, instead of an internal error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from persia_planner.errors import PlannerError
from persia_planner.modules import train_extra as stack
from persia_planner.modules.train_extra import (
    INSTALL_FIXES,
    PS_STACK,
    TRAINING_STACK,
    StackPackage,
    mismatch,
    missing_packages,
    require_training_stack,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_stack_is_complete():
    assert missing_packages(TRAINING_STACK) == ()
    require_training_stack("persia train")  # raises nothing


def test_a_hidden_package_is_named_with_its_distribution(monkeypatch):
    # find_spec answers None for a module whose sys.modules entry is None, as an uninstalled one
    monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)
    monkeypatch.setitem(sys.modules, "tensordict", None)
    assert missing_packages() == (
        StackPackage("fbgemm_gpu", "fbgemm-gpu-cpu / fbgemm-gpu"),
        StackPackage("tensordict", "tensordict"),
    )
    with pytest.raises(PlannerError) as err:
        require_training_stack("persia train")
    assert str(err.value) == (
        "persia train needs the training stack, and fbgemm-gpu-cpu / fbgemm-gpu, tensordict are not installed; "
        f"fix: {INSTALL_FIXES[0]}"
    )


def test_the_ps_needs_only_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchrec", None)
    assert missing_packages(PS_STACK) == ()
    monkeypatch.setitem(sys.modules, "torch", None)
    assert missing_packages(PS_STACK) == (StackPackage("torch", "torch"),)


def installed(monkeypatch, versions: dict[str, str]) -> None:
    """Make the stack's metadata say ``versions`` (distribution -> version); the others are not installed."""
    monkeypatch.setattr(stack, "installed_version", versions.get)


def test_the_known_good_pairs_match(monkeypatch):
    installed(monkeypatch, {"torch": "2.13.0+cpu", "fbgemm-gpu-cpu": "1.8.0", "torchrec": "1.8.0"})
    assert mismatch() is None
    # constraints/train-cpu.txt's install: the file-less fbgemm-gpu 1.8.0+cpu beside fbgemm-gpu-cpu
    installed(monkeypatch, {"torch": "2.13.0+cpu", "fbgemm-gpu": "1.8.0+cpu", "fbgemm-gpu-cpu": "1.8.0"})
    assert mismatch() is None
    installed(monkeypatch, {"torch": "2.13.0", "fbgemm-gpu": "1.8.0", "torchrec": "1.8.0"})  # CUDA
    assert mismatch() is None


def test_a_cuda_fbgemm_beside_a_cpu_torch_is_named(monkeypatch):
    installed(monkeypatch, {"torch": "2.13.0+cpu", "fbgemm-gpu": "1.8.0", "torchrec": "1.8.0"})
    assert mismatch() == "fbgemm-gpu 1.8.0 is the CUDA build, which does not load on torch 2.13.0+cpu (a CPU build)"
    with pytest.raises(PlannerError, match=r"^persia train needs the training stack, and fbgemm-gpu 1.8.0 is the CUDA"):
        require_training_stack("persia train")
    require_training_stack("persia ps", PS_STACK)  # a server does not load fbgemm


def test_a_release_built_for_another_torch_is_named(monkeypatch):
    installed(monkeypatch, {"torch": "2.13.0", "fbgemm-gpu": "1.9.0", "torchrec": "1.8.0"})
    assert mismatch() == "fbgemm 1.9.0 is built for torch 2.14, and torch 2.13.0 is installed"
    installed(monkeypatch, {"torch": "2.13.0+cpu", "fbgemm-gpu-cpu": "1.8.0", "torchrec": "1.7.0"})
    assert mismatch() == "torchrec 1.7.0 is built for torch 2.12, and torch 2.13.0+cpu is installed"


def persia_without(hidden: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``persia ARGS`` in a process where ``hidden`` cannot be imported (its sys.modules entry is None)."""
    code = (
        f"import sys; sys.modules[{hidden!r}] = None; from persia_planner.cli import main; "
        f"sys.argv = ['persia', *{args!r}]; main()"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    env.pop("PERSIA_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("hidden", "args", "named"),
    [
        ("torchrec", ["train", "--steps", "1"], "persia train needs the training stack, and torchrec is not"),
        ("torch", ["ps", "--rank", "0", "--world-size", "2"], "persia ps needs the training stack, and torch is not"),
        ("fbgemm_gpu", ["calibrate", "--quick"], "persia calibrate needs the training stack, and fbgemm-gpu-cpu"),
    ],
)
def test_a_command_without_its_stack_says_what_to_install_in_one_line(tmp_path, hidden, args, named):
    result = persia_without(hidden, args, tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {named}"), lines[0]
    assert lines[0].endswith(f"fix: {INSTALL_FIXES[0]}"), lines[0]
    assert not (tmp_path / "profile.yaml").exists()  # calibrate stopped before measuring anything
