"""The peers' decay schedules: callables of the update number ``n`` (1 for the first) -> the decay, each its
peer's code (docs/schedules.md); started late, the peers give decay 0 (a copy) whatever ``min_decay``."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from numbers import Integral

from .checks import check_decay, check_gamma, check_int, is_int, is_real, one_of, require

__all__ = ["ramp", "warmup", "constant", "harmonic", "power", "sigma_rel_to_gamma", "gamma_to_sigma_rel"]
__all__ += ["decay_over", "Ramp", "Warmup", "Constant", "Harmonic", "Power", "Schedule", "MAX_SIGMA_REL"]

Schedule = Callable[[int], float]

MAX_SIGMA_REL = 1 / math.sqrt(12)  # the power profile's length at gamma = 0 (the running mean): the longest

_LARGEST_N = int(sys.float_info.max)


def _check_decays(decay: float, min_decay: float, after: int = 0) -> None:
    check_decay(decay)
    require(is_real(min_decay) and 0 <= min_decay <= decay, "min_decay", min_decay, f"in [0, decay={decay}]")
    check_int("after", after, 0)


class _Schedule:
    """Shared call and repr: ``n`` checked, then :meth:`at`; the repr reads as the call that makes it."""

    first_n = 1  # the first update number a schedule is defined for

    def __call__(self, n: int) -> float:
        # Inline, not check_int: an update reaches torch in three frames (tests/core/test_call_depth.py).
        # ``type(n) is int`` first: the ABC check costs about a microsecond, and n is an int every update.
        if (type(n) is not int and (isinstance(n, bool) or not isinstance(n, Integral))) or n < self.first_n:
            raise ValueError(f"n must be an int >= {self.first_n}, got {n!r}")
        return self.at(min(n, _LARGEST_N))  # no float overflow: every schedule is at its limit long before

    def at(self, n: int) -> float:
        """The decay of update ``n``, unchecked."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"{type(self).__name__.lower()}({args})"


@dataclass(frozen=True, repr=False)
class Ramp(_Schedule):
    """ultralytics' ramp ``decay * (1 - exp(-n / tau))``: its ``ModelEMA(model, decay, tau).decay(n)``."""

    decay: float = 0.9999
    tau: float = 2000
    first_n = 0  # ultralytics' ema.decay(0) is 0 (a copy)

    def __post_init__(self) -> None:
        _check_decays(self.decay, 0.0)
        require(is_real(self.tau) and self.tau > 0, "tau", self.tau, "a positive number")

    def at(self, n: int) -> float:
        return self.decay * (1 - math.exp(-n / self.tau))


@dataclass(frozen=True, repr=False)
class Warmup(_Schedule):
    """The warm-up ``1 - (1 + s / gamma) ** -power`` in [min_decay, decay], ``s = n - after - 1``: timm
    ``ModelEmaV3(use_warmup=True)``, diffusers ``EMAModel(use_ema_warmup=True)``, ema-pytorch ``EMA``."""

    decay: float = 0.9999
    gamma: float = 1.0
    power: float = 2 / 3
    min_decay: float = 0.0
    after: int = 0

    def __post_init__(self) -> None:
        _check_decays(self.decay, self.min_decay, self.after)
        require(is_real(self.gamma) and self.gamma > 0, "gamma", self.gamma, "a positive number")
        require(is_real(self.power) and self.power > 0, "power", self.power, "a positive number")

    def at(self, n: int) -> float:
        s = n - self.after - 1
        if s <= 0:
            return 0.0
        # The peers' own expression and order of operations: the same float, bit for bit.
        return max(min(1 - (1 + s / self.gamma) ** -self.power, self.decay), self.min_decay)


@dataclass(frozen=True, repr=False)
class Constant(_Schedule):
    """A constant decay after ``after + 1`` copies: timm ``ModelEmaV3(decay, update_after_step=after)``."""

    decay: float = 0.9999
    after: int = 0

    def __post_init__(self) -> None:
        _check_decays(self.decay, 0.0, self.after)

    def at(self, n: int) -> float:
        return 0.0 if n - self.after - 1 <= 0 else float(self.decay)


