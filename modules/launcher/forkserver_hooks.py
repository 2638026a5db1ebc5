"""Imported by the local cluster's fork server only (:func:`.launch.local_cluster` preloads it, nobody imports it):
the fork server and every process it forks die at once with the launching process.

Without it, a worker could die with its launcher only once it ran :func:`.lifecycle.die_with_the_launcher` (after
its work arrived and was unpickled, seconds on a loaded machine), and the fork server, which the workers' death
signal is tied to, ended only after every worker had, then spent seconds more finalizing an interpreter that
imported torch. Here the kernel kills the fork server when the launcher dies (``PR_SET_PDEATHSIG``), and each child
asks for the same right after the fork, before it runs anything else: the whole tree goes at once.
"""

from __future__ import annotations

import os
import signal
import sys

from persia_planner.modules.launcher.lifecycle import set_death_signal

__all__: list[str] = []

_forker = 0  # in a child: the pid of the process that forked it (set before every fork)


def _remember_the_forker() -> None:
    global _forker
    _forker = os.getpid()


def _die_with_the_forker() -> None:
    if not set_death_signal() or os.getppid() != _forker:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


if sys.platform.startswith("linux"):
    set_death_signal()
    os.register_at_fork(before=_remember_the_forker, after_in_child=_die_with_the_forker)
