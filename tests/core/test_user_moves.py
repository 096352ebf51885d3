"""What users do to their model (and its EMA) mid-run, each checked against a plain reference EMA."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import prune

from ema_lab import ModelEMA, PostHocEMA, ShardedModelEMA

from ..helpers import reference_step

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
            if p.grad is not None:  # None: frozen
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


def _assert_follows(
    ema: ModelEMA, model: nn.Module, updates: int = 3, context: Callable = nullcontext
) -> None:
    """``updates`` more updates, each checked against a plain reference: ``e = d * e + (1 - d) * m`` per float
    entry (in float64), the counters copied."""
    ref = _state(ema)
    keys = [k for k, v in ref.items() if v.is_floating_point()]
    floats = [ref[k].double() for k in keys]
    for _ in range(updates):
        _train(model)
        d = ema.decay(ema.updates + 1)
        with context():
            ema.update(model)
        entries = model.state_dict()
        reference_step(floats, [entries[k] for k in keys], d)
        ref.update(zip(keys, floats))
        ref.update({k: v.clone() for k, v in entries.items() if not v.is_floating_point()})  # counters
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


def _freeze_conv(model: nn.Module) -> None:
    model[0].requires_grad_(False)  # its entries stay in the EMA, now constant in the model


def _replace_head(model: nn.Module) -> None:
    model[3] = nn.Linear(64, 5)  # a fresh head of the same shape (a re-initialized classifier)


MOVES = {
    "frozen conv": _freeze_conv,
    "frozen conv then unfrozen": lambda m: (_freeze_conv(m), _train(m), m[0].requires_grad_(True)),
    "head replaced": _replace_head,
    "channels_last": lambda m: m.to(memory_format=torch.channels_last),
    "half() then float()": lambda m: m.half().float(),
}


@pytest.mark.parametrize("move", MOVES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_ema_follows_the_reference_through_a_move_mid_run(strategy: str, move: str) -> None:
    model = _net()
    ema = ModelEMA(model, strategy=strategy, tau=3)
    _assert_follows(ema, model, 2)
    MOVES[move](model)
    _assert_follows(ema, model)


def test_cumulative_batchnorm_is_averaged_with_its_counter_copied() -> None:
    """momentum=None: BatchNorm's running stats are a cumulative mean driven by num_batches_tracked."""
    model = _net()
    model[1].momentum = None
    ema = ModelEMA(model, tau=3)
    _assert_follows(ema, model, 4)
    assert ema.ema[1].num_batches_tracked.item() == 4


CONTEXTS = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_ema_made_and_updated_inside_a_context_follows_outside(strategy: str, context: str) -> None:
    model = _net()
    with CONTEXTS[context]():
        ema = ModelEMA(model, strategy=strategy, tau=3)
    _assert_follows(ema, model, 2, CONTEXTS[context])
    assert all(v.dtype == torch.float32 for v in ema.ema.parameters())  # autocast casts no weight
    _assert_follows(ema, model)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_fused_conv_bn_is_refused_in_one_line_and_changes_nothing(strategy: str) -> None:
    """fuse_conv_bn_eval drops BatchNorm's entries: the EMA cannot follow that model, and says so."""
    model = _net()
    ema = ModelEMA(model, strategy=strategy, tau=3)
    _assert_follows(ema, model, 2)
    kept = _state(ema)
    model.eval()
    model[0], model[1] = torch.nn.utils.fusion.fuse_conv_bn_eval(model[0], model[1]), nn.Identity()
    with pytest.raises(ValueError, match=r"^EMA and model do not hold the same entries: missing \['1.bias'"):
        ema.update(model)
    _assert_same(ema, kept)
    assert ema.updates == 2


class _ValueEqual(nn.Module):
    """A module compared by value (a loss, a frozen feature extractor): __eq__ leaves its class unhashable."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ValueEqual)


def test_modules_without_hash_can_still_be_built_and_changed_once_an_ema_watches_a_model() -> None:
    """torch's registration hooks are global: the EMA's looked every module up by hash (before: TypeError)."""
    model = _net()
    ema = ModelEMA(model, tau=3)
    _assert_follows(ema, model, 1)  # the step, its watch and the hooks are in place
    other = _ValueEqual()
    other.extra = nn.Parameter(torch.zeros(1))
    other.register_buffer("seen", torch.ones(1))
    assert [*other._parameters, *other._buffers, *other._modules] == ["extra", "seen", "lin"]
    assert other.lin(torch.ones(1, 2)).shape == (1, 2)  # torch's named_modules() would need a hash itself
    _assert_follows(ema, model)


PRUNED = {
    "pruned": lambda m: prune.l1_unstructured(m, "weight", amount=0.5),
    "old weight_norm, after a forward": lambda m: torch.nn.utils.weight_norm(m),
}


@pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")
@pytest.mark.parametrize("how", PRUNED)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_model_holding_a_computed_weight_gets_an_ema_that_computes_its_own(strategy: str, how: str) -> None:
    """Pruning and the old weight_norm keep ``weight`` as a non-leaf attribute, which deepcopy refuses
    (before: torch's RuntimeError from ModelEMA()); the EMA holds it detached, its pre-hook computes it."""
    model = _net()
    PRUNED[how](model[3])
    _train(model)
    weight = model[3].weight
    ema = ModelEMA(model, strategy=strategy, tau=3)
    assert model[3].weight is weight and weight.grad_fn is not None  # the model's own is left alone
    _assert_follows(ema, model)
    ema.ema(torch.randn(2, 3, 6, 6))  # its pre-hook recomputes its weight from the EMA's entries
    head = ema.ema[3]
    assert head.weight is not weight and head.weight.grad_fn is None
    torch.testing.assert_close(head.weight, PRUNED_WEIGHT[how](head), rtol=0, atol=0)


PRUNED_WEIGHT = {
    "pruned": lambda m: m.weight_orig * m.weight_mask,
    "old weight_norm, after a forward": lambda m: torch._weight_norm(m.weight_v, m.weight_g, 0),
}
