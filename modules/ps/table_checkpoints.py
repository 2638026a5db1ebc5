"""Checkpoints of embedding parameter servers: versioned, crash-safe, re-shardable.

Layout of a checkpoint ``directory``::

    directory/
      LATEST                              JSON {"version": 3, "n_servers": 2}; replaced atomically by commit()
      v00000003/                          one directory per version
        manifest.server0-of-2.json        format, server, n_servers, delta_sequence; per table: config, rows,
                                          file, size and sha256 (as a job checkpoint records its files)
        manifest.server1-of-2.json
        user_emb.server0-of-2.pt          torch.save of EmbeddingStore.state_dict() (occupied rows only)
        user_emb.server1-of-2.pt
        user_emb.seed.pt                  a seeded table's seed (EmbeddingStore.seed), by server 0 only
        ...

Atomicity: every file is written to a unique temporary name in its final directory, flushed, ``fsync``'ed and
``os.replace``'d onto its name, then the directory is ``fsync``'ed (:mod:`.atomic`); so a file name either does not
exist or holds a complete file. Servers write only into a *new* version directory (:func:`save_shard` refuses the
committed one), and a version becomes visible only when the coordinator replaces ``LATEST`` (:func:`commit`) after
every server finished. A crash at any point before that replace leaves ``LATEST`` and the committed version's files
untouched, so the previous checkpoint loads bit-identically; the half-written version directory is garbage that a
retry overwrites (file by file) or that can be deleted. ``LATEST`` also records ``n_servers``, so stray files of an
aborted save with another server count in the same version directory are never read.

Re-sharding: :func:`load_shard` for server ``i`` of ``n`` reads every saved shard of each table and keeps the rows
with ``server_of(table, ids, n) == i`` (a tensor mask), so the saved and the loading server counts may differ.

Incremental dumps for serving replicas, and how a replica folds them onto a checkpoint: :mod:`.deltas`. Servers
record their last dump's sequence (``delta_sequence``) in the checkpoints they save, so a replica applies only later
deltas.

Seeds: a table that moved from the trainers' local tables to the servers starts unheld ids from the local rows
(:meth:`.store.EmbeddingStore.seed`); every server holds the same seed, so server 0 alone saves it (its manifest's
table entry names the file under ``seed``) and every server loads it back (:func:`load_seeds`).

Pruning: :func:`prune` (and ``PsClient.save(..., keep=N)``) deletes all but the newest committed versions.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from persia_planner.modules.atomic import atomic_json, atomic_torch_save
from persia_planner.modules.manifests import file_problem, file_record, remove_directories

# Serving replicas import apply_deltas from here, where it lived before deltas.py: it stays importable.
from persia_planner.modules.ps.deltas import apply_deltas
from persia_planner.modules.ps.protocol import unreadable
from persia_planner.modules.ps.sharding import server_of
from persia_planner.modules.ps.table_store import TableStore

__all__ = [
    "apply_deltas",
    "commit",
    "load_rows",
    "load_seeds",
    "load_shard",
    "prune",
    "read_latest",
    "read_manifest",
    "save_all",
    "save_shard",
    "verify",
]

SHARD_FORMAT = "persia-ps-shard/1"
LATEST = "LATEST"
_TABLE_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")  # table names become file names


# ----------------------------------------------------------------------------------------------- file helpers


def _version_dir(directory: Path, version: int) -> Path:
    return directory / f"v{version:08d}"


def _manifest_name(server: int, n_servers: int) -> str:
    return f"manifest.server{server}-of-{n_servers}.json"


def _shard_name(table: str, server: int, n_servers: int) -> str:
    return f"{table}.server{server}-of-{n_servers}.pt"


def _seed_name(table: str) -> str:
    return f"{table}.seed.pt"


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
    if not (directory / LATEST).exists():
        return None
    latest = _read_json(directory / LATEST)
    try:
        version, n = int(latest["version"]), int(latest["n_servers"])
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise unreadable(directory / LATEST, err) from None
    if version < 0 or n < 1:
        raise unreadable(directory / LATEST, f"version {version}, {n} servers")
    path = _version_dir(directory, version)
    manifests = []
    for j in range(n):
        try:
            manifests.append(read_manifest(path, j, n))
        except FileNotFoundError as err:  # LATEST names a version whose files are gone: not a partial save
            raise unreadable(Path(err.filename or path), "missing") from None
    try:
        sequence = min(int(m.get("delta_sequence", -1)) for m in manifests)
    except (TypeError, ValueError, OverflowError) as err:
        raise unreadable(path, f"delta_sequence: {err}") from None
    return {"version": version, "n_servers": n, "path": path, "delta_sequence": sequence}


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a checkpoint; FileNotFoundError where it is missing (a save that did not finish)."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as err:  # ValueError: bad JSON or bytes that are not UTF-8
        raise unreadable(path, err) from None
    if not isinstance(value, dict):
        raise unreadable(path, f"a JSON {type(value).__name__}, not an object")
    return value


def read_manifest(path: Path, server: int, n_servers: int) -> dict[str, Any]:
    """The manifest of server ``server`` of ``n_servers`` in the version directory ``path``: its tables, each with its
    ``file``, ``rows``, ``bytes`` and ``config``; FileNotFoundError where it is missing.

    Raises:
        .protocol.CheckpointError: It is unreadable or not a shard manifest.
    """
    manifest = _read_json(path / _manifest_name(server, n_servers))
    if manifest.get("format") != SHARD_FORMAT or not isinstance(manifest.get("tables"), dict):
        raise unreadable(path / _manifest_name(server, n_servers), f"unknown format {manifest.get('format')!r}")
    return manifest


def verify(directory: str | os.PathLike, *, checksums: bool = False) -> dict[str, Any] | None:
    """:func:`read_latest`, after checking that every shard file of the committed version is there, whole.

    The manifests record each file as a job checkpoint's does (:func:`persia_planner.modules.manifests.file_record`:
    its size and sha256). By default only the sizes are checked (``stat`` only), so that a launcher can refuse a
    damaged checkpoint at once before any server starts; ``checksums`` also reads every file against its sha256
    (manifests of older saves recorded neither, or only sizes).

    Raises:
        .protocol.CheckpointError: A file is missing, truncated or unreadable (named in the message).
    """
    latest = read_latest(directory)
    if latest is None:
        return None
    path, n = latest["path"], latest["n_servers"]
    for j in range(n):
        for entry in read_manifest(path, j, n)["tables"].values():
            records = [entry] + ([entry["seed"]] if isinstance(entry.get("seed"), dict) else [])
            for record in records:
                file = path / str(record.get("file"))
                problem = file_problem(file, record, checksums=checksums)
                if problem is not None:
                    raise unreadable(file, problem)
    return latest


# ------------------------------------------------------------------------------------------------ checkpoints


def save_shard(
    stores: Mapping[str, TableStore],
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
        delta_sequence: Sequence number of the last :func:`~.deltas.dump_incremental` before this checkpoint
            (``-1``: none); replicas starting from this checkpoint apply only later deltas.

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
        atomic_torch_save(state, path / name)
        tables[table] = {
            "file": name,
            "rows": int(state["ids"].numel()),
            **file_record(path / name),  # its size and sha256: what verify() checks before a resume
            "config": dict(configs.get(table, {})),
        }
        seed = store.seeded()
        if seed is not None and server == 0:  # every server holds the same seed: one copy
            atomic_torch_save(dict(seed), path / _seed_name(table))
            tables[table]["seed"] = {"file": _seed_name(table), **file_record(path / _seed_name(table))}
    # The manifest goes last: its presence means this server's shard files are complete.
    manifest = {
        "format": SHARD_FORMAT,
        "server": server,
        "n_servers": n_servers,
        "version": version,
        "delta_sequence": int(delta_sequence),
        "tables": tables,
    }
    atomic_json(manifest, path / _manifest_name(server, n_servers))
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
        manifest = read_manifest(path, j, n_servers)  # raises FileNotFoundError for a server that did not finish
        for table, entry in manifest["tables"].items():
            if not (path / entry["file"]).is_file():
                raise FileNotFoundError(f"{path / entry['file']} (table {table!r}, server {j}) is missing")
    atomic_json({"version": version, "n_servers": n_servers}, directory / LATEST)


def save_all(
    stores_by_server: Sequence[Mapping[str, TableStore]],
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
    directory: str | os.PathLike, *, server: int, n_servers: int, tables: Collection[str] | None = None
) -> tuple[dict[str, dict[str, Any]], dict[str, dict]]:
    """The rows server ``server`` of ``n_servers`` owns in a checkpoint, re-sharded from whatever count saved it.

    Args:
        directory: The checkpoint directory.
        server: Index of the loading server.
        n_servers: Server count of the loading job (may differ from the saved one); 1 with ``server`` 0: every row.
        tables: Only these tables (None: every table saved).

    Returns:
        ``(rows, configs)``: table -> state dict in :meth:`.store.EmbeddingStore.state_dict` form (rows in saved-server
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
        manifest = read_manifest(path, j, saved_n)
        for table, entry in manifest["tables"].items():
            if tables is not None and table not in tables:
                continue
            configs.setdefault(table, entry["config"])
            # mmap: only the pages of the rows this server keeps (and the ids) are read into memory. weights_only:
            # unpickling arbitrary objects would run a crafted file's code.
            try:
                state = torch.load(path / entry["file"], weights_only=True, mmap=True)
            except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError... for a damaged file
                raise unreadable(path / entry["file"], err) from None
            if not isinstance(state, dict) or not isinstance(state.get("ids"), torch.Tensor):
                raise unreadable(path / entry["file"], "not a store's state")
            if state["ids"].numel() != entry["rows"]:
                found = f"{state['ids'].numel()} rows, its manifest says {entry['rows']}"
                raise unreadable(path / entry["file"], found)
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


def load_seeds(
    directory: str | os.PathLike, tables: Collection[str] | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """The seeds (:meth:`.store.EmbeddingStore.seed`) of the committed checkpoint's seeded tables (``tables``' only,
    where given): table -> ``{"weights": [rows, dim], "state": [rows, width] (if saved)}``.

    Raises:
        FileNotFoundError: Nothing was committed.
        .protocol.CheckpointError: A seed file is unreadable.
    """
    latest = read_latest(directory)
    if latest is None:
        raise FileNotFoundError(f"{directory}: no committed checkpoint ({LATEST} missing)")
    path = latest["path"]
    seeds: dict[str, dict[str, torch.Tensor]] = {}
    for table, entry in read_manifest(path, 0, latest["n_servers"])["tables"].items():
        record = entry.get("seed")
        if not isinstance(record, dict) or (tables is not None and table not in tables):
            continue
        file = path / str(record.get("file"))
        try:
            seed = torch.load(file, weights_only=True)
        except Exception as err:  # a damaged file: torch raises RuntimeError, UnpicklingError, EOFError...
            raise unreadable(file, err) from None
        if not isinstance(seed, dict) or not isinstance(seed.get("weights"), torch.Tensor):
            raise unreadable(file, "not a table's seed")
        seeds[table] = seed
    return seeds


def load_shard(
    directory: str | os.PathLike,
    *,
    server: int,
    n_servers: int,
    make_store: Callable[[str, dict], TableStore],
) -> dict[str, TableStore]:
    """Build server ``server``'s stores from the committed checkpoint, re-sharding to ``n_servers``.

    Args:
        directory: The checkpoint directory.
        server: Index of the loading server.
        n_servers: Server count of the loading job.
        make_store: ``(table, saved_config) -> TableStore``; decides capacity (and may override the config).

    Returns:
        Table -> store holding exactly the saved rows whose ``server_of`` is ``server`` (weights, optimizer state,
        LRU/LFU metadata bit-identical).

    Raises:
        ValueError: If a table's rows for this server exceed its new store's capacity (the message names the table).
    """
    rows, configs = load_rows(directory, server=server, n_servers=n_servers)
    stores: dict[str, TableStore] = {}
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
    return remove_directories(directory, [directory / name for name in older[: max(0, len(older) - (keep - 1))]])
