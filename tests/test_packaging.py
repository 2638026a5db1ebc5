"""pyproject.toml and constraints/: the wheel holds every package, the extras pin the known-good stack, and the CPU
constraints file stays consistent with the file-less fbgemm-gpu wheel it points pip to."""

from __future__ import annotations

import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONSTRAINTS = ROOT / "constraints" / "train-cpu.txt"


def package_dirs() -> set[str]:
    """Every directory of persia_planner (modules/ included, as installed) that holds Python or example files."""
    found = set()
    for top, name in ((ROOT / "persia_planner", "persia_planner"), (ROOT / "modules", "persia_planner.modules")):
        for path in [top, *top.rglob("*")]:
            parts = path.relative_to(top).parts
            if name == "persia_planner" and parts[:1] == ("modules",):
                continue  # the symlink to modules/, walked as persia_planner.modules
            if path.is_dir() and path.name != "__pycache__" and (any(path.glob("*.py")) or any(path.glob("*.yaml"))):
                found.add(".".join([name, *parts]))
    return found


def test_every_package_directory_is_in_the_wheel():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert package_dirs() == listed


def test_the_train_extra_pins_the_known_good_stack():
    train = PYPROJECT["project"]["optional-dependencies"]["train"]
    for pin in ("torch==2.13.0", "fbgemm-gpu==1.8.0", "torchrec==1.8.0", "torchmetrics==1.0.3"):
        assert pin in train
    for name in ("tensordict", "tqdm", "pyre-extensions", "iopath"):
        assert name in train
    assert any(r.startswith("pyarrow") for r in train) and any(r.startswith("tensorboard") for r in train)


def constraint_lines() -> list[str]:
    lines = (line.split("#")[0].strip() for line in CONSTRAINTS.read_text().splitlines())
    return [line for line in lines if line]


def test_the_cpu_constraints_point_to_a_wheel_that_requires_fbgemm_gpu_cpu():
    lines = constraint_lines()
    assert "fbgemm-gpu==1.8.0+cpu" in lines and "fbgemm-gpu-cpu==1.8.0" in lines and "torch==2.13.0" in lines
    links = [line.split()[1] for line in lines if line.startswith("--find-links")]
    assert links == ["wheels"]
    wheels = sorted((CONSTRAINTS.parent / links[0]).glob("*.whl"))
    assert [w.name for w in wheels] == ["fbgemm_gpu-1.8.0+cpu-py3-none-any.whl"]
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
        metadata = wheel.read("fbgemm_gpu-1.8.0+cpu.dist-info/METADATA").decode()
    # It installs nothing but its metadata: the real fbgemm_gpu package comes from fbgemm-gpu-cpu.
    assert all(name.startswith("fbgemm_gpu-1.8.0+cpu.dist-info/") for name in names), names
    assert "Name: fbgemm-gpu\n" in metadata and "Version: 1.8.0+cpu\n" in metadata
    assert [line for line in metadata.splitlines() if line.startswith("Requires-Dist")] == [
        "Requires-Dist: fbgemm-gpu-cpu==1.8.0"
    ]


def test_the_license_is_the_apache_license_pyproject_names():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
