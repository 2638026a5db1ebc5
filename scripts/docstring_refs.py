"""Docstring cross-references: every Sphinx role in a docstring (``:func:`run_trainer```, ``:class:`~.hybrid.X```)
names an object of the project, or of another library.

Read statically, like scripts/check_docs.py: the sources' syntax trees, nothing imported. A reference resolves as
Sphinx's Python domain resolves it, with the project's modules, classes, functions, module and class attributes
(dataclass fields and attributes set on ``self`` included) and the names modules import (a package's re-exports and
its lazily exported names) as the objects:

* a full dotted name: ``persia_planner.modules.ps.store.EmbeddingStore`` (``persia_planner.modules`` is
  ``modules/``); a name a module imports stands for what it imports (``persia_planner.modules.train.TrainConfig``);
* a leading ``.``: the current class, the current module, then any object whose full name ends with the rest
  (Sphinx's suffix search: ``.hybrid.HybridEmbeddingBagCollection``; a name that several objects end with resolves);
* any other name: the current class (and the classes around it), the current module, then a full name;
* ``~`` (show the last part only), ``!`` (no link), ``title <target>`` and a trailing ``()`` change what is shown;
* a name whose first part is another library (torch, numpy, the standard library, ...) or a builtin is accepted
  unchecked: those are documented elsewhere.

The benchmarks (``benchmarks/``, modules by their file names, as they import each other) are checked too; the
packages' docstrings may not name them.

Run by ``python scripts/check_docs.py``, which prints each problem and exits 1 if there is any.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGE = "persia_planner"
ROLE = re.compile(r":(?:py:)?(?P<role>func|class|mod|data|meth|attr|exc|obj|const):`(?P<text>[^`]+)`")
# Libraries the docstrings name by their first part: accepted unchecked (their own documentation has them).
OTHER_LIBRARIES = frozenset(
    {"torch", "torchrec", "fbgemm_gpu", "numpy", "networkx", "typer", "click", "pyarrow", "yaml", "pandas"}
    | {"scipy", "highspy", "sklearn", "pytest", "hypothesis", "rich", "tqdm", "nbformat", "psutil", "mkdocs"}
    | set(sys.stdlib_module_names)
)
_BUILTINS = frozenset(dir(builtins))
_EXPLICIT_TITLE = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)


@dataclass(frozen=True)
class Scope:
    """Where a docstring is: its module's full name and the classes around it, innermost last (``("Outer",
    "Inner")``)."""

    module: str
    classes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reference:
    """One role in a docstring: ``:role:`text``` at ``path:line`` (``path`` relative to the repository)."""

    path: Path
    line: int
    role: str
    text: str
    scope: Scope

    @property
    def target(self) -> str:
        """The name the role points to: ``text`` without its title, ``~``, ``!`` or trailing ``()``."""
        explicit = _EXPLICIT_TITLE.match(self.text)
        name = explicit["target"] if explicit else self.text
        name = name.strip().lstrip("~!")
        return name.removesuffix("()")

    @property
    def linked(self) -> bool:
        """False for ``!name``: Sphinx's way of saying "no link, and nothing to check"."""
        return not self.text.lstrip("~").startswith("!")

    @property
    def shown(self) -> str:
        """The text the reader sees: the title, the last part (``~``), or the name as written."""
        explicit = _EXPLICIT_TITLE.match(self.text)
        if explicit:
            return explicit["title"]
        name = self.text.strip().lstrip("!")
        if name.startswith("~"):
            return name.lstrip("~").split(".")[-1]
        return name.lstrip(".")  # a leading dot says where to search, not what to show

    def __str__(self) -> str:
        return f":{self.role}:`{self.text}`"


def is_other_library(name: str) -> bool:
    """``torch.nn.Module``, ``os.fork``, ``ValueError``: a name another library (or Python) documents."""
    return name.split(".")[0] in OTHER_LIBRARIES or name in _BUILTINS


