"""Fuzz targets of what a run starts from: the RPC group's environment and torchrun's rendezvous options (through the
checks that run before torch), and a training checkpoint doctored every way (through ``persia predict``'s checks
before any process starts)."""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from fuzzing import (
    HOSTILE_TEXT,
    Mutation,
    Outcome,
    as_arg,
    check,
    junk,
    mutate,
    mutations,
    run_cli,
    write_document,
)
from hypothesis import strategies as st

from persia_planner.paths import EXAMPLES

_RPC_ENV = ("MASTER_ADDR", "MASTER_PORT", "PERSIA_RPC_TRANSPORTS", "PERSIA_RPC_CHANNELS")
_RDZV_KEYS = ["is_host", "read_timeout", "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout"]
_RDZV_KEYS += ["keep_alive_interval", "keep_alive_max_attempt"]
# Near misses of what each field takes, beside the junk every target gets.
_RPC_TEXT = ["127.0.0.1", "localhost", "::1", "[::1]", "fe80::1%lo", "127.0.0.1:29500", "a:b:c", "http://h:1", "h:"]
_RPC_TEXT += [":1", "[::1]:0", "29500", "1", "0", "65535", "65536", "+1", "1_0", "\u0662\u0669", " 7 ", "1e3", "-1"]
_RPC_TEXT += ["uv", "shm,uv", "uv,,shm", ",", "tcp", "basic", "cma,mpt_uv", "true", "no", "maybe", "99999999", "inf"]


def target_rendezvous(case: dict[str, Any]) -> str:
    """Junk ``MASTER_ADDR``, ``MASTER_PORT``, ``PERSIA_RPC_TRANSPORTS``, ``PERSIA_RPC_CHANNELS``, ``--rdzv-endpoint``
    and ``--rdzv-conf`` through the checks that run before torch (``check_rpc_environment`` without resolving the
    address, ``rendezvous_options`` and torchrun's edge for them), and ``persia ps``'s checks where the environment is
    refused before torch: one line or accepted, never a traceback. Nothing resolves, connects or starts: an accepted
    environment never reaches ``persia ps`` (it would serve) nor an accepted rendezvous the handler (it would listen).
    """
    import contextlib
    import io
    import os
    from types import SimpleNamespace

    from persia_planner.errors import PlannerError
    from persia_planner.modules.rpc_environment import check_rpc_environment
    from persia_planner.modules.train.rendezvous import rendezvous_options, torchrun_handler

    # What an environment can hold (no NUL, no lone surrogate): persia ps below runs in it.
    env = {
        name: case[name].encode("utf-8", "replace").decode().replace("\0", "")
        for name in _RPC_ENV
        if case[name] is not None
    }
    started = time.perf_counter()
    try:
        check_rpc_environment("the fuzz", env, resolve_address=False)
        refused = False
    except PlannerError as err:
        found = check(Outcome(2, f"error: {err}\n", time.perf_counter() - started))
        if found:
            return found
        refused = True
    except Exception as err:  # what the target looks for
        return f"check_rpc_environment raised {type(err).__name__}: {err}"
    started = time.perf_counter()
    try:
        rendezvous_options(case["endpoint"], case["conf"])
    except PlannerError:
        stderr = io.StringIO()
        params = SimpleNamespace(endpoint=case["endpoint"], config=case["conf"], run_id="fuzz")
        with contextlib.redirect_stderr(stderr):
            try:
                torchrun_handler(params)
            except SystemExit as exit_:
                code = exit_.code
            else:
                return "torchrun_handler accepted what rendezvous_options refused"
        found = check(Outcome(code if isinstance(code, int) else 3, stderr.getvalue(), time.perf_counter() - started))
        if found:
            return found
    except Exception as err:  # what the target looks for
        return f"rendezvous_options raised {type(err).__name__}: {err}"
    if not refused:
        return ""
    args = ["ps"]
    for option, value in zip(["--rank", "--world-size", "--rpc-timeout"], case["ps"], strict=False):
        args += [option, value]
    saved = {name: os.environ.get(name) for name in _RPC_ENV}
    try:
        for name in _RPC_ENV:
            os.environ.pop(name, None)
        os.environ.update(env)
        return check(run_cli(args))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _field(valid: list[str], *, unset: bool = True) -> st.SearchStrategy[str | None]:
    """A value of one field: often one it takes (so that the checks after it run too), else a near miss or junk."""
    choices = [st.sampled_from(valid)] * 6 + [st.sampled_from(_RPC_TEXT + HOSTILE_TEXT)] * 2
    choices += [st.one_of(st.text(max_size=20), junk.map(as_arg)), st.none() if unset else st.sampled_from(valid)]
    return st.integers(0, len(choices) - 1).flatmap(choices.__getitem__)


