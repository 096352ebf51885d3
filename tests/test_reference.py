"""strategy_errors: every strategy stays within float32 rounding of an independent float64 EMA."""

from __future__ import annotations

import pytest
import torch

from ema_lab.bench import models
from ema_lab.bench.reference import STRATEGY_FUNCTIONS, strategy_errors


def test_all_strategies_close_to_float64_and_model_untouched() -> None:
    model = models.build("tiny_transformer")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    errors = strategy_errors(model, steps=5)
    assert set(errors) == set(STRATEGY_FUNCTIONS)
    eps = torch.finfo(torch.float32).eps
    assert all(0 <= e < 8 * eps * 6 for e in errors.values()), errors
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_reproducible_and_nonzero() -> None:
    model = models.build("tiny_cnn")
    a, b = strategy_errors(model, steps=3, seed=1), strategy_errors(model, steps=3, seed=1)
    assert a == b
    assert max(a.values()) > 0  # float32 rounding is really measured, not a copy of the reference


def test_rejects_zero_steps() -> None:
    with pytest.raises(ValueError, match="steps must be >= 1"):
        strategy_errors(models.build("tiny_cnn"), steps=0)


def test_model_ema_errors_cover_every_strategy_and_leave_the_model_alone() -> None:
    from ema_lab.bench import models
    from ema_lab.bench.reference import model_ema_errors
    from ema_lab.ema import STRATEGIES

    model = models.build("tiny_transformer")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    errors = model_ema_errors(model, steps=5)
    assert list(errors) == list(STRATEGIES)
    assert all(0 <= e <= 1e-5 for e in errors.values())  # float32 rounding of values up to ~5
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
