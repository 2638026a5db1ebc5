"""The tutorials as committed: numbered without gaps, executed, each with at least one plot in its outputs (a
reader browsing the repository sees what the notebook shows; CI re-executes them with ``pytest --nbmake``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))


def test_the_tutorials_are_numbered_without_gaps():
    numbers = [int(re.match(r"(\d+)_", p.name).group(1)) for p in NOTEBOOKS]
    assert numbers == list(range(1, len(NOTEBOOKS) + 1)), [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_committed_tutorial_holds_its_outputs_and_a_plot(path: Path):
    cells = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    unexecuted = [i for i, c in enumerate(cells) if "".join(c["source"]).strip() and c.get("execution_count") is None]
    assert not unexecuted, f"{path.name}: code cells {unexecuted} were not executed (scripts/execute_notebooks.py)"
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: committed with an error: {errors[0].get('ename')}"
    pictures = [o for c in cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert pictures, f"{path.name}: no plot among the committed outputs"
