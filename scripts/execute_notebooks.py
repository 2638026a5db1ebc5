"""Execute the tutorials in place, so that their committed outputs (tables, plots) show when browsing them.

    .venv/bin/python scripts/execute_notebooks.py                 # every tutorials/*.ipynb
    .venv/bin/python scripts/execute_notebooks.py tutorials/02_hybrid_training.ipynb

CI re-executes them from scratch (``pytest --nbmake``); ``tests/test_tutorials.py`` checks that the committed copies
hold their outputs, at least one plot each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def execute(path: Path) -> None:
    """Run every cell of ``path`` in its own directory and write the notebook back with the outputs."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    # Execution counts and kernel timings change on every run: keep the diff to what the cells printed.
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(notebook, path)


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted((ROOT / "tutorials").glob("*.ipynb"))
    for path in paths:
        print(f"executing {path}", flush=True)
        execute(path)


if __name__ == "__main__":
    main(sys.argv[1:])
