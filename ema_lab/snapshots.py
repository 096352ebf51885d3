"""The post-hoc EMA's snapshot store: ``step-<step, 12 digits or more>/g<repr(gamma)>.pt``, each file a
``torch.save`` of :data:`FIELDS` naming its run; a step is saved and removed in one rename."""

from __future__ import annotations

import errno
import io
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .checks import check_gamma, is_int, require

__all__ = ["Snapshot", "check_folder", "save_step", "remove_step", "list_snapshots", "load_snapshot"]
__all__ += ["read_snapshot"]

FORMAT = "ema_lab snapshot 3"  #: what a snapshot file says it is (its "format" entry)
#: A snapshot file's fields and their types (a new field: here and in save_step, and a new FORMAT).
FIELDS = {"format": str, "step": int, "gamma": float, "run": (str, type(None)), "tensors": dict}
MAX_STEP = 2**53  #: the largest step: the synthesis computes steps as float64, exact up to 2**53

_STEP = re.compile(r"step-(\d+)")
_FILE = re.compile(r"g(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\.pt")
_OLD_FILE = re.compile(r"ema-\d+-g.*\.pt")  # the layout before step folders
_HOST = socket.gethostname()
_TMP = re.compile(r"\.step-\d+\.(.+)\.(\d+)\.[0-9a-f]+\.tmp")  # .step-<step>.<host>.<pid>.<random>.tmp


def check_step(name: str, step: object) -> None:
    """A snapshot's update count: an int in [1, 2**53]."""
    require(is_int(step) and 1 <= step <= MAX_STEP, name, step, "an int in [1, 2**53]")


@dataclass(frozen=True)
class Snapshot:
    """One saved EMA: its file, the update count it was saved at, and its profile's exponent gamma."""

    path: Path
    step: int
    gamma: float


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def check_folder(folder: str | os.PathLike) -> Path:
    """``folder`` as an absolute Path, made if missing, checked writable, rid of dead writers' temporaries."""
    path = Path(folder).absolute()  # a later chdir does not move it
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        for p in path.iterdir() if os.name == "posix" else ():  # Windows' os.kill would end the process
            if (m := _TMP.fullmatch(p.name)) and m[1] == _HOST:
                try:
                    os.kill(int(m[2]), 0)  # signal 0: only asks whether the writer exists
                except (ProcessLookupError, OverflowError):  # OverflowError: no process has such a pid
                    shutil.rmtree(p, ignore_errors=True)
                except PermissionError:  # another user's: alive
                    pass
    except OSError as e:
        raise ValueError(f"cannot write snapshots to {str(path)!r}: {e.strerror or _first_line(e)}") from None
    return path


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    """Flush a file or (POSIX only: Windows cannot open one) a folder's entries to disk."""
    if os.name == "posix" or not path.is_dir():
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _hidden(folder: Path, step: int) -> Path:
    """A new hidden name for a step's folder while it is written or removed (:data:`_TMP`)."""
    return folder / f".step-{step:012d}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def save_step(
    folder: str | os.PathLike, step: int, states: Mapping[float, Mapping[str, Tensor]], run: str | None = None
) -> Path:
    """Save update ``step``'s profiles (gamma -> tensors) as ``folder/step-<step>/``, all or not at all."""
    check_step("step", step)
    if not (isinstance(states, Mapping) and states):
        raise ValueError(f"states must be a non-empty dict of gamma -> tensors, got {type(states).__name__}")
    for gamma, tensors in states.items():
        check_gamma("a profile's gamma", gamma)
        named = isinstance(tensors, Mapping) and tensors and all(isinstance(k, str) for k in tensors)
        if not (named and all(isinstance(v, Tensor) and not v.is_meta for v in tensors.values())):
            raise ValueError(f"gamma {gamma!r}: need a non-empty dict: map names to Tensors with data")
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"no snapshot folder at {str(folder)!r} (check_folder makes one; was it deleted?)")
    final = folder / f"step-{step:012d}"
    taken = ValueError(f"{final} exists: a saved step is never replaced")
    if final.exists() or final.is_symlink():  # early and cheap; the rename below decides
        raise taken
    tmp = _hidden(folder, step)
    try:
        os.mkdir(tmp)
        for gamma, tensors in states.items():
            payload = {"format": FORMAT, "step": int(step), "gamma": float(gamma), "run": run}
            payload["tensors"] = {k: v.detach().cpu() for k, v in tensors.items()}
            data = io.BytesIO()  # in memory first: a failed write then raises the OS's reason, not torch's
            torch.save(payload, data)
            path = tmp / f"g{float(gamma)!r}.pt"
            with open(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), "wb") as f:
                f.write(data.getbuffer())
            _fsync(path, os.O_WRONLY)
        _fsync(tmp)
        os.rename(tmp, final)  # fails where final has files or is no folder: a saved step is never replaced
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR) and os.path.lexists(final):
            raise taken from None
        message = f"step {step} not saved to {final}: {e.strerror or _first_line(e)}"
        raise (OSError(e.errno, message) if e.errno else OSError(message)) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing there once renamed
    try:
        _fsync(folder)
    except OSError as e:  # the step is saved and visible; whether it would outlive a power cut is not known
        raise OSError(e.errno, f"step {step} saved to {final}, but {folder} not flushed: {e.strerror}") from e
    return final