rendezvous_cases = st.fixed_dictionaries(
    {
        "MASTER_ADDR": _field(["127.0.0.1", "localhost", "::1", "host0"]),
        "MASTER_PORT": _field(["29500", "1", "65535"]),
        "PERSIA_RPC_TRANSPORTS": _field(["uv", "shm,uv", " uv "]),
        "PERSIA_RPC_CHANNELS": _field(["basic", "cma,mpt_uv"]),
        "endpoint": _field(["127.0.0.1:29400", "head", "[::1]:7", "head:0", ""]),
        "conf": st.fixed_dictionaries(
            {"is_host": _field(["true", "false", "1", "no"])},
            optional={key: _field(["1", "60", "604800"], unset=False) for key in _RDZV_KEYS[1:]}
            | {"x": _field(["1"], unset=False)},
        ).map(lambda conf: {key: value for key, value in conf.items() if value is not None}),
        "ps": st.tuples(
            _field(["0", "1"], unset=False), _field(["1", "2"], unset=False), _field(["3", "inf", "1e300", "nan"])
        ),
    }
)


_PREDICT_MODEL = """
name: tiny
batch_size: 32
tables:
  - {name: user_id, rows: 200_000, dim: 8}
  - {name: country, rows: 50, dim: 8}
data:
  label: clicked
  dense: [{column: price, log1p: true, standardize: true}]
  sparse: {user_id: user, country: country}
"""
_PREDICT_TOPOLOGY = {  # one CPU trainer and one parameter server: user_id trains on the server, country locally
    "name": "fuzz-1x1",
    "hosts": [
        {"name": "trainer", "ddr": "8GiB", "profile": "PROFILE", "cpus": {"count": 1, "memory": "4MiB"}},
        {"name": "ps", "role": "parameter_server", "ddr": "2GiB", "profile": "PROFILE"},
    ],
}
_TRAINED: list[Path] = []


def trained_checkpoint() -> Path:
    """A checkpoint ``persia train`` wrote of a tiny model (one trainer, one server, a table on each), trained once
    per process into a temporary folder removed at exit; the ``step-*`` folder. Its data: ``data.parquet`` beside."""
    if _TRAINED:
        return _TRAINED[0]
    import atexit
    import os
    import shutil
    import subprocess

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(tempfile.mkdtemp(prefix="persia-fuzz-predict-"))
    atexit.register(shutil.rmtree, root, True)
    (root / "model.yaml").write_text(_PREDICT_MODEL)
    profile = str(EXAMPLES / "profiles" / "cpu-2core.yaml")
    topology = json.loads(json.dumps(_PREDICT_TOPOLOGY).replace('"PROFILE"', json.dumps(profile)))
    write_document(root, "topology.yaml", topology)
    rng = np.random.default_rng(0)
    n = 256
    users = [f"u{i % 40}" for i in range(n)]
    table = {"clicked": rng.integers(0, 2, n), "price": rng.uniform(0, 100, n), "user": users}
    pq.write_table(pa.table({**table, "country": rng.integers(0, 9, n)}), root / "data.parquet")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    args = ["train", "--model", root / "model.yaml", "--topology", root / "topology.yaml", "--trainers", "1"]
    args += ["--data", f"parquet:{root / 'data.parquet'}", "--eval-split", "0.2", "--eval-batches", "1"]
    args += ["--batch-size", "32", "--steps", "4", "--checkpoint", root / "run"]
    done = subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", *map(str, args)], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"persia train for the predict targets failed: {done.stderr[-2000:]}")
    (step,) = sorted((root / "run").glob("step-*"))
    _TRAINED.append(step)
    return step


