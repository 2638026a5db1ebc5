"""Every module, function and file that the documents name exists: docs/, README.md and CONTRIBUTING.md.

Read statically (the sources' syntax trees, the file system): nothing is imported, so the check runs in a second
without torch. It finds three kinds of names:

* dotted names under ``persia_planner`` (``persia_planner.cost.analytic.CostModel.step_parts``): the longest prefix
  that is a module or package, then each further part defined at the top of that module (or in the class before it);
* short names in backticks: ``module.name`` (``config.elastic_resume``), ``name`` defined in a module of the project
  of that name, and ``Class.member`` (``CostModel.step_parts``), a member of a class of the project of that name;
* paths of the repository's files (``modules/ps/store.py``, ``benchmarks/hybrid.py:120``).

The tutorials' cells are read the same way (:func:`tutorial_problems`). ``main`` also runs the checks beside this
file: the docstrings' cross-references (docstring_refs.py), the documents' links and anchors (doc_links.py) and the
layout page against the tree (layout_page.py).

Usage: ``python scripts/check_docs.py [ROOT]``; exit 1 with one line per missing name.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the other checks sit beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import doc_links
import docstring_refs
import layout_page
from notebooks import cells, is_written, written_paths

REPOSITORY = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "CONTRIBUTING.md", "docs")
TUTORIALS = "tutorials"
_DOTTED = re.compile(r"(?<![\w./-])persia_planner(?:\.\w+)+")
_SHORT = re.compile(r"`([A-Za-z_]\w*)\.(\w+)((?:\.\w+)*)(?:\(\))?`")
_PATH = re.compile(
    r"(?<![\w./-])((?:persia_planner|modules|tests|benchmarks|scripts|docs|tutorials|constraints)/[\w./-]*\w)"
)
# `search/options.py`: a file named from inside persia_planner/ or modules/.
_INNER_PATH = re.compile(r"`(\w+/[\w/]*\w\.py)`")
# `01_plan_your_model.ipynb`: another tutorial, by its name.
_NOTEBOOK = re.compile(r"(?<![\w./-])(\w+\.ipynb)\b")
# `plan.json`, `topology.yaml`: files, not a module's names.
_TOP_FOLDERS = frozenset(
    {"persia_planner", "modules", "tests", "benchmarks", "scripts", "docs", "tutorials", "constraints"}
)
# Short names of other libraries and of values the documents name: `torch.optim`, `estimate.lower_bound` (plan.json).
_OTHERS = frozenset(
    {"torch", "torchrec", "pytest", "nn", "np", "os", "mp", "rpc", "fx", "llvm", "dist", "optimizer", "estimate"}
    | {"metrics", "libtorch_cuda"}
)
# What the benchmarks and the docs build write: not in a checkout.
_WRITTEN = ("benchmarks/results", "site/")
_EXTENSIONS = frozenset({"json", "yaml", "yml", "py", "md", "txt", "csv", "parquet", "gz", "log", "pt", "png", "toml"})


def source_of(root: Path, dotted: str) -> Path | None:
    """The file of module or package ``dotted`` (``persia_planner.modules`` is ``modules/``), or None."""
    parts = dotted.split(".")
    base = root / "modules" if parts[:2] == ["persia_planner", "modules"] else root / "persia_planner"
    rest = parts[2:] if parts[:2] == ["persia_planner", "modules"] else parts[1:]
    path = base.joinpath(*rest)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if rest and path.with_suffix(".py").is_file() else None


@cache
def names_in(source: Path) -> dict[str, ast.AST | None]:
    """Top-level names of a module: its functions and classes (as nodes), assignments and imports (None)."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    names: dict[str, ast.AST | None] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = None
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
    if source.name == "__init__.py":  # lazily exported names (a package's _HOMES)
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for key in node.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        names.setdefault(key.value, None)
    return names


def members_of(node: ast.ClassDef) -> set[str]:
    found = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            found.add(item.target.id)
        elif isinstance(item, ast.Assign):
            found.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for method in (item for item in node.body if isinstance(item, ast.FunctionDef)):
        found.update(_set_on_self(method))
    return found


def _set_on_self(method: ast.FunctionDef) -> set[str]:
    """The attributes a method assigns to ``self``."""
    return {
        target.attr
        for target in ast.walk(method)
        if isinstance(target, ast.Attribute)
        and isinstance(target.ctx, ast.Store)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }


def dotted_problem(root: Path, dotted: str) -> str | None:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        source = source_of(root, ".".join(parts[:cut]))
        if source is not None:
            break
    else:
        return f"{dotted}: no such module"
    rest = parts[cut:]
    if not rest:
        return None
    node = names_in(source).get(rest[0], "missing")
    if node == "missing":
        return f"{dotted}: {'.'.join(parts[:cut])} defines no {rest[0]!r}"
    if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in members_of(node):
        return f"{dotted}: class {rest[0]} has no {rest[1]!r}"
    return None


@cache
def modules_named(root: Path) -> dict[str, list[Path]]:
    """Every module of the project by its last name (``config`` -> ``modules/train/config.py``)."""
    found: dict[str, list[Path]] = {}
    for top in (root / "persia_planner", root / "modules", root / "benchmarks"):
        for path in top.rglob("*.py"):
            if "__pycache__" not in path.parts and not path.is_symlink():
                name = path.parent.name if path.name == "__init__.py" else path.stem
                found.setdefault(name, []).append(path)
    return found


