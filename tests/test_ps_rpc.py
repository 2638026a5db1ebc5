"""Parameter server over torch RPC: real server and trainer processes on 127.0.0.1 (each test its own cluster).

The trainer bodies are module-level functions (the forked processes import this module to find them) and assert
inside the trainer; a failed assertion comes back as a ``TrainerError`` (its ``detail`` holds the trainer's traceback).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import select
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.rpc as rpc

from persia_planner.errors import PlannerError
from persia_planner.modules.launcher.launch import barrier, local_cluster, trainers_store
from persia_planner.modules.launcher.local_job import TrainerError
from persia_planner.modules.ps import server as server_module
from persia_planner.modules.ps import server_state
from persia_planner.modules.ps.allocator import allocator_env
from persia_planner.modules.ps.client import PsClient
from persia_planner.modules.ps.connection import connect
from persia_planner.modules.ps.delay import DelayScheduler
from persia_planner.modules.ps.deltas import apply_deltas
from persia_planner.modules.ps.group import shutdown_error
from persia_planner.modules.ps.optim import SGD, RowWiseAdagrad
from persia_planner.modules.ps.policies import Uniform
from persia_planner.modules.ps.protocol import (
    PeerLostError,
    PsServerError,
    PsUnavailableError,
    RemoteFailure,
    TableConfig,
    WireOverflowError,
    check_wire_dtype,
)
from persia_planner.modules.ps.server import log_metrics_every
from persia_planner.modules.ps.sharding import server_of
from persia_planner.modules.ps.store import EmbeddingStore
from persia_planner.modules.ps.table_checkpoints import commit, load_rows, read_latest

pytestmark = pytest.mark.timeout(90)  # far below the suite's 600 s: a hang fails here, not the whole run


def _gen(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(seed) & 0xFFFF_FFFF)


# ------------------------------------------------------------------------------------------ (1) round trip


def _round_trip(j, client):
    config = TableConfig("user", 8, 1000, SGD(lr=0.1), Uniform(-0.1, 0.1), seed=7)
    client.register(config)
    client.register(config)  # idempotent
    with pytest.raises(PsServerError, match="different config"):
        client.register(TableConfig("user", 8, 1000, SGD(lr=0.2)))
    with pytest.raises(PsServerError, match="not registered"):
        client.lookup("item", torch.tensor([1]))
    with pytest.raises(ValueError, match="do not match"):  # [dim, n] has the numel of [n, dim], not its layout
        client.push_gradients("user", torch.arange(3), torch.zeros(8, 3))
    with pytest.raises(PlannerError, match="parameter server ps1 is server 1 but is listed as server 0"):
        PsClient(list(reversed(client.servers)))  # servers shard their checkpoints by rank: the order must match

    # Duplicates, a 2-d batch, and ids across the whole uint64 range (negative int64 = high uint64 bit patterns).
    base = torch.cat([torch.randint(0, 40, (90,), generator=_gen(1)), torch.tensor([-1, 2**63 - 1, -(2**63)] * 2)])
    ids = base[torch.randperm(base.numel(), generator=_gen(2))].reshape(4, 24)
    rows = client.lookup("user", ids)
    assert rows.shape == (4, 24, 8) and rows.dtype == torch.float32
    uniq, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
    first = torch.full((uniq.numel(),), ids.numel()).scatter_reduce(0, inverse, torch.arange(ids.numel()), "amin")
    flat = rows.reshape(-1, 8)
    assert torch.equal(flat, flat[first[inverse]])  # the same id always reads the same row
    assert (flat.abs() > 0).any(dim=1).all() and (flat.abs() <= 0.1).all()  # initialised, from Uniform(-0.1, 0.1)
    assert torch.equal(client.lookup("user", ids), rows)  # found again, nothing re-initialised
    none = torch.empty(2, 0, dtype=torch.int64)  # an empty batch sends nothing and reads [*shape, dim] zeros
    assert client.lookup("user", none).shape == client.lookup_async("user", none).wait().shape == (2, 0, 8)
    assert torch.equal(
        client.lookup("user", torch.tensor([2**64 - 1], dtype=torch.uint64))[0], flat[ids.view(-1) == -1][0]
    )

    # Placement: each server holds exactly the ids server_of assigns to it.
    expected = torch.bincount(server_of("user", uniq, 2), minlength=2).tolist()
    held = [m["rows"] for m in client.metrics()]
    assert held == expected and sum(held) == uniq.numel() and min(held) > 0

    # Eval lookups: new ids read as their initial rows (as a state dict reads them) and are not inserted; known ids
    # read their row.
    new = torch.arange(10_000, 10_050)
    cold = client.lookup("user", new, train=False)
    assert torch.equal(cold, client.read_rows("user", new)) and bool((cold != 0).all())
    assert torch.equal(client.lookup("user", ids, train=False), rows)
    metrics = client.metrics()
    assert [m["rows"] for m in metrics] == expected
    assert all(m["bytes"] == m["rows"] * 8 * 4 and m["lookups_per_s"] > 0 for m in metrics)  # SGD: no state
    threads = {Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task")}
    return {"rows": held, "distinct": uniq.numel(), "names": [m["name"] for m in metrics], "threads": threads}


@pytest.mark.processes
def test_round_trip_two_servers():
    [result] = local_cluster(2, 1, _round_trip, run_timeout_s=60)
    assert result["names"] == ["ps0", "ps1"]
    assert sum(result["rows"]) == result["distinct"]
    # The group runs on the uv transport: no shm reactor (a thread that polls a core even when idle). (Tensors
    # between these processes take the cma channel where the kernel allows cross-process reads; not asserted.)
    assert "TP_UV_loop" in result["threads"] and "TP_SHM_reactor" not in result["threads"]


def _environment(j, client):
    # The environment this process image was started with. glibc rewrites GLIBC_TUNABLES there while parsing it
    # (the tunables come out separated by NULs), so each one is looked for in the raw bytes.
    with open("/proc/self/environ", "rb") as f:
        started_with = f.read()
    return {
        "trainer": os.environ.get("PERSIA_TEST_MARK"),
        "server": rpc.rpc_sync(client.servers[0], os.getenv, args=("PERSIA_TEST_MARK",)),
        "tunables": [
            t for t in ("glibc.malloc.tcache_count=0", "glibc.malloc.hugetlb=1") if t.encode() in started_with
        ],
    }


@pytest.mark.processes
def test_processes_take_the_environment_of_each_launch(monkeypatch):
    """The processes are forks of one fork server started by the first launch: they must still see the environment
    of their own launch, and the allocator setting that only takes effect when a process image starts (the fork
    server is restarted when a launch asks for other tunables than it started with)."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    tuned = ["glibc.malloc.tcache_count=0", "glibc.malloc.hugetlb=1"]
    for mark, tune, expected in (
        ("first", "1", tuned),
        ("second", "1", tuned),
        ("third", "0", []),
        ("fourth", "1", tuned),
    ):
        monkeypatch.setenv("PERSIA_TEST_MARK", mark)
        monkeypatch.setenv("PS_TUNE_MALLOC", tune)
        [seen] = local_cluster(1, 1, _environment, run_timeout_s=60)
        assert seen == {"trainer": mark, "server": mark, "tunables": expected}, mark
    assert os.environ.get("GLIBC_TUNABLES") is None  # set only while the processes start