def remove_step(folder: str | os.PathLike, step: int) -> None:
    """Remove ``folder/step-<step>/`` in one rename (a killed removal leaves a temporary)."""
    check_step("step", step)
    folder = Path(folder)
    tmp = _hidden(folder, step)
    try:
        os.rename(folder / f"step-{step:012d}", tmp)
    except OSError as e:
        why = e.strerror or _first_line(e)
        raise OSError(e.errno, f"step {step} not removed from {folder}: {why}") from e
    shutil.rmtree(tmp, ignore_errors=True)


def list_snapshots(folder: str | os.PathLike) -> list[Snapshot]:
    """The snapshots in ``folder`` (complete steps only), by step then gamma."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"no snapshot folder at {str(folder)!r}")
    found = []
    try:
        for p in folder.iterdir():
            if _OLD_FILE.fullmatch(p.name):
                why = f"in the layout before step folders (ema-N-g*.pt); this version reads {FORMAT!r}"
                raise ValueError(f"{p} is {why}")
            if not (m := _STEP.fullmatch(p.name)):
                continue
            check_step(f"the step of {p}", int(m[1]))
            if not p.is_dir():
                raise ValueError(f"{p} is named like a saved step but is not a folder")
            for f in p.iterdir():
                if g := _FILE.fullmatch(f.name):
                    if not f.is_file():  # a FIFO would block its reader
                        raise ValueError(f"{f} is named like a snapshot but is not a regular file")
                    found.append(Snapshot(f, int(m[1]), float(g[1])))
    except OSError as e:  # the folder deleted or changed while listed
        raise ValueError(f"cannot list the snapshots in {str(folder)!r}: {_first_line(e)}") from None
    return sorted(found, key=lambda s: (s.step, s.gamma))


def read_snapshot(snapshot: Snapshot) -> dict:
    """One snapshot file's fields (:data:`FIELDS`), memory-mapped, checked to be what its name says."""
    path = snapshot.path
    try:  # str: torch 2.1 memory-maps a file given by name only
        data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # any file torch cannot read: truncated, empty, foreign, gone
        raise ValueError(f"{path} is not a readable snapshot ({_first_line(e)})") from None
    written = data.get("format") if isinstance(data, dict) else None  # first: other formats, other fields
    if not (isinstance(written, str) and written.startswith("ema_lab snapshot")):
        raise ValueError(f"{path} is not an ema_lab snapshot file (no {FORMAT!r} payload)")
    if written != FORMAT:
        raise ValueError(f"{path} is in format {written!r}; this version reads {FORMAT!r}")
    if data.keys() != FIELDS.keys():
        raise ValueError(f"{path} holds the fields {sorted(data)}, not {FORMAT!r}'s {sorted(FIELDS)}")
    for k, kind in FIELDS.items():
        if not isinstance(data[k], kind) or isinstance(data[k], bool):
            raise ValueError(f"{path} holds a {type(data[k]).__name__} as its {k}")
    if (data["step"], data["gamma"]) != (snapshot.step, snapshot.gamma):
        held = f"step {data['step']}, gamma {data['gamma']!r}"
        raise ValueError(f"{path} holds {held}; its name says step {snapshot.step}")
    tensors = data["tensors"]
    if not (tensors and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items())):
        raise ValueError(f"{path} does not hold a non-empty dict of name -> Tensor")
    return data


def load_snapshot(snapshot: Snapshot) -> dict[str, Tensor]:
    """The tensors of one snapshot, memory-mapped from its file, checked to be what its name says."""
    return read_snapshot(snapshot)["tensors"]
