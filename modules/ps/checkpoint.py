"""Checkpoints of embedding parameter servers: versioned, crash-safe, re-shardable; plus incremental dumps.

Layout of a checkpoint ``directory``::

    directory/
      LATEST                              JSON {"version": 3, "n_servers": 2}; replaced atomically by commit()
      v00000003/                          one directory per version
        manifest.server0-of-2.json        format tag, server, n_servers, delta_sequence, per table: config, rows, file
        manifest.server1-of-2.json
        user_emb.server0-of-2.pt          torch.save of EmbeddingStore.state_dict() (occupied rows only)
        user_emb.server1-of-2.pt
        ...

Atomicity: every file is written to a unique temporary name in its final directory, flushed, ``fsync``'ed and
``os.replace``'d onto its name, then the directory is ``fsync``'ed; so a file name either does not exist or holds a
complete file. Servers write only into a *new* version directory (:func:`save_shard` refuses the committed one),
and a version becomes visible only when the coordinator replaces ``LATEST`` (:func:`commit`) after every server
finished. A crash at any point before that replace leaves ``LATEST`` and the committed version's files untouched, so
the previous checkpoint loads bit-identically; the half-written version directory is garbage that a retry
overwrites (file by file) or that can be deleted. ``LATEST`` also records ``n_servers``, so stray files of an
aborted save with another server count in the same version directory are never read.

Re-sharding: :func:`load_shard` for server ``i`` of ``n`` reads every saved shard of each table and keeps the rows
with ``server_of(table, ids, n) == i`` (a tensor mask), so the saved and the loading server counts may differ.

Incremental dumps for serving (Persia's "embedding dump" to inference replicas): :func:`dump_incremental` writes the
rows each store marked dirty (inserted or updated) since its previous dump to ``delta-{sequence:08d}.server{i}.pt``,
atomically. A replica folds a base checkpoint and the deltas with :func:`apply_deltas`::

    info = read_latest(ckpt_dir)
    rows = load_rows(ckpt_dir, server=i, n_servers=n)
    rows = apply_deltas(rows, delta_dir, after=info["delta_sequence"], server=i, n_servers=n)

Only deltas *dumped after* the checkpoint may be applied on top of it (an older delta holds older values of rows
the checkpoint already has newer), hence ``delta_sequence`` (the last dump before the checkpoint) in the manifest.
A delta carries upserts (``ids``, ``weights``) and removals (``removed``: ids evicted since the previous dump that
the server no longer holds); :func:`apply_deltas` drops removed ids, so a replica holds what the servers hold. A
store logs evictions from its first dump or its last load on (see :meth:`EmbeddingStore.take_dirty`), at most its
capacity in distinct ids between two dumps; past that the delta is marked ``removals_complete`` false and
:func:`apply_deltas` warns. Servers record their last dump's sequence in the checkpoints they save. A server loaded
from a checkpoint goes on from its ``delta_sequence``: its next dump removes that server's deltas numbered after it,
written by the run that was rolled back (replicas start again from that checkpoint).

Pruning: :func:`prune` (and ``PsClient.save(..., keep=N)``) deletes all but the newest committed versions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .sharding import server_of
from .store import EmbeddingStore

__all__ = [
    "apply_deltas",
    "commit",
    "dump_incremental",
    "list_deltas",
    "load_rows",
    "load_shard",
    "prune",
    "read_latest",
    "save_all",
    "save_shard",
]

log = logging.getLogger(__name__)

SHARD_FORMAT = "persia-ps-shard/1"
DELTA_FORMAT = "persia-ps-delta/1"
LATEST = "LATEST"
_DELTA_RE = re.compile(r"^delta-(\d{8,})\.server(\d+)\.pt$")
_TABLE_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")  # table names become file names


# ----------------------------------------------------------------------------------------------- file helpers


def _version_dir(directory: Path, version: int) -> Path:
    return directory / f"v{version:08d}"


def _manifest_name(server: int, n_servers: int) -> str:
    return f"manifest.server{server}-of-{n_servers}.json"


def _shard_name(table: str, server: int, n_servers: int) -> str:
    return f"{table}.server{server}-of-{n_servers}.pt"


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk. Not every platform lets a directory be opened.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` through a temp file in the same directory (same filesystem, so ``os.replace`` is atomic)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    _atomic_write(path, lambda f: torch.save(obj, f))


def _atomic_json(obj: Any, path: Path) -> None:
    _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def _check_server(server: int, n_servers: int) -> None:
    if n_servers <= 0 or not 0 <= server < n_servers:
        raise ValueError(f"need 0 <= server < n_servers, got server={server}, n_servers={n_servers}")


def read_latest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The committed checkpoint of ``directory``, or ``None`` if nothing was committed yet.

    Returns:
        ``{"version": int, "n_servers": int, "path": Path, "delta_sequence": int}``; ``delta_sequence`` is the
        smallest over the servers' manifests (``-1``: apply every delta).
    """
    directory = Path(directory)
    try:
        latest = json.loads((directory / LATEST).read_text())
    except FileNotFoundError:
        return None
    version, n = int(latest["version"]), int(latest["n_servers"])
    path = _version_dir(directory, version)
    manifests = [_read_manifest(path, j, n) for j in range(n)]
    return {
        "version": version,
        "n_servers": n,
        "path": path,
        "delta_sequence": min(int(m.get("delta_sequence", -1)) for m in manifests),
    }


