"""What users do to their model (and its EMA) mid-run, each checked against a plain reference EMA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ema_lab import ModelEMA, PostHocEMA, ShardedModelEMA


@pytest.mark.parametrize("cls", [ModelEMA, PostHocEMA, ShardedModelEMA])
def test_a_lazy_model_is_refused_in_one_line_naming_the_fix(cls: type, tmp_path) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(4))
    args = (tmp_path,) if cls is PostHocEMA else ()
    message = r"^the model's '1.weight' is an uninitialized lazy parameter: run one forward pass with a batch"
    with pytest.raises(ValueError, match=message) as info:
        cls(model, *args)
    assert "\n" not in str(info.value)
    model(torch.randn(2, 3))  # initialized: the EMA is made
    assert torch.equal(cls(model, *args).ema.state_dict()["1.weight"], model[1].weight)