# ------------------------------------------------------------------- (2) equals a local store (RowWiseAdagrad)


def _train_vs_local(j, client):
    optimizer = RowWiseAdagrad(lr=0.05)
    client.register(TableConfig("item", 16, 10_000, optimizer, Uniform(-0.1, 0.1)))
    universe = torch.unique(torch.randint(-(2**63), 2**63 - 1, (300,), generator=_gen(3)))
    client.lookup("item", universe)  # insert every id on the servers
    # The reference starts from the servers' initial rows (two servers draw different random rows than one store).
    local = EmbeddingStore(16, 10_000, optimizer)
    local.lookup(universe)
    state = local.state_dict()
    state["weights"] = client.lookup("item", state["ids"], train=False)
    local.load_state_dict(state)
    initial = local.lookup(universe, train=False)
    target = torch.randn(universe.numel(), 16, generator=_gen(4))
    for step in range(6):
        pick = torch.randint(0, universe.numel(), (256,), generator=_gen(5, step))  # with duplicates
        batch = universe[pick]
        ps_rows, local_rows = client.lookup("item", batch), local.lookup(batch)
        torch.testing.assert_close(ps_rows, local_rows, atol=1e-6, rtol=0)
        grads = ps_rows - target[pick]  # a real loss: pull the rows towards the targets
        assert client.push_gradients("item", batch, grads) == torch.unique(batch).numel()
        local.update(batch, grads)
    final = client.lookup("item", universe, train=False)
    torch.testing.assert_close(final, local.lookup(universe, train=False), atol=1e-6, rtol=0)
    moved = (final - initial).abs().amax().item()
    assert moved > 0.01  # the optimizer really ran
    return moved


@pytest.mark.processes
def test_ps_training_equals_local_store():
    [moved] = local_cluster(2, 1, _train_vs_local, run_timeout_s=60)
    assert moved > 0.01


# ------------------------------------------------------------------ (3) concurrent pushes lose no update


N_IDS, DIM3, STEPS = 64, 4, 12


def _pushes(rank):
    """The (ids, grads) batches trainer ``rank`` pushes: duplicates, gradients in eighths (exact float sums)."""
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, N_IDS, (96,), generator=_gen(6, rank, step))
        grads = torch.randint(-4, 5, (96, DIM3), generator=_gen(7, rank, step)).float() / 8
        out.append((ids, grads))
    return out


def _concurrent(j, client):
    client.register(TableConfig("clicks", DIM3, 1000, SGD(lr=1.0), Uniform(-1, 1)))
    universe = torch.arange(N_IDS)
    initial = client.lookup("clicks", universe)  # inserts; no trainer pushes before everyone passed the barrier
    barrier()
    futures = [client.push_gradients_async("clicks", ids, grads) for ids, grads in _pushes(j)]
    client.flush()
    updated = sum(f.wait() for f in futures)
    barrier()  # every trainer's pushes are applied
    final = client.lookup("clicks", universe, train=False)
    server_updates = sum(m["updates"] for m in client.metrics())
    return initial, final, updated, server_updates


