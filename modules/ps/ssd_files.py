"""The ``ssd`` tier's scratch files: their names, the header that says a file is ours, which of them a server may
remove, and the check of ``--ssd-dir`` before any process starts. Torch-free: :mod:`persia_planner.modules.train.config`
runs the check before torch is imported.

A server's file of rows (:class:`.row_file.RowFile`) lives as long as the server; a server killed by SIGKILL leaves it
behind, and the next server of the same table and index removes it. The directory is the user's and may hold anything,
so a file is removed only when all of these hold: its name is exactly ours (``TABLE.psN.RUN.rows``, RUN the twelve hex
digits of :attr:`Owner.run`); it is a regular file of this user; its first block carries :data:`MAGIC`, the format
version and the same run id; and the process that wrote it, on this host, is gone (its pid is free, or another
process's now: the header keeps the process's start time). Anything else stays as it is, whatever its name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import re
import secrets
import socket
import stat
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from persia_planner.errors import PlannerError, clip
from persia_planner.placement.memory import SSD_HEADER_BYTES

__all__ = ["FORMAT", "MAGIC", "Owner", "check_ssd_dir", "read_owner", "remove_stale", "scratch_name", "this_process"]

MAGIC = b"persia ssd-tier rows\n"
"""The first bytes of every file of rows a server writes."""
FORMAT = 1
"""The header's version: a header of another version is not read (its file is left alone)."""

_RUN_DIGITS = 12
# Memory-backed file systems (statfs's f_type): a "disk" there holds every row in host memory the plan never charged,
# read at memory speed where the plan priced the disk's IOPS.
_MEMORY_FILE_SYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


@dataclass(frozen=True)
class Owner:
    """The process a file of rows belongs to.

    Attributes:
        run: A random id drawn for each file (twelve hex digits): in the file's name and its header, so that a
            table made again by one process never meets its earlier file.
        pid: The process's id.
        host: Its host name (a pid means nothing on another host: a shared directory's files of other hosts stay).
        started: Its start time in clock ticks since boot (``/proc/PID/stat``), telling a reused pid from it; None
            where unknown.
    """

    run: str
    pid: int
    host: str
    started: int | None

    def header(self) -> bytes:
        """The file's first bytes (at most :data:`SSD_HEADER_BYTES`; :class:`.row_file.RowFile` pads the block)."""
        return MAGIC + json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True).encode() + b"\n"

    def gone(self) -> bool:
        """Whether this owner no longer runs on this host (False for another host's, which cannot be known here)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process has that pid: alive, and maybe the owner
            pass
        now = _start_time(self.pid)
        return self.started is not None and now is not None and now != self.started


def this_process() -> Owner:
    """This process as the owner of a new file (a fresh run id each call)."""
    pid = os.getpid()
    return Owner(secrets.token_hex(_RUN_DIGITS // 2), pid, socket.gethostname(), _start_time(pid))


def scratch_name(table: str, index: int, run: str) -> str:
    """The file name of ``table``'s rows on server ``index`` for the owner of run id ``run``."""
    return f"{table}.ps{index}.{run}.rows"


def read_owner(fd: int) -> Owner | None:
    """The owner the header of the open file ``fd`` names; None where it is not a header of ours (another magic, another
    version, malformed)."""
    block = os.pread(fd, SSD_HEADER_BYTES, 0)
    if not block.startswith(MAGIC):
        return None
    line = block[len(MAGIC) :].split(b"\n", 1)[0]
    try:
        fields = json.loads(line)
        if not isinstance(fields, dict) or fields.pop("format", None) != FORMAT:
            return None
        owner = Owner(**fields)
    except (ValueError, TypeError):
        return None
    valid = (
        isinstance(owner.run, str)
        and re.fullmatch(f"[0-9a-f]{{{_RUN_DIGITS}}}", owner.run) is not None
        and type(owner.pid) is int
        and owner.pid > 0
        and isinstance(owner.host, str)
        and (owner.started is None or type(owner.started) is int)
    )
    return owner if valid else None


def remove_stale(directory: Path, table: str, index: int) -> list[Path]:
    """Remove the files of ``table``'s rows on server ``index`` in ``directory`` that a dead server of ours left (see
    the module's docstring for what makes a file ours and stale); returns them. Every other file stays."""
    pattern = re.compile(rf"{re.escape(table)}\.ps{index}\.([0-9a-f]{{{_RUN_DIGITS}}})\.rows")
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            found = pattern.fullmatch(entry.name)
            if found is not None and _remove_if_stale(Path(entry.path), found.group(1)):
                removed.append(Path(entry.path))
    return removed