@dataclass(frozen=True)
class Index:
    """The project's objects by full name: None for a definition, the imported full name for an import; and each
    class's bases as its module wrote them (``persia_planner.cost.Base``)."""

    objects: dict[str, str | None]
    class_bases: dict[str, tuple[str, ...]]
    modules: set[str] = field(default_factory=set)

    @cached_property
    def by_last_part(self) -> dict[str, tuple[str, ...]]:
        found: dict[str, list[str]] = {}
        for name in self.objects:
            found.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        return {last: tuple(names) for last, names in found.items()}

    def canonical(self, name: str) -> str | None:
        """The full name of the definition that ``name`` stands for once imports (and base classes) are followed,
        ``name`` itself for another library's, or None when it names nothing."""
        for _ in range(32):  # an import cycle ends here
            if self.objects.get(name, "") is None:
                return name
            parts = name.split(".")
            cut = next((c for c in range(len(parts), 0, -1) if ".".join(parts[:c]) in self.objects), 0)
            if cut == 0:
                return name if is_other_library(name) else None
            prefix, rest = ".".join(parts[:cut]), parts[cut:]
            target = self.objects[prefix]
            if target is None:  # a definition without this member: one of its bases may have it
                target = self._inherited(prefix, rest[0])
                if target is None:
                    return None
                rest = rest[1:]
            name = ".".join([target, *rest])
        return None

    def _inherited(self, owner: str, member: str) -> str | None:
        """``member`` of the nearest base class of ``owner`` (the project's) that has it."""
        seen: set[str] = set()
        pending = [owner]
        while pending:
            current = pending.pop(0)
            if current in seen:
                continue
            seen.add(current)
            if f"{current}.{member}" in self.objects:
                return f"{current}.{member}"
            for base in self.class_bases.get(current, ()):
                resolved = self.canonical(base)
                if resolved is not None and resolved in self.objects:
                    pending.append(resolved)
        return None

    def resolve(self, target: str, scope: Scope) -> str | None:
        """The full name that ``target``, written in a docstring at ``scope``, links to; None when it names
        nothing. The packages' docstrings may not name a benchmark's objects."""
        for candidate in self._candidates(target, scope):
            resolved = self.canonical(candidate)
            if resolved is not None and self._visible(resolved, scope) and not self._shadowed(resolved):
                return resolved
        if target.startswith("."):
            ends = self.by_last_part.get(target.rsplit(".", 1)[-1], ())
            found = [self.canonical(n) for n in ends if n.endswith(target)]
            found = [f for f in found if f is not None and self._visible(f, scope)]
            if found:  # several: the same object under several names, or a name Sphinx warns about; still a hit
                return min(found, key=lambda n: (len(n.split(".")), n))
        return None

    @staticmethod
    def _candidates(target: str, scope: Scope) -> Iterator[str]:
        name = target.lstrip(".")
        for depth in range(len(scope.classes), 0, -1):
            yield ".".join([scope.module, *scope.classes[:depth], name])
        yield f"{scope.module}.{name}"
        if not target.startswith("."):  # `.statistics` is ours, never the standard library's
            yield name

    @cached_property
    def _module_names(self) -> frozenset[str]:
        return frozenset(m.rsplit(".", 1)[-1] for m in self.modules)

    def _shadowed(self, resolved: str) -> bool:
        """Whether ``resolved``, another library's name (``profile.run``), starts with the name of one of the
        project's modules (``modules/data/profile.py``): written in the project, it means ours, which lacks it."""
        return self.objects.get(resolved, "") == "" and resolved.split(".")[0] in self._module_names

    @staticmethod
    def _visible(name: str, scope: Scope) -> bool:
        home = name.split(".")[0]
        return home == PACKAGE or is_other_library(name) or not scope.module.startswith(PACKAGE)


def module_name(root: Path, path: Path) -> str | None:
    """``persia_planner/cost/analytic.py`` -> ``persia_planner.cost.analytic``, ``modules/ps/__init__.py`` ->
    ``persia_planner.modules.ps``, ``benchmarks/fuzz.py`` -> ``fuzz``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] == "modules":
        return ".".join([PACKAGE, *parts])
    if parts[0] == "benchmarks":
        return ".".join(parts[1:]) or None
    return ".".join(parts)


def sources(root: Path) -> list[Path]:
    """The Python files of persia_planner/, modules/ (not through the persia_planner/modules link) and
    benchmarks/."""
    found = []
    for top in (PACKAGE, "modules", "benchmarks"):
        for folder, dirs, files in os.walk(root / top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (Path(folder) / d).is_symlink())
            found += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
    return found


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a body, those of its ``if``/``try``/``with`` blocks included (not of nested functions or
    classes)."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                yield from _statements(block)
            for handler in getattr(node, "handlers", []):
                yield from _statements(handler.body)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[tuple[str, str]]:
    """(local name, full name imported) for each name an import statement binds."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                yield alias.asname, alias.name
            else:
                yield alias.name.split(".")[0], alias.name.split(".")[0]
        return
    base = node.module or ""
    if node.level:
        package = module.split(".")
        package = package if is_package else package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([node.module] if node.module else [])])
    for alias in node.names:
        if alias.name != "*":
            yield alias.asname or alias.name, f"{base}.{alias.name}"


