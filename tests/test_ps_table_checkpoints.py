"""PS checkpoints: bit-exact round trip, re-sharding on load, crash safety, incremental dumps for serving."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from persia_planner.modules.ps import deltas
from persia_planner.modules.ps import table_checkpoints as ckpt
from persia_planner.modules.ps.optim import SGD, Adam, RowWiseAdagrad
from persia_planner.modules.ps.sharding import server_of
from persia_planner.modules.ps.store import EmbeddingStore

CONFIGS = {
    "user": {"dim": 8, "capacity": 400, "optimizer": "adam"},
    "item": {"dim": 4, "capacity": 300, "optimizer": "rowwise_adagrad"},
}
STATE_KEYS = ("ids", "weights", "state", "last_access", "count")


def _optimizer(name: str):
    return {"adam": Adam(lr=0.01), "rowwise_adagrad": RowWiseAdagrad(lr=0.1), "sgd": SGD(lr=0.5)}[name]


def make_store(table: str, config: dict, *, capacity: int | None = None) -> EmbeddingStore:
    return EmbeddingStore(config["dim"], capacity or config["capacity"], _optimizer(config["optimizer"]))


def _random_ids(n: int, seed: int) -> torch.Tensor:
    """``n`` distinct ids spread over the whole uint64 space (int64 bit patterns)."""
    ids = torch.unique(torch.randint(-(2**63), 2**63 - 1, (n + 16,), generator=torch.Generator().manual_seed(seed)))
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))][:n]


def _train(store: EmbeddingStore, ids: torch.Tensor, seed: int) -> None:
    """A training step: lookup (inserts misses) then an update with deterministic gradients."""
    store.lookup(ids)
    grads = torch.randn(ids.numel(), store.dim, generator=torch.Generator().manual_seed(seed))
    store.update(ids, grads)


def _build_servers(n_servers: int, n_ids: int = 240, seed: int = 0) -> list[dict[str, EmbeddingStore]]:
    """Stores of ``n_servers`` servers, each holding exactly the ids ``server_of`` assigns it, trained a few steps."""
    servers = []
    for i in range(n_servers):
        stores = {}
        for t, (table, config) in enumerate(CONFIGS.items()):
            ids = _random_ids(n_ids, seed + t)
            mine = ids[server_of(table, ids, n_servers) == i]
            store = make_store(table, config)
            for step in range(3):
                _train(store, mine[step * 7 :], seed=100 * t + 10 * i + step)  # uneven access counts / times
            stores[table] = store
        servers.append(stores)
    return servers


def _merged(states: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate state dicts and sort rows by id, so sets of rows compare with ``torch.equal``."""
    cat = {k: torch.cat([s[k] for s in states]) for k in STATE_KEYS}
    order = torch.argsort(cat["ids"])
    return {k: v[order] for k, v in cat.items()}


def _assert_states_equal(a: dict, b: dict) -> None:
    for k in STATE_KEYS:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_round_trip_one_server_is_bit_exact(tmp_path: Path):
    [stores] = _build_servers(1)
    version_dir = ckpt.save_all([stores], tmp_path, configs=CONFIGS)
    assert version_dir == tmp_path / "v00000001"
    assert json.loads((tmp_path / "LATEST").read_text()) == {"version": 1, "n_servers": 1}
    assert sorted(p.name for p in version_dir.iterdir()) == [
        "item.server0-of-1.pt",
        "manifest.server0-of-1.json",
        "user.server0-of-1.pt",
    ]
    manifest = json.loads((version_dir / "manifest.server0-of-1.json").read_text())
    assert manifest["format"] == ckpt.SHARD_FORMAT
    size = (version_dir / "user.server0-of-1.pt").stat().st_size
    assert manifest["tables"]["user"] == {
        "file": "user.server0-of-1.pt",
        "rows": 240,
        "bytes": size,
        "sha256": hashlib.sha256((version_dir / "user.server0-of-1.pt").read_bytes()).hexdigest(),
        "config": CONFIGS["user"],
    }
    assert ckpt.verify(tmp_path)["version"] == 1

    loaded = ckpt.load_shard(tmp_path, server=0, n_servers=1, make_store=make_store)
    assert set(loaded) == {"user", "item"}
    for table, store in stores.items():
        want, got = store.state_dict(), loaded[table].state_dict()
        for k in STATE_KEYS:  # same order, not only the same set: a 1 -> 1 load is a plain copy
            assert torch.equal(want[k], got[k]), (table, k)
        assert got["step"] == want["step"] == 3
        assert loaded[table].capacity == CONFIGS[table]["capacity"]
        ids = want["ids"]
        assert torch.equal(loaded[table].lookup(ids, train=False), store.lookup(ids, train=False))


