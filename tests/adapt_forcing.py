"""A forced re-planning decision for the tests of ``persia train --adapt`` (``PERSIA_ADAPT_DECIDER``): the trainers
call :func:`decide` in place of :func:`persia_planner.replan.decide`; it moves the job to the plan
``PERSIA_TEST_PLAN`` names (a ``{table: placement}`` JSON file), with the collectives ``PERSIA_TEST_QCOMMS`` names
where it is set, at its first decision, and keeps it there after."""

from __future__ import annotations

import json
import os
from pathlib import Path

from persia_planner.model.qcomms import QComms
from persia_planner.plan.plan import placement_from_dict
from persia_planner.replan import Decision, Reason

DECIDER = "adapt_forcing:decide"
PLAN_ENV = "PERSIA_TEST_PLAN"
QCOMMS_ENV = "PERSIA_TEST_QCOMMS"


def decide(model, topology, tables, measured, *, threshold, steps_left, migration_s, seed=0, history=(), **_):
    """Migrate to ``PERSIA_TEST_PLAN``'s tables unless the job runs them already."""
    path = Path(os.environ[PLAN_ENV])
    target = {name: placement_from_dict(p, str(path), name) for name, p in json.loads(path.read_text()).items()}
    named = os.environ.get(QCOMMS_ENV)
    qcomms = QComms.from_value(named, QCOMMS_ENV) if named else model.qcomms
    stay = dict(tables) == target and qcomms == model.qcomms
    return Decision(
        migrate=not stay,
        reason=Reason.WITHIN if stay else Reason.FASTER,
        tables=None if stay else target,
        predicted_old_ms=measured.step_ms,
        predicted_new_ms=None if stay else measured.step_ms / 2,
        refit=None,
        off_by=0.0 if stay else 1.0,
        qcomms=None if stay else qcomms,
    )
