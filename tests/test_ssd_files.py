"""The ``ssd`` tier's scratch files: a server removes only a file of its own kind whose server died, never a file it
did not create, and ``--ssd-dir`` is refused in one line before any process starts where no file of rows could live."""

from __future__ import annotations

import array
import errno
import fcntl
import os
import socket
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.errors import PlannerError
from persia_planner.modules.ps.protocol import TableConfig
from persia_planner.modules.ps.row_file import HEADER_BYTES, RowFile
from persia_planner.modules.ps.server_state import make_store
from persia_planner.modules.ps.ssd_files import (
    MAGIC,
    Owner,
    check_ssd_dir,
    read_owner,
    remove_stale,
    scratch_name,
    this_process,
)
from persia_planner.modules.ps.ssd_store import SsdStore
from persia_planner.tiers import Tier

runner = CliRunner()
DEAD_RUN, LIVE_RUN = "0123456789ab", "ba9876543210"


def _config(directory: Path) -> TableConfig:
    return TableConfig("c1", 8, 100, store=Tier.SSD.spec.store, backing_rows=400, store_dir=str(directory))


def _dead_pid() -> int:
    """A pid no process has: above the kernel's largest."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    except OSError:
        return 2**22 + 1


def _file_of(directory: Path, owner: Owner, index: int = 0, run: str | None = None) -> Path:
    """A file of rows as a server of ``owner`` leaves it when killed: its header, then rows."""
    path = directory / scratch_name("c1", index, run or owner.run)
    path.write_bytes(owner.header().ljust(HEADER_BYTES, b"\0") + os.urandom(3 * HEADER_BYTES))
    return path


def _close(store) -> None:
    assert isinstance(store, SsdStore)
    store.close()


# ---- never a file we did not create ----------------------------------------------------------------------------------
def test_files_that_are_not_ours_survive_a_store_creation_byte_for_byte(tmp_path):
    here = socket.gethostname()
    dead = _dead_pid()
    others = {
        "c1.ps0.backup.rows": os.urandom(5000),
        "c1.ps1.old.rows": os.urandom(100),
        "c1.ps0.123.rows": os.urandom(9000),  # the name of an earlier version's file, no header: not ours
        f"c1.ps0.{DEAD_RUN}.rows": os.urandom(9000),  # our exact pattern, but no header
        f"c1.ps0.{DEAD_RUN}.rows.bak": Owner(DEAD_RUN, dead, here, None).header().ljust(HEADER_BYTES, b"\0"),
        # our header, but another host's (its pid means nothing here), another run's than its name, another format
        f"c1.ps0.{LIVE_RUN}.rows": Owner(LIVE_RUN, dead, "elsewhere", None).header().ljust(HEADER_BYTES, b"\0"),
        f"c1.ps1.{LIVE_RUN}.rows": Owner(DEAD_RUN, dead, here, None).header().ljust(HEADER_BYTES, b"\0"),
        f"c1.ps1.{DEAD_RUN}.rows": (MAGIC + b'{"format": 2}\n').ljust(HEADER_BYTES, b"\0"),
        "notes.txt": b"mine",
    }
    for name, data in others.items():
        (tmp_path / name).write_bytes(data)
    stores = [make_store(_config(tmp_path), index) for index in (0, 1)]
    for name, data in others.items():
        assert (tmp_path / name).read_bytes() == data, name
    for store in stores:
        _close(store)
    assert {p.name for p in tmp_path.iterdir()} == set(others)  # each store removed its own file only


def test_a_stale_file_of_ours_from_a_dead_pid_is_removed_a_live_ones_is_kept(tmp_path):
    here = socket.gethostname()
    dead = _file_of(tmp_path, Owner(DEAD_RUN, _dead_pid(), here, None))
    reused = _file_of(tmp_path, Owner("00000000000a", os.getpid(), here, 1))  # our pid, another start: a reused pid
    live = _file_of(tmp_path, Owner(LIVE_RUN, os.getppid(), here, None))
    live_bytes = live.read_bytes()
    other_index = _file_of(tmp_path, Owner("00000000000b", _dead_pid(), here, None), index=1)
    assert sorted(remove_stale(tmp_path, "c1", 0)) == sorted([dead, reused])
    assert not dead.exists() and not reused.exists()
    assert live.read_bytes() == live_bytes and other_index.exists()  # server 1's file is server 1's to remove
    store = make_store(_config(tmp_path), 1)
    assert not other_index.exists() and live.exists()
    _close(store)


def test_a_link_named_like_our_file_is_not_followed_nor_removed(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    target = _file_of(tmp_path / "elsewhere", Owner(DEAD_RUN, _dead_pid(), socket.gethostname(), None))
    link = tmp_path / target.name
    link.symlink_to(target)
    assert remove_stale(tmp_path, "c1", 0) == []
    assert link.is_symlink() and target.exists()


def test_a_file_of_rows_carries_its_owner_and_never_replaces_a_file(tmp_path):
    owner = this_process()
    assert owner.pid == os.getpid() and len(owner.run) == 12
    assert this_process().run != owner.run  # each file its own: a table made again never meets its earlier file
    path = tmp_path / scratch_name("c1", 0, owner.run)
    rows = RowFile(path, 100, 8, torch.float32, 1, header=owner.header())
    rows.write(torch.tensor([0, 99]), torch.ones(2, 8), torch.ones(2, 1))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_owner(fd) == owner and not owner.gone()
    finally:
        os.close(fd)
    assert torch.equal(rows.read(torch.tensor([99]))[0], torch.ones(1, 8))  # the rows start after the header
    assert path.stat().st_size == rows.disk_bytes == HEADER_BYTES + 4096  # 100 rows of 36 bytes: one block
    rows.close()
    kept = tmp_path / "kept.rows"
    kept.write_bytes(b"the user's")
    with pytest.raises(FileExistsError):
        RowFile(kept, 100, 8, torch.float32, 1)
    assert kept.read_bytes() == b"the user's"


# ---- --ssd-dir: one line, before any process ------------------------------------------------------------------------
def _train(*args: object):
    return runner.invoke(app, ["train", "--steps", "1", *map(str, args)], prog_name="persia")


def _refused(args: tuple, line: str) -> None:
    result = _train(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {line}\n"
    assert "Traceback" not in result.output


def test_an_ssd_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    _refused(
        ("--ssd-dir", tmp_path / "afile"),
        f"--ssd-dir {tmp_path / 'afile'}: {tmp_path / 'afile'} is a file, not a directory; fix: pass a directory",
    )
    _refused(
        ("--ssd-dir", tmp_path / "afile" / "x"),
        f"--ssd-dir {tmp_path / 'afile' / 'x'}: {tmp_path / 'afile'} is a file, not a directory; fix: pass a directory",
    )
    assert (tmp_path / "afile").read_text() == "x"


def test_an_ssd_dir_whose_parent_is_missing_is_refused_not_created(tmp_path):
    _refused(
        ("--ssd-dir", tmp_path / "nvme0" / "rows"),
        f"--ssd-dir {tmp_path / 'nvme0' / 'rows'}: its parent {tmp_path / 'nvme0'} does not exist; "
        "fix: create it (or mount the disk there) first or pass a directory on a mounted disk",
    )
    assert not (tmp_path / "nvme0").exists()


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may create files in: without write permission, or for root (whom permission bits do not
    stop) immutable (``chattr +i``, through its ioctl)."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    get_flags, set_flags, immutable = 0x80086601, 0x40086602, 0x10  # FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = array.array("i", [0])
        try:
            fcntl.ioctl(fd, get_flags, flags, True)
            fcntl.ioctl(fd, set_flags, array.array("i", [flags[0] | immutable]))
        except OSError as err:
            pytest.skip(f"cannot make a directory immutable here ({errno.errorcode.get(err.errno, err)})")
        yield path
        fcntl.ioctl(fd, set_flags, flags)
    finally:
        os.close(fd)


def test_a_read_only_ssd_dir_is_refused_by_a_probe_write(read_only_dir):
    reason = "not permitted" if os.geteuid() == 0 else "permission denied"
    _refused(
        ("--ssd-dir", read_only_dir),
        f"--ssd-dir {read_only_dir}: cannot write there ({reason}); fix: pass a writable directory",
    )
    _refused(
        ("--ssd-dir", read_only_dir / "sub"),
        f"--ssd-dir {read_only_dir / 'sub'}: cannot make it a directory ({reason}); fix: pass a writable directory",
    )
    assert not list(read_only_dir.iterdir())


def test_an_ssd_dir_in_memory_is_refused_and_not_left_behind():
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no /dev/shm")
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    if not any(m[1] == str(shm) and m[2] == "tmpfs" for m in mounts if len(m) > 2):
        pytest.skip("/dev/shm is not tmpfs here")
    path = shm / f"persia-ssd-test-{os.getpid()}"
    _refused(
        ("--ssd-dir", path),
        f"--ssd-dir {path} is on tmpfs, which keeps files in memory: the ssd tier's rows would take host memory the "
        "plan does not charge, at memory speed; fix: pass a directory on a local disk or leave out --ssd-dir",
    )
    assert not path.exists()  # made for the probe, removed with it


def test_a_looping_link_as_ssd_dir_is_refused(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    _refused(
        ("--ssd-dir", tmp_path / "loop"),
        f"--ssd-dir {tmp_path / 'loop'} is a symbolic link to nothing (or to itself); "
        "fix: point the link at a directory or pass another directory",
    )


def test_a_good_ssd_dir_is_made_and_the_probe_leaves_nothing(tmp_path):
    check_ssd_dir(tmp_path / "disks")
    check_ssd_dir(tmp_path / "disks")  # twice: an existing directory is fine
    assert (tmp_path / "disks").is_dir() and not list((tmp_path / "disks").iterdir())
    check_ssd_dir(None)
    with pytest.raises(PlannerError, match="cannot make it a directory"):
        check_ssd_dir(str(tmp_path / "a\0b"))
