"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models").

Track power-function EMAs (:func:`ema_lab.schedules.power`) of two lengths during training and save
their snapshots every N updates (:func:`save_snapshot`); afterwards, :func:`synthesize` the EMA of any
length ``sigma_rel`` as the weighted sum of the snapshots whose profiles ``t ** gamma`` on ``[0, step]``
best fit the wanted one in least squares (Algorithm 3: the profiles' inner products in closed form).
The anchors are EDM2's ``training/phema.py`` (``power_function_correlation``,
``solve_posthoc_coefficients``: it solves the same system and also scales the weights to sum 1) and
ema-pytorch's ``PostHocEMA`` (``torch.linalg.solve``, weights not scaled).

A snapshot is one file ``ema-<step, 12 digits>-g<repr(gamma)>.pt`` written to a temporary file in the same
folder, flushed to disk and renamed over its name: a crash while writing leaves a ``.tmp`` file that
:func:`list_snapshots` ignores, and every earlier snapshot intact.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .checks import check_int, is_real, require
from .ema import ModelEMA
from .schedules import Power, power, sigma_rel_to_gamma

__all__ = [
    "PostHocEMA",
    "Snapshot",
    "power_inner_products",
    "solve_weights",
    "save_snapshot",
    "list_snapshots",
    "load_snapshot",
    "synthesize",
]

_NAME = re.compile(r"ema-(\d+)-g(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\.pt")


@dataclass(frozen=True)
class Snapshot:
    """One saved EMA: its file, the update count it was saved at, and its profile's exponent gamma."""

    path: Path
    step: int
    gamma: float


def _check_gamma(name: str, gamma: object) -> None:
    require(is_real(gamma) and gamma >= 0, name, gamma, "a number >= 0")


def _check_step(name: str, step: object) -> None:
    check_int(name, step, 1)


def power_inner_products(t_a: Tensor, gamma_a: Tensor, t_b: Tensor, gamma_b: Tensor) -> Tensor:
    """Inner products of the normalized power profiles ``(g + 1) / t * (x / t) ** g`` on ``[0, t]``.

    Broadcasts; EDM2's ``power_function_correlation`` (Algorithm 3's ``p_dot_p``) in another form: the
    integral of the product ends at the shorter profile's end, where the longer one has fallen to
    ``(t_short / t_long) ** g_long``.
    """
    t_short, t_long = torch.minimum(t_a, t_b), torch.maximum(t_a, t_b)
    g_long = torch.where(t_a > t_b, gamma_a, gamma_b)
    return (gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1) * (t_short / t_long) ** g_long / t_long


def solve_weights(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[int],
    target_step: int,
    *,
    target_gamma: float | None = None,
    target_sigma_rel: float | None = None,
) -> Tensor:
    """The float64 weights of the snapshots whose sum best fits the power profile of the target.

    Least squares over the profiles: Algorithm 3's Gram system (the normal equations of the fit) solved by
    ``torch.linalg.lstsq``, which also copes with a singular one (a snapshot saved twice); then scaled to
    sum 1 as EDM2 does, so that weights that never move are reproduced exactly.
    """
    if (target_gamma is None) == (target_sigma_rel is None):
        raise ValueError(
            f"give one of target_gamma and target_sigma_rel, got {target_gamma!r} and {target_sigma_rel!r}"
        )
    if len(snapshot_gammas) != len(snapshot_steps) or not snapshot_steps:
        raise ValueError(
            f"need as many snapshot gammas as steps, at least one: got {len(snapshot_gammas)} and "
            f"{len(snapshot_steps)}"
        )
    for g in snapshot_gammas:
        _check_gamma("a snapshot gamma", g)
    for s in snapshot_steps:
        _check_step("a snapshot step", s)
    _check_step("target_step", target_step)
    if target_gamma is None:
        target_gamma = sigma_rel_to_gamma(target_sigma_rel)
    _check_gamma("target_gamma", target_gamma)
    g = torch.tensor(snapshot_gammas, dtype=torch.float64)
    t = torch.tensor(snapshot_steps, dtype=torch.float64)
    gram = power_inner_products(t[:, None], g[:, None], t[None], g[None])
    target = power_inner_products(
        t[:, None],
        g[:, None],
        torch.tensor(float(target_step), dtype=torch.float64),
        torch.tensor(float(target_gamma), dtype=torch.float64),
    )
    weights = torch.linalg.lstsq(gram, target, driver="gelsd").solution[:, 0]
    return weights / weights.sum()


