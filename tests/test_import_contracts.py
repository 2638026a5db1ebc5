"""The import contracts of pyproject.toml: each one breaks when a module imports across its layers.

``scripts/test.sh`` checks that the tree keeps them; these tests check that they can fail, by planting one
forbidden import per contract in a copy of the tree (``persia_planner/modules`` links to ``modules/``; the copy holds
its files).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def copied_tree(into: Path) -> Path:
    """``persia_planner`` (the runtime's files in place of the link) copied under ``into``."""
    shutil.copytree(ROOT / "persia_planner", into / "persia_planner", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    command = [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        ("bound/terms.py", "import torch", "Only the runtime imports torch"),
        ("cli/app.py", "import torchrec", "Only the runtime imports torch"),
        ("cost/analytic.py", "import persia_planner.modules.embedding.hybrid", "The layers:"),
        ("topology/graph.py", "from persia_planner.cost import analytic", "The layers:"),
        ("modules/data/criteo.py", "from persia_planner.modules import train", "The runtime's layers"),
        ("modules/train/config.py", "from persia_planner.modules.train import engine", "Training's layers"),
        ("modules/ps/protocol.py", "from persia_planner.modules.ps import server", "The PS package's layers"),
        ("search/state.py", "from persia_planner.search import improve", "The search's stages"),
    ],
)
def test_an_import_across_the_layers_breaks_its_contract(tmp_path, module, planted, contract):
    tree = copied_tree(tmp_path)
    path = tree / "persia_planner" / module
    text = path.read_text()
    first = text.index("\nimport ") if "\nimport " in text else text.index("\nfrom ")
    path.write_text(f"{text[:first]}\n{planted}{text[first:]}")
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    report = " ".join(result.stdout.split())  # the report wraps long contract names
    after = report[report.index(contract) :]
    verdict = min((after.find(word), word) for word in (" KEPT", " BROKEN") if word in after)[1]
    assert verdict == " BROKEN", report
