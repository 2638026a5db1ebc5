"""Incremental dumps of embedding parameter servers for serving (Persia's "embedding dump" to inference replicas).

:func:`dump_incremental` writes the rows each store marked dirty (inserted or updated) since its previous dump to
``delta-{sequence:08d}.server{i}.pt``, atomically (:mod:`.atomic`). A replica folds a base checkpoint
(:func:`persia_planner.modules.ps.table_checkpoints.read_latest`,
:func:`persia_planner.modules.ps.table_checkpoints.load_rows`) and the deltas with :func:`apply_deltas`::

    info = read_latest(ckpt_dir)
    rows = load_rows(ckpt_dir, server=i, n_servers=n)
    rows = apply_deltas(rows, delta_dir, after=info["delta_sequence"], server=i, n_servers=n)

Only deltas *dumped after* the checkpoint may be applied on top of it (an older delta holds older values of rows
the checkpoint already has newer), hence ``delta_sequence`` (the last dump before the checkpoint) in the manifest.
A delta carries upserts (``ids``, ``weights``) and removals (``removed``: ids evicted since the previous dump that
the server no longer holds); :func:`apply_deltas` drops removed ids, so a replica holds what the servers hold. A
store logs evictions from its first dump or its last load on (see :meth:`.store.EmbeddingStore.take_dirty`), at most its
capacity in distinct ids between two dumps; past that the delta is marked ``removals_complete`` false and
:func:`apply_deltas` warns. Servers record their last dump's sequence in the checkpoints they save. A server loaded
from a checkpoint goes on from its ``delta_sequence``: its next dump removes that server's deltas numbered after it,
written by the run that was rolled back (replicas start again from that checkpoint).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from persia_planner.modules.atomic import atomic_torch_save
from persia_planner.modules.ps.protocol import unreadable
from persia_planner.modules.ps.sharding import server_of
from persia_planner.modules.ps.table_store import TableStore

__all__ = ["DELTA_FORMAT", "apply_deltas", "dump_incremental", "list_deltas"]

log = logging.getLogger(__name__)

DELTA_FORMAT = "persia-ps-delta/1"
_DELTA_RE = re.compile(r"^delta-(\d{8,})\.server(\d+)\.pt$")


def dump_incremental(
    stores: Mapping[str, TableStore],
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
        atomic_torch_save({"format": DELTA_FORMAT, "server": server, "sequence": sequence, "tables": taken}, path)
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
        rows: Table -> ``{"ids", "weights"[, "state"]}`` base (e.g. from
            :func:`persia_planner.modules.ps.table_checkpoints.load_rows`; may be empty).
        deltas: A delta directory (its files with ``after < sequence <= upto`` are applied in order) or explicit
            delta paths, applied in the given order.
        after: See ``deltas``; pass the checkpoint's ``delta_sequence``
            (:func:`persia_planner.modules.ps.table_checkpoints.read_latest`).
        upto: See ``deltas``.
        server: With ``n_servers``, keep only the ids this replica shard owns (re-sharding, as in
            :func:`persia_planner.modules.ps.table_checkpoints.load_rows`).
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
        try:
            delta = torch.load(p, weights_only=True)
        except Exception as err:  # a damaged or crafted file: weights_only refuses to run its code
            raise unreadable(p, err) from None
        if not isinstance(delta, dict) or delta.get("format") != DELTA_FORMAT:
            raise unreadable(p, f"not a delta of format {DELTA_FORMAT!r}")
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
