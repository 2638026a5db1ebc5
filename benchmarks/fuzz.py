"""Fuzz targets, one per input format: model.yaml, topology.yaml, plan.json, a hardware profile, a data schema and the
command-line options. Each target mutates a valid input (values replaced by junk of every JSON type, huge and
non-finite numbers, strings a terminal would act on or rich would read as markup, keys dropped, unknown keys added,
values nested deeper) and runs what reads it: ``persia plan``, ``persia validate``, ``persia topology``, the schema
loader, ``persia plan``'s and ``persia train``'s option checks.

What every run must show: exit 0, or 2 (1 for an invalid plan) with exactly one ``error:`` line, no traceback and no
"internal error"; under 10 s; no file written beside ``--out``.

    python benchmarks/fuzz.py --quick --json out.json      # CI: 60 examples per target
    python benchmarks/fuzz.py --json out.json              # 500 examples per target (--examples N: N)

``tests/test_fuzz.py`` runs every target for a few dozen examples with the tests.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import tempfile
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
from persia_planner.paths import EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, EXAMPLES

LIMIT_S = 10.0
runner = CliRunner()

# ---- what a mutation puts in place of a value ------------------------------------------------------------------------
_HOSTILE_TEXT = ["[/]", "[bold]x", "a\x1b[2Jb", "\x07", "x\u202ey", "", " ", "..", "/", "a" * 300, "1e309", "NaN"]
_NUMBERS = [0, -1, 1, 2**63, 2**64 + 1, 10**30, -(10**30), 1e300, -1e300, 1e-320, 0.5, math.inf, -math.inf, math.nan]
junk: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(_NUMBERS),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(_HOSTILE_TEXT),
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


def _write(directory: Path, name: str, document: Any) -> Path:
    path = directory / name
    if name.endswith(".json"):
        path.write_text(json.dumps(document))
    else:
        path.write_text(yaml.safe_dump(document, allow_unicode=True, sort_keys=False))
    return path


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


# ---- the targets -----------------------------------------------------------------------------------------------------
_SMALL_MODEL = {
    "name": "m",
    "batch_size": 1024,
    "staleness": 4,
    "tables": [
        {"name": "t0", "rows": 100_000, "dim": 16, "pooling_factor": 2.0, "zipf_alpha": 1.0},
        {"name": "t1", "rows": 10**8, "dim": 64, "pooling_factor": 1.0, "constraints": {"tiers": ["ps", "ddr"]}},
    ],
    "dense": {"parameters": 1000, "flops_per_sample": 1000},
}


def target_model(changes: list[Mutation]) -> str:
    """A mutated model.yaml through ``persia plan --out``."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = _write(d, "model.yaml", mutate(_SMALL_MODEL, changes))
        before = _files(d)
        outcome = run_cli(["plan", model, EXAMPLE_TOPOLOGY, "--out", d / "plan.json"])
        after = _files(d)
        after.pop("plan.json", None)
        return check(outcome) or ("files changed beside --out" if after != before else "")


def target_topology(changes: list[Mutation]) -> str:
    """A mutated topology.yaml through ``persia plan`` and ``persia topology``."""
    topology = yaml.safe_load(EXAMPLE_TOPOLOGY.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = _write(d, "model.yaml", _SMALL_MODEL)
        path = _write(d, "topology.yaml", mutate(topology, changes))
        return check(run_cli(["plan", model, path])) or check(run_cli(["topology", path]))


def target_plan(changes: list[Mutation]) -> str:
    """A mutated plan.json through ``persia validate`` (1: an invalid plan)."""
    plan = _plan_document()
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), "plan.json", mutate(plan, changes))
        return check(run_cli(["validate", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, path]), allowed=(0, 1, 2))


