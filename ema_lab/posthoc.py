"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models").

Track power-function EMAs (:func:`ema_lab.schedules.power`) of two lengths during training and save
their snapshots every N updates (:func:`ema_lab.snapshots.save_step`); afterwards, :func:`synthesize`
the EMA of any length ``sigma_rel`` as the weighted sum of the snapshots whose profiles ``t ** gamma``
on ``[0, step]`` best fit the wanted one in least squares (Algorithm 3: the profiles' inner products in
closed form).
The anchors are EDM2's ``training/phema.py`` (``power_function_correlation``,
``solve_posthoc_coefficients``: it solves the same system and also scales the weights to sum 1) and
ema-pytorch's ``PostHocEMA`` (``torch.linalg.solve``, weights not scaled).

The snapshot files (:mod:`ema_lab.snapshots`) hold every profile of a saved update or none of them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from copy import deepcopy

import torch
from torch import Tensor, nn

from .checks import check_int
from .ema import ModelEMA
from .schedules import Power, power, sigma_rel_to_gamma
from .snapshots import _check_gamma, _check_step, check_folder, list_snapshots, load_snapshot, save_step

__all__ = ["PostHocEMA", "power_inner_products", "solve_weights", "synthesize"]


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
    layout: dict[str, tuple] = {}  # the first snapshot's: every other must hold the same model's tensors
    for snapshot, w in zip(used, weights.tolist()):
        tensors = load_snapshot(snapshot)
        this = {k: (v.shape, v.is_floating_point()) for k, v in tensors.items()}
        layout = layout or this
        if this != layout:
            raise ValueError(
                f"{snapshot.path} holds another model's tensors than {used[0].path} ({_diff(layout, this)})"
            )
        for k, v in tensors.items():
            if not v.is_floating_point():
                out[k] = v.clone()
            elif k in out:
                out[k].add_(v, alpha=w)
            else:
                out[k] = v.to(dtype) * w
        del tensors  # unmaps the file before the next one is read
    return out


def _diff(first: dict[str, tuple], other: dict[str, tuple]) -> str:
    """One line on how two snapshots' (shape, is float) layouts differ."""
    if first.keys() != other.keys():
        missing, extra = sorted(first.keys() - other.keys()), sorted(other.keys() - first.keys())
        return f"missing {missing[:3]}, extra {extra[:3]}"
    k = next(k for k in first if first[k] != other[k])
    (shape_a, float_a), (shape_b, float_b) = first[k], other[k]
    kind = lambda f: "float" if f else "not float"  # noqa: E731
    return f"{k!r}: {tuple(shape_b)} {kind(float_b)} instead of {tuple(shape_a)} {kind(float_a)}"


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
        sigma_rels: Iterable[float] = (0.05, 0.10),
        snapshot_every: int = 1000,
        updates: int = 0,
    ) -> None:
        try:  # a list, a tuple, a NumPy array: any non-empty run of numbers
            lengths = [] if isinstance(sigma_rels, (str, bytes)) else list(sigma_rels)
        except TypeError:
            lengths = []
        if not lengths:
            raise ValueError(f"sigma_rels must be a non-empty sequence of lengths, got {sigma_rels!r}")
        sigma_rels = lengths
        schedules = [power(sigma_rel=s) for s in sigma_rels]
        gammas = [s.gamma for s in schedules]
        if len(set(gammas)) != len(gammas):
            raise ValueError(
                f"sigma_rels must be distinct profiles, got {list(sigma_rels)!r} (gammas {gammas})"
            )
        check_int("snapshot_every", snapshot_every, 1)
        check_int("updates", updates, 0)
        self.folder, self.snapshot_every = check_folder(folder), snapshot_every  # a bad folder fails here
        later = [s.step for s in list_snapshots(self.folder) if s.step > updates]
        if later:
            raise ValueError(
                f"{self.folder} holds snapshots up to update {max(later)}: resume with updates=<a saved "
                "update> or give an empty folder"
            )
        super().__init__(model, decay=schedules[0], updates=updates, strategy="flat")
        with torch.inference_mode(False):  # as the first EMA: writable outside inference_mode
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
        """Save every EMA's snapshot of this update as one step, complete or none (ema_lab.snapshots)."""
        states = {s.gamma: e.state_dict() for e, s in zip(self.emas, self.schedules)}
        save_step(self.folder, self.updates, states)

    def synthesize(self, sigma_rel: float, step: int | None = None) -> dict[str, Tensor]:
        """The state_dict of the EMA of length ``sigma_rel`` at ``step`` (default: the last snapshot)."""
        return synthesize(self.folder, sigma_rel, step)
