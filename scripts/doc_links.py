"""Every link of the documents leads somewhere: the file exists and the ``#anchor`` is a heading of it.

The documents: README.md, CONTRIBUTING.md, docs/**/*.md (the decision records too), benchmarks/RESULTS.md and the
markdown cells of tutorials/*.ipynb. Their links: ``[text](target)``, ``[text][ref]`` with its ``[ref]: target``,
``<path>`` and HTML ``href``/``src``; those in code spans and fenced code are examples, not links. A relative target
must exist (a folder will do); a ``#anchor``, alone or after a target, must be a heading of the target markdown file
(or an ``id`` given in HTML, or an object that a ``::: name`` directive of mkdocstrings renders), a line ``#L12`` of
any other file. ``http(s):`` and ``mailto:`` links are not fetched.

Headings become anchors by two rules. The site's (mkdocs, Python-Markdown's toc extension) holds between two pages
of docs/: the site builds those links. GitHub's holds for every other link, followed where GitHub renders the file
(README.md, CONTRIBUTING.md, benchmarks/, tutorials/, and a page of docs/ linking out of docs/ or reached from
outside it). mkdocs.yml leaves a missing page to this check (``validation: links: not_found: info``): pages link to
the repository's files outside docs/, which the site leaves as they are.

Run by ``python scripts/check_docs.py``, which prints each problem and exits 1 if there is any.
"""

from __future__ import annotations

import enum
import html
import os
import re
import sys
import unicodedata
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import unquote

if str(Path(__file__).resolve().parent) not in sys.path:  # notebooks sits beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from notebooks import cells

REPOSITORY = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "CONTRIBUTING.md", "docs", "benchmarks/RESULTS.md")
TUTORIALS = "tutorials"
SITE = "docs"  # mkdocs.yml's docs_dir

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
# A link's text: brackets nest one level deep (`[see [1]](x.md)`); a backslash escapes one character.
_TEXT = r"(?:[^\[\]\\]|\\.|\[(?:[^\[\]\\]|\\.)*\])*"
_INLINE = re.compile(
    rf"!?\[({_TEXT})\]\(\s*(<[^<>\n]*>|(?:[^\s()\\]|\\.|\((?:[^\s()\\]|\\.)*\))*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
_REFERENCE = re.compile(rf"(?<![\w\]\\])!?\[({_TEXT})\]\[([^\[\]]*)\]")
# A reference definition (`[ref]: target`); a footnote's (`[^1]: text`) is none.
_DEFINITION = re.compile(r"^ {0,3}\[(?!\^)((?:[^\[\]\\]|\\.)+)\]:[ \t]*(<[^<>\n]*>|\S+)", re.MULTILINE)
_AUTOLINK = re.compile(r"<([^<>\s]+)>")
_HTML_TARGET = re.compile(r"<(?:a|img)\s[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']*)[\"']", re.IGNORECASE)
_HTML_ID = re.compile(r"<\w+\s[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_EXPLICIT_ID = re.compile(r"\s*\{[^}]*#([\w-]+)[^}]*\}\s*$")
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)", re.MULTILINE)
_LINE_ANCHOR = re.compile(r"^L(\d+)(?:C\d+)?(?:-L(\d+)(?:C\d+)?)?$")


class SlugRule(enum.Enum):
    """Who turns a heading into its anchor."""

    SITE = "the site's"  # mkdocs: Python-Markdown's toc extension
    GITHUB = "GitHub's"


@dataclass(frozen=True)
class Link:
    """A link as a document writes it: ``shown`` is its source (``[text](target)``), ``line`` counts from 1."""

    line: int
    shown: str
    target: str


@dataclass(frozen=True)
class Anchors:
    """The anchors of one markdown file: its headings' and HTML's ids, and the objects of mkdocstrings' directives
    (the object and every member under it)."""

    ids: frozenset[str]
    objects: tuple[str, ...] = ()

    def __contains__(self, anchor: object) -> bool:
        return anchor in self.ids or any(anchor == name or str(anchor).startswith(f"{name}.") for name in self.objects)


def fenced_lines(text: str) -> tuple[frozenset[int], int | None]:
    """The lines (from 0) of ``text`` inside fenced code, fences included, and the line (from 1) of a fence never
    closed (None: every fence is)."""
    inside: set[int] = set()
    fence, opened_at = "", 0
    for number, line in enumerate(text.split("\n")):
        opened = _FENCE.match(line)
        if fence:
            inside.add(number)
            # Only a bare fence closes (```` ``` The```` does not: the block goes on, as on the site and GitHub).
            closing = opened is not None and not line[opened.end() :].strip()
            if closing and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):  # type: ignore[union-attr]
                fence = ""
        elif opened:
            inside.add(number)
            fence, opened_at = opened.group(1), number + 1
    return frozenset(inside), opened_at if fence else None


