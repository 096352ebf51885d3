"""Snapshot files of post-hoc EMA runs (:mod:`ema_lab.posthoc`): a step is saved complete or not at all.

A folder holds one subfolder per saved update, ``step-<step, 12 digits or more>/``, with one file per
profile, ``g<repr(gamma)>.pt`` (``torch.save`` of ``{"format", "step", "gamma", "tensors"}``). A step is
written under a hidden temporary name (``.step-<step>.<pid>.<random>.tmp/``), each file flushed to disk, and
then the whole subfolder is renamed to its name in one system call: a reader sees every profile of a step
or no trace of it, whatever moment the writing process dies at. The rename of a folder never replaces a
folder that holds files, so a step saved once is never replaced, even by another process saving the same
step at the same moment (that one gets a ``ValueError``). Folders of ema_lab 0.1.0 (one file per profile,
``ema-<step>-g<gamma>.pt``) are refused by name, not read.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .checks import is_int, is_real, require

__all__ = ["Snapshot", "check_folder", "save_step", "list_snapshots", "load_snapshot"]

#: What a snapshot file says it is (its ``"format"`` entry).
FORMAT = "ema_lab snapshot 2"
#: The largest step a snapshot may have: the synthesis computes with steps as float64, exact up to 2**53.
MAX_STEP = 2**53

_STEP = re.compile(r"step-(\d+)")
_FILE = re.compile(r"g(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\.pt")
_OLD_FILE = re.compile(r"ema-\d+-g.*\.pt")  # ema_lab 0.1.0


@dataclass(frozen=True)
class Snapshot:
    """One saved EMA: its file, the update count it was saved at, and its profile's exponent gamma."""

    path: Path
    step: int
    gamma: float


def _check_gamma(name: str, gamma: object) -> None:
    require(is_real(gamma) and gamma >= 0, name, gamma, "a number >= 0")


def _check_step(name: str, step: object) -> None:
    require(is_int(step) and 1 <= step <= MAX_STEP, name, step, "an int in [1, 2**53]")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _show(value: object) -> str:
    """A value read from a file, in a message: numbers and strings as such, anything else by its type."""
    return repr(value) if isinstance(value, (int, float, str)) else f"a {type(value).__name__}"


