"""The ceilings of ``persia_planner.limits``: each is documented in formats.md, and the examples stay below them."""

from __future__ import annotations

from pathlib import Path

from persia_planner import limits, load_model, load_topology
from persia_planner.paths import EXAMPLES

ROOT = Path(__file__).resolve().parents[1]


def test_every_ceiling_is_documented_in_formats_md():
    text = (ROOT / "docs" / "formats.md").read_text()
    missing = [name for name in limits.__all__ if f"`{name}`" not in text]
    assert not missing, f"formats.md does not list {missing}"


def test_the_bundled_examples_are_within_the_ceilings():
    for path in sorted(EXAMPLES.glob("*.yaml")):
        text = path.read_text()
        if "tables:" in text:
            model = load_model(path)
            assert all(t.rows <= limits.MAX_ROWS and t.dim <= limits.MAX_DIM for t in model.tables)
        elif "hosts:" in text or "nodes:" in text:
            load_topology(path)
