"""The docstrings' Sphinx roles as links on the API site: a griffe extension that mkdocs.yml loads.

Each ``:class:`~.hybrid.HybridEmbeddingBagCollection``` of a docstring becomes an *optional* autorefs reference to
the full name scripts/docstring_refs.py resolves it to (the rules scripts/check_docs.py checks the sources with):
mkdocs-autorefs links it when an API page renders that object and leaves it as code, without a warning, when none
does (another library's, or one no page shows). A reference that resolves to nothing, or is written ``!name``,
stays code (the check reports the first).
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from typing import Any

import griffe

if str(Path(__file__).resolve().parent) not in sys.path:  # docstring_refs sits beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from docstring_refs import REPOSITORY, ROLE, Index, Reference, Scope, index


def scope_of(obj: griffe.Object) -> Scope:
    """Where ``obj``'s docstring is, as docstring_refs reads it: its module and the classes around it (a class's own
    docstring is inside the class)."""
    classes = []
    current: griffe.Object | None = obj
    while current is not None and not current.is_module:
        if current.is_class:
            classes.append(current.name)
        current = current.parent  # type: ignore[assignment]
    module = obj.path if obj.is_module else obj.module.path
    return Scope(module, tuple(reversed(classes)))


def linked(text: str, scope: Scope, objects: Index) -> str:
    """``text`` (Markdown) with each role replaced by an optional autorefs reference (or code, when none fits)."""

    def replace(match: re.Match[str]) -> str:
        ref = Reference(Path(), 0, match["role"], match["text"], scope)
        shown = f"<code>{html.escape(ref.shown)}</code>"
        target = objects.resolve(ref.target, scope) if ref.linked else None
        if target is None:
            return shown
        return f'<autoref identifier="{html.escape(target)}" optional>{shown}</autoref>'

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    """Rewrites every loaded object's docstring before it is parsed and rendered."""

    def __init__(self, root: str | Path = REPOSITORY) -> None:
        """``root``: the repository whose sources are loaded (mkdocs.yml's, by default)."""
        super().__init__()
        self.objects = index(Path(root).resolve())

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._rewrite(pkg)  # on_object skips the package a load starts from

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        self._rewrite(obj)

    def _rewrite(self, obj: griffe.Object) -> None:
        docstring = obj.docstring
        if docstring is None or "`" not in docstring.value:
            return
        docstring.value = linked(docstring.value, scope_of(obj), self.objects)
        docstring.__dict__.pop("parsed", None)  # parsed before this hook (a cached property): parse the new text