@pytest.mark.processes
def test_concurrent_pushes_lose_no_update():
    results = local_cluster(2, 4, _concurrent, run_timeout_s=75)
    initial, final = results[0][0], results[0][1]
    total = torch.zeros(N_IDS, DIM3)
    for rank in range(4):
        for ids, grads in _pushes(rank):
            total.index_add_(0, ids, grads)
    assert all(torch.equal(r[0], initial) and torch.equal(r[1], final) for r in results)
    torch.testing.assert_close(final, initial - total, atol=1e-5, rtol=0)  # SGD lr=1: w = w0 - sum of all grads
    expected_rows = sum(torch.unique(ids).numel() for rank in range(4) for ids, _ in _pushes(rank))
    assert sum(r[2] for r in results) == expected_rows == results[0][3]


# ------------------------------------------------------------------------------------ (4) unavailable server


def _expect_unavailable(client, ids):
    start = time.monotonic()
    with pytest.raises(PsUnavailableError) as info:
        client.lookup("user", ids)
    return str(info.value), time.monotonic() - start


def _dead_server(j, client):
    client.register(TableConfig("user", 8, 1000))
    ids = torch.arange(200)
    on_ps0 = ids[server_of("user", ids, 2) == 0]
    rows = client.lookup("user", ids)
    pid = client.metrics()[1]["pid"]
    assert pid != os.getpid()

    # A hung server (stopped, connection open): the request times out.
    os.kill(pid, signal.SIGSTOP)
    try:
        hung = _expect_unavailable(client, ids)
        assert torch.equal(client.lookup("user", on_ps0), rows[on_ps0])  # only ps0 is asked: still served
    finally:
        os.kill(pid, signal.SIGCONT)
    assert torch.equal(client.lookup("user", ids), rows)  # recovered

    # A dead server (killed): the broken connection is reported at once.
    pidfd = os.pidfd_open(pid)
    os.kill(pid, signal.SIGKILL)
    assert select.select([pidfd], [], [], 10)[0], "ps1 did not die"  # readable once the process has exited
    os.close(pidfd)
    dead = _expect_unavailable(client, ids)
    with pytest.raises(PsUnavailableError, match="ps1"):
        client.push_gradients("user", ids, torch.zeros(200, 8))
    client.flush()  # that failure was reported by its own call, and is not raised again
    # A fire-and-forget push that fails before flush() is called: flush() reports it (the gradients were lost).
    push = client.push_gradients_async("user", ids, torch.zeros(200, 8))
    with pytest.raises(PsUnavailableError):
        push.wait()
    with pytest.raises(PsUnavailableError, match="ps1"):
        client.flush()
    client.flush()  # reported once
    assert torch.equal(client.lookup("user", on_ps0), rows[on_ps0])
    return hung, dead


@pytest.mark.processes
def test_unavailable_server_raises_naming_it():
    """A hung server fails the request at the client's timeout; a dead one by the lost connection, before it."""
    # The client timeout bounds every lookup, the healthy server's too: long enough for a loaded machine.
    timeout_s, run_timeout_s = 10.0, 120.0
    [(hung, dead)] = local_cluster(
        2, 1, _dead_server, timeout_s=timeout_s, run_timeout_s=run_timeout_s, end_on_lost_server=False
    )
    (hung_msg, hung_s), (dead_msg, dead_s) = hung, dead
    assert hung_msg.startswith(f"parameter server ps1 did not answer a lookup of table 'user' within {timeout_s:g} s")
    assert "MASTER_ADDR/MASTER_PORT" in hung_msg and "\n" not in hung_msg
    # The request's timeout ended the wait (RPC's timer may fire a little early), not the run's.
    assert 0.8 * timeout_s <= hung_s < run_timeout_s / 2
    # The broken connection, not the timeout, reported the dead server.
    assert dead_msg.startswith("parameter server ps1 did not answer a lookup of table 'user': connection lost")
    assert dead_s < run_timeout_s / 2


def _leaves_a_failing_push(j, client):
    client.register(TableConfig("user", 8, 1000))
    ids = torch.arange(200)
    client.lookup("user", ids)
    pid = client.metrics()[0]["pid"]
    pidfd = os.pidfd_open(pid)
    os.kill(pid, signal.SIGKILL)
    assert select.select([pidfd], [], [], 10)[0], "ps0 did not die"
    os.close(pidfd)
    client.push_gradients_async("user", ids, torch.ones(200, 8))  # not waited for: the closing flush must report it
    return "the body returned"


@pytest.mark.processes
def test_a_push_failing_after_the_body_returned_fails_the_trainer():
    """The launcher flushes a trainer's pushes before reporting it done: lost gradients are an error, not a success
    with a non-zero exit code nobody reads."""
    with pytest.raises(TrainerError, match=r"^trainer0 failed: PsUnavailableError: parameter server ps0 did not"):
        local_cluster(1, 1, _leaves_a_failing_push, timeout_s=10.0, run_timeout_s=60, end_on_lost_server=False)


def _fails_while_the_other_waits(j, client):
    if j == 0:
        raise RuntimeError("trainer 0 gives up")
    barrier(timeout_s=600)  # for trainer 0, which never comes


