"""How the search finishes several options of one table from one scoring.

An option's placement is one or more decisions (a column-wise split places its shards one at a time); each decision
scores its candidates, rows of a load matrix. A scoring is a few dozen numpy calls whatever its row count, so the
search scores every option's first decision in one matrix, and then every option's next decision together
(:func:`finish_together`). Ties between candidates are broken by the search's seeded RNG in the order of the options,
one option at a time: a lockstep pick that would draw raises :class:`Tie`, and the caller finishes the options in that
order instead (:func:`finish_in_order`), nothing having changed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Finish", "Pick", "Step", "Tie", "finish_in_order", "finish_together", "given"]

# A scoring: rows of loads (added to the state) -> (scores, step time per GPU) of each row.
Scores = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
# A pick: (scores, which fit) -> the chosen row.
Pick = Callable[[np.ndarray, np.ndarray], int]
# A finish: a generator that yields the load rows of each further decision, is sent their (scores, GPU steps), and
# returns the choice (None where a decision found no room).
Finish = Generator[np.ndarray, tuple[np.ndarray, np.ndarray], Any]


@dataclass(frozen=True)
class Step:
    """An option's first decision: its candidates' load rows, ``finish(scores, gpu_steps, pick)`` of them, and how
    many decisions the option takes. ``forced``: where there is nothing to decide (one candidate that fits), its
    choice without a scoring."""

    loads: np.ndarray
    finish: Callable[[np.ndarray, np.ndarray, Pick], Finish]
    decisions: int = 1
    forced: Callable[[], Any] | None = None


class Tie(Exception):
    """Candidates tied where the seeded tie-breaks must come in the one-option-at-a-time order."""


def given(choice: Any) -> Finish:
    """A finish that needs no further decision."""
    return choice
    yield  # a generator


def _slices(blocks: Sequence[np.ndarray]) -> list[slice]:
    """The rows of each of ``blocks`` stacked."""
    ends = itertools.accumulate(len(block) for block in blocks)
    return [slice(end - len(block), end) for block, end in zip(blocks, ends, strict=True)]


def finish_in_order(
    steps: Sequence[Step], scores: np.ndarray, gpu_steps: np.ndarray, score: Scores, pick: Pick
) -> list[Any]:
    """Finish the options one at a time, each further decision scored as it comes (``scores`` / ``gpu_steps``: of
    the first decisions' rows, stacked)."""
    choices = []
    for step, rows in zip(steps, _slices([step.loads for step in steps]), strict=True):
        run = step.finish(scores[rows], gpu_steps[rows], pick)
        try:
            need = next(run)
            while True:
                need = run.send(score(need))
        except StopIteration as done:
            choices.append(done.value)
    return choices


def finish_together(
    steps: Sequence[Step], scores: np.ndarray, gpu_steps: np.ndarray, score: Scores, pick_untied: Pick
) -> list[Any]:
    """Finish the options in lockstep: every option's next decision scored in one matrix.

    Raises:
        Tie: ``pick_untied`` met a tie (nothing has changed; finish them in order instead).
    """
    choices: list[Any] = [None] * len(steps)
    waiting: dict[int, tuple[Finish, np.ndarray]] = {}

    def advance(k: int, run: Finish, sent: tuple[np.ndarray, np.ndarray] | None) -> None:
        try:
            waiting[k] = (run, next(run) if sent is None else run.send(sent))
        except StopIteration as done:
            choices[k] = done.value

    for k, (step, rows) in enumerate(zip(steps, _slices([step.loads for step in steps]), strict=True)):
        advance(k, step.finish(scores[rows], gpu_steps[rows], pick_untied), None)
    while waiting:
        order = list(waiting)
        needs = [waiting[k][1] for k in order]
        more_scores, more_steps = score(np.concatenate(needs))
        runs = [waiting.pop(k)[0] for k in order]
        for k, run, rows in zip(order, runs, _slices(needs), strict=True):
            advance(k, run, (more_scores[rows], more_steps[rows]))
    return choices
