"""What users do to their model (and its EMA) mid-run, each checked against a plain reference EMA."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from ema_lab import ModelEMA, PostHocEMA, ShardedModelEMA

STRATEGIES = ("auto", "flat", "gated", "foreach", "loop")
LAZY = r"^the model's '1.weight' is an uninitialized lazy parameter: run one forward pass with a batch"


def _lazy() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(4))


@pytest.mark.parametrize("cls", [ModelEMA, PostHocEMA, ShardedModelEMA])
def test_a_lazy_model_is_refused_in_one_line_naming_the_fix(cls: type, tmp_path) -> None:
    model = _lazy()
    args = (tmp_path,) if cls is PostHocEMA else ()
    with pytest.raises(ValueError, match=LAZY) as info:
        cls(model, *args)
    assert "\n" not in str(info.value)
    model(torch.randn(2, 3))  # initialized: the EMA is made
    assert torch.equal(cls(model, *args).ema.state_dict()["1.weight"], model[1].weight)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_update_from_a_lazy_model_made_anew_is_refused_in_one_line_and_changes_nothing(
    strategy: str,
) -> None:
    """A model made again (a resumed run) before its first forward: torch's many-line error before."""
    model = _lazy()
    model(torch.randn(2, 3))
    ema = ModelEMA(model, strategy=strategy)
    ema.update(model)
    kept = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    with pytest.raises(ValueError, match=LAZY + " before making or updating its EMA$"):
        ema.update(_lazy())
    assert ema.updates == 1
    assert all(torch.equal(v, kept[k]) for k, v in ema.ema.state_dict().items())
    ema.update(model, decay=0.0)  # the next valid update moves it
    assert torch.equal(ema.ema[1].weight, model[1].weight)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 5))


def _train(model: nn.Module) -> None:
    """One SGD step in train mode (BatchNorm's buffers and counter move too)."""
    model.train()
    model(torch.randn(2, 3, 6, 6)).square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None


def _state(ema: ModelEMA) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in ema.ema.state_dict().items()}


def _assert_same(ema: ModelEMA, kept: dict[str, Tensor]) -> None:
    """Every EMA entry bitwise as kept (dtype included)."""
    now = ema.ema.state_dict()
    assert now.keys() == kept.keys()
    for k, v in kept.items():
        assert now[k].dtype == v.dtype and torch.equal(now[k], v), k


def _assert_follows(ema: ModelEMA, model: nn.Module, updates: int = 3) -> None:
    """``updates`` more updates, each checked against a plain reference: ``e = d * e + (1 - d) * m`` per float
    entry (in float64), the counters copied."""
    ref = {k: v.double() if v.is_floating_point() else v for k, v in _state(ema).items()}
    for _ in range(updates):
        _train(model)
        d = ema.decay(ema.updates + 1)
        ema.update(model)
        for k, m in model.state_dict().items():
            ref[k] = d * ref[k] + (1 - d) * m.double() if m.is_floating_point() else m.clone()
        for k, v in ema.ema.state_dict().items():
            torch.testing.assert_close(v, ref[k].to(v.dtype))  # an integer counter: exactly


ALIASING = {
    "model loaded from the EMA": lambda model, ema: model.load_state_dict(ema.ema.state_dict(), assign=True),
    "EMA loaded from the model": lambda model, ema: ema.ema.load_state_dict(model.state_dict(), assign=True),
}


@pytest.mark.parametrize("move", ALIASING)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_ema_sharing_the_models_memory_is_refused_and_left_as_is(strategy: str, move: str) -> None:
    """With assign=True, one side's load_state_dict() of the other's state_dict() makes them one memory: the
    EMA then only follows the model (before: silently, under every strategy)."""
    model = _net()
    ema = ModelEMA(model, strategy=strategy, tau=3)
    _train(model)
    ema.update(model)
    ALIASING[move](model, ema)
    kept, updates = _state(ema), ema.updates
    message = r"^entry 0 \('0.weight'\): the EMA's tensor is the model's own memory: the EMA would only"
    with pytest.raises(ValueError, match=message):
        ema.update(model)
    _assert_same(ema, kept)
    assert ema.updates == updates
    ema.ema.load_state_dict(kept, assign=True)  # given a copy: it moves again
    _assert_follows(ema, model)
