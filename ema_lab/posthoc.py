"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models").

Track power-function EMAs of a few lengths in training, save their snapshots every N updates, and afterwards
:func:`synthesize` the EMA of any length ``sigma_rel`` as the sum of the snapshots whose profiles
``t ** gamma`` best fit it in least squares (Algorithm 3, closed-form inner products; as EDM2's
``training/phema.py``, weights scaled to sum 1; ema-pytorch's ``PostHocEMA`` solves it unscaled).

The snapshot store: ``step-<step, 12 digits or more>/g<repr(gamma)>.pt``, each file a ``torch.save`` of
:data:`FIELDS` naming its run. :func:`save_step` writes a step under a hidden name, flushes it to disk, then
renames it in one call: a reader sees it whole or not at all, and a saved step is never replaced.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .checks import check_gamma, check_int, is_int, key_diff, one_of, require
from .ema import ModelEMA
from .schedules import power, sigma_rel_to_gamma

__all__ = ["PostHocEMA", "power_inner_products", "solve_weights", "synthesize", "Snapshot", "check_folder"]
__all__ += ["save_step", "list_snapshots", "load_snapshot"]

#: What a snapshot file says it is (its ``"format"`` entry).
FORMAT = "ema_lab snapshot 3"
#: A snapshot file's fields and the type of each: a new field is one more entry here and in save_step.
FIELDS = {"format": str, "step": int, "gamma": float, "run": (str, type(None)), "tensors": dict}
#: The largest step a snapshot may have: the synthesis computes with steps as float64, exact up to 2**53.
MAX_STEP = 2**53

_STEP = re.compile(r"step-(\d+)")
_FILE = re.compile(r"g(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\.pt")
_OLD_FILE = re.compile(r"ema-\d+-g.*\.pt")  # ema_lab 0.1.0's layout
_HOST = socket.gethostname()
_TMP = re.compile(r"\.step-\d+\.(.+)\.(\d+)\.[0-9a-f]+\.tmp")  # .step-<step>.<host>.<pid>.<random>.tmp


def power_inner_products(t_a: Tensor, gamma_a: Tensor, t_b: Tensor, gamma_b: Tensor) -> Tensor:
    """Inner products of the normalized power profiles ``(g + 1) / t * (x / t) ** g`` on ``[0, t]``
    (broadcasting; EDM2's ``power_function_correlation``: the integral ends with the shorter profile)."""
    t_short, t_long = torch.minimum(t_a, t_b), torch.maximum(t_a, t_b)
    g_long = torch.where(t_a > t_b, gamma_a, gamma_b)
    return (gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1) * (t_short / t_long) ** g_long / t_long


def check_step(name: str, step: object) -> None:
    """A snapshot's update count: an int in [1, 2**53]."""
    require(is_int(step) and 1 <= step <= MAX_STEP, name, step, "an int in [1, 2**53]")


def solve_weights(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[int],
    target_step: int,
    *,
    target_gamma: float | None = None,
    target_sigma_rel: float | None = None,
) -> Tensor:
    """The float64 weights of the snapshots whose sum best fits the power profile of the target: Algorithm
    3's Gram system solved by ``torch.linalg.lstsq`` (which copes with a singular one: a step saved twice),
    then scaled to sum 1 as EDM2 does, so that weights that never move are reproduced exactly."""
    one_of("target_gamma", target_gamma, "target_sigma_rel", target_sigma_rel)
    sizes = (len(snapshot_gammas), len(snapshot_steps))
    require(sizes[0] == sizes[1] > 0, "the snapshot gammas and steps", sizes, "as many, at least one")
    for g, s in zip(snapshot_gammas, snapshot_steps):
        check_gamma("a snapshot gamma", g)
        check_step("a snapshot step", s)
    check_step("target_step", target_step)
    target_gamma = sigma_rel_to_gamma(target_sigma_rel) if target_gamma is None else target_gamma
    check_gamma("target_gamma", target_gamma)
    g, t = (torch.tensor(x, dtype=torch.float64)[:, None] for x in (snapshot_gammas, snapshot_steps))
    gram = power_inner_products(t, g, t.T, g.T)
    target = [torch.tensor(float(x), dtype=torch.float64) for x in (target_step, target_gamma)]
    weights = torch.linalg.lstsq(gram, power_inner_products(t, g, *target), driver="gelsd").solution[:, 0]
    return weights / weights.sum()


@dataclass(frozen=True)
class Snapshot:
    """One saved EMA: its file, the update count it was saved at, and its profile's exponent gamma."""

    path: Path
    step: int
    gamma: float


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def check_folder(folder: str | os.PathLike) -> Path:
    """``folder`` as an absolute Path (a later chdir does not move it), made if missing, checked writable, and
    rid of the temporary folders of dead writers on this host (saves killed midway), never a live one's."""
    path = Path(folder).absolute()
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


def save_step(
    folder: str | os.PathLike, step: int, states: Mapping[float, Mapping[str, Tensor]], run: str | None = None
) -> Path:
    """Save every profile of update ``step`` (gamma -> the EMA's tensors, moved to the CPU), each naming
    ``run``, as ``folder/step-<step>/``, complete or not at all; returns that path. A saved step is never
    replaced (a second save raises ValueError: in a run of several processes only rank 0 saves, or each to
    its own folder); a failed one leaves no trace to a reader (a killed one a hidden ``.step-*.tmp`` folder,
    which :func:`check_folder` removes). A subset of views of one storage stores all of it: clone it first."""
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
    tmp = folder / f".step-{step:012d}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
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
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR) and os.path.lexists(final):
            raise taken from None
        message = f"step {step} not saved to {final}: {e.strerror or _first_line(e)}"
        raise (OSError(e.errno, message) if e.errno else OSError(message)) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _fsync(folder)
    except OSError as e:  # the step is saved and visible; whether it would outlive a power cut is not known
        raise OSError(e.errno, f"step {step} saved to {final}, but {folder} not flushed: {e.strerror}") from e
    return final