@cache
def classes_named(root: Path) -> dict[str, list[ast.ClassDef]]:
    """Every class of the project by its name."""
    found: dict[str, list[ast.ClassDef]] = {}
    for sources in modules_named(root).values():
        for source in sources:
            for node in names_in(source).values():
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(node)
    return found


def short_problem(root: Path, module: str, name: str, member: str = "") -> str | None:
    if module == "persia_planner" or name in _EXTENSIONS:
        return None  # a dotted name (checked whole), or a file (`plan.json`)
    if module[0].isupper():  # `CostModel.step_parts`: a member of one of our classes (others' are not checked)
        classes = classes_named(root).get(module)
        if classes is None or any(name in members_of(c) for c in classes):
            return None
        return f"{module}.{name}: class {module} has no {name!r}"
    sources = modules_named(root).get(module)
    if sources is None:
        if module in _OTHERS:
            return None
        return f"{module}.{name}: no module named {module!r} (or add it to check_docs's other libraries)"
    for source in sources:
        if source.name == "__init__.py" and (source.parent / f"{name}.py").is_file():
            return None  # `search.state`: a module of the package
        names = names_in(source)
        # `hybrid.flush()`: a method of the module's class, called on an instance named after the module
        node = names.get(name, "missing")
        if node == "missing" and any(name in members_of(n) for n in names.values() if isinstance(n, ast.ClassDef)):
            return None
        if node != "missing":
            if member and isinstance(node, ast.ClassDef) and member not in members_of(node):
                return f"{module}.{name}.{member}: class {name} has no {member!r}"
            return None
    return f"{module}.{name}: no module named {module!r} defines {name!r}"


def path_problem(root: Path, path: str) -> str | None:
    path = path.rstrip(".")
    if any(ch in path for ch in "*{<") or path.startswith(_WRITTEN):  # a pattern, or what a run writes
        return None
    where = root / path
    # `docs/decisions/0014`: a decision record by its number
    if where.exists() or any(where.parent.glob(f"{where.name}-*.md")):
        return None
    return f"{path}: no such file or directory"


def inner_path_problem(root: Path, path: str) -> str | None:
    """A path from inside the packages (``search/options.py``): a file of persia_planner/ or modules/ (or one of the
    repository's own, checked by :func:`path_problem`)."""
    if path.split("/")[0] in _TOP_FOLDERS or any(
        (top / path).is_file() for top in (root / "persia_planner", root / "modules")
    ):
        return None
    return f"{path}: no such file in persia_planner/ or modules/"


def documents(root: Path) -> list[Path]:
    found = []
    for name in DOCUMENTS:
        path = root / name
        found.extend(sorted(path.rglob("*.md")) if path.is_dir() else [path])
    return found


def text_problems(
    root: Path, text: str, *, short_names: bool = True, written: frozenset[str] = frozenset()
) -> list[str]:
    """One line per name that ``text`` uses and that does not exist (``short_names``: the backticked ``module.name``
    too; ``written``: paths that a notebook creates when it runs, not checked)."""
    found = [dotted_problem(root, d) for d in sorted({m.group(0) for m in _DOTTED.finditer(text)})]
    if short_names:
        found += [
            short_problem(root, m.group(1), m.group(2), m.group(3)[1:].split(".")[0]) for m in _SHORT.finditer(text)
        ]
    found += [inner_path_problem(root, m.group(1)) for m in _INNER_PATH.finditer(text)]
    found += [path_problem(root, m.group(1)) for m in _PATH.finditer(text) if not is_written(m.group(1), written)]
    return [p for p in dict.fromkeys(found) if p is not None]


def problems(root: Path = REPOSITORY) -> list[str]:
    """One line per name that the documents under ``root`` use and that does not exist."""
    lines = []
    for document in documents(root):
        # The file formats' `dense.arch` is a key of model.yaml, not code.
        found = text_problems(root, document.read_text(encoding="utf-8"), short_names=document.name != "formats.md")
        lines += [f"{document.relative_to(root)}: {p}" for p in found]
    return lines


def tutorial_problems(root: Path = REPOSITORY) -> list[str]:
    """One line per name that a tutorial's cells use and that does not exist: the repository's paths in every cell
    (but those the notebook's code creates), the names and the other notebooks its markdown cells name."""
    lines = []
    for notebook in sorted((root / TUTORIALS).glob("*.ipynb")):
        notebook_cells = cells(notebook)
        written = written_paths(notebook_cells)
        for cell in notebook_cells:
            if cell.kind == "markdown":
                found = text_problems(root, cell.text, written=written)
                missing = [n for n in _NOTEBOOK.findall(cell.text) if not (notebook.parent / n).is_file()]
                found += [f"{n}: no such notebook in {TUTORIALS}/" for n in missing]
            else:  # code runs under nbmake: its imports are checked there
                paths = [m.group(1) for m in _PATH.finditer(cell.text)]
                found = [path_problem(root, path) for path in paths if not is_written(path, written)]
            where = f"{notebook.relative_to(root).as_posix()}:cell {cell.number}"
            lines += [f"{where}: {p}" for p in dict.fromkeys(found) if p is not None]
    return lines


def main() -> int:
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else REPOSITORY
    found = problems(root)
    found += docstring_refs.problems(root)  # the docstrings' cross-references (:func:`name`) resolve
    found += tutorial_problems(root)
    found += doc_links.problems(root)  # every link leads to a file and a heading of it
    found += layout_page.problems(root)  # docs/design/layout.md lists every source file
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
