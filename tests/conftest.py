"""Fixtures shared by the test modules, and the fast tier's guard.

``scripts/test.sh --fast`` deselects the tests marked ``processes`` (servers, trainers, torchrun, the CLI run as a
subprocess, notebooks): what remains must start no process, and a test that does fails there with one line asking
for the marker, so that the fast tier stays fast as tests are added.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    # From collection on (test modules' imports too), once pytest has started: under pytest-xdist the controller runs
    # no test but starts the workers, and a worker's start asks the platform module, which runs `uname`.
    config = session.config
    runs_tests = hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
    if "not processes" in (config.option.markexpr or "") and runs_tests:
        # matplotlib builds its font cache on a machine's first import, asking fontconfig (`fc-list`): once, before
        # the guard, so that a fresh machine's first fast tier does not blame the test that first draws.
        import matplotlib.font_manager  # noqa: F401

        _refuse_processes()


def _refuse_processes() -> None:
    def refused(*_args, **_kwargs):
        raise RuntimeError("this test starts a process: mark it @pytest.mark.processes (the fast tier skips those)")

    subprocess.Popen.__init__ = refused  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = refused  # type: ignore[method-assign]


@pytest.fixture
def one_trainer():
    """A process group of one trainer (DMP needs one), torn down after the test."""
    import torch.distributed as dist  # here: most test modules never import torch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
