"""The tutorials' notebooks as the docs checks read them: their cells, and the paths their code writes.

Read statically (the notebook's JSON, its code cells' syntax trees): nothing runs.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

# What a notebook's code calls to create a path: the method and which of its operands is the path (-1: the object
# it is called on); and the options of `persia` that name an output.
_WRITING_CALLS = {
    "mkdir": -1,
    "write_text": -1,
    "write_bytes": -1,
    "touch": -1,
    "save": 0,
    "savefig": 0,
    "to_csv": 0,
    "to_parquet": 0,
    "makedirs": 0,
    "write_table": 1,
}
_OUTPUT_OPTIONS = frozenset({"--log-dir", "--checkpoint", "--png", "--output", "--out", "-o", "--runs"})


@dataclass(frozen=True)
class Cell:
    """One cell of a notebook: ``number`` counts from 0 as the notebook's JSON lists them."""

    number: int
    kind: str  # "markdown" or "code"
    text: str


def cells(notebook: Path) -> tuple[Cell, ...]:
    """The cells of ``notebook`` (an .ipynb file), their sources joined."""
    data = json.loads(notebook.read_text(encoding="utf-8"))
    found = []
    for number, cell in enumerate(data.get("cells", [])):
        source = cell.get("source", "")
        found.append(Cell(number, cell.get("cell_type", ""), source if isinstance(source, str) else "".join(source)))
    return tuple(found)


def _python(text: str) -> ast.Module | None:
    """A code cell's syntax tree: IPython's ``%magic`` and ``!shell`` lines are blanked first."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in text.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _writes(mode: ast.AST) -> bool:
    """Whether an ``open`` mode creates its file."""
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(ch in mode.value for ch in "wax")


class _Writes(ast.NodeVisitor):
    """The literal paths a notebook's code creates: ``Path("out").mkdir()``, ``open("x.csv", "w")``, a name bound
    to a literal path and then written (``out = Path("out")``, ``out / "plan.json"``), an option of ``persia`` that
    names an output (``"--log-dir", "runs/a"``)."""

    def __init__(self) -> None:
        self.literals: dict[str, str] = {}  # a variable -> the literal path it holds
        self.written: set[str] = set()

    def path_of(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return self.literals.get(node.id)
        if (
            isinstance(node, ast.Call)
            and node.args
            and getattr(node.func, "id", getattr(node.func, "attr", ""))
            in {
                "Path",
                "PurePath",
            }
        ):
            return self.path_of(node.args[0])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            left, right = self.path_of(node.left), self.path_of(node.right)
            return f"{left}/{right}" if left is not None and right is not None else None
        return None

    def visit_Assign(self, node: ast.Assign) -> None:
        path = self.path_of(node.value)
        for target in node.targets:
            if isinstance(target, ast.Name) and path is not None:
                self.literals[target.id] = path
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _WRITING_CALLS:
            where = _WRITING_CALLS[func.attr]
            if where < 0:
                self._add(self.path_of(func.value))
            elif where < len(node.args):
                self._add(self.path_of(node.args[where]))
        elif isinstance(func, ast.Name) and func.id == "open" and len(node.args) > 1 and _writes(node.args[1]):
            self._add(self.path_of(node.args[0]))  # open("x.csv", "w")
        elif isinstance(func, ast.Attribute) and func.attr == "open" and node.args and _writes(node.args[0]):
            self._add(self.path_of(func.value))  # Path("x.csv").open("w")
        self.generic_visit(node)

    def visit_List(self, node: ast.List) -> None:
        for option, value in zip(node.elts, node.elts[1:], strict=False):
            if isinstance(option, ast.Constant) and option.value in _OUTPUT_OPTIONS:
                self._add(self.path_of(value))
        self.generic_visit(node)

    def _add(self, path: str | None) -> None:
        if path:
            self.written.add(path.strip("/").removeprefix("./"))


def written_paths(notebook_cells: tuple[Cell, ...]) -> frozenset[str]:
    """The literal relative paths that the notebook's code creates when it runs (a folder covers what lies under
    it): the documents may name them before they exist."""
    writes = _Writes()
    for cell in notebook_cells:
        tree = _python(cell.text) if cell.kind == "code" else None
        if tree is not None:
            writes.visit(tree)
    return frozenset(writes.written)


def is_written(path: str, written: frozenset[str]) -> bool:
    """Whether ``path`` is one of ``written`` or lies under one of them."""
    path = path.strip("/").removeprefix("./")
    return any(path == w or path.startswith(f"{w}/") for w in written)