def check_folder(folder: str | os.PathLike) -> Path:
    """``folder`` as an absolute Path (a later chdir does not move it), made if missing and checked writable
    by writing and removing a probe in it."""
    path = Path(folder).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        os.mkdir(probe)
        try:
            os.close(os.open(probe / "p", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as e:
        raise ValueError(f"cannot write snapshots to {str(path)!r}: {e.strerror or _first_line(e)}") from None
    return path


class _Recorder:
    """A file for ``torch.save`` that keeps the OSError of a failed write: torch reports a short write as
    ``[enforce fail at inline_container.cc] unexpected pos``, without the disk's reason."""

    def __init__(self, file) -> None:
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.file.flush()


def _write_file(path: Path, payload: dict) -> None:
    """``payload`` into the new file ``path`` (mode 0666 less the umask, as torch.save of a path), on disk."""
    with open(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), "wb") as f:
        recorder = _Recorder(f)
        try:
            torch.save(payload, recorder)
        except Exception as e:
            if recorder.error is None:
                raise
            raise recorder.error from e
        f.flush()
        os.fsync(f.fileno())


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a new or renamed name) to disk; POSIX only (Windows cannot open a folder)."""
    if os.name == "posix":
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_step(folder: str | os.PathLike, step: int, states: Mapping[float, Mapping[str, Tensor]]) -> Path:
    """Save the snapshots of every profile of update ``step`` (gamma -> the EMA's tensors, moved to the CPU)
    as ``folder/step-<step>/``, complete or not at all; returns that path.

    A step saved once is never replaced: a second save of it (a retry of a save that succeeded, or another
    process saving the same step) raises ValueError and changes nothing. So in a run of several processes
    (every DDP rank) only one may save (rank 0), or each saves to its own folder. A failed save (disk full,
    the process killed) leaves no trace of the step to a reader, so a retry saves it whole; a killed one
    may leave a hidden ``.step-*.tmp`` folder, which no reader lists. Views of one storage (a flat EMA's
    state_dict) share it in the file; a subset of such views stores the whole storage: clone them first.
    """
    _check_step("step", step)
    if not (isinstance(states, Mapping) and states):
        raise ValueError(f"states must be a non-empty dict of gamma -> tensors, got {type(states).__name__}")
    for gamma, tensors in states.items():
        _check_gamma("a profile's gamma", gamma)
        if not (isinstance(tensors, Mapping) and tensors):
            raise ValueError(
                f"gamma {gamma!r}: tensors must be a non-empty dict, got {type(tensors).__name__}"
            )
        bad = [k for k, v in tensors.items() if not (isinstance(k, str) and isinstance(v, Tensor))]
        bad += [k for k, v in tensors.items() if isinstance(v, Tensor) and v.is_meta]
        if bad:
            raise ValueError(
                f"gamma {gamma!r}: tensors must map names to Tensors with data; not so for {bad[:3]}"
            )
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"no snapshot folder at {str(folder)!r} (check_folder makes one; was it deleted?)")
    final = folder / f"step-{step:012d}"
    if final.exists() or final.is_symlink():  # early and cheap; the rename below decides
        raise ValueError(f"{final} exists: a saved step is never replaced")
    tmp = folder / f".step-{step:012d}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        os.mkdir(tmp, 0o777)
        for gamma, tensors in states.items():
            payload = {"format": FORMAT, "step": int(step), "gamma": float(gamma)}
            payload["tensors"] = {k: v.detach().cpu() for k, v in tensors.items()}
            _write_file(tmp / f"g{float(gamma)!r}.pt", payload)
        _fsync_folder(tmp)
        try:
            os.rename(tmp, final)  # fails where final is a folder with files, or not a folder
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise ValueError(f"{final} exists: a saved step is never replaced") from None
            raise
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        message = f"step {step} not saved to {final}: {e.strerror or _first_line(e)}"
        raise (OSError(e.errno, message) if e.errno else OSError(message)) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _fsync_folder(folder)
    except OSError as e:  # the step is saved and visible; whether it would outlive a power cut is not known
        raise OSError(e.errno, f"step {step} saved to {final}, but {folder} not flushed: {e.strerror}") from e
    return final


def _profiles(step_dir: Path, step: int) -> list[Snapshot]:
    """The snapshots in one step's folder; a name like a profile's that is no regular file is refused (a
    FIFO would block the reader, a dangling link would fail it later)."""
    found = []
    for p in sorted(step_dir.iterdir()):
        if m := _FILE.fullmatch(p.name):
            if not p.is_file():
                raise ValueError(f"{p} is named like a snapshot but is not a regular file")
            found.append(Snapshot(p, step, float(m[1])))
    return found


def list_snapshots(folder: str | os.PathLike) -> list[Snapshot]:
    """The snapshots in ``folder`` (complete steps only: a step is published whole), by step then gamma."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"no snapshot folder at {str(folder)!r}")
    found = []
    try:
        for p in folder.iterdir():
            if _OLD_FILE.fullmatch(p.name):
                raise ValueError(
                    f"{p} was written by ema_lab 0.1.0, whose snapshots this version does not read"
                )
            if m := _STEP.fullmatch(p.name):
                if not 1 <= int(m[1]) <= MAX_STEP:
                    raise ValueError(f"{p} is named like a saved step, but its step is not in [1, 2**53]")
                if not p.is_dir():
                    raise ValueError(f"{p} is named like a saved step but is not a folder")
                found += _profiles(p, int(m[1]))
    except OSError as e:  # the folder deleted or changed while listed
        raise ValueError(f"cannot list the snapshots in {str(folder)!r}: {_first_line(e)}") from None
    return sorted(found, key=lambda s: (s.step, s.gamma))


def load_snapshot(snapshot: Snapshot) -> dict[str, Tensor]:
    """The tensors of one snapshot, memory-mapped from its file, checked to be what its name says."""
    path = snapshot.path
    try:
        # str: torch 2.1 memory-maps a file given by name only
        data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # any file torch cannot read: truncated, empty, foreign, gone
        raise ValueError(f"{path} is not a readable snapshot ({_first_line(e)})") from None
    if not (isinstance(data, dict) and data.keys() == {"format", "step", "gamma", "tensors"}):
        raise ValueError(f"{path} is not an ema_lab snapshot file (no {FORMAT!r} payload)")
    if not (isinstance(data["format"], str) and data["format"] == FORMAT):
        raise ValueError(f"{path} is in format {_show(data['format'])}; this version reads {FORMAT!r}")
    step, gamma, tensors = data["step"], data["gamma"], data["tensors"]
    if not (type(step) is int and type(gamma) is float and (step, gamma) == (snapshot.step, snapshot.gamma)):
        raise ValueError(
            f"{path} holds step {_show(step)}, gamma {_show(gamma)}; its name says step {snapshot.step}, "
            f"gamma {snapshot.gamma!r}"
        )
    if not (
        isinstance(tensors, dict)
        and tensors
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items())
    ):
        raise ValueError(f"{path} does not hold a non-empty dict of name -> Tensor")
    return tensors