@pytest.mark.parametrize(("saved_n", "loaded_n"), [(1, 3), (3, 2)])
def test_reshard_on_load(tmp_path: Path, saved_n: int, loaded_n: int):
    servers = _build_servers(saved_n)
    ckpt.save_all(servers, tmp_path, configs=CONFIGS)
    loaded = [ckpt.load_shard(tmp_path, server=i, n_servers=loaded_n, make_store=make_store) for i in range(loaded_n)]
    for table in CONFIGS:
        saved = _merged([s[table].state_dict() for s in servers])
        parts = [loaded[i][table].state_dict() for i in range(loaded_n)]
        for i, part in enumerate(parts):
            # Every id on the server server_of names for the new count, and that server holds some ids.
            assert part["ids"].numel() > 0
            assert (server_of(table, part["ids"], loaded_n) == i).all()
        got = _merged(parts)
        assert sum(p["ids"].numel() for p in parts) == saved["ids"].numel() == 240  # nothing lost or duplicated
        assert torch.unique(got["ids"]).numel() == 240
        _assert_states_equal(got, saved)


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    servers = _build_servers(2)
    ckpt.save_all(servers, tmp_path, configs=CONFIGS)
    before = _file_bytes(tmp_path)
    want = [{t: s.state_dict() for t, s in stores.items()} for stores in servers]
    for stores in servers:  # train on, so a successful save would change the rows
        _train(stores["user"], stores["user"].state_dict()["ids"][:20], seed=7)

    calls = {"n": 0}
    real_save = torch.save

    def failing_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="simulated"):
        ckpt.save_all(servers, tmp_path, configs=CONFIGS)
    monkeypatch.setattr(torch, "save", real_save)

    # The half-written version 2 holds one shard file, no manifest and no temp file; nothing old was touched.
    assert sorted(p.name for p in (tmp_path / "v00000002").iterdir()) == ["user.server0-of-2.pt"]
    assert {k: v for k, v in _file_bytes(tmp_path).items() if not k.startswith("v00000002")} == before
    assert ckpt.read_latest(tmp_path)["version"] == 1
    with pytest.raises(FileNotFoundError):
        ckpt.commit(tmp_path, 2, n_servers=2)  # the coordinator cannot commit an incomplete version
    for i in range(2):
        loaded = ckpt.load_shard(tmp_path, server=i, n_servers=2, make_store=make_store)
        for table in CONFIGS:
            _assert_states_equal(loaded[table].state_dict(), want[i][table])

    # A retry writes version 2 over the debris and commits it.
    ckpt.save_all(servers, tmp_path, configs=CONFIGS)
    assert ckpt.read_latest(tmp_path)["version"] == 2
    loaded = ckpt.load_shard(tmp_path, server=1, n_servers=2, make_store=make_store)
    _assert_states_equal(loaded["user"].state_dict(), servers[1]["user"].state_dict())


