"""The rows of one parameter-server table on local disk: fixed-size records in a file read and written around the
kernel's page cache.

Why a file of records and not an embedded key-value store (RocksDB, LMDB): the server already keeps an exact id ->
slot index (:class:`.index.HashIndex`), so the disk only has to hold rows at known offsets; a record costs the disk
its bytes and one 4 KiB block read, where an LSM store adds compaction, write amplification and a second index whose
cost the planner could not state in a formula. Why ``O_DIRECT``: with the page cache in the path, a file that fits in
free memory is read from DDR, and the disk tier would be measured at memory speed on a small machine while the
planner prices it at the disk's IOPS; the host's DDR cache of the tier is the server's own store
(:class:`.ssd_store.SsdStore`), sized by the plan.

Layout: the first block is the file's header (who wrote it: :mod:`.ssd_files`), the rows follow it. A record is a
row's weights (the table's dtype) then its optimizer state (float32), padded to 4 bytes. Records pack into 4 KiB blocks
(``4096 // record`` a block, none straddling two); a record past 4 KiB takes whole blocks of its own. Reading a row
reads its block; writing one reads its block, patches it and writes it back (a block never written reads as zeros, so
it is not read). The loops are numba, calling ``pread``/``pwrite`` through ctypes with the GIL released, in block
order, one request per run of consecutive blocks (up to 1 MiB): a cache's misses are one block each, a checkpoint's
whole file streams. A batch's reads are split over :data:`READERS` threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numpy as np
import torch

from persia_planner.placement.memory import SSD_BLOCK_BYTES, SSD_HEADER_BYTES, ssd_record_size

__all__ = ["BLOCK_BYTES", "HEADER_BYTES", "READERS", "RowFile"]

BLOCK_BYTES = SSD_BLOCK_BYTES
"""The unit of every read and write (the page size ``O_DIRECT`` aligns to on NVMe and most file systems)."""
HEADER_BYTES = SSD_HEADER_BYTES
"""The header block before the rows (a whole block: the rows' offsets stay aligned for ``O_DIRECT``)."""

_LIBC = ctypes.CDLL(None, use_errno=True)
_PREAD = _LIBC.pread
_PREAD.restype = ctypes.c_ssize_t
_PREAD.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
_PWRITE = _LIBC.pwrite
_PWRITE.restype = ctypes.c_ssize_t
_PWRITE.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]


def _aligned(nbytes: int) -> np.ndarray:
    """A zeroed page-aligned uint8 buffer (what ``O_DIRECT`` reads into and writes from)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, BLOCK_BYTES)), dtype=np.uint8)[:nbytes]


@numba.njit(nogil=True)  # not cached: the machine code holds libc's address, which differs per process
def _run_end(order, units, j, max_run):  # pragma: no cover - compiled
    """The end ``k`` of the run of rows from ``order[j]`` whose units are consecutive (repeats allowed), spanning at
    most ``max_run`` units: one request reads or writes them all."""
    u0 = units[order[j]]
    last = u0
    k = j
    while k < order.size:
        u = units[order[k]]
        if u - u0 >= max_run or u - last > 1:
            break
        last = u
        k += 1
    return k, last - u0 + 1


@numba.njit(nogil=True)  # not cached: see _run_end
def _read(fd, order, units, offsets, out, scratch, unit_bytes, record, written, max_run, base):  # pragma: no cover
    """Copy the records at ``units[i]``/``offsets[i]`` into ``out[i]``, visiting rows in ``order`` (sorted by unit):
    each run of consecutive units is one ``pread`` (units never written read as zeros, unread); unit 0 starts at byte
    ``base``. Returns the units read, or ``-1 - i`` where the read of row ``i`` failed."""
    reads = 0
    j = 0
    while j < order.size:
        u0 = units[order[j]]
        k, run = _run_end(order, units, j, max_run)
        readable = min(run, max(written - u0, 0))
        if readable > 0:
            n = _PREAD(fd, scratch.ctypes.data, readable * unit_bytes, base + u0 * unit_bytes)
            if n != readable * unit_bytes:
                return -1 - order[j]
            reads += readable
        scratch[readable * unit_bytes : run * unit_bytes] = 0
        for m in range(j, k):
            i = order[m]
            o = (units[i] - u0) * unit_bytes + offsets[i]
            out[i, :] = scratch[o : o + record]
        j = k
    return reads


@numba.njit(nogil=True)  # not cached: see _run_end
def _write(
    fd, order, units, offsets, rows, scratch, unit_bytes, record, written, whole, max_run, base
):  # pragma: no cover
    """Write ``rows[i]`` at ``units[i]``/``offsets[i]``, visiting rows in ``order`` (sorted by unit): each run of
    consecutive units is read once (unless never written, or ``whole``: one record fills a unit), patched and written
    in one ``pwrite``; unit 0 starts at byte ``base``. Returns ``(units read, units written)``, or ``(-1, i)`` where
    row ``i``'s run failed."""
    reads = 0
    writes = 0
    j = 0
    while j < order.size:
        u0 = units[order[j]]
        k, run = _run_end(order, units, j, max_run)
        readable = 0 if whole else min(run, max(written - u0, 0))
        if readable > 0:
            n = _PREAD(fd, scratch.ctypes.data, readable * unit_bytes, base + u0 * unit_bytes)
            if n != readable * unit_bytes:
                return -1, order[j]
            reads += readable
        scratch[readable * unit_bytes : run * unit_bytes] = 0
        for m in range(j, k):
            i = order[m]
            o = (units[i] - u0) * unit_bytes + offsets[i]
            scratch[o : o + record] = rows[i, :]
        n = _PWRITE(fd, scratch.ctypes.data, run * unit_bytes, base + u0 * unit_bytes)
        if n != run * unit_bytes:
            return -1, order[j]
        writes += run
        j = k
    return reads, writes


