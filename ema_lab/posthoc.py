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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .schedules import _int, _real, _require, sigma_rel_to_gamma

__all__ = [
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
    _require(_real(gamma) and gamma >= 0, name, gamma, "a number >= 0")


def _check_step(name: str, step: object) -> None:
    _require(_int(step) and step >= 1, name, step, "an int >= 1")


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