@pytest.mark.processes
def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path: Path):
    servers = _build_servers(1)
    ckpt.save_all(servers, tmp_path, configs=CONFIGS)
    before = _file_bytes(tmp_path)
    # A separate process loads, trains, and dies (os._exit: no cleanup, no finally) while writing the 2nd file.
    script = textwrap.dedent(
        f"""
        import os, torch
        from persia_planner.modules.ps import table_checkpoints as ckpt
        from persia_planner.modules.ps.store import EmbeddingStore
        from persia_planner.modules.ps.optim import Adam, RowWiseAdagrad
        opt = {{"adam": Adam(lr=0.01), "rowwise_adagrad": RowWiseAdagrad(lr=0.1)}}
        make = lambda t, c: EmbeddingStore(c["dim"], c["capacity"], opt[c["optimizer"]])
        stores = ckpt.load_shard({str(tmp_path)!r}, server=0, n_servers=1, make_store=make)
        for s in stores.values():
            s.update(s.state_dict()["ids"], torch.ones(len(s), s.dim))
        real, calls = torch.save, [0]
        def dying_save(obj, f, *a, **k):
            calls[0] += 1
            if calls[0] == 2:
                f.write(b"PK\\x03\\x04 half a zip")
                f.flush()
                os._exit(9)
            return real(obj, f, *a, **k)
        torch.save = dying_save
        ckpt.save_all([stores], {str(tmp_path)!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()
    after = _file_bytes(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("v00000002")} == before
    # The debris: one complete shard and one orphaned temp file, neither under a name a loader reads.
    debris = sorted(k for k in after if k.startswith("v00000002"))
    assert len(debris) == 2 and any(".tmp-" in k for k in debris)
    loaded = ckpt.load_shard(tmp_path, server=0, n_servers=1, make_store=make_store)
    for table in CONFIGS:
        _assert_states_equal(loaded[table].state_dict(), servers[0][table].state_dict())


def test_capacity_error_names_the_table(tmp_path: Path):
    servers = _build_servers(1)
    ckpt.save_all(servers, tmp_path, configs=CONFIGS)

    def small(table: str, config: dict) -> EmbeddingStore:
        return make_store(table, config, capacity=100 if table == "item" else None)

    with pytest.raises(ValueError, match=r"table 'item'.*240 rows.*capacity 100"):
        ckpt.load_shard(tmp_path, server=0, n_servers=1, make_store=small)
    # Spread over 3 servers, about 80 rows each fit.
    loaded = ckpt.load_shard(tmp_path, server=0, n_servers=3, make_store=small)
    assert 0 < len(loaded["item"]) <= 100


def test_save_refuses_to_overwrite_the_committed_version(tmp_path: Path):
    servers = _build_servers(1)
    ckpt.save_all(servers, tmp_path)
    with pytest.raises(ValueError, match="committed"):
        ckpt.save_shard(servers[0], tmp_path, server=0, n_servers=1, version=1)
    with pytest.raises(FileNotFoundError):
        ckpt.load_shard(tmp_path / "nothing", server=0, n_servers=1, make_store=make_store)


def _delta_tables(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    delta = torch.load(path, weights_only=True)
    assert delta["format"] == deltas.DELTA_FORMAT
    return delta["tables"]


def test_incremental_dumps_fold_to_live_rows(tmp_path: Path):
    base_dir, delta_dir = tmp_path / "ckpt", tmp_path / "deltas"
    [stores] = _build_servers(1)
    user = stores["user"]
    first = deltas.dump_incremental(stores, delta_dir, server=0, sequence=0)
    assert first.name == "delta-00000000.server0.pt"
    assert _delta_tables(first)["user"]["ids"].numel() == 240  # everything was inserted since construction
    ckpt.save_all([stores], base_dir, configs=CONFIGS, delta_sequence=0)

    ids = user.state_dict()["ids"]
    touched = ids[torch.tensor([3, 50, 51, 199])]
    user.lookup(ids[100:120])  # hits only refresh LRU metadata: not dirty
    user.update(torch.cat([touched, touched[:1]]), torch.ones(5, user.dim))  # a duplicate counts once
    tables = _delta_tables(deltas.dump_incremental(stores, delta_dir, server=0, sequence=1, with_state=True))
    got = tables["user"]
    assert torch.equal(torch.sort(got["ids"]).values, torch.sort(touched).values)
    assert torch.equal(got["weights"], user.lookup(got["ids"], train=False))
    assert got["state"].shape == (4, user.state_width)
    assert tables["item"]["ids"].numel() == 0 and tables["item"]["weights"].shape == (0, 4)

    new_ids = _random_ids(30, seed=99)
    _train(user, new_ids, seed=5)  # 30 inserts + updates
    _train(stores["item"], stores["item"].state_dict()["ids"][:10], seed=6)
    tables = _delta_tables(deltas.dump_incremental(stores, delta_dir, server=0, sequence=2))
    assert torch.equal(torch.sort(tables["user"]["ids"]).values, torch.sort(new_ids).values)
    assert tables["item"]["ids"].numel() == 10 and "state" not in tables["item"]

    # A replica: base checkpoint + the deltas after it == the live rows, for 1 replica shard and for 2.
    info = ckpt.read_latest(base_dir)
    assert info["delta_sequence"] == 0
    assert [p.name for p in deltas.list_deltas(delta_dir, after=0)] == [
        "delta-00000001.server0.pt",
        "delta-00000002.server0.pt",
    ]
    base, _ = ckpt.load_rows(base_dir, server=0, n_servers=1)
    folded = deltas.apply_deltas(base, delta_dir, after=info["delta_sequence"])
    for table, store in stores.items():
        live = _merged([store.state_dict()])
        assert torch.equal(folded[table]["ids"], live["ids"])
        assert torch.equal(folded[table]["weights"], live["weights"])
        assert "state" not in folded[table]  # delta 2 carries no state, so no consistent state can be folded
    for i in range(2):
        rows, _ = ckpt.load_rows(base_dir, server=i, n_servers=2)
        part = deltas.apply_deltas(rows, delta_dir, after=0, server=i, n_servers=2)["user"]
        mask = server_of("user", folded["user"]["ids"], 2) == i
        assert torch.equal(part["ids"], folded["user"]["ids"][mask])
        assert torch.equal(part["weights"], folded["user"]["weights"][mask])
    # Why only deltas after the checkpoint: delta 0 predates the update of `touched`, so folding it rolls them back.
    stale = deltas.apply_deltas(base, [first])["user"]
    at = torch.searchsorted(stale["ids"], torch.sort(touched).values)
    assert not torch.equal(stale["weights"][at], user.lookup(torch.sort(touched).values, train=False))


def test_evicted_rows_do_not_appear_in_deltas(tmp_path: Path):
    store = EmbeddingStore(4, 4, SGD(lr=1.0), eviction="lru")
    store.lookup(torch.tensor([1, 2, 3, 4]))
    assert torch.equal(torch.sort(store.take_dirty()["ids"]).values, torch.tensor([1, 2, 3, 4]))
    assert store.take_dirty()["ids"].numel() == 0  # taking clears
    store.lookup(torch.tensor([3, 4]))
    store.update(torch.tensor([1]), torch.ones(1, 4))  # 1 is dirty ...
    store.lookup(torch.tensor([5, 6]))  # ... and then evicted with 2 (least recently looked up)
    assert not store.contains(torch.tensor([1, 2])).any()
    path = deltas.dump_incremental({"t": store}, tmp_path, server=3, sequence=7)
    assert path.name == "delta-00000007.server3.pt"
    assert torch.equal(torch.sort(_delta_tables(path)["t"]["ids"]).values, torch.tensor([5, 6]))
    # ... but they are listed as removed (the log started with the first take_dirty above).
    assert torch.equal(_delta_tables(path)["t"]["removed"], torch.tensor([1, 2]))


@pytest.mark.parametrize("n_replicas", [1, 2])
def test_replica_from_checkpoint_and_deltas_equals_the_servers_under_eviction(tmp_path: Path, n_replicas: int):
    """Training that keeps evicting (chunked LRU): checkpoint + every later delta folds to exactly the rows the
    servers hold, no more (removed ids are dropped) and no less; also re-sharded over two replica shards."""
    base_dir, delta_dir = tmp_path / "ckpt", tmp_path / "deltas"
    stores = {"t": EmbeddingStore(4, 100, SGD(lr=0.5), eviction="lru", eviction_chunk=0.1, init_seed=3)}
    universe = _random_ids(600, seed=11)
    g = torch.Generator().manual_seed(12)
    sequence = 0

    def churn(steps: int) -> None:
        for _ in range(steps):
            _train(stores["t"], universe[torch.unique(torch.randint(0, 600, (30,), generator=g))], seed=sequence)

    churn(10)
    deltas.dump_incremental(stores, delta_dir, server=0, sequence=sequence)  # starts the eviction log
    ckpt.save_all([stores], base_dir, delta_sequence=sequence)
    for sequence in range(1, 17):
        churn(2)
        deltas.dump_incremental(stores, delta_dir, server=0, sequence=sequence)
    assert stores["t"].metrics()["evictions"] > 200
    removed = torch.cat([_delta_tables(p)["t"]["removed"] for p in deltas.list_deltas(delta_dir, after=0)])
    assert removed.numel() > 50
    live = _merged([stores["t"].state_dict()])
    info = ckpt.read_latest(base_dir)
    got_ids, got_weights = [], []
    for i in range(n_replicas):
        base, _ = ckpt.load_rows(base_dir, server=i, n_servers=n_replicas)
        shard = {} if n_replicas == 1 else {"server": i, "n_servers": n_replicas}
        folded = deltas.apply_deltas(base, delta_dir, after=info["delta_sequence"], **shard)["t"]
        got_ids.append(folded["ids"])
        got_weights.append(folded["weights"])
    ids, weights = torch.cat(got_ids), torch.cat(got_weights)
    order = torch.argsort(ids)
    assert torch.equal(ids[order], live["ids"]) and torch.equal(weights[order], live["weights"])
    # Upserts alone would leave evicted ids on the replica: the removals are what makes it exact.
    base, _ = ckpt.load_rows(base_dir, server=0, n_servers=1)
    upserted = [base["t"]["ids"]] + [_delta_tables(p)["t"]["ids"] for p in deltas.list_deltas(delta_dir, after=0)]
    assert torch.unique(torch.cat(upserted)).numel() > live["ids"].numel() + 50


def test_an_overflowing_eviction_log_is_dropped_and_the_delta_says_so(tmp_path: Path, caplog):
    """Between two dumps the log keeps at most the capacity in distinct evicted ids; past that the next delta lists
    none and is marked incomplete, apply_deltas warns, and the replica keeps (only) extra ids."""
    store = EmbeddingStore(4, 10, SGD(lr=1.0), eviction="lru", eviction_chunk=0)
    store.lookup(torch.arange(10))
    deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=0)
    for start in range(100, 130):  # 30 new ids, one a batch: 30 evictions of ids never seen again
        store.lookup(torch.tensor([start]))
    path = deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=1)
    delta = _delta_tables(path)["t"]
    assert not bool(delta["removals_complete"]) and delta["removed"].numel() == 0
    with caplog.at_level("WARNING"):
        folded = deltas.apply_deltas({}, tmp_path)["t"]
    assert "lists only some of the ids evicted" in caplog.text
    live = store.state_dict()["ids"]
    assert torch.isin(live, folded["ids"]).all() and folded["ids"].numel() > live.numel()
    # The next dump logs again from a clean slate.
    store.lookup(torch.tensor([500]))  # evicts 120
    delta = _delta_tables(deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=2))["t"]
    assert bool(delta["removals_complete"]) and torch.equal(delta["removed"], torch.tensor([120]))


def test_loaded_store_logs_evictions_for_its_first_dump():
    """A server restarted from a checkpoint: replicas start from that checkpoint, so evictions after the load must
    reach them with the first dump."""
    store = EmbeddingStore(4, 4, SGD(), eviction="lru", eviction_chunk=0)
    store.lookup(torch.tensor([1, 2, 3, 4]))
    restarted = EmbeddingStore(4, 4, SGD(), eviction="lru", eviction_chunk=0)
    restarted.load_state_dict(store.state_dict())
    restarted.lookup(torch.tensor([10, 11]))  # evicts two loaded rows
    removed = restarted.take_dirty()["removed"]
    assert removed.numel() == 2 and not restarted.contains(removed).any()


def test_checkpoint_before_the_first_dump_logs_evictions_for_it(tmp_path: Path):
    """A checkpoint saved before any dump is a replica's base: the evictions between that save and the first dump
    must reach the replica with that dump, or it keeps the evicted ids for good."""
    store = EmbeddingStore(2, 4, SGD(), eviction="lru", eviction_chunk=0)
    store.lookup(torch.arange(4))
    ckpt.save_all([{"t": store}], tmp_path / "ckpt")  # no dump yet: delta_sequence -1
    store.lookup(torch.arange(10, 14))  # evicts 0..3
    deltas.dump_incremental({"t": store}, tmp_path / "deltas", server=0, sequence=0)
    rows, _ = ckpt.load_rows(tmp_path / "ckpt", server=0, n_servers=1)
    after = ckpt.read_latest(tmp_path / "ckpt")["delta_sequence"]
    replica = deltas.apply_deltas(rows, tmp_path / "deltas", after=after)["t"]
    assert torch.equal(torch.sort(replica["ids"]).values, torch.arange(10, 14))


def test_failed_dump_after_an_overflowing_log_stays_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A dump that fails after its take said ``removals_complete`` false: the retry must say so too (it cannot list
    the removals the dropped log lost)."""
    store = EmbeddingStore(2, 4, SGD(), eviction="lru", eviction_chunk=0)
    store.lookup(torch.arange(4))
    deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=0)
    for b in range(1, 6):  # 20 evictions of distinct ids, more than twice the capacity: the log is dropped
        store.lookup(torch.arange(4) + 4 * b)
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("simulated")))
    with pytest.raises(OSError):
        deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=1)
    monkeypatch.undo()
    delta = _delta_tables(deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=1))["t"]
    assert not bool(delta["removals_complete"]) and delta["removed"].numel() == 0
    assert torch.equal(torch.sort(delta["ids"]).values, torch.arange(20, 24))