@pytest.mark.processes
def test_a_failed_trainer_does_not_leave_the_run_waiting_for_the_others():
    """A trainer waiting for a failed one (here in a barrier, in training a gloo collective) would hold the run
    until its own timeout: the launcher gives the others ``failure_grace_s``, then kills everything and reports."""
    start = time.monotonic()
    with pytest.raises(TrainerError, match=r"^trainer0 failed: RuntimeError: trainer 0 gives up"):
        local_cluster(1, 2, _fails_while_the_other_waits, run_timeout_s=600, failure_grace_s=2.0)
    assert time.monotonic() - start < 120  # the barrier alone would wait 600 s
    assert [p.name for p in multiprocessing.active_children() if p.name.startswith(("ps", "trainer"))] == []


@pytest.mark.processes
def test_a_trainer_that_cannot_start_leaves_no_server_running():
    """The servers start first; if a trainer then cannot (its body does not pickle), they are killed, not left
    waiting for the group until their rendezvous timeout."""
    with pytest.raises((pickle.PicklingError, AttributeError)):
        local_cluster(1, 1, lambda j, client: None, rpc_timeout_s=60)
    assert [p.name for p in multiprocessing.active_children() if p.name.startswith("ps")] == []


# ------------------------------------------------------------------------ (5) checkpoint -> kill -> load, re-shard

_CKPT_CONFIG = TableConfig("item", 16, 4000, RowWiseAdagrad(lr=0.05), Uniform(-0.05, 0.05), seed=3)
_CKPT_IDS = torch.cat([torch.arange(0, 900), torch.tensor([-1, -(2**63), 2**63 - 1])])


def _train_and_save(j, client, directory):
    client.register(_CKPT_CONFIG)
    for step in range(3):
        batch = _CKPT_IDS[torch.randperm(_CKPT_IDS.numel(), generator=_gen(10, step))[:600]]
        client.lookup("item", batch)
        client.push_gradients_async("item", batch, torch.randn(batch.numel(), 16, generator=_gen(11, step)))
    client.lookup("item", _CKPT_IDS)  # every id held
    version = client.save(directory)  # flushes the pushes, then every server writes, then LATEST moves
    client.dump_incremental(f"{directory}/deltas", 0)  # everything so far
    touched = _CKPT_IDS[[3, 7, 7, 500, -1]]
    client.push_gradients("item", touched, torch.ones(touched.numel(), 16))
    assert client.dump_incremental(f"{directory}/deltas", 1) == 4  # exactly the distinct rows touched since
    # A second checkpoint that keeps only itself: version 1 is pruned once version 2 is committed.
    assert client.save(directory, keep=1) == version + 1
    return version, client.lookup("item", _CKPT_IDS, train=False)


def _load_and_read(j, client, directory):
    client.register(_CKPT_CONFIG)
    loaded = client.load(directory)
    held = [m["rows"] for m in client.metrics()]
    expected = torch.bincount(server_of("item", _CKPT_IDS, client.n_servers), minlength=client.n_servers).tolist()
    return loaded, held, expected, client.lookup("item", _CKPT_IDS, train=False)


@pytest.mark.processes
def test_checkpoint_survives_the_servers_and_reshards(tmp_path):
    ((version, saved),) = local_cluster(2, 1, _train_and_save, str(tmp_path))  # then every process exits
    assert version == 1
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v00000002"]  # save(keep=1) pruned version 1
    for n_servers in (3, 1):
        ((loaded, held, expected, rows),) = local_cluster(n_servers, 1, _load_and_read, str(tmp_path))
        assert loaded == _CKPT_IDS.numel()
        assert held == expected  # each id on the server server_of names for the new count
        assert torch.equal(rows, saved)  # every row bit-exact


# ------------------------------------------------------------------------------ (6) injected latency (delay_ms)

DELAY_MS = 50


def _delayed(j, client):
    assert client.delay_ms == DELAY_MS
    plain = PsClient(client.servers, timeout_s=client.timeout_s)  # the same servers, no delay
    config = TableConfig("slow", 8, 10_000, SGD(lr=0.5), Uniform(-0.1, 0.1), seed=4)
    started = time.perf_counter()
    client.register(config)  # every request is delayed, not only lookups
    register_s = time.perf_counter() - started
    plain.register(config)
    ids = torch.randint(0, 5000, (4, 300), generator=_gen(20))
    reference = plain.lookup("slow", ids)  # inserts every id; the delayed lookups below are hits

    started = time.perf_counter()
    rows = client.lookup("slow", ids)
    one_s = time.perf_counter() - started

    started = time.perf_counter()
    futures = [client.lookup_async("slow", ids[k]) for k in range(4)]
    issue_s = time.perf_counter() - started  # the caller is not blocked by the delay
    concurrent = [f.wait() for f in futures]
    four_s = time.perf_counter() - started

    distinct = torch.unique(ids[0])
    before = plain.lookup("slow", distinct, train=False)
    started = time.perf_counter()
    pushed = client.push_gradients("slow", distinct, torch.ones(distinct.numel(), 8))
    push_s = time.perf_counter() - started
    started = time.perf_counter()
    client.metrics()
    metrics_s = time.perf_counter() - started
    after = plain.lookup("slow", distinct, train=False)
    client.close()
    return {
        "same": torch.equal(rows, reference)
        and all(torch.equal(c, r) for c, r in zip(concurrent, reference, strict=True)),
        "pushed": pushed == distinct.numel(),
        "applied": torch.allclose(after, before - 0.5),
        "times": (register_s, one_s, issue_s, four_s, push_s, metrics_s),
    }