def _remove_if_stale(path: Path, run: str) -> bool:
    try:
        # O_NOFOLLOW: a link is not our file; O_NONBLOCK: a FIFO of that name does not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < SSD_HEADER_BYTES:
            return False
        owner = read_owner(fd)
        if owner is None or owner.run != run or not owner.gone():
            return False
        now = os.lstat(path)  # still the file read: not replaced since
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        path.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot; None where unknown (no ``/proc``, gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        # After the command name (in parentheses, which may hold anything): state, ..., starttime is the 20th field.
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------------------------------------- --ssd-dir, checked


def check_ssd_dir(directory: str | os.PathLike[str] | None) -> None:
    """``--ssd-dir`` must be a directory, or a new one in an existing directory (created here), on a disk: writable
    with ``O_DIRECT`` (as :class:`.row_file.RowFile` writes), not memory (tmpfs, ramfs). Found out by writing a probe
    file of one block and removing it, before any server starts: a server would fail at its first table.

    Why the parent must exist: ``--ssd-dir`` names a disk, usually a mount point's folder; creating missing parents
    would put the tier on whatever disk holds ``/`` when that disk is not mounted.

    Raises:
        PlannerError: It cannot be such a directory (one line, naming the path and why).
    """
    if directory is None:
        return
    path = Path(directory)
    shown = clip(str(path), 160)
    try:
        created = _make_directory(path, shown)
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        raise PlannerError(
            f"--ssd-dir {shown}: cannot make it a directory ({_reason(err)})", fixes=("pass a writable directory",)
        ) from None
    try:
        memory = _memory_file_system(path)
        if memory is not None:
            raise PlannerError(
                f"--ssd-dir {shown} is on {memory}, which keeps files in memory: the ssd tier's rows would take host "
                "memory the plan does not charge, at memory speed",
                fixes=("pass a directory on a local disk", "leave out --ssd-dir"),
            )
        _probe(path, shown)
    except PlannerError:
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


def _make_directory(path: Path, shown: str) -> bool:
    """Make ``path`` a directory if it is none yet (its parent must exist); returns whether it was created."""
    if path.is_dir():
        return False
    if path.is_symlink() and not path.exists():
        raise PlannerError(
            f"--ssd-dir {shown} is a symbolic link to nothing (or to itself)",
            fixes=("point the link at a directory", "pass another directory"),
        )
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise PlannerError(
            f"--ssd-dir {shown}: {clip(str(blocker), 160)} is a file, not a directory",
            fixes=("pass a directory",),
        )
    if not path.parent.is_dir():
        raise PlannerError(
            f"--ssd-dir {shown}: its parent {clip(str(path.parent), 160)} does not exist",
            fixes=("create it (or mount the disk there) first", "pass a directory on a mounted disk"),
        )
    try:
        path.mkdir()
    except FileExistsError:
        # Another process of the job (every torchrun process checks it) made it first: it is not ours to remove.
        if path.is_dir():
            return False
        raise
    return True


def _probe(path: Path, shown: str) -> None:
    """Create, write with ``O_DIRECT`` and remove a file of one block of our own in ``path``."""
    probe = path / f".persia-ssd-probe.{os.getpid()}.{secrets.token_hex(4)}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd, ours = -1, False
    try:
        fd = os.open(probe, flags | getattr(os, "O_DIRECT", 0), 0o600)
        ours = True
        block = mmap.mmap(-1, SSD_HEADER_BYTES)  # page-aligned, as O_DIRECT needs
        try:
            os.pwrite(fd, block, 0)
        finally:
            block.close()
    except OSError as err:
        if err.errno == errno.EINVAL:
            ours = True  # a file system that refuses O_DIRECT may have created the file first: ours (O_EXCL)
            raise PlannerError(
                f"--ssd-dir {shown}: its file system refuses direct I/O (O_DIRECT), which the ssd tier reads and "
                "writes with",
                fixes=("pass a directory on a local disk (ext4, xfs)", "leave out --ssd-dir"),
            ) from None
        raise PlannerError(
            f"--ssd-dir {shown}: cannot write there ({_reason(err)})", fixes=("pass a writable directory",)
        ) from None
    finally:
        if fd >= 0:
            os.close(fd)
        if ours:
            with contextlib.suppress(OSError):
                probe.unlink()


def _reason(err: OSError | ValueError) -> str:
    if isinstance(err, OSError):
        return {errno.EACCES: "permission denied", errno.EPERM: "not permitted"}.get(
            err.errno or 0, (err.strerror or str(err)).lower()
        )
    return str(err)


def _memory_file_system(path: Path) -> str | None:
    """The name of the memory-backed file system ``path`` is on (tmpfs, ramfs); None for another or where unknown."""
    if not sys.platform.startswith("linux"):
        return None
    buffer = ctypes.create_string_buffer(512)  # struct statfs: 120 bytes on 64-bit Linux, f_type its first word
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), buffer) != 0:
        return None
    return _MEMORY_FILE_SYSTEMS.get(ctypes.c_ulong.from_buffer(buffer).value & 0xFFFFFFFF)