def list_snapshots(folder: str | os.PathLike) -> list[Snapshot]:
    """The snapshots in ``folder`` (complete steps only: a step is published whole), by step then gamma; a
    name like a snapshot's that is no regular file is refused (a FIFO would block its reader)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"no snapshot folder at {str(folder)!r}")
    found = []
    try:
        for p in folder.iterdir():
            if _OLD_FILE.fullmatch(p.name):
                raise ValueError(f"{p} was written by ema_lab 0.1.0, whose files this version does not read")
            if not (m := _STEP.fullmatch(p.name)):
                continue
            check_step(f"the step of {p}", int(m[1]))
            if not p.is_dir():
                raise ValueError(f"{p} is named like a saved step but is not a folder")
            for f in p.iterdir():
                if g := _FILE.fullmatch(f.name):
                    if not f.is_file():
                        raise ValueError(f"{f} is named like a snapshot but is not a regular file")
                    found.append(Snapshot(f, int(m[1]), float(g[1])))
    except OSError as e:  # the folder deleted or changed while listed
        raise ValueError(f"cannot list the snapshots in {str(folder)!r}: {_first_line(e)}") from None
    return sorted(found, key=lambda s: (s.step, s.gamma))


def _read(snapshot: Snapshot) -> dict:
    path = snapshot.path
    try:  # str: torch 2.1 memory-maps a file given by name only
        data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # any file torch cannot read: truncated, empty, foreign, gone
        raise ValueError(f"{path} is not a readable snapshot ({_first_line(e)})") from None
    if not (isinstance(data, dict) and data.keys() == FIELDS.keys()):
        raise ValueError(f"{path} is not an ema_lab snapshot file (no {FORMAT!r} payload)")
    for k, kind in FIELDS.items():
        if not isinstance(data[k], kind) or isinstance(data[k], bool):
            raise ValueError(f"{path} holds a {type(data[k]).__name__} as its {k}")
    if data["format"] != FORMAT:
        raise ValueError(f"{path} is in format {data['format']!r}; this version reads {FORMAT!r}")
    if (data["step"], data["gamma"]) != (snapshot.step, snapshot.gamma):
        raise ValueError(
            f"{path} holds step {data['step']}, gamma {data['gamma']!r}; its name says step {snapshot.step}"
        )
    tensors = data["tensors"]
    if not (tensors and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items())):
        raise ValueError(f"{path} does not hold a non-empty dict of name -> Tensor")
    return data


def load_snapshot(snapshot: Snapshot) -> dict[str, Tensor]:
    """The tensors of one snapshot, memory-mapped from its file, checked to be what its name says."""
    return _read(snapshot)["tensors"]


def synthesize(
    folder: str | os.PathLike,
    sigma_rel: float | None = None,
    step: int | None = None,
    *,
    gamma: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """The EMA of length ``sigma_rel`` (or exponent ``gamma``) at ``step`` (default: the last snapshot's),
    combined from the snapshots of one run saved up to ``step``, read one at a time (memory-mapped): float
    tensors summed with their weights in ``dtype``, other entries (integer counters) the last snapshot's."""
    one_of("sigma_rel", sigma_rel, "gamma", gamma)
    require(dtype in (torch.float32, torch.float64), "dtype", dtype, "torch.float32 or torch.float64")
    if not (snapshots := list_snapshots(folder)):
        raise ValueError(f"no snapshots in {str(folder)!r}")
    steps = sorted({s.step for s in snapshots})
    step = steps[-1] if step is None else step
    require(step in steps, "step", step, f"one of the snapshots' steps ({steps[0]} .. {steps[-1]})")
    used = [s for s in snapshots if s.step <= step]
    weights = solve_weights(
        [s.gamma for s in used], [s.step for s in used], step, target_gamma=gamma, target_sigma_rel=sigma_rel
    )
    out: dict[str, Tensor] = {}
    first: tuple = ()  # the first snapshot's run and layout: every other must be of that run and model
    for snapshot, w in zip(used, weights.tolist()):
        data = _read(snapshot)
        tensors = data["tensors"]
        kind = {
            k: f"{tuple(v.shape)} {'' if v.is_floating_point() else 'not '}float" for k, v in tensors.items()
        }
        run, layout = first = first or (data["run"], kind)
        if data["run"] != run:
            why = f"of run {data['run']!r}, {used[0].path} of run {run!r}"
            raise ValueError(f"{snapshot.path} is {why}: a folder holds the snapshots of one run")
        if kind != layout:
            bad = [k for k in kind if kind[k] != layout.get(k)]
            why = key_diff(layout, kind) if kind.keys() != layout.keys() else f"{bad[0]!r}: {kind[bad[0]]}"
            raise ValueError(f"{snapshot.path} holds another model's tensors than {used[0].path} ({why})")
        for k, v in tensors.items():
            if k in out and v.is_floating_point():
                out[k].add_(v, alpha=w)
            else:
                out[k] = v.to(dtype) * w if v.is_floating_point() else v.clone()
        del data, tensors  # unmaps the file before the next one is read
    return out


class PostHocEMA(ModelEMA):
    """Power-function EMAs (Karras et al. 2024) of one model, one per length in ``sigma_rels`` (distinct, in
    (0, 0.2887]; EDM2's two by default) as ``.emas`` and ``.schedules`` (``.ema`` the first), all moved by
    one step from one read of the model and saved in ``folder`` every ``snapshot_every`` updates, each
    snapshot naming ``.run``. ``updates=N`` resumes from the snapshots of update N (a folder holding later
    ones, another run's, is refused), then :meth:`load_state_dict` continues from a checkpoint bit for bit."""

    def __init__(
        self,
        model: nn.Module,
        folder: str | os.PathLike,
        sigma_rels: Iterable[float] = (0.05, 0.10),
        snapshot_every: int = 1000,
        updates: int = 0,
    ) -> None:
        lengths = []  # a list, a tuple, a NumPy array: any non-empty run of numbers
        with contextlib.suppress(TypeError):
            lengths = [] if isinstance(sigma_rels, (str, bytes)) else list(sigma_rels)
        if not lengths:
            raise ValueError(f"sigma_rels must be a non-empty sequence of lengths, got {sigma_rels!r}")
        schedules = [power(sigma_rel=s) for s in lengths]
        gammas = [s.gamma for s in schedules]
        if len(set(gammas)) != len(gammas):
            raise ValueError(f"sigma_rels must be distinct profiles, got {lengths!r} (gammas {gammas})")
        check_int("snapshot_every", snapshot_every, 1)
        check_int("updates", updates, 0)
        self.folder, self.snapshot_every = check_folder(folder), snapshot_every  # a bad folder fails here
        listed = list_snapshots(self.folder)
        if later := [s.step for s in listed if s.step > updates]:
            why = "resume with updates=<a saved update> or give an empty folder"
            raise ValueError(f"{self.folder} holds snapshots up to update {max(later)}: {why}")
        super().__init__(model, decay=schedules, updates=updates, strategy="flat")
        self.run, self.saved = secrets.token_hex(8), updates  # the last update this run saved (or resumed at)
        if updates:
            saved = {s.gamma: s for s in listed if s.step == updates}
            for ema, s in zip(self.emas, self.schedules):
                if s.gamma not in saved:
                    raise ValueError(f"no snapshot of update {updates}, gamma {s.gamma!r} in {self.folder}")
                data = _read(saved[s.gamma])
                ema.load_state_dict(data["tensors"])
                self.run = data["run"]

    def update(self, model: nn.Module) -> None:
        """Move every EMA one step towards ``model``; every ``snapshot_every`` updates, save them all. If the
        save raises, the update is undone (the EMAs and ``updates`` as before it) and the error propagates."""
        if not self.enabled or (self.updates + 1) % self.snapshot_every:
            super().update(model)
            return
        copies = [{k: v.clone() for k, v in ema.state_dict().items()} for ema in self.emas]  # to undo it
        super().update(model)
        try:
            self.save()
        except BaseException:
            with torch.no_grad():  # in place: the step's buffers stay the EMAs' memory
                for ema, copy in zip(self.emas, copies):
                    for k, v in ema.state_dict().items():
                        v.copy_(copy[k])
            self.updates -= 1  # as before it
            raise

    def save(self) -> None:
        """Save every EMA's snapshot of this update as one step, complete or none; refused where the folder
        holds a later update than this run saved (another run writes there)."""
        if later := [s.step for s in list_snapshots(self.folder) if s.step > self.saved]:
            why = f"after run {self.run}'s last save ({self.saved}): another run writes there"
            raise ValueError(f"{self.folder} holds update {max(later)}, {why}; give each run its own folder")
        states = {s.gamma: e.state_dict() for e, s in zip(self.emas, self.schedules)}
        save_step(self.folder, self.updates, states, self.run)
        self.saved = self.updates

    def state_dict(self) -> dict:
        """:meth:`ModelEMA.state_dict` and the run it continues."""
        return {**super().state_dict(), "run": self.run}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (:meth:`ModelEMA.load_state_dict`) and its run: the one resumed, if any."""
        run = state.get("run", self.run) if isinstance(state, dict) else self.run  # no run: the base refuses
        if self.saved and run != self.run:
            raise ValueError(f"the state is of run {run!r}, the snapshots in {self.folder} of {self.run!r}")
        super().load_state_dict(state)
        self.run = run

    def synthesize(self, sigma_rel: float, step: int | None = None) -> dict[str, Tensor]:
        """The state_dict of the EMA of length ``sigma_rel`` at ``step`` (default: the last snapshot)."""
        return synthesize(self.folder, sigma_rel, step)
