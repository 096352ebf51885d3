"""Run by tests/trainers/test_lightning.py under torchrun (2 processes, gloo): three Lightning fits, DDP.

1. ``EMACallback`` (ema_lab), 2 epochs, a checkpoint after each epoch's validation;
2. Lightning's own ``EMAWeightAveraging``, the same run;
3. ``EMACallback`` resumed from run 1's first checkpoint (``fit(ckpt_path=...)``) to the same end;
4. and 5. runs 1 and 2 without validation or checkpoints.

Each rank saves its EMA after each run to ``<out>/<run>-rank<r>.pt``; run 1's checkpoints stay in
``<out>/ckpt``. Usage: ``torchrun --nproc-per-node 2 lightning_ddp.py OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ema_lab.schedules import constant
from ema_lab.trainers.lightning import EMACallback

DECAY = 0.9


class Net(pl.LightningModule):
    """A convolution with BatchNorm: under DDP each rank's running statistics follow its own batches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )

    def training_step(self, batch: list, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: list, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(torch.randn(n, 3, 12, 12, generator=g), torch.randint(0, 4, (n,), generator=g)), 8
    )


def fit(callback: pl.Callback, out: Path, ckpt_path: str | None = None, validate: bool = True) -> pl.Trainer:
    saver = [ModelCheckpoint(dirpath=out, save_top_k=-1, filename="{epoch}")] if validate else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        callbacks=[callback, *saver],
        enable_checkpointing=validate,
        limit_val_batches=None if validate else 0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), data(64, 1), data(32, 2), ckpt_path=ckpt_path)
    return trainer


def main(out: Path) -> None:
    ours = EMACallback(decay=constant(DECAY))
    fit(ours, out / "ckpt")
    rank = dist.get_rank()
    torch.save(ours.ema.ema.state_dict(), out / f"ours-rank{rank}.pt")
    theirs = EMAWeightAveraging(decay=DECAY)
    fit(theirs, out / "theirs-ckpt")
    torch.save(theirs._average_model.module.state_dict(), out / f"lightning-rank{rank}.pt")
    resumed = EMACallback(decay=constant(DECAY))
    fit(resumed, out / "resumed-ckpt", ckpt_path=str(out / "ckpt" / "epoch=0.ckpt"))
    torch.save(resumed.ema.ema.state_dict(), out / f"resumed-rank{rank}.pt")
    unvalidated = EMACallback(decay=constant(DECAY))
    fit(unvalidated, out, validate=False)
    torch.save(unvalidated.ema.ema.state_dict(), out / f"ours-unvalidated-rank{rank}.pt")
    theirs = EMAWeightAveraging(decay=DECAY)
    fit(theirs, out, validate=False)
    torch.save(theirs._average_model.module.state_dict(), out / f"lightning-unvalidated-rank{rank}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
