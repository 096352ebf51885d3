"""The short training run with ModelEMA as a drop-in: reproducible, and the EMA's eval loss ends lower."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ema_lab.lessons.training import train_with_ema


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny matmuls: a second intra-op thread only adds stalls when other processes share the 2 cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_same_seed_same_losses() -> None:
    a = train_with_ema(epochs=3, steps_per_epoch=10)
    b = train_with_ema(epochs=3, steps_per_epoch=10)
    assert a == b
    assert a.ema_updates == 30
    assert len(a.raw_loss) == len(a.ema_loss) == 3


def test_different_seeds_differ() -> None:
    assert train_with_ema(epochs=2, steps_per_epoch=5, seed=0) != train_with_ema(
        epochs=2, steps_per_epoch=5, seed=1
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ema_ends_below_raw(seed: int) -> None:
    # Observed on torch 2.13 CPU: last-epoch EMA loss 0.012-0.015 vs raw 0.019-0.027 for seeds 0-2;
    # the mean of the last five epochs separates by a similar margin, so both are asserted.
    run = train_with_ema(seed=seed)
    assert run.ema_loss[-1] < run.raw_loss[-1]
    assert sum(run.ema_loss[-5:]) < sum(run.raw_loss[-5:])
    assert run.ema_loss[-1] < run.ema_loss[0]  # it learned something


@pytest.mark.parametrize("strategy", ["loop", "foreach", "gated"])
def test_strategies_agree(strategy: str) -> None:
    ref = train_with_ema(epochs=2, steps_per_epoch=10, strategy="auto")
    run = train_with_ema(epochs=2, steps_per_epoch=10, strategy=strategy)
    assert run.raw_loss == ref.raw_loss  # the EMA never feeds back into training
    assert run.ema_loss == pytest.approx(ref.ema_loss, rel=1e-4)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size >= 2"):
        train_with_ema(batch_size=1)
