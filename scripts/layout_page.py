"""docs/design/layout.md against the tree: every source file of persia_planner/ and modules/ is listed, and every
file listed exists.

The page is written by hand (its arrows say which module imports which, its asides what each holds), so it is
checked, not generated. Its first fenced block is read as it is written:

* a line at the margin that starts ``persia_planner/`` or ``modules/`` opens that folder; another line at the margin
  (``benchmarks/``, ``tests/``) closes it;
* inside a folder, a line indented two spaces starts an entry. ``pkg/  a (what a holds) <-- b, c | d`` lists the
  modules of the package pkg/ on that line and the lines indented under it: code spans and (asides) dropped, the
  rest split at ``<--``, ``,``, ``|`` and ``;``. ``a, b     what they hold`` lists modules of the folder itself: the
  names before the first gap of two spaces; the rest of the entry describes them.

A package is its folder's line, so its ``__init__.py`` and ``__main__.py`` are not listed.

Run by ``python scripts/check_docs.py``, which prints each problem and exits 1 if there is any.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
LAYOUT = "docs/design/layout.md"
FOLDERS = ("persia_planner", "modules")
_UNLISTED = frozenset({"__init__.py", "__main__.py"})
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_PACKAGE = re.compile(r"^  ([\w/]+/)(?:\s+|$)")
_ASIDE = re.compile(r"\([^()]*\)")
_SEPARATORS = re.compile(r"<--|[,|;]")


@dataclass(frozen=True)
class Entry:
    """The modules one entry of the page lists: ``package`` is the folder they sit in, relative to the repository
    (``modules/ps``); ``line`` counts from 1 in the page."""

    line: int
    package: str
    names: tuple[str, ...]


def _layout_block(text: str) -> list[tuple[int, str]]:
    """The page's first fenced block: (line number from 1, line)."""
    block: list[tuple[int, str]] = []
    fence = ""
    for number, line in enumerate(text.split("\n"), start=1):
        opened = _FENCE.match(line)
        if fence:
            if opened and opened.group(1)[0] == fence[0] and not line[opened.end() :].strip():
                return block
            block.append((number, line))
        elif opened:
            fence = opened.group(1)
    return block


def read_entries(text: str) -> tuple[list[Entry], list[str]]:
    """The entries of the page's layout block, and one line per part of a module list that is not a module name."""
    entries: list[Entry] = []
    unreadable: list[str] = []
    folder: str | None = None
    current: tuple[int, str, list[str]] | None = None  # (line, package, the list's lines)

    def close() -> None:
        if current is None:
            return
        line, package, parts = current
        names = []
        listed = " ".join(parts)
        while _ASIDE.search(listed):  # innermost asides first: they nest
            listed = _ASIDE.sub(" ", listed)
        for piece in _SEPARATORS.split(re.sub(r"`[^`]*`", " ", listed)):
            piece = piece.strip()
            if re.fullmatch(r"[A-Za-z_]\w*", piece):
                names.append(piece)
            elif piece:
                unreadable.append(f"{LAYOUT}:{line}: {package}/: {piece!r} is not a module name")
        entries.append(Entry(line, package, tuple(names)))

    for number, line in _layout_block(text):
        if line and not line[0].isspace():  # a folder at the margin
            close()
            current = None
            head = line.split()[0].rstrip("/")
            folder = head if head in FOLDERS else None
            continue
        if folder is None or not line.strip():
            continue
        package = _PACKAGE.match(line)
        if package:
            close()
            current = (number, f"{folder}/{package.group(1).rstrip('/')}", [line[package.end() :]])
        elif re.match(r"^  \S", line):  # the folder's own modules, then what they hold
            close()
            current = None
            names = re.split(r"\s{2,}", line.strip())[0]
            entries.append(Entry(number, folder, tuple(n.strip() for n in names.split(",") if n.strip())))
        elif current is not None:
            current[2].append(line)
    close()
    return entries, unreadable


def sources(root: Path) -> list[str]:
    """The source files the page must list, relative to ``root``."""
    found = []
    for folder in FOLDERS:
        for path in (root / folder).rglob("*.py"):
            relative = path.relative_to(root)
            if "__pycache__" not in relative.parts and path.name not in _UNLISTED and not path.is_symlink():
                found.append(relative.as_posix())
    return sorted(found)


def problems(root: Path = REPOSITORY) -> list[str]:
    """One line per source file the layout page misses, per file it lists that does not exist, and per part of a
    module list it cannot read."""
    page = root / LAYOUT
    if not page.is_file():
        return [f"{LAYOUT}: no such file"]
    entries, found = read_entries(page.read_text(encoding="utf-8"))
    listed = set()
    for entry in entries:
        if entry.package != entry.package.split("/")[0] and not (root / entry.package).is_dir():
            found.append(f"{LAYOUT}:{entry.line}: {entry.package}/ is listed but does not exist")
            continue
        for name in entry.names:
            path = f"{entry.package}/{name}.py"
            package = root / entry.package / name / "__init__.py"
            if (root / path).is_file() or package.is_file():
                listed.add(path)
            else:
                found.append(f"{LAYOUT}:{entry.line}: {path} is listed but does not exist")
    found += [f"{LAYOUT}: {path} is not listed" for path in sources(root) if path not in listed]
    return found
