"""ema_lab.schedules: the peers' decay schedules, checked by what they do to an EMA, not by their formulas.

The peers themselves are run by benchmarks/peer_schedules.py (docs/results/peer-schedules.json).
"""

from __future__ import annotations

import math
import pickle
import sys

import pytest
import torch

from ema_lab import ModelEMA, schedules
from ema_lab.bench import models
from ema_lab.schedules import (
    MAX_SIGMA_REL,
    constant,
    decay_over,
    gamma_to_sigma_rel,
    harmonic,
    power,
    sigma_rel_to_gamma,
    warmup,
)

from ..helpers import float_entries


def ema_of(xs: list[float], decay_of, every: int = 1) -> float:
    """The EMA of the sequence xs (x_1 first), updated on every ``every``-th step with decay_of(n)."""
    e = xs[0]  # any start: the first update has decay 0 under every schedule here
    for n, x in enumerate(xs, start=1):
        if n % every == 0:
            d = decay_of(n)
            e = d * e + (1 - d) * x
    return e


def test_warmup_with_gamma_1_power_1_is_the_running_mean_after_the_copies():
    # 1 - 1 / (1 + s) = s / (s + 1): the mean of the models since the last copy (update after + 1).
    xs = [math.sin(i) + i for i in range(1, 200)]
    for after in (0, 3, 50):
        for m in (after + 1, after + 2, after + 10, len(xs)):
            got = ema_of(xs[:m], warmup(decay=1.0, gamma=1.0, power=1.0, after=after))
            assert got == pytest.approx(sum(xs[after:m]) / (m - after), rel=1e-12)


def test_warmup_reaches_crowsonkb_milestones():
    # timm's and ema-pytorch's docstrings: power 2/3 reaches 0.999 at 31.6K steps, 0.9999 at 1M;
    # power 3/4 reaches 0.999 at 10K, 0.9999 at 215.4K.
    for pw, milestones in ((2 / 3, {0.999: 31.6e3, 0.9999: 1e6}), (3 / 4, {0.999: 10e3, 0.9999: 215.4e3})):
        s = warmup(decay=1.0, power=pw)
        for d, n in milestones.items():
            assert s(round(n * 0.999)) < d < s(round(n * 1.001))


def test_warmup_is_zero_then_monotone_and_clamped():
    s = warmup(decay=0.999, min_decay=0.5, after=20)
    values = [s(n) for n in range(1, 100_000, 7)]
    assert all(s(n) == 0.0 for n in range(1, 22))  # the first after + 1 updates copy, whatever min_decay
    assert s(22) == 0.5  # 1 - 2 ** (-2 / 3) = 0.37 is under the floor
    tail = values[3:]  # n = 22, 29, ...
    assert all(a <= b for a, b in zip(tail, tail[1:]))
    assert min(tail) == 0.5 and max(tail) == 0.999


def test_constant_copies_then_holds():
    s = constant(0.99, after=5)
    assert [s(n) for n in range(1, 9)] == [0.0] * 6 + [0.99, 0.99]


def test_harmonic_values_and_cap():
    s = harmonic(decay=0.9999, after=4)
    assert s(5) == 0.0
    assert s(5 + 8) == 0.5 and s(5 + 80) == 0.9  # (1 + s) / (10 + s) at s = 8 and 80
    assert s(5 + 89_989) < 0.9999 == s(5 + 89_990)  # 89,990 / 89,999 < 0.9999 = 89,991 / 90,000
    values = [s(n) for n in range(6, 200_000, 13)]
    assert all(a <= b for a, b in zip(values, values[1:]))


def test_power_gamma_0_is_the_running_mean():
    xs = [math.cos(3 * i) * i for i in range(1, 500)]
    for m in (1, 2, 17, len(xs)):
        assert ema_of(xs[:m], power(gamma=0.0)) == pytest.approx(sum(xs[:m]) / m, rel=1e-12)


@pytest.mark.parametrize("gamma", [0.0, 1.5, 6.94, 16.97])
@pytest.mark.parametrize("k", [1, 2, 10, 100])
def test_power_k_step_product_telescopes(gamma, k):
    s = power(gamma=gamma)
    for n in (k, k + 1, 3 * k, 1000 * k + 7):
        assert decay_over(s, n, k) == pytest.approx(((n - k) / n) ** (gamma + 1), rel=1e-12, abs=1e-300)


