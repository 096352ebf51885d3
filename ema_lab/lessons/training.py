"""A short, real training run with :class:`ema_lab.ModelEMA` as a drop-in: raw vs EMA eval loss per epoch.

The task is deliberately small (a BatchNorm MLP regressing a smooth function from noisy labels,
plain SGD with a large step) so that it runs in a couple of seconds on a laptop CPU and the
optimizer's noise is visible: the raw weights jitter around the optimum, the EMA averages the
jitter away. Everything is drawn from generators seeded by ``seed``, so a run is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..ema import ModelEMA

__all__ = ["train_with_ema"]


@dataclass(frozen=True)
class TrainingRun:
    """Per-epoch eval losses (mean squared error on held-out clean targets) of the raw model and its EMA."""

    raw_loss: list[float]
    ema_loss: list[float]
    steps_per_epoch: int
    ema_updates: int


def synthetic_regression(
    n: int, features: int = 8, noise: float = 0.5, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``n`` samples of a fixed smooth function of ``features`` inputs, plus Gaussian label noise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, generator=torch.Generator().manual_seed(1234))  # same function for every seed
    x = torch.randn(n, features, generator=g)
    y = torch.sin(x @ w / features**0.5) + 0.5 * torch.tanh(x[:, 0] * x[:, 1])
    return x, (y + noise * torch.randn(n, generator=g)).unsqueeze(1)


def tiny_mlp(features: int = 8, hidden: int = 64) -> nn.Module:
    """Linear-BatchNorm-SiLU MLP: float parameters plus BatchNorm buffers, one of them an integer counter."""
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.BatchNorm1d(hidden),
        nn.SiLU(),
        nn.Linear(hidden, hidden),
        nn.SiLU(),
        nn.Linear(hidden, 1),
    )


@torch.no_grad()
def _eval_loss(model: nn.Module, x: Tensor, y: Tensor) -> float:
    was_training = model.training
    model.eval()
    loss = nn.functional.mse_loss(model(x), y).item()
    model.train(was_training)
    return loss


def train_with_ema(
    epochs: int = 15,
    steps_per_epoch: int = 20,
    batch_size: int = 32,
    lr: float = 0.2,
    decay: float = 0.99,
    tau: float = 50.0,
    seed: int = 0,
    strategy: str = "auto",
) -> TrainingRun:
    """Train :func:`tiny_mlp` with SGD, ``ModelEMA.update`` after every step; eval both after each epoch."""
    if epochs < 1 or steps_per_epoch < 1 or batch_size < 2:
        raise ValueError(
            f"need epochs >= 1, steps_per_epoch >= 1 and batch_size >= 2 (BatchNorm), "
            f"got {epochs}, {steps_per_epoch}, {batch_size}"
        )
    x_train, y_train = synthetic_regression(epochs * steps_per_epoch * batch_size, seed=seed)
    # Eval against the noise-free function: the loss measures the model, not the label noise.
    x_eval, y_eval = synthetic_regression(1024, noise=0.0, seed=seed + 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tiny_mlp()
    ema = ModelEMA(model, decay=decay, tau=tau, strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    raw_loss, ema_loss = [], []
    model.train()
    for epoch in range(epochs):
        for step in range(steps_per_epoch):
            i = (epoch * steps_per_epoch + step) * batch_size
            xb, yb = x_train[i : i + batch_size], y_train[i : i + batch_size]
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            ema.update(model)
        raw_loss.append(_eval_loss(model, x_eval, y_eval))
        ema_loss.append(_eval_loss(ema.ema, x_eval, y_eval))
    return TrainingRun(raw_loss, ema_loss, steps_per_epoch, ema.updates)