def _assigned(node: ast.stmt) -> Iterator[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]  # type: ignore[attr-defined]
    for target in targets:
        for name in ast.walk(target):
            if isinstance(name, ast.Name):
                yield name.id


def _set_on_self(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {
        node.attr
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def _lazy_exports(tree: ast.Module) -> Iterator[tuple[str, str]]:
    """A package's lazily exported names: ``{"TrainConfig": "persia_planner.modules.train.config"}`` dicts."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.isidentifier():
                    home = value.value if isinstance(value, ast.Constant) else None
                    if isinstance(home, str) and home.startswith(PACKAGE + "."):
                        yield key.value, f"{home}.{key.value}"


def _add_body(index: Index, owner: str, body: list[ast.stmt], module: str, is_package: bool, in_class: bool) -> None:
    objects = index.objects
    for node in _statements(body):
        if isinstance(node, ast.ClassDef):
            full = f"{owner}.{node.name}"
            objects[full] = None
            index.class_bases[full] = tuple(
                f"{module}.{ast.unparse(b)}" for b in node.bases if isinstance(b, ast.Name | ast.Attribute)
            )
            _add_body(index, full, node.body, module, is_package, in_class=True)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            objects[f"{owner}.{node.name}"] = None
            if in_class:
                for name in _set_on_self(node):
                    objects.setdefault(f"{owner}.{name}", None)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for name in _assigned(node):
                objects.setdefault(f"{owner}.{name}", None)
        elif isinstance(node, ast.Import | ast.ImportFrom) and not in_class:
            for local, imported in _imported(node, module, is_package):
                objects.setdefault(f"{owner}.{local}", imported)


@cache
def index(root: Path = REPOSITORY) -> Index:
    """Every object of the project under ``root``, by full name."""
    found = Index({}, {})
    for path in sources(root):
        module = module_name(root, path)
        if module is None:
            continue
        parts = module.split(".")
        for cut in range(1, len(parts)):  # the packages above it
            found.objects.setdefault(".".join(parts[:cut]), None)
        found.objects[module] = None
        found.modules.add(module)
        tree = _parse(path)
        is_package = path.name == "__init__.py"
        _add_body(found, module, tree.body, module, is_package, in_class=False)
        if is_package:
            for name, home in _lazy_exports(tree):
                found.objects.setdefault(f"{module}.{name}", home)
    # A class's bases were written as the module sees them: `Base` is `module.Base` (found above, or imported)
    return found


def _docstrings(body: list[ast.stmt], scope: Scope) -> Iterator[tuple[ast.Constant, Scope]]:
    """Every string statement (module, class, function and attribute docstrings) with where it is."""
    for node in _statements(body):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.value, scope
        elif isinstance(node, ast.ClassDef):
            yield from _docstrings(node.body, Scope(scope.module, (*scope.classes, node.name)))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _docstrings(node.body, scope)


def references(root: Path = REPOSITORY) -> list[Reference]:
    """Every role in every docstring of the project's sources under ``root``."""
    found = []
    for path in sources(root):
        module = module_name(root, path)
        if module is None:
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        for string, scope in _docstrings(ast.parse(text, filename=str(path)).body, Scope(module)):
            # The source lines, not the string's value: a role's line is then exact.
            source = "".join(lines[string.lineno - 1 : string.end_lineno])
            for match in ROLE.finditer(source):
                line = string.lineno + source.count("\n", 0, match.start())
                where = path.relative_to(root)
                found.append(Reference(where, line, match["role"], match["text"], scope))
    return found


def problems(root: Path = REPOSITORY) -> list[str]:
    """One line per docstring reference under ``root`` that names nothing."""
    objects = index(root)
    return [
        f"{ref.path}:{ref.line}: {ref}: no such name (looked in module {ref.scope.module})"
        for ref in references(root)
        if ref.linked and objects.resolve(ref.target, ref.scope) is None
    ]
