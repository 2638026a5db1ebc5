"""The fuzz targets of benchmarks/fuzz.py, briefly (the benchmark runs them longer): every mutated model.yaml,
topology.yaml, plan.json, hardware profile, data schema and set of options is accepted or refused in one line."""

from __future__ import annotations

import pytest
from benchmark_modules import load

fuzz = load("fuzz")

EXAMPLES = 25


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.processes) if n in fuzz.STARTS_PROCESSES else n for n in fuzz.TARGETS]
)
def test_every_mutated_input_is_accepted_or_refused_in_one_line(name):
    result = fuzz.fuzz(name, EXAMPLES, seed=1)
    assert result["examples"] >= EXAMPLES // 2  # hypothesis may stop early on a small input space
    assert result.get("failed", 0) == 0, result["failures"]


@pytest.mark.parametrize(
    ("outcome", "problem"),
    [
        (fuzz.Outcome(3, "error: internal error (KeyError)\n", 0.1), "exit 3"),
        (fuzz.Outcome(2, "error: a\nerror: b\n", 0.1), "not one error line"),
        (fuzz.Outcome(2, "Traceback (most recent call last):\n", 0.1), "not one error line"),
        (fuzz.Outcome(2, "error: x (Traceback) y\n", 0.1), "internal"),
        (fuzz.Outcome(2, "error: a\x1b[2Jb\n", 0.1), "control character"),
        (fuzz.Outcome(0, "", 0.1, "name a\x1b]0;title\x07\n"), "printed a control character"),
        (fuzz.Outcome(2, "error: slow\n", 11.0), "took 11.0 s"),
    ],
)
def test_the_check_finds_what_it_must(outcome, problem):
    assert fuzz.check(outcome).startswith(problem)
    assert fuzz.check(fuzz.Outcome(2, "error: fine; fix: this\n", 0.1)) == ""


def test_a_mutation_reaches_nested_values_and_keeps_the_original():
    document = {"a": [{"b": 1}, {"c": 2}]}
    changed = fuzz.mutate(document, [fuzz.Mutation("replace", (0, 1, 0), "x")])
    assert changed == {"a": [{"b": 1}, {"c": "x"}]} and document == {"a": [{"b": 1}, {"c": 2}]}
    assert fuzz.mutate(document, [fuzz.Mutation("drop", (0,))]) == {}
    assert fuzz.mutate(document, [fuzz.Mutation("nest", (0, 0), None)]) == {"a": [[{"b": 1}], {"c": 2}]}