def _read_manifest(path: Path, server: int, n_servers: int) -> dict[str, Any]:
    manifest = json.loads((path / _manifest_name(server, n_servers)).read_text())
    if manifest.get("format") != SHARD_FORMAT:
        raise ValueError(f"{path / _manifest_name(server, n_servers)}: unknown format {manifest.get('format')!r}")
    return manifest


# ------------------------------------------------------------------------------------------------ checkpoints


def save_shard(
    stores: Mapping[str, EmbeddingStore],
    directory: str | os.PathLike,
    *,
    server: int,
    n_servers: int,
    configs: Mapping[str, dict] | None = None,
    version: int | None = None,
    delta_sequence: int = -1,
) -> Path:
    """Write the tables of one server into a (not yet committed) checkpoint version.

    Every server of a job calls this with the same ``version``; then the coordinator calls :func:`commit`. Nothing
    becomes visible to :func:`load_shard` before the commit.

    Args:
        stores: Table name -> that table's store on this server.
        directory: The checkpoint directory (created if missing).
        server: This server's index in ``[0, n_servers)``.
        n_servers: Number of servers the job runs with.
        configs: Table name -> JSON-serialisable config (e.g. dim, capacity, optimizer), stored in the manifest and
            handed back to ``make_store`` on load. Tables without one get ``{}``.
        version: Version number to write. Default: one more than the committed version (1 for the first), which
            every server computes identically as long as they save between the same two commits.
        delta_sequence: Sequence number of the last :func:`dump_incremental` before this checkpoint (``-1``: none);
            replicas starting from this checkpoint apply only later deltas.

    Returns:
        The version directory.

    Raises:
        ValueError: On a bad server index, a table name unfit for a file name, or a ``version`` that is the
            committed one (overwriting it in place would break the crash guarantee).
    """
    _check_server(server, n_servers)
    directory = Path(directory)
    latest = read_latest(directory)
    if version is None:
        version = 1 if latest is None else latest["version"] + 1
    if latest is not None and version == latest["version"]:
        raise ValueError(f"version {version} is the committed checkpoint of {directory}; save a new version")
    configs = configs or {}
    path = _version_dir(directory, version)
    path.mkdir(parents=True, exist_ok=True)
    tables: dict[str, Any] = {}
    for table, store in stores.items():
        if not _TABLE_RE.match(table):
            raise ValueError(f"table name {table!r} is not usable as a file name (letters, digits, _ . - only)")
        name = _shard_name(table, server, n_servers)
        state = store.state_dict()
        _atomic_torch_save(state, path / name)
        tables[table] = {"file": name, "rows": int(state["ids"].numel()), "config": dict(configs.get(table, {}))}
    # The manifest goes last: its presence means this server's shard files are complete.
    manifest = {
        "format": SHARD_FORMAT,
        "server": server,
        "n_servers": n_servers,
        "version": version,
        "delta_sequence": int(delta_sequence),
        "tables": tables,
    }
    _atomic_json(manifest, path / _manifest_name(server, n_servers))
    return path