def target_profile(changes: list[Mutation]) -> str:
    """A mutated hardware profile, named by a host's ``profile:``, through ``persia topology``."""
    profile = yaml.safe_load((EXAMPLES / "profiles" / "cpu-2core.yaml").read_text())
    topology = yaml.safe_load((EXAMPLES / "local_2x1.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _write(d, "profile.yaml", mutate(profile, changes))
        for host in topology["hosts"]:
            host["profile"] = "profile.yaml"
        return check(run_cli(["topology", _write(d, "topology.yaml", topology)]))


def target_schema(changes: list[Mutation]) -> str:
    """A mutated data schema through its loader (``persia train --schema`` reads it so): it loads, or raises a
    PlannerError of one line."""
    from persia_planner.errors import PlannerError
    from persia_planner.model.data_schema import load_data_schema

    schema = {"label": "clicked", "dense": ["age", "price"], "sparse": {"t0": "user", "t1": {"column": "items"}}}
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), "schema.yaml", mutate(schema, changes))
        started = time.perf_counter()
        try:
            load_data_schema(path)
        except PlannerError as err:
            return check(Outcome(2, f"error: {err}\n", time.perf_counter() - started))
        except Exception as err:  # what the target looks for
            return f"raised {type(err).__name__}: {err}"
        return check(Outcome(0, "", time.perf_counter() - started))


_PLAN_OPTIONS = ["--seed", "--staleness", "--ps-wire", "--tune-budget", "--tune-steps", "--tune-candidates"]
_TRAIN_OPTIONS = ["--steps", "--batch-size", "--staleness", "--dense-lr", "--sparse-lr", "--eval-every", "--trainers"]
_TRAIN_OPTIONS += ["--eval-batches", "--checkpoint-every", "--keep", "--ps-delay-ms", "--seed", "--mode", "--data"]


def target_options(values: list[tuple[int, Any]]) -> str:
    """``persia plan`` with options given junk (no --tune: it would run jobs), and ``persia train``'s option checks
    (the TrainConfig every run builds first: a rejected option never starts a process)."""
    from persia_planner.errors import PlannerError
    from persia_planner.modules.train.config import TrainConfig

    args: list[Any] = ["plan"]
    for index, value in values:
        args += [_PLAN_OPTIONS[index % len(_PLAN_OPTIONS)], _as_arg(value)]
    found = check(run_cli(args))
    if found:
        return found
    names = ["steps", "batch_size", "staleness", "dense_lr", "sparse_lr", "eval_every", "trainers"]
    names += ["eval_batches", "checkpoint_every", "keep", "ps_delay_ms", "seed"]
    kwargs = {names[index % len(names)]: value for index, value in values}
    started = time.perf_counter()
    try:
        TrainConfig(**kwargs)
    except (PlannerError, TypeError) as err:  # TypeError: typer has already refused a value of another type
        if isinstance(err, PlannerError):
            return check(Outcome(2, f"error: {err}\n", time.perf_counter() - started))
    except Exception as err:  # what the target looks for
        return f"TrainConfig raised {type(err).__name__}: {err}"
    return ""


def _as_arg(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, list | dict) else str(value)


_PLAN_CACHE: list[dict] = []


def _plan_document() -> dict:
    if not _PLAN_CACHE:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "plan.json"
            assert run_cli(["plan", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, "--out", out]).code == 0
            _PLAN_CACHE.append(json.loads(out.read_text()))
    return _PLAN_CACHE[0]


option_values = st.lists(st.tuples(st.integers(0, 100), junk), min_size=1, max_size=3)
TARGETS: dict[str, tuple[Callable[[Any], str], st.SearchStrategy[Any]]] = {
    "model.yaml": (target_model, mutations),
    "topology.yaml": (target_topology, mutations),
    "plan.json": (target_plan, mutations),
    "profile": (target_profile, mutations),
    "data schema": (target_schema, mutations),
    "options": (target_options, option_values),
}


def fuzz(name: str, examples: int, seed: int = 0) -> dict[str, Any]:
    """Run target ``name`` on ``examples`` generated inputs; the counts of outcomes and the first failures."""
    target, strategy = TARGETS[name]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 inputs per target (CI)")
    parser.add_argument("--examples", type=int, default=None, help="inputs per target (default 500)")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args(argv)
    examples = args.examples or (60 if args.quick else 500)
    started = time.perf_counter()
    rows = [fuzz(name, examples) for name in TARGETS]
    print(f"{'target':<16}{'examples':>10}{'clean':>8}{'failed':>8}")
    for r in rows:
        print(f"{r['target']:<16}{r['examples']:>10}{r.get('clean', 0):>8}{r.get('failed', 0):>8}")
        for failure in r["failures"]:
            print(f"    {failure[:200]}")
    out = {
        "machine": platform.platform(),
        "quick": args.quick,
        "targets": rows,
        "examples": sum(r["examples"] for r in rows),
        "failed": sum(r.get("failed", 0) for r in rows),
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