def test_power_every_k_keeps_the_profile():
    # A weight equal to the step t: the power profile t**gamma on [0, T] averages it to T (g + 1) / (g + 2).
    # facts.md measured ema-pytorch's KarrasEMA (one-step decay once per k): 16 % of it at k = 100.
    big_t, s = 20_000, power(sigma_rel=0.05)
    profile = big_t * (s.gamma + 1) / (s.gamma + 2)
    xs = [float(t) for t in range(1, big_t + 1)]
    for k in (1, 10, 100):
        kept = ema_of(xs, lambda n, k=k: decay_over(s, n, k), every=k)
        assert abs(kept - profile) <= k / 2 + 1  # the models read are k apart: within half a gap
    naive = ema_of(xs, s, every=100)
    assert naive / profile < 0.2


def test_sigma_rel_gamma_table_and_round_trip():
    # Karras et al. 2024, Table/Section 3.1: sigma_rel 0.05 <-> gamma 16.97, 0.10 <-> 6.94.
    assert round(sigma_rel_to_gamma(0.05), 2) == 16.97
    assert round(sigma_rel_to_gamma(0.10), 2) == 6.94
    assert sigma_rel_to_gamma(MAX_SIGMA_REL) == 0.0  # gamma 0: the running mean, the longest profile
    for sr in (1e-4, 0.01, 0.05, 0.1, 0.2, 0.28):
        assert gamma_to_sigma_rel(sigma_rel_to_gamma(sr)) == pytest.approx(sr, rel=1e-13)
    for g in (0.0, 0.5, 3.0, 100.0, 1e5):
        assert sigma_rel_to_gamma(gamma_to_sigma_rel(g)) == pytest.approx(g, rel=1e-9, abs=1e-12)
    assert power(sigma_rel=0.1) == power(gamma=sigma_rel_to_gamma(0.1))
    assert power(gamma=6.94).sigma_rel == pytest.approx(0.1, abs=1e-4)


def test_sigma_rel_to_gamma_matches_numpy_roots():
    np = pytest.importorskip("numpy")
    for sr in (0.01, 0.05, 0.1, 0.2):
        t = sr**-2
        assert sigma_rel_to_gamma(sr) == pytest.approx(np.roots([1, 7, 16 - t, 12 - t]).real.max(), rel=1e-13)


def test_sigma_rel_is_the_profile_std():
    # sigma_rel: the std of the profile t**gamma on [0, 1], by a midpoint sum (not the closed form).
    g, m = sigma_rel_to_gamma(0.1), 200_000
    ts = [(i + 0.5) / m for i in range(m)]
    w = [t**g for t in ts]
    mean = sum(t * wi for t, wi in zip(ts, w)) / sum(w)
    var = sum((t - mean) ** 2 * wi for t, wi in zip(ts, w)) / sum(w)
    assert math.sqrt(var) == pytest.approx(0.1, rel=1e-6)


ALL = [warmup(), warmup(0.999, 2.0, 0.75, 0.1, 7), constant(0.9, 3), harmonic(0.99, 0.5, 2), power(gamma=3.5)]


@pytest.mark.parametrize("s", ALL, ids=repr)
def test_repr_pickle_and_equality(s):
    assert eval(repr(s), vars(schedules)) == s
    assert pickle.loads(pickle.dumps(s)) == s
    assert repr(s).startswith(type(s).__name__.lower() + "(")


@pytest.mark.parametrize("s", ALL, ids=repr)
def test_values_are_decays(s):
    values = [s(n) for n in (1, 2, 3, 10, 1000, 10**6, 10**9)]
    assert all(0.0 <= v <= 1.0 for v in values) and values[0] == 0.0
    # n past the largest float (an int has no bound) gives the schedule's limit, not an OverflowError.
    assert s(10**400) == s(int(sys.float_info.max))