def test_prune_keeps_the_newest_committed_versions(tmp_path: Path):
    [stores] = _build_servers(1)
    for _ in range(4):
        ckpt.save_all([stores], tmp_path, configs=CONFIGS)
    (tmp_path / "v00000005").mkdir()  # a save in progress (not committed): never pruned
    deleted = ckpt.prune(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["v00000001", "v00000002"]
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v00000003", "v00000004", "v00000005"]
    assert ckpt.read_latest(tmp_path)["version"] == 4
    rows, _ = ckpt.load_rows(tmp_path, server=0, n_servers=1)
    assert rows["user"]["ids"].numel() == 240
    assert ckpt.prune(tmp_path, keep=2) == []
    with pytest.raises(ValueError, match="keep"):
        ckpt.prune(tmp_path, keep=0)
    # A directory whose number has a leading zero too many is its own version: deleted as itself, never confused
    # with the committed v00000004.
    (tmp_path / "v000000003").mkdir()
    deleted = ckpt.prune(tmp_path, keep=1)
    assert sorted(p.name for p in deleted) == ["v000000003", "v00000003"]
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v00000004", "v00000005"]


def test_failed_dump_keeps_rows_dirty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    store = EmbeddingStore(4, 8, SGD(lr=1.0))
    store.lookup(torch.tensor([10, 11, 12]))

    def broken(*args, **kwargs):
        raise OSError("simulated")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError):
        deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=0)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []  # no file, no temp file
    path = deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=0)
    assert torch.equal(torch.sort(_delta_tables(path)["t"]["ids"]).values, torch.tensor([10, 11, 12]))