@pytest.mark.processes
def test_delay_ms_delays_every_request_and_delays_overlap():
    [result] = local_cluster(2, 1, _delayed, delay_ms=DELAY_MS, run_timeout_s=60)
    register_s, one_s, issue_s, four_s, push_s, metrics_s = result["times"]
    assert result["same"] and result["pushed"] and result["applied"]  # values identical to a no-delay client
    delay = DELAY_MS / 1000
    assert min(register_s, one_s, push_s, metrics_s) >= delay  # a lower bound: every request waits the delay
    assert four_s >= delay
    assert issue_s < delay  # lookup_async returns before the delay has passed
    assert four_s < 4 * delay  # the four delays overlap (sequential delays alone would take 4 x 50 ms)


def test_delay_scheduler_fires_in_due_order_without_blocking():
    scheduler = DelayScheduler()
    fired: list[tuple[str, float]] = []
    start = time.monotonic()
    for name, due_ms in (("c", 60), ("a", 20), ("b", 40), ("a2", 20)):
        scheduler.at(start + due_ms / 1000, lambda name=name: fired.append((name, time.monotonic() - start)))
    assert time.monotonic() - start < 0.02  # at() returns at once
    scheduler.close()  # sends (runs) everything due, then stops
    assert [name for name, _ in fired] == ["a", "a2", "b", "c"]  # by due time, ties in scheduling order
    assert all(t >= due / 1000 for (_, t), due in zip(fired, (20, 20, 40, 60), strict=True))
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.at(time.monotonic(), lambda: None)


def test_client_argument_checks_and_allocator_env():
    with pytest.raises(ValueError, match="delay_ms"):
        PsClient(["ps0"], delay_ms=-1.0)
    ours = "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1"
    assert allocator_env({}) == {"GLIBC_TUNABLES": ours}
    assert allocator_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{ours}"
    }
    # The user's own setting of a tunable stands; only the ones not named are added.
    assert allocator_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.tcache_count=3:glibc.malloc.hugetlb=1"
    }
    assert allocator_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.tcache_count=3"}) == {}
    assert allocator_env({"PS_TUNE_MALLOC": "0"}) == {}


def test_metrics_are_logged_periodically(caplog):
    stop = threading.Event()
    with caplog.at_level(logging.INFO, logger="persia_planner.modules.ps.server"):
        thread = log_metrics_every(0.02, stop)
        time.sleep(0.15)
        stop.set()
        thread.join(5)
    lines = [r.getMessage() for r in caplog.records if "lookups/s" in r.getMessage()]
    assert len(lines) >= 2 and "rows" in lines[0]
    assert not thread.is_alive()


# ------------------------------------------------------------------------------------ (7) wire dtype (fp16/bf16)

_WIRE_LR = 0.05


def _wire_reference(client, name, optimizer, universe):
    """A local store holding exactly the servers' current rows of ``universe`` for table ``name``."""
    local = EmbeddingStore(16, 10_000, optimizer)
    local.lookup(universe)
    state = local.state_dict()
    state["weights"] = client.lookup(name, state["ids"], train=False)
    local.load_state_dict(state)
    return local


def _wire_dtypes(j, client):
    half = PsClient(client.servers, timeout_s=client.timeout_s, wire_dtype=torch.float16)
    bf16 = PsClient(client.servers, timeout_s=client.timeout_s, wire_dtype=torch.bfloat16)
    assert client.wire_dtype == torch.float32 and half.wire_dtype == torch.float16
    universe = torch.unique(torch.randint(-(2**63), 2**63 - 1, (400,), generator=_gen(30)))
    out = {}
    for name, optimizer in (("sgd", SGD(lr=_WIRE_LR)), ("rowwise", RowWiseAdagrad(lr=_WIRE_LR))):
        config = TableConfig(name, 16, 10_000, optimizer, Uniform(-0.5, 0.5), seed=5)
        for c in (client, half, bf16):
            c.register(config)
        # Lookups (duplicates, 2-d, two servers): every value rounded once to the wire dtype, returned as float32.
        batch = universe[torch.randint(0, universe.numel(), (6, 100), generator=_gen(31))]
        rows32 = client.lookup(name, batch)  # inserts every id of the batch
        rows16, rows_bf = half.lookup(name, batch), bf16.lookup(name, batch)
        assert rows16.dtype == rows_bf.dtype == torch.float32 and rows16.shape == rows32.shape == (6, 100, 16)
        assert torch.equal(rows16, rows32.half().float())
        assert torch.equal(rows_bf, rows32.bfloat16().float())
        assert not torch.equal(rows16, rows32)  # the rows really travelled rounded
        cold = torch.arange(50_000, 50_010)  # never trained: their initial rows, rounded once for the wire
        assert torch.equal(half.lookup(name, cold, train=False), client.read_rows(name, cold).half().float())
        client.lookup(name, universe)  # every id held

        # Pushes of distinct ids: the servers step with exactly grads.half().float(), in float32.
        local = _wire_reference(client, name, optimizer, universe)
        fp32_local = _wire_reference(client, name, optimizer, universe)
        for step in range(3):
            ids = universe[torch.randperm(universe.numel(), generator=_gen(32, step))[:150]]
            grads = torch.randn(ids.numel(), 16, generator=_gen(33, step))
            assert half.push_gradients(name, ids, grads) == ids.numel()
            local.update(ids, grads.half().float())
            fp32_local.update(ids, grads)
        after = client.lookup(name, universe, train=False)
        torch.testing.assert_close(after, local.lookup(universe, train=False), atol=1e-6, rtol=0)
        assert (after - fp32_local.lookup(universe, train=False)).abs().amax() > 1e-5  # not float32 gradients

        # Duplicate ids: summed per id in float32 on the client, then rounded once for the wire.
        ids = universe[torch.randint(0, 40, (300,), generator=_gen(34))]
        grads = torch.randn(ids.numel(), 16, generator=_gen(35))
        uniq, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(uniq.numel(), 16).index_add_(0, inverse, grads)
        assert half.push_gradients(name, ids, grads) == uniq.numel()
        local.update(uniq, summed.half().float())
        torch.testing.assert_close(
            client.lookup(name, universe, train=False), local.lookup(universe, train=False), atol=1e-6, rtol=0
        )

        # A finite gradient that float16 cannot hold is refused, not turned into inf weights; bfloat16 holds it.
        with pytest.raises(WireOverflowError, match=r"overflow torch\.float16.*fix: send bfloat16"):
            half.push_gradients(name, universe[:2], torch.full((2, 16), 1e5))
        # A nan in one row must not hide a finite overflow in another.
        with pytest.raises(WireOverflowError, match=r"largest summed \|gradient\| 100000 "):
            nan_and_big = torch.stack([torch.full((16,), float("nan")), torch.full((16,), 1e5)])
            half.push_gradients(name, universe[:2], nan_and_big)
        assert bf16.push_gradients(name, universe[:2], torch.full((2, 16), 1e5)) == 2
        assert torch.isfinite(client.lookup(name, universe, train=False)).all()
        out[name] = client.metrics()
    return {name: [m["tables"][name]["updates"] for m in metrics] for name, metrics in out.items()}