BAD = [
    (warmup, {"decay": 1.5}, "decay must be a finite number in [0, 1]"),  # the rule of ModelEMA's decay
    (warmup, {"decay": float("nan")}, "decay must be"),
    (warmup, {"min_decay": 0.5, "decay": 0.4}, "min_decay must be in [0, decay=0.4]"),
    (warmup, {"gamma": 0}, "gamma must be a positive number"),
    (warmup, {"power": -1}, "power must be a positive number"),
    (warmup, {"after": -1}, "after must be an int >= 0"),
    (warmup, {"after": 1.0}, "after must be an int"),
    (constant, {"decay": True}, "decay must be"),
    (harmonic, {"min_decay": -0.1}, "min_decay must be"),
    (power, {}, "give one of gamma and sigma_rel"),
    (power, {"gamma": 1.0, "sigma_rel": 0.1}, "give one of gamma and sigma_rel"),
    (power, {"gamma": -0.5}, "gamma must be a number >= 0"),
    (power, {"sigma_rel": 0.3}, "sigma_rel must be in (0, 0.2886751345948129]"),
    (power, {"sigma_rel": 0}, "sigma_rel must be in"),
    (gamma_to_sigma_rel, {"gamma": "7"}, "gamma must be"),
]


@pytest.mark.parametrize(("make", "kwargs", "message"), BAD, ids=[str(b[1]) for b in BAD])
def test_bad_arguments_one_line(make, kwargs, message):
    with pytest.raises(ValueError) as info:
        make(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("n", "k"), [(0, 1), (5, 0), (5, 6), (5.0, 1), (True, 1)])
def test_decay_over_bad_counts(n, k):
    with pytest.raises(ValueError, match="must be an int") as info:
        decay_over(power(gamma=1.0), n, k)
    assert "\n" not in str(info.value)


def test_frozen():
    with pytest.raises(AttributeError):
        warmup().decay = 0.5


def test_the_documented_range_holds_to_its_bounds_without_overflow():
    tiny = power(sigma_rel=1e-200)  # inside (0, MAX_SIGMA_REL]: sigma_rel ** -2 would overflow a double
    assert tiny.gamma == pytest.approx(1e200) and tiny.sigma_rel == pytest.approx(1e-200, rel=1e-12)
    assert tiny(10) == 0.0
    assert gamma_to_sigma_rel(1e308) == pytest.approx(1e-308, rel=1e-12)


@pytest.mark.parametrize("n", [-1, 0, 1.5, True, "2"])
@pytest.mark.parametrize("schedule", [power(gamma=1), warmup(), constant(), harmonic()], ids=repr)
def test_a_schedule_called_directly_checks_n(schedule, n):
    with pytest.raises(ValueError, match=r"n must be an int >= 1, got"):
        schedule(n)


def test_the_sigma_rel_bound_is_printed_so_that_it_does_not_contradict_the_value():
    with pytest.raises(ValueError) as info:
        power(sigma_rel=0.2887)
    bound = float(str(info.value).split("(0, ")[1].split("]")[0])
    assert bound == MAX_SIGMA_REL < 0.2887


# --- ModelEMA(decay=schedule) and every=k ------------------------------------------------------


STRATEGIES = ["auto", "flat", "gated", "foreach", "loop"]


