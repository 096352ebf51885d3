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
from collections.abc import Sequence

import torch
from torch import Tensor

from .schedules import sigma_rel_to_gamma
from .snapshots import _check_gamma, _check_step, list_snapshots, load_snapshot

__all__ = ["power_inner_products", "solve_weights", "synthesize"]


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
