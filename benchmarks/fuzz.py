"""Fuzz targets, one per input: model.yaml, topology.yaml, plan.json, a hardware profile, a data schema, the
command-line options, the parameter servers' disks and ``--ssd-dir`` (:mod:`fuzz_specs`); the RPC environment and
torchrun's rendezvous options, and a doctored training checkpoint (:mod:`fuzz_runs`); click logs through
``persia data profile``, ``persia train``'s checks before start and ``persia predict``'s (:mod:`fuzz_data`). Each
target mutates a valid input (:mod:`fuzzing`: values replaced by junk of every JSON type, huge and non-finite
numbers, strings a terminal would act on or rich would read as markup, keys dropped, unknown keys added, values
nested deeper; bytes cut or flipped) and runs what reads it.

What every run must show: exit 0, or 2 (1 for an invalid plan) with exactly one ``error:`` line, no traceback and no
"internal error"; under 10 s; no file written beside ``--out``.

    python benchmarks/fuzz.py --quick --json out.json      # CI: 60 examples per target
    python benchmarks/fuzz.py --json out.json              # 500 examples per target (--examples N: N)

``tests/test_fuzz.py`` runs every target for a few dozen examples with the tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # the targets' modules sit beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_data import (
    data_changes,
    data_logs,
    target_data_profile,
    target_predict_data,
    target_train_data,
    train_data_cases,
)
from fuzz_runs import checkpoint_changes, rendezvous_cases, target_predict_checkpoint, target_rendezvous
from fuzz_specs import (
    option_values,
    ssd_cases,
    target_model,
    target_options,
    target_plan,
    target_profile,
    target_schema,
    target_ssd,
    target_topology,
)
from fuzzing import LIMIT_S, Mutation, Outcome, check, fuzz_target, mutate, mutations
from hypothesis import strategies as st

__all__ = ["LIMIT_S", "STARTS_PROCESSES", "TARGETS", "Mutation", "Outcome", "check", "fuzz", "main", "mutate"]

TARGETS: dict[str, tuple[Callable[[Any], str], st.SearchStrategy[Any]]] = {
    "model.yaml": (target_model, mutations),
    "topology.yaml": (target_topology, mutations),
    "plan.json": (target_plan, mutations),
    "profile": (target_profile, mutations),
    "data schema": (target_schema, mutations),
    "options": (target_options, option_values),
    "rendezvous": (target_rendezvous, rendezvous_cases),
    "ssd": (target_ssd, ssd_cases),
    "predict checkpoint": (target_predict_checkpoint, checkpoint_changes),
    "predict data": (target_predict_data, data_changes),
    "data profile": (target_data_profile, data_logs),
    "train data": (target_train_data, train_data_cases),
}
STARTS_PROCESSES = frozenset({"predict checkpoint", "predict data"})
"""The targets whose one setup starts processes (:func:`fuzz_runs.trained_checkpoint`); tests mark them
``processes``."""


def fuzz(name: str, examples: int, seed: int = 0) -> dict[str, Any]:
    """Run target ``name`` on ``examples`` generated inputs; the counts of outcomes and the first failures."""
    target, strategy = TARGETS[name]
    return fuzz_target(name, target, strategy, examples, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 inputs per target (CI)")
    parser.add_argument("--examples", type=int, default=None, help="inputs per target (default 500)")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args(argv)
    examples = args.examples or (60 if args.quick else 500)
    started = time.perf_counter()
    rows = [fuzz(name, examples) for name in TARGETS]
    print(f"{'target':<20}{'examples':>10}{'clean':>8}{'failed':>8}")
    for r in rows:
        print(f"{r['target']:<20}{r['examples']:>10}{r.get('clean', 0):>8}{r.get('failed', 0):>8}")
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