@pytest.mark.processes
def test_fp16_and_bf16_on_the_wire_round_once_and_keep_fp32_on_the_server():
    [updates] = local_cluster(2, 1, _wire_dtypes, run_timeout_s=75)
    # 3 x 150 distinct + the duplicate batch's distinct ids + 2 (bfloat16), split over both servers
    assert all(min(per_server) > 0 for per_server in updates.values())


def _default_is_exact(j, client):
    assert client.wire_dtype == torch.float32
    optimizer = RowWiseAdagrad(lr=_WIRE_LR)
    client.register(TableConfig("exact", 16, 10_000, optimizer, Uniform(-0.5, 0.5), seed=6))
    universe = torch.unique(torch.randint(-(2**63), 2**63 - 1, (300,), generator=_gen(40)))
    client.lookup("exact", universe)
    local = _wire_reference(client, "exact", optimizer, universe)
    for step in range(4):
        batch = universe[torch.randint(0, universe.numel(), (4, 128), generator=_gen(41, step))]  # duplicates
        assert torch.equal(client.lookup("exact", batch, train=False), local.lookup(batch, train=False))
        grads = torch.randn(4, 128, 16, generator=_gen(42, step))
        client.push_gradients("exact", batch, grads)
        local.update(batch, grads)
    final = client.lookup("exact", universe, train=False)
    return torch.equal(final, local.lookup(universe, train=False)), (
        final.view(torch.int32) == local.lookup(universe, train=False).view(torch.int32)
    ).all().item()


@pytest.mark.processes
def test_default_wire_stays_bit_exact():
    [(equal, same_bits)] = local_cluster(2, 1, _default_is_exact, run_timeout_s=60)
    assert equal and same_bits


def test_wire_dtype_is_validated():
    for bad in (torch.float64, torch.int8, "float16", None):
        with pytest.raises(ValueError, match=r"^wire_dtype must be torch\.float32, torch\.float16 or torch\.bfloat16"):
            PsClient(["ps0"], wire_dtype=bad)
    # connect checks before joining the RPC group (no MASTER_ADDR needed to get the error).
    with pytest.raises(ValueError, match="wire_dtype") as info:
        connect("trainer0", 1, 2, servers=["ps0"], wire_dtype=torch.float64)
    assert "\n" not in str(info.value) and "torch.float64" in str(info.value)
    assert check_wire_dtype(torch.bfloat16) is torch.bfloat16


