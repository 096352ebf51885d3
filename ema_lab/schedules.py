"""The peers' decay schedules: callables of the update number ``n`` (1 for the first update) -> the decay.

``ModelEMA(model, decay=schedule)`` calls ``schedule(n)`` once per update, as ultralytics calls
``self.decay(self.updates)`` after ``self.updates += 1``. Each schedule matches its peer's code with the
arguments named in its docstring (``benchmarks/peer_schedules.py`` runs the peers and compares, over
100,000 steps; docs/schedules.md has the figures). ultralytics' ramp ``decay * (1 - exp(-n / tau))``
is not here: it is ``ModelEMA``'s number form (``decay=0.9999, tau=2000``).

Start late (``after``): timm, diffusers and ema-pytorch all shift the update number by
``s = n - after - 1`` and give decay 0 (the EMA copies the model) while ``s <= 0``, so the first
``after + 1`` updates copy, whatever the floor ``min_decay``. The schedules are frozen dataclasses:
picklable, comparable, and their repr reads as the call that makes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from numbers import Integral, Real

__all__ = ["warmup", "constant", "harmonic", "power", "sigma_rel_to_gamma", "gamma_to_sigma_rel"]
__all__ += ["decay_over", "Warmup", "Constant", "Harmonic", "Power"]

# Karras et al.'s length of the power profile at gamma = 0 (the running mean): the longest it can be.
MAX_SIGMA_REL = 1 / math.sqrt(12)


def _real(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _require(ok: bool, name: str, value: object, what: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _check_decays(decay: float, min_decay: float) -> None:
    _require(_real(decay) and 0 <= decay <= 1, "decay", decay, "a number in [0, 1]")
    _require(_real(min_decay) and 0 <= min_decay <= decay, "min_decay", min_decay, f"in [0, decay={decay}]")


def _check_after(after: int) -> None:
    _require(_int(after) and after >= 0, "after", after, "an int >= 0")


def _check_n(n: int) -> None:
    _require(_int(n) and n >= 1, "n", n, "an int >= 1")


class _Schedule:
    """Shared repr: the public function's name and the fields, so that the repr reads as the call."""

    _name = ""

    def __repr__(self) -> str:
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"{self._name}({args})"


@dataclass(frozen=True, repr=False)
class Warmup(_Schedule):
    """``1 - (1 + s / gamma) ** -power`` clamped to [min_decay, decay]; 0 while ``s = n - after - 1 <= 0``."""

    decay: float = 0.9999
    gamma: float = 1.0
    power: float = 2 / 3
    min_decay: float = 0.0
    after: int = 0
    _name = "warmup"

    def __post_init__(self) -> None:
        _check_decays(self.decay, self.min_decay)
        _require(_real(self.gamma) and self.gamma > 0, "gamma", self.gamma, "a positive number")
        _require(_real(self.power) and self.power > 0, "power", self.power, "a positive number")
        _check_after(self.after)

    def __call__(self, n: int) -> float:
        """The decay of update ``n``."""
        s = n - self.after - 1
        if s <= 0:
            return 0.0
        # The peers' own expression and order of operations: the same float, bit for bit.
        d = 1 - (1 + s / self.gamma) ** -self.power
        return max(min(d, self.decay), self.min_decay)


@dataclass(frozen=True, repr=False)
class Constant(_Schedule):
    """``decay`` from update ``after + 2`` on; 0 (a copy of the model) before."""

    decay: float = 0.9999
    after: int = 0
    _name = "constant"

    def __post_init__(self) -> None:
        _check_decays(self.decay, 0.0)
        _check_after(self.after)

    def __call__(self, n: int) -> float:
        """The decay of update ``n``."""
        return 0.0 if n - self.after - 1 <= 0 else float(self.decay)


@dataclass(frozen=True, repr=False)
class Harmonic(_Schedule):
    """``(1 + s) / (10 + s)`` clamped to [min_decay, decay]; 0 while ``s = n - after - 1 <= 0``."""

    decay: float = 0.9999
    min_decay: float = 0.0
    after: int = 0
    _name = "harmonic"

    def __post_init__(self) -> None:
        _check_decays(self.decay, self.min_decay)
        _check_after(self.after)

    def __call__(self, n: int) -> float:
        """The decay of update ``n``."""
        s = n - self.after - 1
        if s <= 0:
            return 0.0
        return max(min((1 + s) / (10 + s), self.decay), self.min_decay)


