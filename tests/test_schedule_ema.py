"""``ModelEMA(decay=...)``: a number keeps ultralytics' ramp bit for bit; a schedule (ema_lab.schedules) gives
the decay of each update; ``every=k`` updates on every k-th call with the k decays' product; a schedule's bad
value is a one-line error that changes nothing."""

from __future__ import annotations

import math

import pytest
import torch

from ema_lab import ModelEMA
from ema_lab.bench import models
from ema_lab.schedules import constant, harmonic, power, warmup

from .helpers import float_entries

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