@dataclass(frozen=True, repr=False)
class Harmonic(_Schedule):
    """diffusers' ``(1 + s) / (10 + s)`` in [min_decay, decay], ``s = n - after - 1`` (no warm-up)."""

    decay: float = 0.9999
    min_decay: float = 0.0
    after: int = 0

    def __post_init__(self) -> None:
        _check_decays(self.decay, self.min_decay, self.after)

    def at(self, n: int) -> float:
        s = n - self.after - 1
        return 0.0 if s <= 0 else max(min((1 + s) / (10 + s), self.decay), self.min_decay)


@dataclass(frozen=True, repr=False)
class Power(_Schedule):
    """Karras et al.'s power-function EMA: ``(1 - 1 / n) ** (gamma + 1)`` (0 at n = 1: a copy)."""

    gamma: float

    def __post_init__(self) -> None:
        check_gamma("gamma", self.gamma)

    @property
    def sigma_rel(self) -> float:
        """The profile's length relative to the training so far (Karras et al.'s sigma_rel)."""
        return gamma_to_sigma_rel(self.gamma)

    def at(self, n: int) -> float:
        return (1 - 1 / n) ** (self.gamma + 1)


ramp, warmup, constant, harmonic = Ramp, Warmup, Constant, Harmonic  # the classes: defaults in one place


def power(gamma: float | None = None, *, sigma_rel: float | None = None) -> Power:
    """The :class:`Power` schedule by ``gamma`` or ``sigma_rel`` (EDM2's ``power_function_beta``)."""
    one_of("gamma", gamma, "sigma_rel", sigma_rel)
    return Power(sigma_rel_to_gamma(sigma_rel) if gamma is None else gamma)


def gamma_to_sigma_rel(gamma: float) -> float:
    """The relative length (std / training time) of the power profile ``t ** gamma`` (EDM2's exp_to_std)."""
    check_gamma("gamma", gamma)
    # sqrt((g + 1) / (g + 2) ** 2 / (g + 3)) without squaring: (g + 2) ** 2 overflows from g = 1.4e154.
    return math.sqrt((gamma + 1) / (gamma + 3)) / (gamma + 2)


_TINY_SIGMA_REL = 1e-150  #: below it, sigma_rel ** -2 overflows; gamma + 3 = 1 / sigma_rel to a double there


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The gamma whose profile has relative length ``sigma_rel`` (EDM2's std_to_exp, Algorithm 2)."""
    ok = is_real(sigma_rel) and 0 < sigma_rel <= MAX_SIGMA_REL
    require(ok, "sigma_rel", sigma_rel, f"in (0, {MAX_SIGMA_REL!r}] (gamma >= 0)")
    sigma_rel = float(sigma_rel)  # a numpy float32 would run Newton's method (and give gamma) in float32
    if sigma_rel < _TINY_SIGMA_REL:
        gamma = 1 / sigma_rel - 3
        require(math.isfinite(gamma), "sigma_rel", sigma_rel, "at least 1/1.8e308 (gamma is a finite float)")
        return gamma
    t = sigma_rel**-2
    g = math.sqrt(t)  # Newton's method from here, where the cubic is convex and positive: g falls to its root
    while True:
        f = ((g + 7) * g + 16 - t) * g + 12 - t
        nxt = g - f / ((3 * g + 14) * g + 16 - t)
        if not nxt < g:  # rounding: no further descent
            return max(g, 0.0)
        g = nxt


def decay_over(schedule: Callable[[int], float], n: int, k: int) -> float:
    """The decay of updates ``n - k + 1 .. n`` applied at once: the product of the schedule's k decays."""
    check_int("n", n, 1)
    require(is_int(k) and 1 <= k <= n, "k", k, f"an int in [1, n={n}]")
    return math.prod(schedule(i) for i in range(n - k + 1, n + 1))