def save_snapshot(folder: str | os.PathLike, tensors: Mapping[str, Tensor], step: int, gamma: float) -> Path:
    """Write ``tensors`` (moved to the CPU) as the snapshot of the EMA of exponent ``gamma`` at ``step``.

    Atomic: a temporary file in ``folder`` is written, flushed to disk and renamed over the final name,
    so a reader sees the whole snapshot or none. Views of one storage (a flat EMA's state_dict) share it
    in the file; a subset of such views stores the whole storage: clone them first.
    """
    _check_step("step", step)
    _check_gamma("gamma", gamma)
    if not (isinstance(tensors, Mapping) and tensors):
        raise ValueError(f"tensors must be a non-empty dict of name -> Tensor, got {type(tensors).__name__}")
    bad = [k for k, v in tensors.items() if not (isinstance(k, str) and isinstance(v, Tensor))]
    if bad:
        raise ValueError(f"tensors must map names to Tensors; not so for {bad[:3]}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ema-{step:012d}-g{float(gamma)!r}.pt"
    if path.exists():
        raise ValueError(f"{path} exists: a snapshot is never written over")
    payload = {
        "step": step,
        "gamma": float(gamma),
        "tensors": {k: v.detach().cpu() for k, v in tensors.items()},
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if os.name == "posix":  # the rename itself reaches the disk with the folder's entry
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def list_snapshots(folder: str | os.PathLike) -> list[Snapshot]:
    """The snapshots in ``folder``, by step then gamma (unfinished ``.tmp`` files and other files ignored)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"no snapshot folder at {str(folder)!r}")
    found = []
    for p in folder.iterdir():
        m = _NAME.fullmatch(p.name)
        if m and p.is_file():
            found.append(Snapshot(p, int(m[1]), float(m[2])))
    return sorted(found, key=lambda s: (s.step, s.gamma))


def load_snapshot(snapshot: Snapshot) -> dict[str, Tensor]:
    """The tensors of one snapshot, memory-mapped from its file (checked to hold its step and gamma)."""
    # str: torch 2.1 memory-maps a file given by name only
    data = torch.load(str(snapshot.path), map_location="cpu", weights_only=True, mmap=True)
    if (data["step"], data["gamma"]) != (snapshot.step, snapshot.gamma):
        raise ValueError(f"{snapshot.path.name} holds step {data['step']}, gamma {data['gamma']}")
    return data["tensors"]


def synthesize(
    folder: str | os.PathLike,
    sigma_rel: float | None = None,
    step: int | None = None,
    *,
    gamma: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """The EMA of length ``sigma_rel`` (or exponent ``gamma``) at ``step`` (default: the last snapshot's),
    combined from the snapshots saved up to ``step``.

    Streams: one snapshot is read at a time (memory-mapped), its float tensors added with its weight into
    sums of ``dtype``; other entries (integer counters) are the last snapshot's.
    """
    if (gamma is None) == (sigma_rel is None):
        raise ValueError(f"give one of sigma_rel and gamma, got sigma_rel={sigma_rel!r}, gamma={gamma!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    snapshots = list_snapshots(folder)
    if not snapshots:
        raise ValueError(f"no snapshots in {str(folder)!r}")
    steps = sorted({s.step for s in snapshots})
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(
            f"step must be one of the snapshots' steps ({steps[0]} .. {steps[-1]}), got {step!r}"
        )
    used = [s for s in snapshots if s.step <= step]
    weights = solve_weights(
        [s.gamma for s in used], [s.step for s in used], step, target_gamma=gamma, target_sigma_rel=sigma_rel
    )
    out: dict[str, Tensor] = {}
    for snapshot, w in zip(used, weights.tolist()):
        tensors = load_snapshot(snapshot)
        if out and tensors.keys() != out.keys():
            raise ValueError(f"{snapshot.path.name} has other entries than {used[0].path.name}")
        for k, v in tensors.items():
            if not v.is_floating_point():
                out[k] = v.clone()
            elif k in out:
                out[k].add_(v, alpha=w)
            else:
                out[k] = v.to(dtype) * w
        del tensors  # unmaps the file before the next one is read
    return out


class PostHocEMA(ModelEMA):
    """Power-function EMAs (Karras et al. 2024) of one model, one per length in ``sigma_rels`` (EDM2's two by
    default), all moved by one step from one read of the model; every ``snapshot_every`` updates all are
    saved in ``folder``, and :meth:`synthesize` then makes the EMA of any length after training.

    ``.emas`` holds the EMA modules and ``.schedules`` their :func:`~ema_lab.schedules.power` schedules
    (``.gamma``, ``.sigma_rel``), in the order of ``sigma_rels``; ``.ema`` is the first, as in ``ModelEMA``.
    The lengths must be distinct and in (0, 0.2887] (checked before anything is made). ``updates=N`` resumes
    a run from its snapshots of update N; a snapshot is never written over. An update whose snapshots fail to
    save is undone (every EMA and ``updates`` as before it) and the error propagates: a retried
    ``update()`` applies it once.
    """

    def __init__(
        self,
        model: nn.Module,
        folder: str | os.PathLike,
        sigma_rels: Sequence[float] = (0.05, 0.10),
        snapshot_every: int = 1000,
        updates: int = 0,
    ) -> None:
        if isinstance(sigma_rels, (str, bytes)) or not isinstance(sigma_rels, Sequence) or not sigma_rels:
            raise ValueError(f"sigma_rels must be a non-empty sequence of lengths, got {sigma_rels!r}")
        schedules = [power(sigma_rel=s) for s in sigma_rels]
        gammas = [s.gamma for s in schedules]
        if len(set(gammas)) != len(gammas):
            raise ValueError(
                f"sigma_rels must be distinct profiles, got {list(sigma_rels)!r} (gammas {gammas})"
            )
        check_int("snapshot_every", snapshot_every, 1)
        check_int("updates", updates, 0)
        self.folder, self.snapshot_every = Path(folder), snapshot_every
        self.folder.mkdir(parents=True, exist_ok=True)  # a bad folder fails here, not at the first save
        later = [s.step for s in list_snapshots(self.folder) if s.step > updates]
        if later:
            raise ValueError(
                f"{self.folder} holds snapshots up to update {max(later)}: resume with updates=<a saved "
                "update> or give an empty folder"
            )
        super().__init__(model, decay=schedules[0], updates=updates, strategy="flat")
        self.emas += [deepcopy(self.ema) for _ in schedules[1:]]
        self.schedules: list[Power] = schedules
        if updates:
            self._resume(updates)

    def _resume(self, step: int) -> None:
        """Load every EMA from its snapshot of update ``step``."""
        saved = {s.gamma: s for s in list_snapshots(self.folder) if s.step == step}
        for ema, schedule in zip(self.emas, self.schedules):
            if schedule.gamma not in saved:
                raise ValueError(
                    f"no snapshot of update {step} with gamma {schedule.gamma!r} in {self.folder}"
                )
            ema.load_state_dict(load_snapshot(saved[schedule.gamma]))

    def update(self, model: nn.Module) -> None:
        """Move every EMA one step towards ``model``; every ``snapshot_every`` updates, save them all. If the
        save raises, the update is undone (the EMAs and ``updates`` as before it) and the error propagates."""
        if not self.enabled:
            return
        if (self.updates + 1) % self.snapshot_every:
            super().update(model)
            return
        before = self.updates
        # Only on a snapshot update: a copy of every EMA to undo it with.
        copies = [{k: v.clone() for k, v in ema.state_dict().items()} for ema in self.emas]
        super().update(model)
        try:
            self.save()
        except BaseException:
            with torch.no_grad():  # in place: the step's buffers stay the EMAs' memory
                for ema, copy in zip(self.emas, copies):
                    for k, v in ema.state_dict().items():
                        v.copy_(copy[k])
            self.updates = before
            raise

    def save(self) -> None:
        """Write every EMA's snapshot at the current update count (atomic files)."""
        for ema, schedule in zip(self.emas, self.schedules):
            save_snapshot(self.folder, ema.state_dict(), self.updates, schedule.gamma)

    def synthesize(self, sigma_rel: float, step: int | None = None) -> dict[str, Tensor]:
        """The state_dict of the EMA of length ``sigma_rel`` at ``step`` (default: the last snapshot)."""
        return synthesize(self.folder, sigma_rel, step)