def _drift(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for v in float_entries(model).values():
            v.add_(torch.randn(v.shape, generator=g, dtype=v.dtype))


def test_the_default_is_ultralytics_ramp_and_after_code_bit_for_bit() -> None:
    """The default ModelEMA against the PR's after-code as ultralytics wrote it, over 30 updates."""
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    reference = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    for n in range(1, 31):
        _drift(model, n)
        ema.update(model)
        d = 0.9999 * (
            1 - math.exp(-n / 2000)
        )  # ultralytics: self.decay = lambda x: decay * (1 - exp(-x / tau))
        assert ema.decay(n) == d
        floats = [k for k, v in reference.items() if v.is_floating_point()]
        msd = model.state_dict()
        torch._foreach_lerp_([reference[k] for k in floats], [msd[k] for k in floats], 1 - d)
    for k, v in ema.ema.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(v, reference[k]), k


def _applied_decays(ema: ModelEMA, model: torch.nn.Module, calls: int) -> list[float]:
    """The decay each call applied, read back from a float64 model set to 1 then 0 around each call."""
    out = []
    for _ in range(calls):
        with torch.no_grad():
            model.weight.fill_(1.0)
            ema.ema.weight.fill_(0.0)
        ema.update(model)
        out.append(1.0 - ema.ema.weight[0, 0].item())  # e' = e + (1 - d) (m - e) with e = 0, m = 1
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "schedule",
    [
        warmup(0.999, gamma=1.0, power=0.75, after=3),
        constant(0.99, after=2),
        harmonic(0.995),
        power(gamma=6.94),
    ],
    ids=repr,
)
def test_each_update_applies_the_schedule_of_its_update_number(schedule, strategy: str) -> None:
    model = torch.nn.Linear(1, 1, bias=False).double()
    ema = ModelEMA(model, decay=schedule, strategy=strategy)
    applied = _applied_decays(ema, model, 40)
    torch.testing.assert_close(applied, [schedule(n) for n in range(1, 41)], rtol=0, atol=1e-12)
    assert ema.updates == 40 and repr(schedule) in repr(ema)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_k_updates_on_the_kth_call_with_the_product_of_the_k_decays(strategy: str) -> None:
    model = torch.nn.Linear(1, 1, bias=False).double()
    ema = ModelEMA(model, decay=0.9, tau=5, every=3, strategy=strategy)
    applied = _applied_decays(ema, model, 9)
    products = [math.prod(ema.decay(i) for i in range(n - 2, n + 1)) for n in (3, 6, 9)]
    for n, d in enumerate(applied, start=1):
        want = products[n // 3 - 1] if n % 3 == 0 else 1.0  # the other calls leave the EMA where it was
        assert d == pytest.approx(want, abs=1e-12), n
    assert ema.updates == 9


@pytest.mark.parametrize("k", [1, 10, 100])
def test_a_power_ema_updated_every_k_steps_keeps_its_profile(k: int) -> None:
    """A weight equal to the step count t: the power EMA of exponent gamma reads T (gamma + 1) / (gamma + 2)
    at step T; ema-pytorch's KarrasEMA with update_every=100 reads 16 % of it (docs/schedules.md)."""
    schedule = power(sigma_rel=0.05)
    model = torch.nn.Linear(1, 1, bias=False).double()
    ema = ModelEMA(model, decay=schedule, every=k)
    steps = 20_000
    for t in range(1, steps + 1):
        with torch.no_grad():
            model.weight.fill_(t)
        ema.update(model)
    profile = steps * (schedule.gamma + 1) / (schedule.gamma + 2)
    assert ema.ema.weight.item() == pytest.approx(profile, rel=k / steps + 1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), "0.9", None])
def test_a_schedule_value_outside_0_1_is_a_one_line_error_and_changes_nothing(bad, strategy: str) -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model, decay=lambda n: 0.5 if n < 3 else bad, strategy=strategy)
    ema.update(model)
    ema.update(model)
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    _drift(model, 3)
    with pytest.raises(ValueError, match=r"gave decay .* at update 3, not a number in \[0, 1\]$") as info:
        ema.update(model)
    assert "\n" not in str(info.value) and ema.updates == 2
    for k, v in ema.ema.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_every_must_be_a_positive_int(every) -> None:
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        ModelEMA(torch.nn.Linear(2, 2), every=every)


def test_with_every_k_a_bad_decay_is_refused_on_every_call() -> None:
    model = torch.nn.Linear(2, 2)
    ema = ModelEMA(model, every=3)
    with pytest.raises(ValueError, match=r"finite number in \[0, 1\]"):
        ema.update(model, decay=7.0)  # call 1 of 3: no update, still no bad decay let through
    assert ema.updates == 0


def test_a_numpy_sigma_rel_gives_a_float64_gamma() -> None:
    np = pytest.importorskip("numpy")
    # A float32 sigma_rel ran Newton's method in float32: gamma np.float32(16.972198), in repr and snapshots.
    gamma = power(sigma_rel=np.float32(0.05)).gamma
    assert type(gamma) is float and gamma == sigma_rel_to_gamma(float(np.float32(0.05)))