def test_server_functions_cast_on_the_wire_in_process(monkeypatch):
    """The RPC functions called directly (no RPC group): casts, refusals and the float32 upcast of gradients."""
    server_state.reset_state()  # a fresh server state, as a restarted server has
    config = TableConfig("wire_unit", 8, 100, SGD(lr=1.0), Uniform(-1, 1), seed=9)
    assert server_module.create(config) == 0
    ids = torch.tensor([3, 5, 9])
    rows = server_module.lookup("wire_unit", ids, True, True)
    assert rows.dtype == torch.float32
    assert torch.equal(server_module.lookup("wire_unit", ids, True, True, torch.float16), rows.half())
    assert torch.equal(server_module.lookup("wire_unit", ids, True, True, torch.float32), rows)
    refused = server_module.lookup("wire_unit", ids, True, True, torch.int8)
    assert isinstance(refused, RemoteFailure) and "torch.int8" in refused.message
    grads = torch.tensor([[1 / 3] * 8, [-2.0] * 8, [1e-3] * 8])
    assert server_module.update("wire_unit", ids, grads.half(), True) == 3
    after = server_module.lookup("wire_unit", ids, False, True)
    assert torch.equal(after, rows - grads.half().float())  # SGD lr=1 on the upcast gradients, in float32
    # A weight beyond float16's range is refused for a float16 wire (it would arrive as inf), not for bfloat16.
    assert server_module.update("wire_unit", ids[:1], torch.full((1, 8), -70000.0), True) == 1
    refused = server_module.lookup("wire_unit", ids, False, True, torch.float16)
    assert isinstance(refused, RemoteFailure) and "beyond float16's 65504" in refused.message
    assert "wire_unit" in refused.message and "\n" not in refused.message
    assert torch.isfinite(server_module.lookup("wire_unit", ids, False, True, torch.bfloat16)).all()
    # ... until a weight passes bfloat16's range (~3.39e38, below float32's): then bfloat16 refuses too.
    assert server_module.update("wire_unit", ids[1:2], torch.full((1, 8), -3.4e38), True) == 1
    refused = server_module.lookup("wire_unit", ids, False, True, torch.bfloat16)
    assert isinstance(refused, RemoteFailure) and "beyond torch.bfloat16's range" in refused.message
    assert "\n" not in refused.message
    assert torch.isfinite(server_module.lookup("wire_unit", ids[2:], False, True, torch.bfloat16)).all()


def test_a_dropped_table_leaves_the_server_and_its_metrics_in_process():
    server_state.reset_state()
    server_module.create(TableConfig("kept", 4, 10))
    server_module.create(TableConfig("scratch", 4, 10))
    server_module.lookup("scratch", torch.tensor([1, 2]), True, True)
    assert server_module.drop("scratch") is True and server_module.drop("scratch") is False
    assert set(server_module.server_metrics()["tables"]) == {"kept"}
    refused = server_module.lookup("scratch", torch.tensor([1]), True, True)
    assert isinstance(refused, RemoteFailure) and "no table 'scratch'" in refused.message
    server_module.create(TableConfig("scratch", 8, 10))  # the name is free again, for another config