def commit(directory: str | os.PathLike, version: int, *, n_servers: int | None = None) -> None:
    """Make ``version`` the current checkpoint by atomically replacing ``LATEST`` (the coordinator's last step).

    Args:
        directory: The checkpoint directory.
        version: The version every server saved.
        n_servers: The job's server count; inferred from the manifests present if omitted.

    Raises:
        FileNotFoundError: If some server's manifest (hence its shard files) is missing.
        ValueError: If ``n_servers`` is omitted and the manifests do not identify a single complete set.
    """
    directory = Path(directory)
    path = _version_dir(directory, version)
    if n_servers is None:
        found: dict[int, set[int]] = {}
        for p in path.glob("manifest.server*-of-*.json"):
            m = re.match(r"^manifest\.server(\d+)-of-(\d+)\.json$", p.name)
            if m:
                found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
        complete = [n for n, servers in found.items() if servers == set(range(n))]
        if len(complete) != 1:
            raise ValueError(f"{path}: cannot infer n_servers (complete manifest sets for {sorted(complete)})")
        n_servers = complete[0]
    for j in range(n_servers):
        manifest = _read_manifest(path, j, n_servers)  # raises FileNotFoundError for a server that did not finish
        for table, entry in manifest["tables"].items():
            if not (path / entry["file"]).is_file():
                raise FileNotFoundError(f"{path / entry['file']} (table {table!r}, server {j}) is missing")
    _atomic_json({"version": version, "n_servers": n_servers}, directory / LATEST)


def save_all(
    stores_by_server: Sequence[Mapping[str, EmbeddingStore]],
    directory: str | os.PathLike,
    *,
    configs: Mapping[str, dict] | None = None,
    version: int | None = None,
    delta_sequence: int = -1,
) -> Path:
    """Save and commit the stores of all servers held by one process (``stores_by_server[i]`` is server ``i``)."""
    n = len(stores_by_server)
    if n == 0:
        raise ValueError("save_all needs the stores of at least one server")
    if version is None:
        latest = read_latest(directory)
        version = 1 if latest is None else latest["version"] + 1
    path = Path(directory)
    for i, stores in enumerate(stores_by_server):
        path = save_shard(
            stores, directory, server=i, n_servers=n, configs=configs, version=version, delta_sequence=delta_sequence
        )
    commit(directory, version, n_servers=n)
    return path