@dataclass(frozen=True, repr=False)
class Power(_Schedule):
    """Karras et al.'s power-function EMA: ``(1 - 1 / n) ** (gamma + 1)`` (0 at n = 1: a copy)."""

    gamma: float
    _name = "power"

    def __post_init__(self) -> None:
        _require(_real(self.gamma) and self.gamma >= 0, "gamma", self.gamma, "a number >= 0")

    @property
    def sigma_rel(self) -> float:
        """The profile's length relative to the training so far (Karras et al.'s sigma_rel)."""
        return gamma_to_sigma_rel(self.gamma)

    def __call__(self, n: int) -> float:
        """The decay of update ``n``."""
        return (1 - 1 / n) ** (self.gamma + 1)


def warmup(
    decay: float = 0.9999, gamma: float = 1.0, power: float = 2 / 3, min_decay: float = 0.0, after: int = 0
) -> Warmup:
    """The warm-up ``1 - (1 + s / gamma) ** -power`` in [min_decay, decay], ``s = n - after - 1``.

    Matches timm ``ModelEmaV3(use_warmup=True, decay, warmup_gamma=gamma, warmup_power=power, min_decay,
    update_after_step=after)`` updated with ``step=n``; diffusers ``EMAModel(use_ema_warmup=True, decay,
    inv_gamma=gamma, power, min_decay, update_after_step=after)``; ema-pytorch ``EMA(beta=decay,
    inv_gamma=gamma, power, min_value=min_decay, update_after_step=after, update_every=1)`` at its n-th
    ``update()`` call (ema-pytorch computes it in float32: within 6e-8 of this float64 value).
    """
    return Warmup(decay, gamma, power, min_decay, after)


def constant(decay: float = 0.9999, after: int = 0) -> Constant:
    """A constant decay after ``after + 1`` copies: timm ``ModelEmaV3(decay, update_after_step=after)``."""
    return Constant(decay, after)


def harmonic(decay: float = 0.9999, min_decay: float = 0.0, after: int = 0) -> Harmonic:
    """``(1 + s) / (10 + s)`` in [min_decay, decay], ``s = n - after - 1``.

    Matches diffusers ``EMAModel(use_ema_warmup=False, decay, min_decay, update_after_step=after)``.
    """
    return Harmonic(decay, min_decay, after)


def power(gamma: float | None = None, *, sigma_rel: float | None = None) -> Power:
    """Karras et al. 2024's power-function EMA ``(1 - 1 / n) ** (gamma + 1)``, by gamma or sigma_rel.

    Matches EDM2's ``power_function_beta(std=sigma_rel, t_next=n, t_delta=1)``. ema-pytorch
    ``KarrasEMA(gamma=gamma, update_every=1)`` applies this schedule's value at ``n + 1`` on its n-th call
    (its counter starts at 0 after a copy). Updated every k steps, apply :func:`decay_over` (the k-step
    product ``((n - k) / n) ** (gamma + 1)``) to keep the profile.
    """
    if (gamma is None) == (sigma_rel is None):
        raise ValueError(f"give one of gamma and sigma_rel, got gamma={gamma!r}, sigma_rel={sigma_rel!r}")
    return Power(sigma_rel_to_gamma(sigma_rel) if gamma is None else gamma)


def gamma_to_sigma_rel(gamma: float) -> float:
    """The relative length (std / training time) of the power profile ``t ** gamma`` (EDM2's exp_to_std)."""
    _require(_real(gamma) and gamma >= 0, "gamma", gamma, "a number >= 0")
    return math.sqrt((gamma + 1) / (gamma + 2) ** 2 / (gamma + 3))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The gamma whose profile has relative length ``sigma_rel`` (EDM2's std_to_exp, Algorithm 2).

    The largest real root of ``g**3 + 7 g**2 + (16 - t) g + 12 - t``, ``t = sigma_rel ** -2``, by Newton's
    method from ``sqrt(t)``: the cubic is convex and positive there, so the iterates fall to the root.
    """
    ok = _real(sigma_rel) and 0 < sigma_rel <= MAX_SIGMA_REL
    _require(ok, "sigma_rel", sigma_rel, f"in (0, {MAX_SIGMA_REL:.4f}] (gamma >= 0)")
    t = sigma_rel**-2
    g = math.sqrt(t)
    while True:
        f = ((g + 7) * g + 16 - t) * g + 12 - t
        nxt = g - f / ((3 * g + 14) * g + 16 - t)
        if not nxt < g:  # rounding: no further descent
            return max(g, 0.0)
        g = nxt


def decay_over(schedule: Callable[[int], float], n: int, k: int) -> float:
    """The decay of updates ``n - k + 1 .. n`` applied at once: the product of the schedule's k decays.

    An EMA updated on every k-th step with this decay weighs the models it reads as the schedule would
    if it read each of them k times; for :func:`power` it is ``((n - k) / n) ** (gamma + 1)``.
    """
    _check_n(n)
    _require(_int(k) and 1 <= k <= n, "k", k, f"an int in [1, n={n}]")
    return math.prod(schedule(i) for i in range(n - k + 1, n + 1))