def test_failed_dump_keeps_removals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    store = EmbeddingStore(4, 2, SGD(lr=1.0), eviction="lru")
    store.lookup(torch.tensor([1, 2]))
    deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=0)
    store.lookup(torch.tensor([3]))  # evicts 1
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("simulated")))
    with pytest.raises(OSError):
        deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=1)
    monkeypatch.undo()
    path = deltas.dump_incremental({"t": store}, tmp_path, server=0, sequence=1)
    assert torch.equal(_delta_tables(path)["t"]["removed"], torch.tensor([1]))
    assert torch.equal(_delta_tables(path)["t"]["ids"], torch.tensor([3]))


def test_load_state_dict_clears_dirty():
    [stores] = _build_servers(1)
    fresh = make_store("user", CONFIGS["user"])
    fresh.load_state_dict(stores["user"].state_dict())
    assert fresh.take_dirty()["ids"].numel() == 0


class Planted:
    """Unpickling it would create ``path``: what a crafted checkpoint file could do with any code."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_damaged_or_crafted_checkpoint_is_one_error_naming_its_file(tmp_path: Path):
    """Corrupt LATEST or manifest, a truncated or missing shard, a shard or delta whose unpickling would run code:
    each is a CheckpointError naming the file; the crafted code never runs."""
    from persia_planner.modules.ps.protocol import CheckpointError

    ckpt.save_all(_build_servers(2), tmp_path, configs=CONFIGS)
    version = tmp_path / "v00000001"
    shard, manifest = version / "user.server1-of-2.pt", version / "manifest.server0-of-2.json"

    def refused(pattern: str, load=lambda: ckpt.verify(tmp_path)) -> None:
        with pytest.raises(CheckpointError, match=pattern):
            load()

    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    refused(rf"^checkpoint file {shard} is unreadable \({len(whole) // 2} bytes, its manifest recorded {len(whole)}")
    # A server loading it anyway (no verify first) names the file too.
    refused(rf"^checkpoint file {shard} is unreadable \(", lambda: ckpt.load_rows(tmp_path, server=0, n_servers=1))
    shard.unlink()
    refused(rf"^checkpoint file {shard} is unreadable \(missing\)")
    shard.write_bytes(whole)
    assert ckpt.verify(tmp_path)["version"] == 1

    planted = tmp_path / "planted"
    state = torch.load(shard, weights_only=True)
    torch.save(state | {"payload": Planted(planted)}, shard)
    refused(
        rf"^checkpoint file {shard} is unreadable \(UnpicklingError",
        lambda: ckpt.load_rows(tmp_path, server=1, n_servers=2),
    )
    delta = tmp_path / "deltas" / "crafted.pt"
    delta.parent.mkdir()
    torch.save({"format": "x", "payload": Planted(planted)}, delta)
    refused(rf"^checkpoint file {delta} is unreadable \(UnpicklingError", lambda: ckpt.apply_deltas({}, [delta]))
    assert not planted.exists()
    shard.write_bytes(whole)

    text = manifest.read_text()
    manifest.write_text(text[:40])
    refused(rf"^checkpoint file {manifest} is unreadable \(JSONDecodeError")
    manifest.write_text("[1, 2]")
    refused(rf"^checkpoint file {manifest} is unreadable \(a JSON list, not an object\)")
    manifest.write_text(text)
    (tmp_path / "LATEST").write_bytes(b"\xff\xfe")
    refused(rf"^checkpoint file {tmp_path / 'LATEST'} is unreadable \(UnicodeDecodeError")
    (tmp_path / "LATEST").write_text('{"version": "one"}')
    refused(rf"^checkpoint file {tmp_path / 'LATEST'} is unreadable \(ValueError: invalid literal")
    (tmp_path / "LATEST").write_text('{"version": 1, "n_servers": 0}')
    refused(rf"^checkpoint file {tmp_path / 'LATEST'} is unreadable \(version 1, 0 servers\)")
    (tmp_path / "LATEST").write_text('{"version": 1, "n_servers": 2}')
    manifest.write_text(text.replace('"delta_sequence": -1', '"delta_sequence": "x"'))
    refused(rf"^checkpoint file {version} is unreadable \(delta_sequence: invalid literal")


def test_a_tables_seed_is_saved_once_and_loaded_back_with_only_the_tables_asked(tmp_path: Path):
    stores = [{name: make_store(name, config) for name, config in CONFIGS.items()} for _ in range(2)]
    seed = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    for i, server in enumerate(stores):
        server["item"].seed(seed, torch.ones(5, 1))
        server["user"].lookup(_random_ids(20, 1 + i))
    ckpt.save_all(stores, tmp_path, configs=CONFIGS)
    version = ckpt.read_latest(tmp_path)["path"]
    assert sorted(p.name for p in version.glob("*.seed.pt")) == ["item.seed.pt"]  # server 0's copy only
    assert ckpt.verify(tmp_path) is not None
    seeds = ckpt.load_seeds(tmp_path)
    assert list(seeds) == ["item"] and torch.equal(seeds["item"]["weights"], seed)
    assert torch.equal(seeds["item"]["state"], torch.ones(5, 1))
    assert ckpt.load_seeds(tmp_path, ["user"]) == {}
    rows, configs = ckpt.load_rows(tmp_path, server=0, n_servers=1, tables=["user"])
    assert list(rows) == ["user"] and list(configs) == ["user"] and rows["user"]["ids"].numel() == 40
    (version / "item.seed.pt").write_bytes(b"damaged")
    with pytest.raises(Exception, match=r"item\.seed\.pt is unreadable"):
        ckpt.verify(tmp_path)


def test_a_servers_manifest_records_each_file_as_a_job_checkpoint_does_and_a_changed_byte_is_found(tmp_path: Path):
    """One manifest format: size and sha256; a file of the right size with one byte changed passes the cheap check
    and fails the checksums'."""
    import json

    from persia_planner.modules.manifests import file_record
    from persia_planner.modules.ps.protocol import CheckpointError

    ckpt.save_all(_build_servers(2), tmp_path, configs=CONFIGS)
    version = tmp_path / "v00000001"
    entry = json.loads((version / "manifest.server1-of-2.json").read_text())["tables"]["user"]
    shard = version / entry["file"]
    assert {k: entry[k] for k in ("bytes", "sha256")} == file_record(shard)
    whole = bytearray(shard.read_bytes())
    whole[-1] ^= 0xFF
    shard.write_bytes(bytes(whole))
    assert ckpt.verify(tmp_path)["version"] == 1  # sizes only: the launcher's quick check
    with pytest.raises(CheckpointError, match=rf"^checkpoint file {shard} is unreadable \(its bytes do not match"):
        ckpt.verify(tmp_path, checksums=True)