def load_rows(
    directory: str | os.PathLike, *, server: int, n_servers: int
) -> tuple[dict[str, dict[str, Any]], dict[str, dict]]:
    """The rows server ``server`` of ``n_servers`` owns in a checkpoint, re-sharded from whatever count saved it.

    Args:
        directory: The checkpoint directory.
        server: Index of the loading server.
        n_servers: Server count of the loading job (may differ from the saved one).

    Returns:
        ``(rows, configs)``: table -> state dict in :meth:`EmbeddingStore.state_dict` form (rows in saved-server
        order, then saved order), and table -> saved config. ``step`` is the largest of the merged shards' steps.
    """
    _check_server(server, n_servers)
    directory = Path(directory)
    latest = read_latest(directory)
    if latest is None:
        raise FileNotFoundError(f"{directory}: no committed checkpoint ({LATEST} missing)")
    path, saved_n = latest["path"], latest["n_servers"]
    parts: dict[str, list[dict[str, Any]]] = {}
    configs: dict[str, dict] = {}
    for j in range(saved_n):
        manifest = _read_manifest(path, j, saved_n)
        for table, entry in manifest["tables"].items():
            configs.setdefault(table, entry["config"])
            # mmap: only the pages of the rows this server keeps (and the ids) are read into memory.
            state = torch.load(path / entry["file"], weights_only=True, mmap=True)
            if state["ids"].numel() != entry["rows"]:
                raise ValueError(f"{path / entry['file']}: {state['ids'].numel()} rows, manifest says {entry['rows']}")
            keep = (server_of(table, state["ids"], n_servers) == server).nonzero().squeeze(1)
            parts.setdefault(table, []).append(
                {k: (v.index_select(0, keep) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
            )
    rows: dict[str, dict[str, Any]] = {}
    for table, shards in parts.items():
        merged: dict[str, Any] = {
            k: torch.cat([s[k] for s in shards]) for k, v in shards[0].items() if isinstance(v, torch.Tensor)
        }
        # LRU clocks of different saved servers are independent; the max keeps every loaded row "in the past".
        merged["step"] = max(int(s.get("step", 0)) for s in shards)
        rows[table] = merged
    return rows, configs


def load_shard(
    directory: str | os.PathLike,
    *,
    server: int,
    n_servers: int,
    make_store: Callable[[str, dict], EmbeddingStore],
) -> dict[str, EmbeddingStore]:
    """Build server ``server``'s stores from the committed checkpoint, re-sharding to ``n_servers``.

    Args:
        directory: The checkpoint directory.
        server: Index of the loading server.
        n_servers: Server count of the loading job.
        make_store: ``(table, saved_config) -> EmbeddingStore``; decides capacity (and may override the config).

    Returns:
        Table -> store holding exactly the saved rows whose ``server_of`` is ``server`` (weights, optimizer state,
        LRU/LFU metadata bit-identical).

    Raises:
        ValueError: If a table's rows for this server exceed its new store's capacity (the message names the table).
    """
    rows, configs = load_rows(directory, server=server, n_servers=n_servers)
    stores: dict[str, EmbeddingStore] = {}
    for table, state in rows.items():
        store = make_store(table, configs[table])
        n = state["ids"].numel()
        if n > store.capacity:
            raise ValueError(
                f"table {table!r}: server {server} of {n_servers} gets {n} rows from the checkpoint, but its store "
                f"has capacity {store.capacity}; raise the capacity or load with more servers"
            )
        store.load_state_dict(state)
        stores[table] = store
    return stores


# ------------------------------------------------------------------------------------------ incremental dumps


def dump_incremental(
    stores: Mapping[str, EmbeddingStore],
    directory: str | os.PathLike,
    *,
    server: int,
    sequence: int,
    with_state: bool = False,
    supersedes: int | None = None,
) -> Path:
    """Atomically write the rows of ``stores`` inserted or updated since their previous dump; clears their marks.

    Call it with the store operations paused (it reads and clears each store's dirty mask). If writing fails, the
    taken rows are marked dirty again, so the next dump still carries them.

    Args:
        stores: Table name -> store of this server.
        directory: Where deltas go (created if missing).
        server: This server's index (part of the file name).
        sequence: Dump number, increasing; every server uses the same number for the same dump round.
        with_state: Also dump optimizer state (for training replicas; serving needs weights only).
        supersedes: This server's previous dump in the current run (after a load: the checkpoint's
            ``delta_sequence``). Its other files numbered after it are left by a run rolled back to that checkpoint
            and are removed once this dump is written. ``None``: remove nothing.

    Returns:
        The path ``delta-{sequence:08d}.server{server}.pt``. A dump with no dirty rows is still written, so a
        replica can tell "nothing changed" from "dump missing".
    """
    if sequence < 0:
        raise ValueError(f"sequence must be >= 0, got {sequence}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"delta-{sequence:08d}.server{server}.pt"
    taken: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for table, store in stores.items():
            taken[table] = store.take_dirty(with_state=with_state)
        _atomic_torch_save({"format": DELTA_FORMAT, "server": server, "sequence": sequence, "tables": taken}, path)
    except BaseException:
        for table, rows in taken.items():  # only the tables already taken: the others still hold their marks
            stores[table].mark_dirty(
                rows["ids"], removed=rows["removed"], removals_complete=bool(rows["removals_complete"])
            )
        raise
    if supersedes is not None:
        # This server's files numbered after `supersedes` were written by a run that has since been rolled back to
        # a checkpoint: folded with this run's deltas, they would bring back rows the servers no longer hold.
        for stale in list_deltas(directory, after=supersedes):
            m = _DELTA_RE.match(stale.name)
            if m and int(m.group(2)) == server and stale != path:
                log.warning("removing %s: a delta of a run rolled back to an earlier checkpoint", stale)
                stale.unlink(missing_ok=True)
    return path


def list_deltas(directory: str | os.PathLike, *, after: int = -1, upto: int | None = None) -> list[Path]:
    """Delta files in ``directory`` with ``after < sequence <= upto``, ordered by (sequence, server)."""
    found = []
    for p in Path(directory).glob("delta-*.server*.pt"):
        m = _DELTA_RE.match(p.name)
        if m and int(m.group(1)) > after and (upto is None or int(m.group(1)) <= upto):
            found.append((int(m.group(1)), int(m.group(2)), p))
    return [p for _, _, p in sorted(found)]


def apply_deltas(
    rows: Mapping[str, Mapping[str, Any]],
    deltas: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    after: int = -1,
    upto: int | None = None,
    server: int | None = None,
    n_servers: int | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Fold deltas into base rows: the latest weights of every id (what a serving replica holds).

    Args:
        rows: Table -> ``{"ids", "weights"[, "state"]}`` base (e.g. from :func:`load_rows`; may be empty).
        deltas: A delta directory (its files with ``after < sequence <= upto`` are applied in order) or explicit
            delta paths, applied in the given order.
        after: See ``deltas``; pass the checkpoint's ``delta_sequence`` (:func:`read_latest`).
        upto: See ``deltas``.
        server: With ``n_servers``, keep only the ids this replica shard owns (re-sharding, as in :func:`load_rows`).
        n_servers: See ``server``.

    Returns:
        Table -> ``{"ids", "weights"}`` (and ``"state"`` if the base and every delta of the table carry it), one row
        per distinct id, a later row winning over an earlier one and an id whose latest entry is a removal left
        out; ids are sorted (as int64).
    """
    if (server is None) != (n_servers is None):
        raise ValueError("pass both server and n_servers, or neither")
    if isinstance(deltas, str | os.PathLike):
        paths = list_deltas(deltas, after=after, upto=upto)
    else:
        paths = [Path(p) for p in deltas]
    pieces: dict[str, list[Mapping[str, Any]]] = {t: [r] for t, r in rows.items()}
    for p in paths:
        delta = torch.load(p, weights_only=True)
        if delta.get("format") != DELTA_FORMAT:
            raise ValueError(f"{p}: unknown format {delta.get('format')!r}")
        for table, part in delta["tables"].items():
            if "removals_complete" in part and not bool(part["removals_complete"]):
                log.warning(
                    "%s: table %r lists only some of the ids evicted since the previous dump (its log outgrew the "
                    "capacity); the replica keeps the others until it loads a full checkpoint",
                    p,
                    table,
                )
            part = {k: v for k, v in part.items() if k != "removals_complete"}
            if server is not None:
                keep = (server_of(table, part["ids"], n_servers) == server).nonzero().squeeze(1)
                filtered = {k: v.index_select(0, keep) for k, v in part.items() if k != "removed"}
                if "removed" in part:
                    gone = part["removed"]
                    filtered["removed"] = gone[server_of(table, gone, n_servers) == server]
                part = filtered
            pieces.setdefault(table, []).append(part)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for table, parts in pieces.items():
        dim = next((p["weights"].shape[1] for p in parts if "weights" in p and p["weights"].dim() == 2), 0)
        # Every part contributes its upserts, then its removals (disjoint within a delta) as rows marked dead.
        ids, alive, weights, states = [], [], [], []
        with_state = all("state" in p for p in parts)
        for p in parts:
            gone = p.get("removed", torch.empty(0, dtype=torch.int64))
            ids += [p["ids"], gone]
            alive += [torch.ones(p["ids"].numel(), dtype=torch.bool), torch.zeros(gone.numel(), dtype=torch.bool)]
            weights += [p["weights"], torch.zeros(gone.numel(), dim)]
            if with_state:
                states += [p["state"], torch.zeros(gone.numel(), p["state"].shape[1])]
        all_ids = torch.cat(ids)
        uniq, inverse = torch.unique(all_ids, return_inverse=True)
        # The last occurrence of each id is its newest value: parts are concatenated oldest first.
        last = torch.full((uniq.numel(),), -1, dtype=torch.int64)
        last.scatter_reduce_(0, inverse, torch.arange(all_ids.numel()), reduce="amax")
        last = last[torch.cat(alive)[last]]  # ids whose newest entry is a removal are gone
        folded = {"ids": all_ids.index_select(0, last), "weights": torch.cat(weights).index_select(0, last)}
        if with_state:
            folded["state"] = torch.cat(states).index_select(0, last)
        out[table] = folded
    return out


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete every checkpoint version of ``directory`` but the ``keep`` newest up to the committed one.

    Versions newer than the committed one (a save in progress, or one that crashed) are left alone, and so is
    ``LATEST``'s own version whatever ``keep`` is. Returns the deleted version directories.

    Raises:
        ValueError: If ``keep < 1``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the committed checkpoint always stays), got {keep}")
    directory = Path(directory)
    latest = read_latest(directory)
    if latest is None:
        return []
    # The directories themselves, by number: never a path rebuilt from the number (v000000002 is not v00000002).
    found = [p for p in directory.glob("v*") if p.is_dir() and re.fullmatch(r"v\d{8,}", p.name)]
    committed = sorted((int(p.name[1:]), p.name) for p in found if int(p.name[1:]) <= latest["version"])
    current = latest["path"].name
    older = [name for _, name in committed if name != current]
    deleted = []
    for name in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(directory / name)
        deleted.append(directory / name)
    if deleted:
        _fsync_dir(directory)
    return deleted
