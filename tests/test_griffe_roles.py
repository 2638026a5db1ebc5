"""scripts/griffe_roles.py: the docstrings' Sphinx roles become optional autorefs references to the full names they
resolve to (links where a page renders the object, code where none does)."""

from __future__ import annotations

from pathlib import Path

import griffe
import pytest
from benchmark_modules import load

ROOT = Path(__file__).resolve().parents[1]
griffe_roles = load("griffe_roles", ROOT / "scripts")

STORE = '''"""Stores: :class:`Store`, :meth:`~.Store.take`, :func:`!unlinked`, :func:`.nothing`,
:class:`torch.Tensor`."""


class Store:
    """A store; :meth:`take` reads rows."""

    def take(self):
        """The rows of a :class:`persia_planner.store.Store`."""
'''


def _package(tmp_path: Path) -> Path:
    (tmp_path / "persia_planner").mkdir()
    (tmp_path / "persia_planner" / "__init__.py").write_text('"""The package: :mod:`.store`."""\n')
    (tmp_path / "persia_planner" / "store.py").write_text(STORE)
    return tmp_path


@pytest.mark.processes  # griffe asks git (a subprocess) where the package lives
def test_each_role_becomes_an_optional_reference_to_its_full_name(tmp_path):
    root = _package(tmp_path)
    loaded = griffe.load(
        "persia_planner",
        search_paths=[str(root)],
        try_relative_path=False,  # not the repository's own persia_planner/, in the working directory
        extensions=griffe.load_extensions(griffe_roles.SphinxRoles(root=root)),
    )

    def ref(identifier: str, shown: str) -> str:
        return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'

    store = loaded["store"]
    assert loaded.docstring.value == f"The package: {ref('persia_planner.store', 'store')}."
    assert store.docstring.value == (
        f"Stores: {ref('persia_planner.store.Store', 'Store')}, {ref('persia_planner.store.Store.take', 'take')}, "
        f"<code>unlinked</code>, <code>nothing</code>,\n{ref('torch.Tensor', 'torch.Tensor')}."
    )
    assert store["Store"].docstring.value == f"A store; {ref('persia_planner.store.Store.take', 'take')} reads rows."
    assert store["Store.take"].docstring.value == (
        f"The rows of a {ref('persia_planner.store.Store', 'persia_planner.store.Store')}."
    )
