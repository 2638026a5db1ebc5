"""The fuzzing of ``benchmarks/fuzz.py``: what a mutation puts in place of a value (junk of every JSON type, huge and
non-finite numbers, strings a terminal would act on or rich would read as markup), the mutations of a document, how
one run is judged (:func:`check`), and the loop that runs a target on generated inputs (:func:`fuzz_target`)."""

from __future__ import annotations

import copy
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from persia_planner.cli import app

LIMIT_S = 10.0
runner = CliRunner()

# ---- what a mutation puts in place of a value ------------------------------------------------------------------------
HOSTILE_TEXT = ["[/]", "[bold]x", "a\x1b[2Jb", "\x07", "x\u202ey", "", " ", "..", "/", "a" * 300, "1e309", "NaN"]
NUMBERS = [0, -1, 1, 2**63, 2**64 + 1, 10**30, -(10**30), 1e300, -1e300, 1e-320, 0.5, math.inf, -math.inf, math.nan]
junk: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(NUMBERS),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(HOSTILE_TEXT),
        st.text(max_size=12),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


@dataclass(frozen=True)
class Mutation:
    """One change at a path of a document: ``replace`` its value, ``drop`` its key, ``add`` an unknown key, or
    ``nest`` the value one level deeper."""

    kind: str
    path: tuple[int, ...]  # indices into the document's paths, taken modulo their counts at each level
    value: Any = None


mutations = st.lists(
    st.builds(
        Mutation,
        st.sampled_from(["replace", "replace", "replace", "drop", "add", "nest"]),
        st.lists(st.integers(0, 1000), min_size=1, max_size=5).map(tuple),
        junk,
    ),
    min_size=1,
    max_size=3,
)


def mutate(document: Any, changes: list[Mutation]) -> Any:
    """``document`` (JSON-like) with ``changes`` applied, each at the path its indices pick."""
    doc = copy.deepcopy(document)
    for change in changes:
        parent, key, node = None, None, doc
        for index in change.path:
            keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
            if not keys:
                break
            key = keys[index % len(keys)]
            parent, node = node, node[key]
        if parent is None:
            continue
        if change.kind == "replace":
            parent[key] = change.value
        elif change.kind == "drop" and isinstance(parent, dict):
            del parent[key]
        elif change.kind == "add" and isinstance(parent, dict):
            parent[f"x_{len(parent)}"] = change.value
        elif change.kind == "nest":
            parent[key] = [parent[key]] if isinstance(parent[key], dict) else {"nested": parent[key]}
    return doc


# ---- running one input -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """How a run ended: its exit code, its stderr, its seconds, and what it printed."""

    code: int
    stderr: str
    seconds: float
    stdout: str = ""


def run_cli(args: list[Any]) -> Outcome:
    started = time.perf_counter()
    result = runner.invoke(app, [str(a) for a in args], prog_name="persia")
    stderr = result.stderr if result.exception is None or isinstance(result.exception, SystemExit) else ""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr = f"Traceback: {type(result.exception).__name__}: {result.exception}"
        return Outcome(3, stderr, time.perf_counter() - started)
    return Outcome(result.exit_code, stderr, time.perf_counter() - started, result.stdout)


def check(outcome: Outcome, allowed: tuple[int, ...] = (0, 2)) -> str:
    """What is wrong with ``outcome`` ("" when nothing): the exit code, the error line, the time."""
    if outcome.seconds > LIMIT_S:
        return f"took {outcome.seconds:.1f} s"
    if outcome.code not in allowed:
        return f"exit {outcome.code}: {outcome.stderr[-300:]}"
    if _acts_on_terminal(outcome.stdout.replace("\n", "")):
        return f"printed a control character: {outcome.stdout[-300:]!r}"
    if outcome.code == 0:
        return ""
    lines = outcome.stderr.splitlines()
    if len(lines) != 1 or not lines[0].startswith("error: "):
        return f"not one error line: {outcome.stderr[-300:]!r}"
    if "Traceback" in outcome.stderr or "internal error" in outcome.stderr:
        return f"internal: {lines[0][:300]}"
    if _acts_on_terminal(lines[0]):
        return f"control character in the line: {lines[0][:300]!r}"
    return ""


def _acts_on_terminal(text: str) -> bool:
    """Whether ``text`` holds a C0 or C1 control character (ESC starts a terminal's escape sequences)."""
    return any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in text)


def write_document(directory: Path, name: str, document: Any) -> Path:
    path = directory / name
    if name.endswith(".json"):
        path.write_text(json.dumps(document))
    else:
        path.write_text(yaml.safe_dump(document, allow_unicode=True, sort_keys=False))
    return path


def files_in(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def as_arg(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, list | dict) else str(value)


def fuzz_target(name: str, target: Callable[[Any], str], strategy: st.SearchStrategy[Any], examples: int,
                seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Run ``target`` on ``examples`` inputs that ``strategy`` generates; the counts of outcomes and the first
    failures, under ``name``."""
    counts: Counter[str] = Counter()
    failures: list[str] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(value: Any) -> None:
        problem = target(value)
        counts["failed" if problem else "clean"] += 1
        if problem and len(failures) < 5:
            failures.append(problem)

    from hypothesis import seed as seeded

    seeded(seed)(one)()
    return {"target": name, "examples": sum(counts.values()), **counts, "failures": failures}