def blank_code(text: str) -> str:
    """``text`` with its fenced code, code spans and HTML comments blanked (newlines kept, so offsets and line
    numbers hold)."""
    inside, _ = fenced_lines(text)
    text = "\n".join(" " * len(line) if n in inside else line for n, line in enumerate(text.split("\n")))

    def blank(match: re.Match[str]) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    def blank_span(match: re.Match[str]) -> str:
        # A code span does not cross a blank line: such a backtick is a literal one.
        return match.group(0) if "\n\n" in match.group(0) else blank(match)

    # Code spans first (a `<!--` inside one opens no comment), then comments, which may span paragraphs.
    return _COMMENT.sub(blank, _CODE_SPAN.sub(blank_span, text))


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _shown(source: str) -> str:
    source = " ".join(source.split())
    return source if len(source) <= 100 else f"{source[:97]}..."


def links(text: str) -> list[Link]:
    """The links of a markdown text, in order; a ``[text][ref]`` without its definition has target ``""``."""
    plain = blank_code(text)
    found: list[tuple[int, Link]] = []
    definitions = {}

    def add(match: re.Match[str], target: str) -> None:
        shown = _shown(text[match.start() : match.end()])
        found.append((match.start(), Link(_line(plain, match.start()), shown, target.strip("<>"))))

    for match in _DEFINITION.finditer(plain):
        definitions[_label(match.group(1))] = match.group(2).strip("<>")
        add(match, match.group(2))
    for match in _INLINE.finditer(plain):
        add(match, match.group(2))
    for match in _REFERENCE.finditer(plain):
        add(match, definitions.get(_label(match.group(2) or match.group(1)), ""))
    for match in _AUTOLINK.finditer(plain):
        target = match.group(1)
        if not _SCHEME.match(target) and "@" not in target and _looks_like_path(target):
            add(match, target)
    for match in _HTML_TARGET.finditer(plain):
        add(match, match.group(1))
    return [link for _, link in sorted(found, key=lambda pair: pair[0])]


def _label(label: str) -> str:
    """A reference's label as markdown matches it: case and runs of white space do not count."""
    return " ".join(label.split()).casefold()


def _looks_like_path(target: str) -> bool:
    """``<docs/formats.md>``, ``<../README.md#install>``: not an HTML tag (``<br/>``, ``</details>``, ``<T>``)."""
    if target.startswith(("/", "!", "?")) or "=" in target or re.fullmatch(r"\w+/", target):
        return False
    return "/" in target or "#" in target or re.search(r"\.\w+$", target) is not None


# ---- anchors ---------------------------------------------------------------------------------------------------


def plain_heading(source: str) -> str:
    """A heading's text as rendered and stripped of its tags: code spans keep their text, links their label."""
    parts = re.split(r"((?<!`)`+(?!`).*?(?<!`)`+(?!`))", source)
    text = []
    for number, part in enumerate(parts):
        if number % 2:  # a code span: its content, one padding space each side dropped
            content = part.strip("`")
            text.append(
                content[1:-1] if content.startswith(" ") and content.endswith(" ") and content.strip() else content
            )
            continue
        part = re.sub(r"!?\[([^\]]*)\](?:\([^)]*\)|\[[^\]]*\])", r"\1", part)
        part = re.sub(r"<[^>]+>", "", part)
        part = re.sub(r"\\(.)", r"\1", part)
        part = part.replace("*", "")
        part = re.sub(r"(?<![\w])_+(?=\S)|(?<=\S)_+(?![\w])", "", part)
        text.append(html.unescape(part))
    return "".join(text).strip()


def site_slug(text: str) -> str:
    """Python-Markdown's ``toc.slugify`` with mkdocs' separator ``-``: ASCII letters, digits, ``_`` and ``-`` kept,
    lowercased, each run of spaces and hyphens one ``-``."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def github_slug(text: str) -> str:
    """GitHub's (github-slugger): lowercased, punctuation but ``-`` and ``_`` dropped, each space one ``-``."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _site_unique(slug: str, taken: set[str]) -> str:
    """Python-Markdown's ``toc.unique``: a taken (or empty) id gets ``_1``, ``_2``, ..."""
    if slug in taken or not slug:
        match = re.match(r"^(.*)_([0-9]+)$", slug)
        base, count = (match.group(1), int(match.group(2))) if match else (slug, 0)
        count += 1
        while f"{base}_{count}" in taken:
            count += 1
        slug = f"{base}_{count}"
    taken.add(slug)
    return slug


def _github_unique(slug: str, occurrences: dict[str, int]) -> str:
    """github-slugger's rule: the second ``x`` is ``x-1``, the third ``x-2``, skipping ids already taken."""
    result = slug
    while result in occurrences:
        occurrences[slug] += 1
        result = f"{slug}-{occurrences[slug]}"
    occurrences[result] = 0
    return result


def headings(text: str) -> list[str]:
    """The headings of a markdown text (ATX ``## x`` and setext underlines), as written, outside code."""
    plain = blank_code(text).split("\n")
    source = text.split("\n")
    found = []
    paragraph: list[str] = []
    for number, line in enumerate(plain):
        atx = _ATX.match(line)
        setext = _SETEXT.match(line)
        if atx:
            found.append(_ATX.match(source[number]).group(2) or "")  # type: ignore[union-attr]
            paragraph = []
        elif setext and paragraph:
            found.append(" ".join(paragraph))
            paragraph = []
        elif not line.strip() or re.match(r"^\s*([-*+>|]|\d+[.)])\s", line) or line.strip().startswith("|"):
            paragraph = []
        else:
            paragraph.append(source[number].strip())
    return found


