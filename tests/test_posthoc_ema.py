"""``PostHocEMA``: any number of power-function EMAs from one read of the model, each equal to its own
``ModelEMA``, snapshots every N updates (an update whose save fails undone), and a synthesized length between
two close to one tracked directly."""

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


@pytest.mark.parametrize(
    "sigma_rels", [(0.05, 0.2), (0.05, 0.1, 0.15, 0.2)], ids=["2 profiles", "4 profiles"]
)
@pytest.mark.parametrize("layout", ["plain", "flattened", "half model"])
def test_every_ema_equals_its_own_model_ema_bit_for_bit(layout: str, sigma_rels: tuple, tmp_path) -> None:
    model = models.build("tiny_cnn")
    if layout == "flattened":
        flatten_model(model)
    posthoc = PostHocEMA(model, tmp_path, sigma_rels=sigma_rels, snapshot_every=4)
    direct = [ModelEMA(model, decay=power(sigma_rel=s), strategy="flat") for s in sigma_rels]
    for step in range(1, 11):
        _train_step(model, step)
        if layout == "half model" and step == 5:
            model.half()  # a conversion mid-run: both EMAs follow the rebuilt step
        posthoc.update(model)
        for ema in direct:
            ema.update(model)
    assert len(posthoc.emas) == len(direct) and posthoc.ema is posthoc.emas[0]
    for ours, theirs in zip(posthoc.emas, direct):
        mine, other = ours.state_dict(), theirs.ema.state_dict()
        assert mine.keys() == other.keys()
        for k in mine:
            assert torch.equal(mine[k], other[k]), k
    assert posthoc.rebuilds == (2 if layout == "half model" else 1)
    assert [s.step for s in list_snapshots(tmp_path)] == [4] * len(sigma_rels) + [8] * len(sigma_rels)


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
        ({"sigma_rels": ()}, "sigma_rels must be a non-empty sequence of lengths"),
        ({"sigma_rels": 0.05}, "sigma_rels must be a non-empty sequence of lengths"),
        ({"sigma_rels": (0.05, 0.05)}, "sigma_rels must be distinct profiles"),
        ({"sigma_rels": (0.05, 0.5)}, "sigma_rel must be in"),
        ({"snapshot_every": 0}, "snapshot_every must be an int >= 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs: dict, message: str, tmp_path) -> None:
    with pytest.raises(ValueError, match=message) as info:
        PostHocEMA(torch.nn.Linear(2, 2), tmp_path / "run", **kwargs)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_the_second_ema_follows_its_own_tensors_being_replaced(tmp_path) -> None:
    """A further EMA's tensors moved by the user (new memory, another dtype) are laid out again."""
    model = models.build("tiny_cnn")
    posthoc = PostHocEMA(model, tmp_path, sigma_rels=(0.05, 0.2), snapshot_every=100)
    direct = ModelEMA(model, decay=power(sigma_rel=0.2), strategy="flat")
    for step in range(1, 9):
        _train_step(model, step)
        if step == 3:
            posthoc.emas[1][0].conv.weight.data = posthoc.emas[1][0].conv.weight.data.clone()
        if step == 5:
            posthoc.emas[1].double()  # laid out again in the first EMA's dtype
        posthoc.update(model)
        direct.update(model)
    want = direct.ema.state_dict()
    for k, v in posthoc.emas[1].state_dict().items():
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
    for mine, other in ((resumed.ema, whole.ema), (resumed.emas[1], whole.emas[1])):
        want = other.state_dict()
        for k, v in mine.state_dict().items():
            assert torch.equal(v, want[k]), k


def test_an_update_whose_save_fails_is_undone_and_a_retry_applies_it_once(tmp_path, monkeypatch) -> None:
    model, twin = models.build("tiny_cnn"), models.build("tiny_cnn")
    failing = PostHocEMA(model, tmp_path / "failing", snapshot_every=2)
    whole = PostHocEMA(twin, tmp_path / "whole", snapshot_every=2)
    for step in (1, 2):
        for m, ema in ((model, failing), (twin, whole)):
            _train_step(m, step)
            ema.update(m)
    before = [{k: v.clone() for k, v in ema.state_dict().items()} for ema in failing.emas]
    for m in (model, twin):
        _train_step(m, 3)
    failing.update(model)
    whole.update(twin)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr("ema_lab.posthoc.save_step", disk_full)
        _train_step(model, 4)
        with pytest.raises(OSError, match="No space left"):
            failing.update(model)
    assert failing.updates == 3
    for ema, old in zip(failing.emas, before):
        assert any(not torch.equal(v, old[k]) for k, v in ema.state_dict().items())  # update 3 stayed
    failing.update(model)  # the retry, once space is back
    _train_step(twin, 4)
    whole.update(twin)
    assert failing.updates == whole.updates == 4 and failing.rebuilds == 1
    for mine, other in zip(failing.emas, whole.emas):
        want = other.state_dict()
        for k, v in mine.state_dict().items():
            assert torch.equal(v, want[k]), k
