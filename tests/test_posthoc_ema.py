"""``PostHocEMA``: two power-function EMAs from one read of the model, each equal to its own ``ModelEMA``,
snapshots every N updates, and a synthesized length between the two close to one tracked directly."""

from __future__ import annotations

import pytest
import torch

from ema_lab import ModelEMA, PostHocEMA, flatten_model
from ema_lab.bench import models
from ema_lab.schedules import power
from ema_lab.snapshots import list_snapshots

from .helpers import float_entries


def _train_step(model: torch.nn.Module, step: int) -> None:
    """A deterministic drift plus noise, and the BatchNorm counters moving, as training would."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for v in float_entries(model).values():
            v.add_(torch.randn(v.shape, generator=g) * 0.01 + 0.001)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.num_batches_tracked += 1


@pytest.mark.parametrize("layout", ["plain", "flattened", "half model"])
def test_both_emas_equal_their_own_model_ema_bit_for_bit(layout: str, tmp_path) -> None:
    model = models.build("tiny_cnn")
    if layout == "flattened":
        flatten_model(model)
    posthoc = PostHocEMA(model, tmp_path, sigma_rels=(0.05, 0.2), snapshot_every=4)
    direct = [ModelEMA(model, decay=power(sigma_rel=s), strategy="flat") for s in (0.05, 0.2)]
    for step in range(1, 11):
        _train_step(model, step)
        if layout == "half model" and step == 5:
            model.half()  # a conversion mid-run: both EMAs follow the rebuilt step
        posthoc.update(model)
        for ema in direct:
            ema.update(model)
    for ours, theirs in zip((posthoc.ema, posthoc.ema2), direct):
        mine, other = ours.state_dict(), theirs.ema.state_dict()
        assert mine.keys() == other.keys()
        for k in mine:
            assert torch.equal(mine[k], other[k]), k
    assert posthoc.rebuilds == (2 if layout == "half model" else 1)
    assert [s.step for s in list_snapshots(tmp_path)] == [4, 4, 8, 8]


def test_synthesis_between_the_two_lengths_is_close_to_the_ema_tracked_directly(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    posthoc = PostHocEMA(model, tmp_path, sigma_rels=(0.05, 0.10), snapshot_every=100)
    direct = ModelEMA(model, decay=power(sigma_rel=0.075))
    start = model.weight.detach().clone()
    for step in range(1, 2001):
        with torch.no_grad():  # a drifting weight: the EMA's length shows in how far it lags
            model.weight.copy_(start + step / 2000 + 0.05 * torch.randn_like(start))
        posthoc.update(model)
        direct.update(model)
    synthesized = posthoc.synthesize(0.075)["weight"]
    tracked, nearest = direct.ema.weight, posthoc.ema.weight
    gap = (tracked - synthesized).abs().max().item()
    assert gap < 0.05 * (tracked - nearest).abs().max().item()  # 5 % of the distance to a snapshot's EMA


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sigma_rels": (0.05,)}, "sigma_rels must be two lengths"),
        ({"sigma_rels": (0.05, 0.5)}, "sigma_rel"),
        ({"snapshot_every": 0}, "snapshot_every must be a positive int"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs: dict, message: str, tmp_path) -> None:
    with pytest.raises(ValueError, match=message) as info:
        PostHocEMA(torch.nn.Linear(2, 2), tmp_path, **kwargs)
    assert "\n" not in str(info.value)


def test_the_second_ema_follows_its_own_tensors_being_replaced(tmp_path) -> None:
    """.ema2's tensors moved by the user (new memory, another dtype) are laid out again, not left behind."""
    model = models.build("tiny_cnn")
    posthoc = PostHocEMA(model, tmp_path, sigma_rels=(0.05, 0.2), snapshot_every=100)
    direct = ModelEMA(model, decay=power(sigma_rel=0.2), strategy="flat")
    for step in range(1, 9):
        _train_step(model, step)
        if step == 3:
            posthoc.ema2[0].conv.weight.data = posthoc.ema2[0].conv.weight.data.clone()
        if step == 5:
            posthoc.ema2.double()  # laid out again in the first EMA's dtype
        posthoc.update(model)
        direct.update(model)
    want = direct.ema.state_dict()
    for k, v in posthoc.ema2.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_a_run_resumed_from_its_snapshots_equals_one_that_never_stopped(tmp_path) -> None:
    model, again = models.build("tiny_cnn"), models.build("tiny_cnn")
    whole = PostHocEMA(model, tmp_path / "whole", snapshot_every=4)
    first = PostHocEMA(again, tmp_path / "resumed", snapshot_every=4)
    for step in range(1, 9):
        for m, ema in ((model, whole), (again, first)):
            _train_step(m, step)
            ema.update(m)
    with pytest.raises(ValueError, match="holds snapshots up to update 8: resume with updates="):
        PostHocEMA(again, tmp_path / "resumed", snapshot_every=4)
    resumed = PostHocEMA(again, tmp_path / "resumed", snapshot_every=4, updates=8)
    for step in range(9, 13):
        for m, ema in ((model, whole), (again, resumed)):
            _train_step(m, step)
            ema.update(m)
    assert resumed.updates == whole.updates == 12
    for mine, other in ((resumed.ema, whole.ema), (resumed.ema2, whole.ema2)):
        want = other.state_dict()
        for k, v in mine.state_dict().items():
            assert torch.equal(v, want[k]), k
