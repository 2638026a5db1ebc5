"""Fuzz targets of the planner's inputs: model.yaml, topology.yaml (its parameter servers' ``ssd:`` too), plan.json,
a hardware profile, a data schema, and the command-line options of ``persia plan`` and ``persia train`` (``--ssd-dir``
too), through what reads them."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from fuzzing import (
    Mutation,
    Outcome,
    as_arg,
    check,
    files_in,
    junk,
    mutate,
    mutations,
    run_cli,
    write_document,
)
from hypothesis import strategies as st

from persia_planner.paths import EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, EXAMPLES

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
        model = write_document(d, "model.yaml", mutate(_SMALL_MODEL, changes))
        before = files_in(d)
        outcome = run_cli(["plan", model, EXAMPLE_TOPOLOGY, "--out", d / "plan.json"])
        after = files_in(d)
        after.pop("plan.json", None)
        return check(outcome) or ("files changed beside --out" if after != before else "")


def target_topology(changes: list[Mutation]) -> str:
    """A mutated topology.yaml through ``persia plan`` and ``persia topology``."""
    topology = yaml.safe_load(EXAMPLE_TOPOLOGY.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = write_document(d, "model.yaml", _SMALL_MODEL)
        path = write_document(d, "topology.yaml", mutate(topology, changes))
        return check(run_cli(["plan", model, path])) or check(run_cli(["topology", path]))


def target_plan(changes: list[Mutation]) -> str:
    """A mutated plan.json through ``persia validate`` (1: an invalid plan)."""
    plan = _plan_document()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_document(Path(tmp), "plan.json", mutate(plan, changes))
        return check(run_cli(["validate", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, path]), allowed=(0, 1, 2))


def target_profile(changes: list[Mutation]) -> str:
    """A mutated hardware profile, named by a host's ``profile:``, through ``persia topology``."""
    profile = yaml.safe_load((EXAMPLES / "profiles" / "cpu-2core.yaml").read_text())
    topology = yaml.safe_load((EXAMPLES / "local_2x1.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_document(d, "profile.yaml", mutate(profile, changes))
        for host in topology["hosts"]:
            host["profile"] = "profile.yaml"
        return check(run_cli(["topology", write_document(d, "topology.yaml", topology)]))


def target_schema(changes: list[Mutation]) -> str:
    """A mutated data schema through its loader (``persia train --schema`` reads it so): it loads, or raises a
    PlannerError of one line."""
    from persia_planner.errors import PlannerError
    from persia_planner.model.data_schema import load_data_schema

    schema = {"label": "clicked", "dense": ["age", "price"], "sparse": {"t0": "user", "t1": {"column": "items"}}}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_document(Path(tmp), "schema.yaml", mutate(schema, changes))
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
        args += [_PLAN_OPTIONS[index % len(_PLAN_OPTIONS)], as_arg(value)]
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


_PLAN_CACHE: list[dict] = []


def _plan_document() -> dict:
    if not _PLAN_CACHE:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "plan.json"
            assert run_cli(["plan", EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, "--out", out]).code == 0
            _PLAN_CACHE.append(json.loads(out.read_text()))
    return _PLAN_CACHE[0]


_SSD_MODEL = {
    "name": "m",
    "batch_size": 1024,
    "tables": [
        {"name": "t0", "rows": 100_000, "dim": 16},
        {"name": "t1", "rows": 10**6, "dim": 16, "constraints": {"tiers": ["ssd"]}},
    ],
}
# --ssd-dir values ({tmp}: the case's own folder, which holds a file "afile" and a looping link "loop"); every other
# value is one name inside that folder, so that nothing is made or probed outside it.
_SSD_DIRS = [
    "{tmp}",
    "{tmp}/new",
    "{tmp}/afile",
    "{tmp}/afile/x",
    "{tmp}/missing/x",
    "{tmp}/loop",
    "{tmp}/loop/x",
    "{tmp}/" + "a" * 300,
    "{tmp}/" + "/".join(["b" * 200] * 25),
    "{tmp}/a\x00b",
    "{tmp}/a\x1b[2Jb",
    "{tmp}/x\u202ey",
    "{tmp}/[bold]x",
    "/proc/persia-fuzz",
    "/dev/null",
    "/dev/null/x",
    "/dev/shm/persia-fuzz-{pid}",
]


def target_ssd(case: tuple[list[Mutation], str]) -> str:
    """Parameter servers whose ``ssd:`` is mutated (junk sizes and rates, dropped, replaced) under a model that holds a
    table to the ``ssd`` tier, through ``persia plan`` and ``persia topology``; and a mutated ``--ssd-dir`` through
    ``persia train``'s checks of it (TrainConfig, ``check_ssd_dir``: no process starts). The directory is refused in
    one line, or made and left empty; the files beside it stay as they were."""
    changes, directory = case
    topology = yaml.safe_load(EXAMPLE_TOPOLOGY.read_text())
    disk = mutate({"ssd": {"size": "1TiB", "read_iops": 400_000, "write_iops": 150_000}}, changes)
    for host in topology["hosts"]:
        if host.get("role") == "parameter_server" and "ssd" in disk:
            host["ssd"] = disk["ssd"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = write_document(d, "model.yaml", _SSD_MODEL)
        path = write_document(d, "topology.yaml", topology)
        found = check(run_cli(["plan", model, path])) or check(run_cli(["topology", path]))
        return found or _check_ssd_dir(d, directory)


def _check_ssd_dir(d: Path, directory: str) -> str:
    import contextlib
    import os

    from persia_planner.errors import PlannerError
    from persia_planner.modules.ps.ssd_files import check_ssd_dir
    from persia_planner.modules.train.config import TrainConfig

    (d / "afile").write_bytes(b"the user's")
    (d / "loop").symlink_to(d / "loop")
    if directory in _SSD_DIRS:
        path = Path(directory.format(tmp=d, pid=os.getpid()))
    else:  # one name inside the case's folder
        name = directory.replace("/", "_")
        path = d / (name if name not in ("", ".", "..") else "dot")
    before = files_in(d)
    started = time.perf_counter()
    try:
        try:
            check_ssd_dir(TrainConfig(ssd_dir=str(path)).ssd_dir)
        except PlannerError as err:
            return check(Outcome(2, f"error: {err}\n", time.perf_counter() - started)) or (
                "files changed beside --ssd-dir" if files_in(d) != before else ""
            )
        except Exception as err:  # what the target looks for
            return f"check_ssd_dir raised {type(err).__name__}: {err}"
        if not path.is_dir() or [p for p in path.iterdir() if p.name.startswith(".persia-ssd-probe")]:
            return f"accepted {path!r} but left no directory, or its probe"
        return check(Outcome(0, "", time.perf_counter() - started)) or (
            "files changed beside --ssd-dir" if files_in(d) != before else ""
        )
    finally:
        if str(path).startswith("/dev/shm/"):  # refused and removed; this is the backstop of a failure
            with contextlib.suppress(OSError):
                path.rmdir()


ssd_cases = st.tuples(mutations, st.one_of(st.sampled_from(_SSD_DIRS), st.text(max_size=20)))

option_values = st.lists(st.tuples(st.integers(0, 100), junk), min_size=1, max_size=3)
