"""model_ema_errors: every ModelEMA strategy stays within float32 rounding of an independent float64 EMA."""

from __future__ import annotations

import torch

from ema_lab.bench import models


def test_model_ema_errors_cover_every_strategy_and_leave_the_model_alone() -> None:
    from ema_lab.bench.reference import model_ema_errors
    from ema_lab.ema import STRATEGIES

    model = models.build("tiny_transformer")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    errors = model_ema_errors(model, steps=5)
    assert list(errors) == list(STRATEGIES)
    assert all(0 <= e <= 1e-5 for e in errors.values())  # float32 rounding of values up to ~5
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
