"""``state_dict()``/``load_state_dict()``: a run resumed from a checkpoint equals the uninterrupted one, bit
for bit, and a checkpoint of another model or schedule is refused with the EMA left as it was."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ema_lab import ModelEMA, ShardedModelEMA
from ema_lab.bench.models import build
from ema_lab.schedules import Schedule, power, ramp, warmup

from ..helpers import one_rank_group

STRATEGIES = ("auto", "flat", "gated", "foreach", "loop")
CONFIGS = {
    "ramp": {"decay": 0.9, "tau": 2},
    "warmup": {"decay": warmup(0.9, after=1)},
    "power every 3": {"decay": power(gamma=2.0), "every": 3},
}


def _train_step(model: nn.Module, i: int) -> None:
    """A deterministic stand-in for one training step: a forward in train mode (BatchNorm's statistics move)
    and an SGD step."""
    g = torch.Generator().manual_seed(i)
    model.train()
    model.zero_grad()
    model(torch.randn(4, 3, 16, 16, generator=g)).square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


def _roundtrip(state: dict) -> dict:
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint file would."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_resumed_run_equals_the_uninterrupted_one_bitwise(strategy: str, config: str) -> None:
    kwargs = {**CONFIGS[config], "strategy": strategy}
    model = build("tiny_cnn")
    start = _copy(model.state_dict())
    ema = ModelEMA(model, **kwargs)
    for i in range(8):
        _train_step(model, i)
        ema.update(model)
        if i == 3:  # the checkpoint: model and EMA, mid-way through an every=3 cycle
            saved = _roundtrip({"model": model.state_dict(), "ema": ema.state_dict()})

    resumed_model = build("tiny_cnn")
    resumed_model.load_state_dict(start)  # a fresh process builds the EMA from a model it then loads
    resumed = ModelEMA(resumed_model, **kwargs)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["ema"])
    assert resumed.updates == 4
    for i in range(4, 8):
        _train_step(resumed_model, i)
        resumed.update(resumed_model)
    assert resumed.updates == ema.updates == 8
    _assert_same(resumed.ema.state_dict(), ema.ema.state_dict())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loading_into_a_used_ema_overwrites_it_in_place_and_keeps_its_step(strategy: str) -> None:
    model = build("tiny_cnn")
    ema = ModelEMA(model, decay=0.5, tau=0.01, strategy=strategy)
    ema.update(model)
    saved = _roundtrip(ema.state_dict())
    expected = _copy(ema.ema.state_dict())
    for i in range(3):
        _train_step(model, i)
        ema.update(model)
    ema.load_state_dict(saved)
    _assert_same(ema.ema.state_dict(), expected)
    assert ema.updates == 1
    ema.update(model)
    assert ema.rebuilds == 1  # loaded in place: the cached step still holds the EMA's tensors


def test_the_state_holds_weights_count_and_what_load_checks() -> None:
    model = build("tiny_cnn")
    ema = ModelEMA(model, decay=0.99, tau=100, every=2)
    ema.update(model)
    state = ema.state_dict()
    assert state["updates"] == 1 and state["every"] == 2
    assert state["schedules"] == ["ramp(decay=0.99, tau=100)"]
    _assert_same(state["emas"][0], ema.ema.state_dict())


def _refused(ema: ModelEMA, state: dict, match: str) -> None:
    """``load_state_dict(state)`` raises a one-line ValueError matching ``match``; the EMA is unchanged."""
    before, updates = _copy(ema.ema.state_dict()), ema.updates
    with pytest.raises(ValueError, match=match) as e:
        ema.load_state_dict(state)
    assert "\n" not in str(e.value)
    _assert_same(ema.ema.state_dict(), before)
    assert ema.updates == updates


def _checkpoint(model: nn.Module, **kwargs: object) -> dict:
    ema = ModelEMA(model, **kwargs)
    for i in range(2):
        _train_step(model, i)
        ema.update(model)
    return _roundtrip(ema.state_dict())


@pytest.mark.parametrize(
    ("saved", "here", "match"),
    [
        (
            {"decay": 0.999},
            {"decay": 0.9999},
            r"^the checkpoint's schedules is \['ramp\(decay=0.999, tau=2000\)'\]",
        ),
        ({"tau": 100}, {}, r"schedules .*tau=100.*tau=2000"),
        ({"decay": warmup(0.9)}, {"decay": ramp(0.9)}, r"schedules .*warmup.*ramp"),
        ({"decay": power(gamma=7.0)}, {"decay": power(gamma=6.9)}, r"schedules .*gamma=7\.0.*gamma=6\.9"),
        ({"every": 2}, {}, r"^the checkpoint's every is 2, this EMA's 1$"),
    ],
    ids=["decay", "tau", "schedule", "gamma", "every"],
)
def test_a_checkpoint_of_another_schedule_is_refused_and_changes_nothing(saved, here, match) -> None:
    state = _checkpoint(build("tiny_cnn"), **saved)
    model = build("tiny_cnn")
    ema = ModelEMA(model, **here)
    ema.update(model)
    _refused(ema, state, match)


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing() -> None:
    state = _checkpoint(build("tiny_cnn"))
    other = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    _refused(
        ModelEMA(other),
        state,
        r"^the checkpoint is another model's: entries \['0\.conv\.weight', '0\.bn\.weight', '0\.bn\.bias'\] ",
    )
    wider = build("tiny_cnn")
    wider[0].conv = nn.Conv2d(3, 8, 5, bias=False)  # the same keys, another shape
    ema = ModelEMA(wider)
    _refused(
        ema,
        state,
        r"^the checkpoint is another model's: entries \['0\.conv\.weight'\] differ in name or shape$",
    )


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (
            [],
            r"^not a ModelEMA state_dict: expected a dict of \['emas', 'every', 'schedules', 'updates'\]$",
        ),
        ({"ema": {}}, r"^not a ModelEMA state_dict: "),
    ],
)
def test_what_is_not_a_state_dict_is_refused(state: object, match: str) -> None:
    _refused(ModelEMA(build("tiny_cnn")), state, match)


@pytest.mark.parametrize("emas", [[], [None], "ema", "two"], ids=["none", "not a dict", "not a list", "two"])
def test_a_checkpoint_holding_other_emas_is_refused(emas: object) -> None:
    model = build("tiny_cnn")
    state = _checkpoint(model)
    state["emas"] = state["emas"] * 2 if emas == "two" else emas
    _refused(ModelEMA(build("tiny_cnn")), state, r"^the checkpoint is another model's: entries \[")


def test_a_negative_update_count_is_refused() -> None:
    model = build("tiny_cnn")
    state = {**_checkpoint(model), "updates": -1}
    _refused(ModelEMA(build("tiny_cnn")), state, r"^updates must be an int >= 0, got -1$")


# --- a schedule's name (issue #62, item 5) ----------------------------------------------------------------


def _half_life(h: float, n: int) -> float:
    """A schedule of the user's, defined at module level: ``partial(_half_life, h)`` names it by ``h``."""
    return 0.5 ** (1 / h)


def _call(schedule: Schedule, n: int) -> float:
    return schedule(n)


def _closure(d: float) -> Schedule:
    def schedule(n: int) -> float:
        return d

    return schedule


class _Fixed:
    """A callable object, not a dataclass: its name says nothing of its decay."""

    def __init__(self, d: float) -> None:
        self.d = d

    def __call__(self, n: int) -> float:
        return self.d


UNNAMED = {
    "lambda": lambda n: 0.5,
    "nested function": _closure(0.5),
    "callable object": _Fixed(0.5),
    "partial of a lambda": partial(lambda d, n: d, 0.5),
    "partial of an object": partial(_call, _Fixed(0.5)),
}


@pytest.mark.parametrize("decay", UNNAMED.values(), ids=UNNAMED)
def test_a_schedule_two_functions_could_share_the_name_of_is_refused_naming_the_fix(decay) -> None:
    model = build("tiny_cnn")
    ema = ModelEMA(model, decay=decay)
    ema.update(model)
    with pytest.raises(ValueError, match="no name .* a function defined at module level, a dataclass") as e:
        ema.state_dict()
    assert "\n" not in str(e.value)
    # A checkpoint an older ema_lab saved as "<lambda>": loading into such an EMA is refused the same way.
    old = {**_checkpoint(build("tiny_cnn")), "schedules": ["<lambda>"]}
    _refused(ema, old, "no name a checkpoint can tell from another's")


def test_named_functions_and_partials_of_them_load_only_into_their_own() -> None:
    state = _checkpoint(build("tiny_cnn"), decay=partial(_half_life, 10))
    assert state["schedules"] == ["_half_life(10)"]
    model = build("tiny_cnn")
    _refused(
        ModelEMA(model, decay=partial(_half_life, 20)),
        state,
        r"schedules .*_half_life\(10\).*_half_life\(20\)",
    )
    _refused(
        ModelEMA(model, decay=_half_life), state, r"is \['_half_life\(10\)'\], this EMA's \['_half_life'\]"
    )
    ModelEMA(model, decay=partial(_half_life, h=10)).load_state_dict(
        {**state, "schedules": ["_half_life(h=10)"]}
    )
    ModelEMA(model, decay=partial(_half_life, 10)).load_state_dict(state)


# --- every entry checked before any is copied (issue #62, item 6) -----------------------------------------

BAD_ENTRIES = {
    "meta": (lambda t: t.to("meta"), r"is on the meta device: it holds no values"),
    "sparse": (lambda t: t.to_sparse(), r"is a torch.sparse_coo tensor, not a dense one"),
    "complex": (
        lambda t: t.to(torch.complex64),
        r"is torch.complex64, which does not cast to .* torch.float32",
    ),
    "not a tensor": (lambda t: SimpleNamespace(shape=t.shape), r"is a SimpleNamespace, not a tensor"),
}


@pytest.mark.parametrize("bad", BAD_ENTRIES)
def test_an_entry_torch_could_not_copy_is_refused_before_any_is_copied(bad: str) -> None:
    """The bad entry last: torch would have copied every other one before it raised."""
    make, match = BAD_ENTRIES[bad]
    state = _checkpoint(build("tiny_cnn"))
    entries = state["emas"][0]
    key = [k for k, v in entries.items() if v.is_floating_point()][-1]
    state["emas"] = [{**{k: v for k, v in entries.items() if k != key}, key: make(entries[key])}]
    model = build("tiny_cnn")
    ema = ModelEMA(model)
    ema.update(model)
    _refused(ema, state, rf"^the checkpoint's entry '{re.escape(key)}' {match}.*: nothing was loaded$")


def test_a_counter_saved_as_float_is_refused_and_a_float64_checkpoint_loads() -> None:
    state = _checkpoint(build("tiny_cnn"))
    entries = state["emas"][0]
    counter = next(k for k, v in entries.items() if not v.is_floating_point())
    model = build("tiny_cnn")
    ema = ModelEMA(model)
    ema.update(model)
    floated = {**state, "emas": [{**entries, counter: entries[counter].float()}]}
    _refused(ema, floated, rf"'{re.escape(counter)}' is torch.float32, which does not cast to .* torch.int64")
    doubled = {k: v.double() if v.is_floating_point() else v for k, v in entries.items()}
    ema.load_state_dict({**state, "emas": [doubled]})  # float64 into float32: cast, as torch's load does
    _assert_same(ema.ema.state_dict(), {k: v.to(entries[k].dtype) for k, v in doubled.items()})


def test_module_is_the_ema_under_torch_and_timms_name() -> None:
    """timm's unwrap_model() follows ``.module``; its CheckpointSaver saves unwrap_model(ema).state_dict()."""
    ema = ModelEMA(build("tiny_cnn"))
    assert ema.module is ema.ema
    other = build("tiny_cnn")
    ema.module = other
    assert ema.ema is other


# --- ShardedModelEMA over a one-rank gloo group ------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    with one_rank_group(tmp_path_factory.mktemp("pg")):
        yield init_device_mesh("cpu", (1,))


def _sharded(mesh: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    return fully_shard(build("tiny_cnn"), mesh=mesh)


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
@pytest.mark.parametrize("strategy", ["auto", "gated", "foreach", "loop"])
def test_a_resumed_sharded_ema_equals_the_uninterrupted_one_bitwise(mesh: object, strategy: str) -> None:
    kwargs = {"decay": warmup(0.9), "every": 2, "strategy": strategy}
    model = _sharded(mesh)
    ema = ShardedModelEMA(model, **kwargs)
    for i in range(5):
        _train_step(model, i)
        ema.update(model)
        if i == 2:
            saved = _roundtrip({"model": model.state_dict(), "ema": ema.state_dict()})
    resumed_model = _sharded(mesh)
    resumed = ShardedModelEMA(resumed_model, **kwargs)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["ema"])
    for i in range(3, 5):
        _train_step(resumed_model, i)
        resumed.update(resumed_model)
    assert resumed.updates == ema.updates == 5
    _assert_same(resumed.local_tensors(), ema.local_tensors())
    other = ShardedModelEMA(_sharded(mesh), decay=warmup(0.99), every=2)
    _refused(other, saved["ema"], r"^the checkpoint's schedules is \['warmup\(decay=0\.9, ")
