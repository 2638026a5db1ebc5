"""Where a ``persia`` command may write: the one rule every output path of every command goes through.

An output file is refused, before any work, when it

- is a directory, is not a regular file, lies under a file, or lies in a folder that does not exist or cannot be
  written (found by writing a probe file of ours there and removing it);
- names an input of the command (the same file, through links too) or another of its outputs, or lies inside an
  input folder (``--data csv:logs/`` and ``--out logs/scores.parquet``: the next read of the folder would take it);
- lies inside a training run's folders: a checkpoint (its ``step-*`` directories are replaced and pruned), or a
  ``--checkpoint`` or ``--log-dir`` folder of ``persia train`` (marked by :data:`RUN_MARKER`);
- exists: without ``--overwrite`` always, and with it unless it is a file of the same kind that persia wrote (each
  :class:`OutputKind` knows its own mark: plan.json's ``format``, a header line, PNG or Parquet metadata).

A checked output is written whole or not at all (:func:`write_output`): into a temporary file beside it, then linked
to its name (which fails if the name appeared meanwhile) or, with ``--overwrite``, renamed over our own file.

Torch-free: the CLI checks every output before the work starts, the training launcher its run folders.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import itertools
import json
import os
import re
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from persia_planner.errors import PlannerError

__all__ = [
    "CHECKPOINT_FORMAT",
    "MANIFEST",
    "PICTURE_METADATA",
    "RUN_MARKER",
    "SCORES_METADATA",
    "Output",
    "OutputKind",
    "RunFolder",
    "check_outputs",
    "check_run_folder",
    "enclosing_run_folder",
    "in_passing",
    "output_folder",
    "refuse_run_folder",
    "remove_made_folder",
    "unwritable",
    "write_output",
]

RUN_MARKER = ".persia-run"
"""The file ``persia train`` keeps in its ``--checkpoint`` and ``--log-dir`` folders: who holds the folder (it is
locked for the run's life) and that the folder is a run's, so that no other command writes inside it."""
_PROBE_PREFIX = ".persia-probe-"
_TMP_INFIX = ".persia-tmp-"
MANIFEST = "MANIFEST.json"
"""A checkpoint's manifest, written last into its ``step-*`` directory."""
CHECKPOINT_FORMAT = "persia-checkpoint/1"
_STEP_DIR = re.compile(r"^\.?step-\d{9,}(\.(tmp|old)-[0-9a-f]+)?$")
_HEAD_BYTES = 4096


class OutputKind(enum.StrEnum):
    """What a command writes, and how a file of that kind written by persia is known again.

    The value is how messages name it.
    """

    PLAN = "a plan (persia plan --out)"
    PICTURE = "a picture (persia plan/topology --png, persia size's frontier.png)"
    PROFILE = "a hardware profile (persia calibrate --out)"
    MODEL = "a suggested model (persia data profile --out)"
    SCORES = "scores (persia predict --out)"
    FACTORS = "refitted cost-model factors (persia train --log-dir, refit.yaml)"
    BEST = "the best evaluation's mark (persia train --early-stop, BEST.json)"
    TOPOLOGY = "a sized cluster (persia size --out, topology.yaml)"
    SIZING = "a sizing's shapes (persia size --out, sizing.json)"

    @property
    def file_name(self) -> str:
        """The name such a file usually has (what a message suggests)."""
        return _FILE_NAMES[self]

    @property
    def mark(self) -> bytes:
        """Bytes a file of this kind that persia wrote holds near its start (Parquet: in its footer's metadata)."""
        return _MARKS[self]

    def header(self, about: str = "") -> str:
        """The first line of a text output of this kind (:attr:`PROFILE`, :attr:`MODEL`, :attr:`TOPOLOGY`): its mark,
        then ``about``."""
        mark = self.mark.decode().rstrip(": ")
        return f"{mark}{': ' + about if about else ''}\n"

    def written_by_persia(self, path: Path) -> bool:
        """Whether the regular file ``path`` is of this kind and carries persia's mark."""
        if self is OutputKind.SCORES:
            return _parquet_marked(path, self.mark)
        try:
            with open(path, "rb") as f:
                head = f.read(_HEAD_BYTES)
        except OSError:
            return False
        if self in (OutputKind.PLAN, OutputKind.SIZING):  # JSON whose first key is its format
            return re.match(rb'\s*\{\s*"format"\s*:\s*"' + re.escape(self.mark), head) is not None
        if self is OutputKind.PICTURE:
            return head.startswith(b"\x89PNG\r\n\x1a\n") and self.mark in head
        return head.startswith(self.mark)


_MARKS = {
    OutputKind.PLAN: b"persia-plan/",
    OutputKind.PICTURE: b"Software\x00persia-planner",
    OutputKind.PROFILE: b"# persia calibrate",
    OutputKind.MODEL: b"# persia data profile",
    OutputKind.SCORES: b"persia-scores/1",
    OutputKind.FACTORS: b"# persia train: the cost model's factors",
    OutputKind.BEST: b'{"format": "persia-best/',
    OutputKind.TOPOLOGY: b"# persia size: ",
    OutputKind.SIZING: b"persia-sizing/",
}

_FILE_NAMES = {
    OutputKind.PLAN: "plan.json",
    OutputKind.PICTURE: "plan.png",
    OutputKind.PROFILE: "profile.yaml",
    OutputKind.MODEL: "model.yaml",
    OutputKind.SCORES: "scores.parquet",
    OutputKind.FACTORS: "refit.yaml",
    OutputKind.BEST: "BEST.json",
    OutputKind.TOPOLOGY: "topology.yaml",
    OutputKind.SIZING: "sizing.json",
}

PICTURE_METADATA = {"Software": "persia-planner"}
"""What :attr:`OutputKind.PICTURE` files carry (matplotlib's ``savefig(metadata=...)`` writes it as PNG text)."""
SCORES_METADATA = {b"persia": _MARKS[OutputKind.SCORES]}
"""What :attr:`OutputKind.SCORES` files carry in their Parquet schema's metadata."""


def _parquet_marked(path: Path, mark: bytes) -> bool:
    try:
        import pyarrow.parquet as pq

        metadata = pq.read_schema(path).metadata or {}
    except Exception:  # any file that is not a readable Parquet file is not ours
        return False
    return metadata.get(b"persia") == mark


@dataclass(frozen=True)
class Output:
    """One file a command is asked to write.

    Attributes:
        option: The option that names it (``"--out"``), as messages say it.
        path: Where.
        kind: What it will hold.
    """

    option: str
    path: Path
    kind: OutputKind


@dataclass(frozen=True)
class RunFolder:
    """A folder of a training run found around a path.

    Attributes:
        path: The folder.
        what: How messages name it (``"the checkpoint step-000000400"``).
    """

    path: Path
    what: str


InputPaths = Mapping[str, "Path | Iterable[Path] | None"]
"""A command's inputs by the name messages give them (``"MODEL"``, ``"--data"``): a file, a folder, several, or none."""


def check_outputs(outputs: Iterable[Output | None], inputs: InputPaths, *, overwrite: bool) -> None:
    """Refuse, before any work, an output that breaks the rule of this module.

    Args:
        outputs: The command's outputs (None: not asked for).
        inputs: The command's inputs.
        overwrite: Whether ``--overwrite`` was given.

    Raises:
        PlannerError: One line naming the output, what it would destroy and the fix.
    """
    given = [o for o in outputs if o is not None]
    sources = _sources(inputs)
    for out in given:
        _check_place(out.option, out.path, out.kind)
        for name, source in sources:
            _refuse_input(out.option, out.path, name, source)
        refuse_run_folder(out.option, out.path)
        _check_existing(out, overwrite)
    for a, b in itertools.combinations(given, 2):
        if _same_file(a.path, b.path):
            raise PlannerError(f"{a.option} and {b.option} name one file, {a.path}", fixes=("give each its own path",))


def check_run_folder(option: str, path: Path, inputs: InputPaths, *, own: Iterable[Path] = ()) -> None:
    """Refuse a folder ``persia train`` would write (``--checkpoint``, ``--log-dir``) that is an input, lies inside an
    input folder, inside a checkpoint or inside another run's folder (``own``: this run's other folders, where it may
    lie). Whether it can be written, and what it already holds, the training launcher checks.

    Raises:
        PlannerError: One line naming the folder and what it would destroy.
    """
    for name, source in _sources(inputs):
        _refuse_input(option, path, name, source)
    mine = {os.path.realpath(p) for p in own}
    folder = enclosing_run_folder(path, strict=True)
    if folder is not None and os.path.realpath(folder.path) not in mine:
        raise PlannerError(
            f"{option} {path} is inside {folder.what} ({folder.path}): writing there would change another run's files",
            fixes=("pass a folder outside it",),
        )


def enclosing_run_folder(path: Path, *, strict: bool = False) -> RunFolder | None:
    """The training run's folder ``path`` lies in (itself too, unless ``strict``): a checkpoint's ``step-*`` or
    staging directory, or a folder holding :data:`RUN_MARKER` or published checkpoints."""
    resolved = Path(os.path.realpath(path))
    for i, folder in enumerate((resolved, *resolved.parents)):
        if strict and i == 0:
            # The folder itself may be a run's (a --resume), but never a checkpoint of one.
            if _STEP_DIR.match(folder.name) and folder.is_dir():
                return RunFolder(folder, f"the checkpoint {folder.name}")
            continue
        if not folder.is_dir():
            continue
        if _STEP_DIR.match(folder.name) and (folder.name.startswith(".") or (folder / MANIFEST).is_file()):
            return RunFolder(folder, f"the checkpoint {folder.name}")
        if (folder / RUN_MARKER).is_file():
            return RunFolder(folder, f"the {_marker_role(folder / RUN_MARKER)} folder of a persia train run")
        if _holds_checkpoints(folder):
            return RunFolder(folder, "the --checkpoint folder of a persia train run")
    return None


def _marker_role(marker: Path) -> str:
    try:
        role = json.loads(marker.read_bytes()[:_HEAD_BYTES]).get("role")
    except (OSError, ValueError, AttributeError):
        role = None
    return role if role in ("--checkpoint", "--log-dir") else "--checkpoint"


def _holds_checkpoints(folder: Path) -> bool:
    """Whether ``folder`` holds a published checkpoint (a run of an earlier version left no marker)."""
    try:
        return any(_STEP_DIR.match(p.name) and (p / MANIFEST).is_file() for p in folder.glob("step-*"))
    except OSError:
        return False


def output_folder(option: str, path: Path) -> bool:
    """Make ``path``, the folder a command writes its outputs into (``persia size --out sized/``), where it does not
    exist yet: only inside a folder that does (never a chain of them). Returns whether it was made here, so that a
    refusal of its files can remove it again (:func:`remove_made_folder`); the files themselves go through
    :func:`check_outputs`.

    Raises:
        PlannerError: ``path`` is something other than a folder, or its parent folder does not exist.
    """
    if path.is_dir():
        return False
    if path.exists() or path.is_symlink():
        raise PlannerError(f"{option} {path} is not a folder", fixes=("give a folder to write the outputs into",))
    parent = path.parent
    refuse_run_folder(option, path)
    if not parent.is_dir():
        raise PlannerError(
            f"{option} {path}: its parent folder {parent} does not exist", fixes=(f"create {parent} first",)
        )
    try:
        path.mkdir()
    except OSError as err:
        raise PlannerError(
            f"{option}: cannot create {path} ({err.strerror or err})", fixes=("choose a writable folder",)
        ) from None
    return True


def remove_made_folder(path: Path) -> None:
    """Remove the folder :func:`output_folder` made, where it is still empty (nothing else is ever removed)."""
    with contextlib.suppress(OSError):
        path.rmdir()


def write_output(out: Output, write: Callable[[Path], None], *, overwrite: bool) -> None:
    """Write ``out`` whole or not at all: ``write`` fills a new temporary file beside it, which then takes its name
    (refused if that name appeared since the check, or, with ``overwrite``, became something else).

    Raises:
        PlannerError: The file cannot be written there, or the name was taken meanwhile (one line).
    """
    target = Path(os.path.realpath(out.path))  # a link is written through: the file it names is replaced
    tmp = target.with_name(f".{target.name}{_TMP_INFIX}{uuid.uuid4().hex[:12]}")
    try:
        write(tmp)
        if overwrite and target.exists():
            _check_existing(out, overwrite)
            os.replace(tmp, target)
        else:
            _publish_new(tmp, target, out)
    except OSError as err:
        raise PlannerError(
            f"{out.option}: cannot write {out.path} ({err.strerror or err})", fixes=("choose a writable path",)
        ) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _publish_new(tmp: Path, target: Path, out: Output) -> None:
    """Give ``tmp`` the name ``target``, which must still be free."""
    try:
        os.link(tmp, target)  # atomic, and never replaces: EEXIST if the name was taken since the check
        return
    except FileExistsError:
        raise PlannerError(
            f"{out.option} {out.path} appeared while it was being written", fixes=("run again, or name another file",)
        ) from None
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
    # A filesystem without hard links: take the name with an exclusive create, then rename over our own empty file.
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        raise PlannerError(
            f"{out.option} {out.path} appeared while it was being written", fixes=("run again, or name another file",)
        ) from None
    os.replace(tmp, target)


# ---- the checks ------------------------------------------------------------------------------------------------------
def _sources(inputs: InputPaths) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for name, value in inputs.items():
        if value is None:
            continue
        for path in [value] if isinstance(value, str | os.PathLike) else value:
            found.append((name, Path(path)))
    return found


def refuse_run_folder(option: str, path: Path) -> None:
    """Refuse an output inside a training run's folders (see :func:`enclosing_run_folder`), naming ``option``.

    Raises:
        PlannerError: ``path`` is inside a run's folders (one line naming the folder and the fix).
    """
    folder = enclosing_run_folder(path)
    if folder is not None:
        raise PlannerError(
            f"{option} {path} is inside {folder.what} ({folder.path}): writing there would change a training run's "
            "files",
            fixes=("write it outside the run's folders",),
        )


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (through links; by path where either does not exist yet)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _inside(path: Path, folder: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(folder)
    return real != base and real.startswith(base.rstrip(os.sep) + os.sep)


def _refuse_input(option: str, path: Path, name: str, source: Path) -> None:
    kind = "folder" if source.is_dir() else "file"
    if _same_file(path, source):
        raise PlannerError(
            f"{option} {path} is the {name} {kind}: writing there would replace it",
            fixes=("choose another path for the output",),
        )
    if kind == "folder" and _inside(path, source):
        raise PlannerError(
            f"{option} {path} is inside the {name} folder {source}: the next read of that folder would take it in",
            fixes=("write it outside the input folder",),
        )


def _check_place(option: str, path: Path, kind: OutputKind) -> None:
    """``path`` can become a regular file: not a directory or a special file, in a folder that exists and takes a
    new file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError:
        blocker = next(p for p in path.parents if p.exists() and not p.is_dir())
        raise PlannerError(
            f"{option} {path}: {blocker} is a file, not a folder", fixes=("name a file in an existing folder",)
        ) from None
    except OSError as err:
        raise PlannerError(f"{option} {path}: {err.strerror or err}", fixes=("name another file",)) from None
    if mode is not None and stat.S_ISDIR(mode):
        raise PlannerError(f"{option} {path} is a folder", fixes=(f"name a file in it, e.g. {path / kind.file_name}",))
    if mode is not None and not stat.S_ISREG(mode):
        raise PlannerError(f"{option} {path} is not a regular file", fixes=("name a regular file",))
    folder = Path(os.path.realpath(path)).parent
    if not folder.is_dir():
        raise PlannerError(f"{option} {path}: the folder {folder} does not exist", fixes=("create it first",))
    problem = unwritable(folder)
    if problem is not None:
        raise PlannerError(
            f"{option} {path}: cannot write in {folder} ({problem})", fixes=("choose a writable folder",)
        )


def in_passing(name: str) -> bool:
    """Whether a file of this name is one persia keeps in a folder only in passing: the run's marker, a probe of
    :func:`unwritable` or a file :func:`write_output` is writing. Another process of the same run (torchrun's, on a
    shared file system) may have one open while this one looks at the folder: it makes no folder hold anything."""
    return name == RUN_MARKER or name.startswith(_PROBE_PREFIX) or _TMP_INFIX in name


def unwritable(folder: Path) -> str | None:
    """Why no file can be written in ``folder`` (None: one can). Permissions, read-only mounts and pseudo file
    systems (/proc) are only known by writing: a probe file of ours, removed at once."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=_PROBE_PREFIX):
            pass
    except OSError as err:
        return err.strerror or str(err)
    return None


def _check_existing(out: Output, overwrite: bool) -> None:
    if not os.path.lexists(out.path):
        return
    if not overwrite:
        raise PlannerError(
            f"{out.option} {out.path} exists", fixes=("add --overwrite to replace it", "name another file")
        )
    if not out.kind.written_by_persia(Path(os.path.realpath(out.path))):
        raise PlannerError(
            f"{out.option} {out.path} exists and is not {out.kind.value}: --overwrite replaces only a file of the "
            "same kind that persia wrote",
            fixes=("name another file",),
        )
