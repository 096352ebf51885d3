"""The staleness watch cannot be fooled: after any move a user makes on the EMA or the model (a conversion,
a reload, a reassigned ``.data``, a swapped module or tensor, a parametrization), with or without references
kept to the old tensors, the next update reads what the model holds now and writes what the EMA holds now."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from ema_lab import ModelEMA, flatten_model
from ema_lab.bench.models import build
from ema_lab.schedules import ramp

from ..helpers import float_entries

#: Each EMA is built, updated once (its step built), then moved; "flattened" flattens the model first.
STRATEGIES = ("auto", "flat", "gated", "foreach", "loop", "flattened")
KEPT: list[object] = []  # references a move keeps alive (what a user's "best checkpoint" dict does)


class Scale(nn.Module):
    """A parametrization that changes nothing but the state_dict's layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


def _first_param(module: nn.Module) -> nn.Parameter:
    return module[0].conv.weight


def _last_param(module: nn.Module) -> nn.Parameter:
    return module[-1].bias


def _swap(t: torch.Tensor) -> None:
    torch.utils.swap_tensors(t, nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad))


def _data_kept(get: Callable[[nn.Module], nn.Parameter]) -> Callable[[nn.Module], None]:
    """``old = p.data; p.data = old.clone()``, ``old`` kept: one more view of the old memory, one fewer."""

    def move(module: nn.Module) -> None:
        p = get(module)
        KEPT.append(p.data)
        p.data = KEPT[-1].clone()

    return move


def _kept_then(move: Callable[[nn.Module], object]) -> Callable[[nn.Module], None]:
    """``kept = module.state_dict()`` (views of every entry), then ``move``."""

    def both(module: nn.Module) -> None:
        KEPT.append(module.state_dict())
        move(module)

    return both


def _reload(assign: bool) -> Callable[[nn.Module], None]:
    def move(module: nn.Module) -> None:
        state = {k: v + 0.25 if v.is_floating_point() else v.clone() for k, v in module.state_dict().items()}
        module.load_state_dict(state, assign=assign)

    return move


def _under(flag: str, move: Callable[[nn.Module], object]) -> Callable[[nn.Module], None]:
    """``move`` with one of torch's ``torch.__future__`` conversion flags on (swap or replace parameters)."""

    def flagged(module: nn.Module) -> None:
        getattr(torch.__future__, f"set_{flag}")(True)
        try:
            move(module)
        finally:
            getattr(torch.__future__, f"set_{flag}")(False)

    return flagged


def _set(module: nn.Module) -> None:
    with torch.no_grad():
        _last_param(module).set_(_last_param(module).detach().clone())


def _to_vector_and_back(module: nn.Module) -> None:
    """torch's own ``vector_to_parameters``: ``p.data = ...`` on every parameter."""
    vector = nn.utils.parameters_to_vector(module.parameters()).clone()
    nn.utils.vector_to_parameters(vector, module.parameters())


def _new_conv(module: nn.Module) -> None:
    conv = module[0].conv
    module[0].conv = nn.Conv2d(3, 8, 3, 2, 1, bias=False).to(conv.weight.dtype)


#: What a user does to a module (the EMA's or the model's), by name.
MOVES: dict[str, Callable[[nn.Module], object]] = {
    ".half()": lambda m: m.half(),
    ".double()": lambda m: m.double(),
    ".to(float64)": lambda m: m.to(torch.float64),
    ".float() after .half()": lambda m: m.half().float(),
    "kept state_dict, .half()": _kept_then(lambda m: m.half()),
    "kept state_dict, .double()": _kept_then(lambda m: m.double()),
    "kept state_dict x2, .to(float64)": _kept_then(_kept_then(lambda m: m.to(torch.float64))),
    "p.data = (first)": lambda m: setattr(_first_param(m), "data", _first_param(m).detach().clone()),
    "kept p.data, p.data = (first)": _data_kept(_first_param),
    "kept p.data, p.data = (last)": _data_kept(_last_param),
    "kept state_dict, p.data = (last)": _kept_then(_data_kept(_last_param)),
    "buffer.data =": lambda m: setattr(m[1].bn.running_var, "data", m[1].bn.running_var.clone()),
    "_buffers[...] =": lambda m: m[1].bn._buffers.__setitem__("running_mean", m[1].bn.running_mean.clone()),
    "swap_tensors (last)": lambda m: _swap(_last_param(m)),
    "kept view, swap_tensors (last)": lambda m: (KEPT.append(_last_param(m).detach()), _swap(_last_param(m))),
    "load_state_dict": _reload(assign=False),
    "kept state_dict, load_state_dict(assign=True)": _kept_then(_reload(assign=True)),
    "new parameter": lambda m: setattr(m[-1], "bias", nn.Parameter(m[-1].bias.detach().clone())),
    "module swap": _new_conv,
    "kept state_dict, module swap": _kept_then(_new_conv),
    "p.set_ (last)": _set,
    "vector_to_parameters": _to_vector_and_back,
    "share_memory()": lambda m: m.share_memory(),
    ".double(), parameters replaced": _under("overwrite_module_params_on_conversion", lambda m: m.double()),
    ".double(), parameters swapped": _under("swap_module_params_on_conversion", lambda m: m.double()),
    "load_state_dict, tensors swapped": _under("swap_module_params_on_conversion", _reload(assign=False)),
    "buffer popped, then set": lambda m: m[1].bn._buffers.update(
        running_var=m[1].bn._buffers.pop("running_var") + 0
    ),
    # What sending a state_dict to another process does (torch.multiprocessing): no Python hook runs.
    "storage moved to shared memory (last)": lambda m: _last_param(m).untyped_storage().share_memory_(),
}
#: The moves as test parameters: swap_tensors exists from torch 2.3 (the floor is 2.1).
MOVE_PARAMS = [
    pytest.param(name, marks=pytest.mark.requires_torch("2.3", "torch.utils.swap_tensors"))
    if "swap" in name
    else name
    for name in MOVES
]