_RUN_BYTES = 1 << 20  # the most one request reads or writes: a run of consecutive units (a checkpoint's whole file)
READERS = 4
"""Threads that read a batch's rows together: the reads the device has outstanding at once."""
_MIN_ROWS_PER_READER = 16  # below this a batch is read by one thread: a thread's hand-off costs more than the reads


class RowFile:
    """``capacity`` rows of ``dim`` weights (``weight_dtype``) and ``state_width`` float32 state at slots
    ``[0, capacity)`` of a new file at ``path``, after a header block, created empty (sparse) and removed by
    :meth:`close`.

    Args:
        path: The file (its directory must exist). It must not exist yet: a file of rows never replaces a file it did
            not create (a server's disk tier starts empty and is filled from a checkpoint, never from a file a
            crashed run left half written).
        capacity: Rows the file holds.
        dim: Embedding width.
        weight_dtype: The rows' dtype.
        state_width: float32 optimizer-state values per row.
        direct: Open with ``O_DIRECT`` (bypassing the page cache). A file system that refuses it (tmpfs) is opened
            buffered instead, and :attr:`direct` says so.
        header: The file's first bytes (at most :data:`HEADER_BYTES`, padded with zeros to the block): who wrote it
            (:meth:`.ssd_files.Owner.header`).

    Raises:
        OSError: The file exists, or cannot be created and written.
    """

    def __init__(
        self, path: str | os.PathLike, capacity: int, dim: int, weight_dtype: torch.dtype, state_width: int,
        *, direct: bool = True, header: bytes = b"",
    ) -> None:  # fmt: skip
        if capacity <= 0 or dim <= 0 or state_width < 0:
            raise ValueError(f"capacity and dim must be positive, got capacity={capacity}, dim={dim}")
        if len(header) > HEADER_BYTES:
            raise ValueError(f"the header takes at most {HEADER_BYTES} bytes, got {len(header)}")
        self.path = Path(path)
        self.capacity, self.dim, self.weight_dtype, self.state_width = capacity, dim, weight_dtype, state_width
        self.weight_bytes = dim * weight_dtype.itemsize
        self.record = ssd_record_size(dim, weight_dtype.itemsize, state_width)
        self.per_unit = max(BLOCK_BYTES // self.record, 1)
        self.unit_bytes = BLOCK_BYTES * -(-self.record // BLOCK_BYTES) if self.per_unit == 1 else BLOCK_BYTES
        self.units = -(-capacity // self.per_unit)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._fd = -1
        # Created here (O_EXCL, never through a link) with its header written and synced before any row: a file that
        # a killed server leaves behind says whose it was (.ssd_files.remove_stale reads it).
        created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(created, HEADER_BYTES + self.units * self.unit_bytes)
            os.pwrite(created, header.ljust(HEADER_BYTES, b"\0"), 0)
            os.fsync(created)
            if self.direct:
                try:
                    self._fd = os.open(self.path, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:  # a file system without O_DIRECT: the buffered descriptor serves
                    self.direct = False
        except BaseException:
            os.close(created)
            self.path.unlink(missing_ok=True)
            raise
        if self._fd >= 0:
            os.close(created)
        else:
            self._fd = created
        self._max_run = max(1, _RUN_BYTES // self.unit_bytes)
        self._scratch = _aligned(self._max_run * self.unit_bytes)
        self._scratches = [self._scratch]  # one per reader thread (see read)
        self._pool: ThreadPoolExecutor | None = None
        self._written = 0  # blocks below this were written (or may hold data); above it they read as zeros
        self.io = {"blocks_read": 0, "blocks_written": 0}

    @property
    def disk_bytes(self) -> int:
        """The file's size: what its header and rows take on disk."""
        return HEADER_BYTES + self.units * self.unit_bytes

    def _where(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise IndexError(f"row slots must be in [0, {self.capacity}), got {int(slots.min())}..{int(slots.max())}")
        units = slots // self.per_unit
        offsets = (slots % self.per_unit) * self.record
        return units, offsets, np.argsort(units, kind="stable")

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights ``[k, dim]`` (the file's dtype) and state ``[k, state_width]`` (float32) of rows ``slots``."""
        s = slots.numpy().astype(np.int64, copy=False)
        units, offsets, order = self._where(s)
        out = np.empty((s.size, self.record), dtype=np.uint8)
        # A device serves several outstanding reads at once (NVMe at depth 1 reaches a fraction of its IOPS): the
        # rows go to READERS threads in contiguous stretches of block order, each with its own buffer.
        parts = np.array_split(order, READERS) if s.size >= READERS * _MIN_ROWS_PER_READER else [order]
        if self._pool is None and len(parts) > 1:
            self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="row-file")
            self._scratches += [_aligned(self._max_run * self.unit_bytes) for _ in range(READERS - 1)]

        def part(k: int) -> int:
            return _read(
                self._fd, parts[k], units, offsets, out, self._scratches[k], self.unit_bytes, self.record,
                self._written, self._max_run, HEADER_BYTES,
            )  # fmt: skip

        counts = list(self._pool.map(part, range(len(parts)))) if len(parts) > 1 else [part(0)]
        for n in counts:
            if n < 0:
                raise OSError(f"{self.path}: reading row slot {int(s[-1 - n])} failed")
        self.io["blocks_read"] += sum(counts)
        return self._split(out)

    def write(self, slots: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, *, fresh: bool = False) -> None:
        """Write rows ``slots`` (distinct) from ``weights`` ``[k, dim]`` and ``state`` ``[k, state_width]``.

        ``fresh``: the blocks they fall in hold nothing else worth keeping (a log's new blocks), so they are written
        whole without being read first.
        """
        s = slots.numpy().astype(np.int64, copy=False)
        if not s.size:
            return
        units, offsets, order = self._where(s)
        rows = np.zeros((s.size, self.record), dtype=np.uint8)
        rows[:, : self.weight_bytes] = weights.to(self.weight_dtype).contiguous().view(torch.uint8).numpy()
        rows[:, self.weight_bytes : self.weight_bytes + 4 * self.state_width] = (
            state.to(torch.float32).contiguous().view(torch.uint8).numpy()
        )
        whole = fresh or self.per_unit == 1
        r, w = _write(
            self._fd, order, units, offsets, rows, self._scratch, self.unit_bytes, self.record, self._written, whole,
            self._max_run, HEADER_BYTES,
        )  # fmt: skip
        if r < 0:
            raise OSError(f"{self.path}: writing row slot {int(s[w])} failed")
        self._written = max(self._written, int(units.max()) + 1)
        self.io["blocks_read"] += r
        self.io["blocks_written"] += w

    def _split(self, out: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        raw = torch.from_numpy(out)
        weights = raw[:, : self.weight_bytes].contiguous().view(self.weight_dtype)
        state = raw[:, self.weight_bytes : self.weight_bytes + 4 * self.state_width].contiguous().view(torch.float32)
        return weights, state

    def sync(self) -> None:
        """Make the written rows durable (``fsync``: ``O_DIRECT`` skips the page cache, not the device's)."""
        os.fsync(self._fd)

    def close(self, *, wait: bool = True) -> None:
        """Close and remove the file (its rows live on in checkpoints, never in the file); ``wait``: join the
        reader threads first."""
        if self._fd >= 0:
            if self._pool is not None:
                self._pool.shutdown(wait=wait)
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)

    def __del__(self) -> None:  # a server that exits without close() still leaves no file of rows behind
        # Never joins: the collector may run this inside a starting thread's bootstrap, which holds the lock a join
        # needs (a test deadlocked there). An unreachable file has no read in flight; its idle readers exit alone.
        with contextlib.suppress(Exception):  # at interpreter shutdown os may be gone
            self.close(wait=False)
