"""The EMA's own parameters and module dicts tell its step when they are moved, so the step reads none of them
per update. What that must not change: the model's types, copies and files of the EMA (plain torch types),
torch.compile, export and tracing of the EMA, a user's own Parameter subclass, other EMAs' steps."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from ema_lab import ModelEMA, PostHocEMA
from ema_lab.bench.models import build

from ..helpers import GUARDED, float_entries


class Projected(nn.Module):
    """A persistent buffer feeding a matmul: a tensor subclass there fails a compiled module's first run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("proj", torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.proj


class Tagged(nn.Parameter):
    """A user's own Parameter type."""


def _updated(model: nn.Module) -> ModelEMA:
    ema = ModelEMA(model)
    ema.update(model)  # the step is built: the EMA guarded
    return ema


def _plain(module: nn.Module) -> bool:
    """Every tensor and module dict of ``module`` is torch's own type."""
    tensors = module.state_dict(keep_vars=True).values()
    dicts = [d for m in module.modules() for d in (m._parameters, m._buffers)]
    return not any(type(x).__module__.startswith("ema_lab") for x in (*tensors, *dicts))


def test_the_model_keeps_its_types() -> None:
    model = build("tiny_cnn")
    ema = _updated(model)
    ema.update(model)
    assert _plain(model)


@GUARDED
def test_the_emas_parameters_and_dicts_are_guarded() -> None:
    ema = _updated(build("tiny_cnn"))
    assert not _plain(ema.ema)
    assert all(type(p).__module__ == "ema_lab.step" for p in ema.ema.parameters())


@pytest.mark.parametrize(
    "copy_of",
    [
        copy.deepcopy,
        lambda m: pickle.loads(pickle.dumps(m)),
        lambda m: torch.load(io.BytesIO(_saved(m)), weights_only=False),
    ],
    ids=["deepcopy", "pickle", "torch.save"],
)
def test_copies_and_files_of_the_ema_hold_plain_torch_types(copy_of) -> None:
    ema = _updated(build("tiny_cnn"))
    copied = copy_of(ema.ema)
    assert _plain(copied)
    assert all(torch.equal(v, float_entries(ema.ema)[k]) for k, v in float_entries(copied).items())
    state = torch.load(io.BytesIO(_saved(ema.state_dict())), weights_only=True)
    assert all(type(t) is torch.Tensor for t in state["emas"][0].values())


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_a_guarded_parameter_prints_as_a_parameter() -> None:
    ema = _updated(build("tiny_cnn"))
    p = ema.ema[-1].bias
    assert repr(p) == repr(nn.Parameter(p.detach().clone(), requires_grad=False))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_ema_compiles_and_its_compiled_forward_matches(backend: str) -> None:
    model = Projected()
    ema = _updated(model)
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    assert torch.allclose(torch.compile(ema.ema, backend=backend)(x), ema.ema(x))
    ema.update(model)
    assert ema.rebuilds == 1  # compiling moved nothing


@pytest.mark.requires_torch("2.3", "torch.export.export")
def test_an_exported_or_traced_ema_matches_and_the_next_update_follows() -> None:
    model = build("tiny_cnn").eval()
    ema = _updated(model)
    x = torch.randn(2, 3, 16, 16)
    assert torch.allclose(torch.export.export(ema.ema, (x,)).module()(x), ema.ema(x))
    assert torch.allclose(torch.jit.trace(ema.ema, x)(x), ema.ema(x))
    with torch.no_grad():
        model[0].conv.weight.add_(1.0)
    ema.update(model, decay=0.0)  # export swapped the entries in and out: one rebuild, then exact
    assert torch.equal(ema.ema[0].conv.weight, model[0].conv.weight)


def test_a_users_parameter_subclass_keeps_its_type_and_is_followed() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight = Tagged(model[0].weight.detach().clone())
    ema = _updated(model)
    assert type(ema.ema[0].weight) is Tagged
    ema.ema[0].weight.data = ema.ema[0].weight.detach().clone()  # read per update: seen
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model, decay=0.0)
    assert torch.equal(ema.ema[0].weight, model[0].weight) and type(ema.ema[0].weight) is Tagged


def test_a_move_of_one_ema_rebuilds_that_one_only() -> None:
    """Each step's parameters tell their own step: two EMAs never rebuild each other in turn."""
    models = [build("tiny_cnn") for _ in range(2)]
    emas = [_updated(m) for m in models]
    emas[0].ema.double()
    for _ in range(3):
        for ema, model in zip(emas, models):
            ema.update(model)
    assert [e.rebuilds for e in emas] == [2, 1]


def test_the_profiles_of_a_posthoc_ema_tell_their_one_step(tmp_path) -> None:
    model = build("tiny_cnn")
    posthoc = PostHocEMA(model, tmp_path, sigma_rels=(0.05, 0.28), snapshot_every=100)
    posthoc.update(model)
    posthoc.emas[1][0].conv.weight.data = posthoc.emas[1][0].conv.weight.detach().clone()
    with torch.no_grad():
        model[0].conv.weight.add_(1.0)
    before = posthoc.emas[1][0].conv.weight.clone()
    posthoc.update(model)
    assert posthoc.rebuilds == 2
    assert not torch.equal(posthoc.emas[1][0].conv.weight, before)  # the moved tensor is the one updated


def test_an_ema_module_outlives_its_ema() -> None:
    model = build("tiny_cnn")
    ema = _updated(model)
    kept = ema.ema
    del ema
    kept.half().float()  # its parameters' step is gone: nothing to tell
    model.load_state_dict(kept.state_dict())
    assert all(torch.equal(v, float_entries(kept)[k]) for k, v in float_entries(model).items())


def test_the_ema_compiles_to_one_graph_as_the_model_does() -> None:
    """A tensor subclass but a Parameter's would break the graph: the EMA's buffers keep their type."""
    model = build("tiny_cnn").eval()
    ema = _updated(model)
    x = torch.randn(2, 3, 16, 16)
    for module in (model, ema.ema):
        explained = torch._dynamo.explain(module)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_a_copy_of_the_ema_traces_with_make_fx() -> None:
    """make_fx takes no Parameter subclass (docs/api.md says to trace a copy): a copy's are plain."""
    from torch.fx.experimental.proxy_tensor import make_fx

    ema = _updated(build("tiny_cnn").eval())
    x = torch.randn(2, 3, 16, 16)
    assert torch.allclose(make_fx(copy.deepcopy(ema.ema))(x)(x), ema.ema(x))