def _build(strategy: str) -> tuple[nn.Module, ModelEMA]:
    torch.manual_seed(0)
    model = build("tiny_cnn")
    if strategy == "flattened":
        flatten_model(model)
    ema = ModelEMA(model, strategy="auto" if strategy == "flattened" else strategy)
    ema.update(model)  # the step is built
    return model, ema


def _follows(model: nn.Module, ema: ModelEMA) -> None:
    """One update at decay 0 after moving every float entry of the model: the EMA holds the model's values
    now (in its own dtype), or, where the strategy refuses the layout, a one-line ValueError left it as is."""
    with torch.no_grad():
        for v in float_entries(model).values():
            v.add_(torch.rand_like(v) + 1.0)
    want, before = float_entries(model), {k: v.clone() for k, v in float_entries(ema.ema).items()}
    mixed = any(v.dtype != want[k].dtype for k, v in before.items())
    if ema.strategy == "foreach" and mixed:  # foreach takes one dtype per pair: refused, nothing changed
        with pytest.raises(ValueError, match="does not match model") as e:
            ema.update(model, decay=0.0)
        assert "\n" not in str(e.value)
        assert all(torch.equal(v, before[k]) for k, v in float_entries(ema.ema).items())
        return
    ema.update(model, decay=0.0)
    got = float_entries(ema.ema)
    assert got.keys() == want.keys()
    for k, v in got.items():
        assert torch.equal(v, want[k].to(v.dtype)), k
    assert ema.ema[1].bn.num_batches_tracked.item() == model[1].bn.num_batches_tracked.item()


