"""The EMA keeps each tensor's memory format (issue #62, item 8): a channels_last model's EMA stays
channels_last under every strategy and in every mode of the flat step, with the values of the "gated" EMA
(in place: it never moves a tensor).

The flat step moves the EMA into one buffer per group; each tensor keeps its strides there, and a mode that
pairs elements by their place in memory (a ``torch.cat`` gather, one ``lerp_`` over a whole buffer, the
cast into scratch) must read the model in the EMA's element order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from ema_lab import STRATEGIES, ModelEMA, PostHocEMA, flatten_model
from ema_lab.bench import models

from ..helpers import float_entries

CL = torch.channels_last


def _cnn(channels_last: bool = True, dtype: torch.dtype = torch.float32) -> nn.Module:
    model = models.build("tiny_cnn").to(dtype)
    return model.to(memory_format=CL) if channels_last else model


def _move(model: nn.Module, step: int) -> None:
    """A training step's worth of change to every float entry, in place (the tensors keep their strides)."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for v in float_entries(model).values():
            v.add_(torch.randn(v.shape, generator=g).to(v.dtype))


def _layouts(module: nn.Module) -> dict[str, tuple]:
    return {k: (v.dtype, v.stride()) for k, v in module.state_dict().items()}


def _check(
    model: nn.Module,
    emas: list[ModelEMA],
    ready: Callable[[nn.Module], object] = lambda m: m,
    ref: str = "gated",
) -> None:
    """Update each EMA (its module prepared by ``ready``) and a ``ref`` one 4 times: each keeps the strides
    it was built with, and equals the reference bit for bit."""
    ref = ModelEMA(model, decay=0.6, tau=0.01, strategy=ref)
    for ema in (ref, *emas):
        ready(ema.ema)
    built = [_layouts(ema.ema) for ema in emas]
    assert all(layout == _layouts(ref.ema) for layout in built)
    for step in range(4):
        _move(model, step)
        for ema in (ref, *emas):
            ema.update(model)
    want = ref.ema.state_dict()
    for ema, layout in zip(emas, built):
        assert _layouts(ema.ema) == layout, ema.modes
        for k, v in ema.ema.state_dict().items():
            assert torch.equal(v, want[k]), (k, ema.modes)


def _convs(module: nn.Module) -> list[torch.Tensor]:
    return [v for v in module.state_dict().values() if v.dim() == 4]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_keeps_a_channels_last_ema_channels_last(strategy: str) -> None:
    model = _cnn()
    ema = ModelEMA(model, decay=0.6, tau=0.01, strategy=strategy)
    _check(model, [ema], ref="loop" if strategy == "loop" else "gated")  # loop: v *= d; v += (1 - d) * m
    assert _convs(ema.ema) and all(w.is_contiguous(memory_format=CL) for w in _convs(ema.ema))
    assert not any(w.is_contiguous() for w in _convs(ema.ema))


@pytest.mark.parametrize("cat_max_numel", [0, 2048, 1 << 30], ids=["foreach", "cat+foreach", "cat all"])
def test_each_mode_of_the_flat_step_reads_the_model_in_the_emas_element_order(cat_max_numel: int) -> None:
    """A channels_last model into a channels_last EMA; a contiguous model into a channels_last EMA (the EMA
    converted for a faster validation); a channels_last model into a contiguous EMA."""
    for model_cl, ema_cl in ((True, True), (False, True), (True, False)):
        model = _cnn(model_cl)
        ema = ModelEMA(model, decay=0.6, tau=0.01, strategy="flat", cat_max_numel=cat_max_numel)
        fmt = CL if ema_cl else torch.contiguous_format
        _check(model, [ema], ready=lambda m, fmt=fmt: m.to(memory_format=fmt))
        assert all(w.is_contiguous(memory_format=fmt) for w in _convs(ema.ema))


def test_the_cast_group_keeps_the_format_of_an_fp32_ema_of_a_bf16_model() -> None:
    """Against the cast group of the same model kept contiguous (the "gated" EMA casts by another formula)."""
    models_ = [_cnn(dtype=torch.bfloat16), _cnn(channels_last=False, dtype=torch.bfloat16)]
    emas = [ModelEMA(m, decay=0.6, tau=0.01, strategy="flat") for m in models_]
    for ema in emas:
        ema.ema.float()
    for step in range(4):
        for model, ema in zip(models_, emas):
            _move(model, step)
            ema.update(model)
    assert all("cast" in ema.modes for ema in emas)
    assert all(w.is_contiguous(memory_format=CL) and not w.is_contiguous() for w in _convs(emas[0].ema))
    want = emas[1].ema.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in emas[0].ema.state_dict().items())


@pytest.mark.parametrize("ema_cl", [False, True], ids=["contiguous EMA: fused", "channels_last EMA"])
def test_a_flattened_models_one_lerp_group_only_where_the_ema_has_its_element_order(ema_cl: bool) -> None:
    """flatten_model of a contiguous model: one lerp_ over its buffer pairs elements by place, so a
    channels_last EMA (converted after it was built) is updated in another mode, to the same values."""
    model = _cnn(channels_last=False)
    flatten_model(model)
    ema = ModelEMA(model, decay=0.6, tau=0.01)
    _check(model, [ema], ready=lambda m: m.to(memory_format=CL) if ema_cl else m)
    assert ("fused" in ema.modes) != ema_cl


def test_a_flattened_channels_last_model_and_its_ema() -> None:
    model = _cnn()
    flatten_model(model)
    ema = ModelEMA(model, decay=0.6, tau=0.01)
    _check(model, [ema])
    assert all(w.is_contiguous(memory_format=CL) for w in _convs(ema.ema))


def test_every_ema_of_a_posthoc_ema_keeps_the_format(tmp_path: Path) -> None:
    model = _cnn()
    posthoc = PostHocEMA(model, tmp_path, snapshot_every=2)
    loops = [ModelEMA(model, decay=s, strategy="gated") for s in posthoc.schedules]
    for step in range(4):
        _move(model, step)
        for ema in (posthoc, *loops):
            ema.update(model)
    for ema, loop in zip(posthoc.emas, loops):
        assert all(w.is_contiguous(memory_format=CL) and not w.is_contiguous() for w in _convs(ema))
        want = loop.ema.state_dict()
        assert all(torch.equal(v, want[k]) for k, v in ema.state_dict().items())


class _WithIndex(nn.Module):
    """A conv and a 4-D integer buffer (copied, not averaged, by the steps' counters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("index", torch.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5))


@pytest.mark.parametrize("strategy", ["flat", "gated"])
def test_an_integer_buffer_is_copied_in_the_emas_element_order(strategy: str) -> None:
    model = _WithIndex()
    ema = ModelEMA(model, decay=0.6, tau=0.01, strategy=strategy)
    ema.ema.to(memory_format=CL)  # the EMA's integer buffer channels_last, the model's contiguous
    for step in range(3):
        model.index.add_(step + 1)
        ema.update(model)
        assert torch.equal(ema.ema.index, model.index)
    assert ema.ema.index.is_contiguous(memory_format=CL) and not ema.ema.index.is_contiguous()