def test_trainers_store_needs_the_rendezvous_address(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(PlannerError, match=r"^MASTER_ADDR and MASTER_PORT must be set for the trainers' group") as info:
        trainers_store()
    assert "MASTER_ADDR=None" in str(info.value) and "\n" not in str(info.value)


def test_server_checkpoint_records_its_last_dump_for_replicas(monkeypatch, tmp_path):
    """A checkpoint saved by the servers records the last dump before it, so a replica starting from it applies only
    later deltas: an older delta's removals and upserts must not undo what the checkpoint holds."""
    server_state.reset_state()
    config = TableConfig("seq", 4, 2, SGD(lr=1.0), Uniform(-1, 1), eviction_chunk=0.0)
    server_module.create(config)
    deltas, base = tmp_path / "deltas", tmp_path / "ckpt"
    server_module.dump(str(deltas), 0)  # starts the eviction log
    server_module.lookup("seq", torch.tensor([1, 2]), True, True)
    server_module.dump(str(deltas), 1)
    server_module.lookup("seq", torch.tensor([3]), True, True)  # evicts 1: delta 2 removes it
    server_module.dump(str(deltas), 2)
    server_module.lookup("seq", torch.tensor([1]), True, True)  # evicts 2, 1 is back
    assert server_module.save(str(base), 1, 1) == 2
    commit(base, 1, n_servers=1)
    info = read_latest(base)
    assert info["delta_sequence"] == 2
    rows, _ = load_rows(base, server=0, n_servers=1)
    folded = apply_deltas(rows, deltas, after=info["delta_sequence"])["seq"]
    assert folded["ids"].tolist() == [1, 3]  # what the server holds; applying delta 2 would drop 1 and keep 2
    # A server restarted from that checkpoint continues from the same point.
    server_state.reset_state()
    server_module.create(config)
    assert server_module.load(str(base), 1) == 2
    assert server_state.state().last_dump_sequence == 2


def test_a_restored_server_supersedes_the_rolled_back_runs_deltas(monkeypatch, tmp_path):
    """Deltas a run dumped after the checkpoint it is later rolled back to must not reach replicas: the restored
    server's first dump removes its files numbered after the checkpoint's delta_sequence."""
    server_state.reset_state()
    config = TableConfig("roll", 4, 100, SGD(lr=1.0), Uniform(-1, 1), seed=5)
    server_module.create(config)
    deltas, base = tmp_path / "deltas", tmp_path / "ckpt"
    server_module.lookup("roll", torch.tensor([1]), True, True)
    server_module.dump(str(deltas), 0)
    server_module.save(str(base), 1, 1)
    commit(base, 1, n_servers=1)  # delta_sequence 0
    for sequence, new_id in ((1, 2), (2, 3), (3, 4)):  # the run that will be rolled back
        server_module.lookup("roll", torch.tensor([new_id]), True, True)
        server_module.dump(str(deltas), sequence)
    server_state.reset_state()  # a crash; the job restarts from the checkpoint
    server_module.create(config)
    server_module.load(str(base), 1)
    server_module.lookup("roll", torch.tensor([7]), True, True)
    refused = server_module.dump(str(deltas), 0)  # at or below the checkpoint's: a replica would skip it
    assert isinstance(refused, RemoteFailure) and "dump sequence 0 must be above 0" in refused.message
    server_module.dump(str(deltas), 1)  # numbering goes on from the checkpoint's delta_sequence
    assert sorted(p.name for p in deltas.iterdir()) == ["delta-00000000.server0.pt", "delta-00000001.server0.pt"]
    rows, _ = load_rows(base, server=0, n_servers=1)
    replica = apply_deltas(rows, deltas, after=read_latest(base)["delta_sequence"])["roll"]
    held = server_state.state().table("roll").store.state_dict()["ids"]
    assert sorted(replica["ids"].tolist()) == sorted(held.tolist()) == [1, 7]


def test_server_load_refusing_a_table_loads_none(monkeypatch, tmp_path):
    """A table the checkpoint cannot fill (more rows than its new capacity) makes the whole load fail with one line
    naming it, and no table is replaced: the server is not left half old, half new."""
    server_state.reset_state()
    big, small = TableConfig("a_big", 4, 100, SGD(lr=1.0), seed=1), TableConfig("b_small", 4, 100, SGD(lr=1.0), seed=2)
    server_module.create(big)
    server_module.create(small)
    server_module.lookup("a_big", torch.arange(10), True, True)
    server_module.lookup("b_small", torch.arange(50), True, True)
    assert server_module.save(str(tmp_path), 1, 1) == 60
    commit(tmp_path, 1, n_servers=1)
    # Restarted with b_small's capacity too low for its 50 saved rows; a_big already holds other rows.
    server_state.reset_state()
    server_module.create(big)
    server_module.create(TableConfig("b_small", 4, 20, SGD(lr=1.0), seed=2))
    before = server_module.lookup("a_big", torch.arange(100, 105), True, True)
    refused = server_module.load(str(tmp_path), 1)
    assert isinstance(refused, RemoteFailure) and "\n" not in refused.message
    assert "cannot load table 'b_small'" in refused.message and "nothing was loaded" in refused.message
    table = server_state.state().table("a_big").store
    assert len(table) == 5 and torch.equal(server_module.lookup("a_big", torch.arange(100, 105), False, True), before)


def test_a_seeded_table_keeps_its_seed_through_a_checkpoint_and_loads_alone(tmp_path):
    """A table moved from the trainers: the servers answer unheld ids from its seed (row ``id mod rows``), a
    checkpoint keeps the seed, and a load of only some tables leaves the others as they are."""
    server_state.reset_state()
    moved, other = TableConfig("moved", 4, 100, SGD(lr=1.0), seed=1), TableConfig("other", 4, 100, SGD(lr=1.0))
    server_module.create(moved)
    server_module.create(other)
    seed = torch.arange(12.0).view(3, 4)
    refused = server_module.seed("moved", torch.zeros(3, 5))
    assert isinstance(refused, RemoteFailure) and "seed weights must be [rows, 4], got (3, 5)" in refused.message
    assert server_module.seed("moved", seed) is True
    assert torch.equal(server_module.read("moved", torch.tensor([4, 9])), seed[[1, 0]])
    server_module.lookup("moved", torch.tensor([4]), True, True)
    server_module.lookup("other", torch.arange(3), True, True)
    server_module.save(str(tmp_path), 1, 1)
    commit(tmp_path, 1, n_servers=1)
    server_state.reset_state()
    server_module.create(moved)
    server_module.create(other)
    server_module.lookup("other", torch.arange(10, 12), True, True)
    assert server_module.load(str(tmp_path), 1, ["moved"]) == 1
    assert torch.equal(server_module.read("moved", torch.tensor([5])), seed[[2]])  # the seed came back
    assert server_state.state().table("other").store.state_dict()["ids"].tolist() == [10, 11]  # not loaded


@pytest.mark.parametrize(
    ("name", "peers", "message", "lost"),
    [
        # A follower's shutdown fails on its call to the leader (the smallest name): the leader is the lost one.
        ("trainer0", ["ps0", "ps1"], "ECONNRESET: connection reset by peer (this error originated at x.cc:132)", "ps0"),
        # The leader's fails on the followers torch lists.
        (
            "ps0",
            ["ps1", "trainer0"],
            "Followers ['trainer0'] timed out in _all_gather after 0.00 seconds. The first exception is ECONNRESET: "
            "connection reset by peer (this error originated at x.cc:132)",
            "trainer0",
        ),
        ("ps0", ["ps1", "trainer0"], "something torch did not say who", None),
    ],
)
def test_a_failed_shutdown_names_the_worker_it_failed_on(name, peers, message, lost):
    err = RuntimeError(message)
    error = shutdown_error(name, peers, err, is_server=name.startswith("ps"))
    if lost is None:
        assert error is err  # nothing to name: torch's own error goes on
        return
    assert isinstance(error, PeerLostError) and error.peer == lost and error.worker == name
    who = "parameter server ps0" if name == "ps0" else "trainer trainer0"
    assert str(error).startswith(
        f"{who}: worker {lost} of its RPC group stopped answering (ECONNRESET: connection reset by peer) during the "
        "group's shutdown; "
    ), str(error)
    assert "\n" not in str(error) and f"fix: look at {lost}'s log" in str(error)
    assert shutdown_error(name, peers, KeyboardInterrupt(), is_server=False).__class__ is KeyboardInterrupt