@pytest.mark.parametrize("move", MOVE_PARAMS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_next_update_follows_a_move_of_the_ema(strategy: str, move: str) -> None:
    model, ema = _build(strategy)
    MOVES[move](ema.ema)
    try:
        _follows(model, ema)
    finally:
        KEPT.clear()


@pytest.mark.parametrize("move", MOVE_PARAMS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_next_update_follows_a_move_of_the_model(strategy: str, move: str) -> None:
    model, ema = _build(strategy)
    with torch.no_grad():
        model[1].bn(torch.randn(4, 16, 2, 2))  # num_batches_tracked moves: the counters are copied too
    MOVES[move](model)
    try:
        _follows(model, ema)
    finally:
        KEPT.clear()


@pytest.mark.parametrize("move", MOVE_PARAMS)
@pytest.mark.parametrize("strategy", ["auto", "gated"])
def test_the_next_update_follows_a_move_of_a_second_ema(strategy: str, move: str) -> None:
    """Two EMAs on one step (as PostHocEMA's profiles): a move of the second is followed by both."""
    torch.manual_seed(0)
    model = build("tiny_cnn")
    ema = ModelEMA(model, decay=[ramp(0.9, 10), ramp(0.99, 10)], strategy=strategy)
    ema.update(model)
    MOVES[move](ema.emas[1])
    try:
        with torch.no_grad():
            for v in float_entries(model).values():
                v.add_(1.0)
        ema.update(model, decay=0.0)
    finally:
        KEPT.clear()
    want = float_entries(model)
    for e in ema.emas:
        assert all(torch.equal(v, want[k].to(v.dtype)) for k, v in float_entries(e).items())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_next_update_follows_both_parametrized_alike(strategy: str) -> None:
    model, ema = _build(strategy)
    for module in (model, ema.ema):
        parametrize.register_parametrization(module[0].conv, "weight", Scale())
    _follows(model, ema)
    assert "0.conv.parametrizations.weight.original" in float_entries(ema.ema)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_model_parametrized_alone_is_refused_by_name(strategy: str) -> None:
    model, ema = _build(strategy)
    parametrize.register_parametrization(model[0].conv, "weight", Scale())
    with pytest.raises(ValueError, match=r"^EMA and model do not hold the same entries: .*0\.conv\.weight"):
        ema.update(model)


#: Edits of a module's children that no registration hook sees: the containers' own methods, ``del``.
EDITS: dict[str, Callable[[nn.Sequential], object]] = {
    "Sequential.insert": lambda m: m.insert(1, nn.Conv2d(8, 8, 1)),
    "del seq[-1]": lambda m: m.__delitem__(-1),
    "Sequential.pop(0)": lambda m: m.pop(0),
    "Sequential.insert, then pop": lambda m: (m.insert(0, nn.Conv2d(3, 3, 1)), m.pop(-1)),
    "del block.bn": lambda m: delattr(m[1], "bn"),
    "del block.bn, then None in its place": lambda m: (delattr(m[1], "bn"), m[1].register_module("bn", None)),
}


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_next_update_follows_an_edit_of_both(strategy: str, edit: str) -> None:
    model, ema = _build(strategy)
    for module in (model, ema.ema):
        EDITS[edit](module)
    ema.update(model, decay=0.0)
    want = float_entries(model)
    assert float_entries(ema.ema).keys() == want.keys()
    for k, v in float_entries(ema.ema).items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("side", ["model", "EMA"])
@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_edit_of_one_side_is_refused_by_name(strategy: str, edit: str, side: str) -> None:
    model, ema = _build(strategy)
    EDITS[edit](model if side == "model" else ema.ema)
    before = {k: v.clone() for k, v in float_entries(ema.ema).items()}
    with pytest.raises(ValueError, match=r"^EMA and model do not hold the same entries: missing"):
        ema.update(model)
    assert all(torch.equal(v, before[k]) for k, v in float_entries(ema.ema).items())


@pytest.mark.parametrize("strategy", ["auto", "flat", "flattened"])
def test_a_kept_reference_costs_no_rebuild(strategy: str) -> None:
    model, ema = _build(strategy)
    kept = [ema.ema.state_dict(), model.state_dict()]
    for _ in range(3):
        ema.update(model)
    assert ema.rebuilds == 1 and kept


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weight_norm_on_both_is_followed(strategy: str) -> None:
    """torch's weight_norm makes new Parameters from the EMA's own tensors (``nn.Parameter(weight)``)."""
    model, ema = _build(strategy)
    for module in (model, ema.ema):
        nn.utils.parametrizations.weight_norm(module[0].conv)
    _follows(model, ema)
    assert "0.conv.parametrizations.weight.original0" in float_entries(ema.ema)


class _Cached(nn.Module):
    """A layer whose forward reassigns a non-persistent buffer (a rotary or mask cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = x.detach().mean(0)
        return self.linear(x)


@pytest.mark.parametrize("strategy", STRATEGIES[:-1])
def test_what_a_mean_teacher_does_costs_no_rebuild(strategy: str) -> None:
    """The EMA runs forward every step (its cache reassigned) and is moved to where it already is."""
    model = nn.Sequential(_Cached(), nn.BatchNorm1d(4))
    ema = ModelEMA(model, strategy=strategy)
    for _ in range(5):
        x = torch.randn(8, 4)
        model(x)
        ema.ema(x)
        ema.ema.to("cpu").float()
        ema.update(model, decay=0.0)
    assert ema.rebuilds == 1
    want = float_entries(model)
    assert all(torch.equal(v, want[k]) for k, v in float_entries(ema.ema).items())


def test_a_deleted_models_modules_are_not_kept_alive_by_the_watch() -> None:
    model, ema = _build("auto")
    child = weakref.ref(model[1])
    del model
    gc.collect()
    assert child() is None


def test_a_replaced_step_is_freed_at_once() -> None:
    """Without waiting for the garbage collector: an old step holds the tensors the model had."""
    model, ema = _build("auto")
    old = weakref.ref(ema._step.watch)
    model.half()
    ema.update(model)
    assert ema.rebuilds == 2 and old() is None