def _attr_list(root: Path) -> bool:
    """Whether mkdocs.yml enables attr_list: then ``## Heading {#id}`` gives the heading its id on the site."""
    config = root / "mkdocs.yml"
    if not config.is_file():
        return False
    return any("attr_list" in line.split("#")[0] for line in config.read_text(encoding="utf-8").splitlines())


@cache
def anchors(text: str, rule: SlugRule, attr_list: bool = False) -> Anchors:
    """The anchors of a markdown file's ``text`` under ``rule`` (``attr_list``: the site reads ``{#id}``)."""
    ids = {match.group(1) for match in _HTML_ID.finditer(blank_code(text))}
    taken: set[str] = set()
    occurrences: dict[str, int] = {}
    for heading in headings(text):
        explicit = _EXPLICIT_ID.search(heading) if rule is SlugRule.SITE and attr_list else None
        if explicit:
            ids.add(explicit.group(1))
            taken.add(explicit.group(1))
        elif rule is SlugRule.SITE:
            ids.add(_site_unique(site_slug(plain_heading(heading)), taken))
        else:
            ids.add(_github_unique(github_slug(plain_heading(heading)), occurrences))
    objects = tuple(_DIRECTIVE.findall(blank_code(text))) if rule is SlugRule.SITE else ()
    return Anchors(frozenset(ids), objects)


# ---- the check -------------------------------------------------------------------------------------------------


def target_problem(root: Path, document: Path, target: str) -> str | None:
    """Why ``target``, linked from ``document``, leads nowhere (None: it leads somewhere, or is not checked)."""
    target = target.strip()
    if _SCHEME.match(target) or target.startswith("//"):
        return None  # http(s), mailto: not fetched
    if any(ch in target for ch in "{}"):
        return None  # a template
    address, _, anchor = target.partition("#")
    address = unquote(address.split("?")[0])
    where = document
    if address:
        where = Path(
            os.path.normpath(root / address.lstrip("/") if address.startswith("/") else document.parent / address)
        )
        if not where.is_relative_to(root):
            return f"{address} leads out of the repository"
        if not where.exists():
            return f"no file {where.relative_to(root).as_posix()}"
    if not anchor or where.is_dir() or where.suffix == ".ipynb":
        return None
    anchor = unquote(anchor)
    named = where.relative_to(root).as_posix()
    if where.suffix.lower() in {".md", ".markdown"}:
        site = root / SITE
        rule = SlugRule.SITE if document.is_relative_to(site) and where.is_relative_to(site) else SlugRule.GITHUB
        if anchor in anchors(where.read_text(encoding="utf-8"), rule, _attr_list(root)):
            return None
        return f"no heading {anchor!r} in {named} (anchors by {rule.value} rule)"
    lines = _LINE_ANCHOR.match(anchor)
    if lines is None:
        return f"{named} is not markdown: its anchor must be a line (#L12 or #L12-L20), not {anchor!r}"
    count = len(where.read_text(encoding="utf-8", errors="replace").splitlines())
    last = max(int(n) for n in lines.groups() if n)
    return None if last <= count else f"{named} has {count} lines, not {last}"


def text_problems(root: Path, document: Path, text: str, where: str) -> list[str]:
    """One line per broken link of ``text`` (``document``'s, or a cell of it), each line starting ``where:LINE``."""
    found = []
    _, unclosed = fenced_lines(text)
    if unclosed is not None:  # the rest of the document is code: its headings and links are gone
        found.append(f"{where}:{unclosed}: this code fence is never closed (a closing fence stands alone on its line)")
    for link in links(text):
        problem = (
            target_problem(root, document, link.target)
            if link.target
            else "no definition of this reference ([ref]: target)"
        )
        if problem is not None:
            found.append(f"{where}:{link.line}: {link.shown}: {problem}")
    return found


def documents(root: Path) -> list[Path]:
    """The markdown documents whose links are checked (the tutorials' cells apart)."""
    found = []
    for name in DOCUMENTS:
        path = root / name
        found.extend(sorted(path.rglob("*.md")) if path.is_dir() else [path] if path.is_file() else [])
    return found


def problems(root: Path = REPOSITORY) -> list[str]:
    """One line per broken link of the documents under ``root``."""
    root = root.resolve()
    found = []
    for document in documents(root):
        found += text_problems(
            root, document, document.read_text(encoding="utf-8"), document.relative_to(root).as_posix()
        )
    for notebook in sorted((root / TUTORIALS).glob("*.ipynb")):
        for cell in cells(notebook):
            if cell.kind == "markdown":
                where = f"{notebook.relative_to(root).as_posix()}:cell {cell.number}"
                found += text_problems(root, notebook, cell.text, where)
    return found