class _Payload:
    """What a hostile ``trainer.pt`` pickles: unpickled, it would make the folder ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.mkdir, (self.marker,))


_CHECKPOINT_CHANGES = ["plan", "model", "ps", "flip", "truncate", "payload", "tensors", "remove"]
_TENSOR_EDITS = ["drop", "rename", "reshape", "add", "dtype", "nan", "junk"]
checkpoint_changes = st.tuples(
    st.sampled_from(_CHECKPOINT_CHANGES), mutations, st.integers(0, 10**6), st.sampled_from(_TENSOR_EDITS),
    st.booleans(),
)  # fmt: skip


def _doctor(step: Path, kind: str, changes: list[Mutation], at: int, edit: str, marker: Path) -> None:
    """``step`` (a copy of the trained checkpoint) changed by one ``kind`` of change."""
    import shutil

    import torch

    files = sorted(p for p in step.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    if kind == "plan":
        write_document(step, "plan.json", mutate(json.loads((step / "plan.json").read_text()), changes))
    elif kind == "model":
        write_document(step, "model.yaml", mutate(yaml.safe_load((step / "model.yaml").read_text()), changes))
    elif kind == "ps":
        jsons = sorted(p for p in (step / "ps").rglob("*") if p.is_file() and not p.name.endswith(".pt"))
        target = jsons[at % len(jsons)]
        target.write_text(json.dumps(mutate(json.loads(target.read_text()), changes)))
    elif kind in ("flip", "truncate"):
        target = files[at % len(files)]
        data = bytearray(target.read_bytes())
        if kind == "flip" and data:
            data[at % len(data)] ^= 1 << (at % 8)
        target.write_bytes(bytes(data if kind == "flip" else data[: at % max(1, len(data))]))
    elif kind == "payload":
        state = torch.load(step / "trainer.pt", weights_only=True)
        state["local" if at % 2 else "extra"] = _Payload(str(marker))
        torch.save(state, step / "trainer.pt")
    elif kind == "tensors":
        state = torch.load(step / "trainer.pt", weights_only=True)
        _edit_state(state, edit, at, changes[0].value)
        torch.save(state, step / "trainer.pt")
    else:
        gone = [*files, step / "ps", step / "MANIFEST.json"][at % (len(files) + 2)]
        shutil.rmtree(gone) if gone.is_dir() else gone.unlink()


def _edit_state(state: dict[str, Any], edit: str, at: int, value: Any) -> None:
    """One change to ``trainer.pt``'s state: a tensor dropped, renamed, reshaped, added, of another dtype or NaN, or
    a value replaced by junk."""
    import torch

    if edit == "junk":
        keys = sorted(state)
        state[keys[at % len(keys)]] = value
        return
    tensors = [(part, key) for part in ("local", "dense") for key in sorted(state[part])]
    part, key = tensors[at % len(tensors)]
    tensor = state[part][key]
    if edit == "drop":
        del state[part][key]
    elif edit == "rename":
        state[part][f"{key}x"] = state[part].pop(key)
    elif edit == "reshape":
        state[part][key] = torch.zeros(*(s + 1 for s in tensor.shape))
    elif edit == "add":
        state[part][f"extra{at}"] = torch.zeros(2, 2)
    elif edit == "dtype":
        state[part][key] = tensor.to(torch.int64 if at % 2 else torch.float16)
    else:
        state[part][key] = tensor.clone().fill_(math.nan)


def _rehash(step: Path) -> None:
    """``step``'s manifest naming its files as they are now (what one who edits a checkpoint on purpose does)."""
    from persia_planner.modules.manifests import file_record

    manifest = step / "MANIFEST.json"
    if not manifest.is_file():
        return
    try:
        document = json.loads(manifest.read_text())
    except ValueError:
        return
    files = sorted(p for p in step.rglob("*") if p.is_file() and p != manifest)
    document["files"] = {p.relative_to(step).as_posix(): file_record(p) for p in files}
    manifest.write_text(json.dumps(document))


def prepared(checkpoint: Path, data: str, out: Path) -> str:
    """``persia predict``'s checks (everything before a process starts) in this process: they accept, or refuse in
    one line, within the time; nothing is written at ``out``."""
    from persia_planner.errors import PlannerError
    from persia_planner.modules.train.prediction import prepare

    started = time.perf_counter()
    try:
        prepare(checkpoint, data, out)
        outcome = Outcome(0, "", time.perf_counter() - started)
    except PlannerError as err:
        outcome = Outcome(2, f"error: {err}\n", time.perf_counter() - started)
    except Exception as err:  # what the target looks for
        return f"raised {type(err).__name__}: {str(err)[:300]}"
    return check(outcome) or ("wrote --out" if out.exists() else "")


def target_predict_checkpoint(change: tuple[str, list[Mutation], int, str, bool]) -> str:
    """A copy of a trained checkpoint changed (plan.json, model.yaml or ps/'s JSON mutated, a file's bytes flipped or
    cut, a pickle payload or changed tensors in trainer.pt, a file removed), its manifest re-hashed or not, through
    ``persia predict``'s checks; a payload must never run."""
    import shutil

    kind, changes, at, edit, rehash = change
    trained = trained_checkpoint()
    with tempfile.TemporaryDirectory() as tmp:
        step = Path(tmp) / "run" / trained.name
        shutil.copytree(trained, step)
        marker = Path(tmp) / "payload-ran"
        _doctor(step, kind, changes, at, edit, marker)
        if rehash:
            _rehash(step)
        found = prepared(step, f"parquet:{trained.parent.parent / 'data.parquet'}", Path(tmp) / "scores.parquet")
        return found or ("the payload ran" if marker.exists() else "")
