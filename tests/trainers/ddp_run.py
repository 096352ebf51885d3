"""Run by tests/trainers/test_ddp.py: docs/trainers.md's plain DDP recipe, 2 processes (gloo), torch alone.

``torchrun --nproc-per-node 2 ddp_run.py OUT``: an uninterrupted run of STEPS steps that saves model,
optimizer and EMA after SAVE_AT (rank 0, written to a temporary file and renamed), then, in the same
processes, a run from other weights that loads that file on every rank and goes on to STEPS. Each rank
saves both EMAs to ``<out>/<run>-rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ema_lab import ModelEMA

STEPS, SAVE_AT = 8, 4


def net(seed: int) -> nn.Module:
    """A convolution with BatchNorm: under DDP each rank's running statistics follow its own batches."""
    torch.manual_seed(seed)
    layers = [nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers, nn.Linear(8, 4))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = 2 * 4 * STEPS  # 2 ranks, 4 a batch
    return TensorDataset(torch.randn(n, 3, 12, 12, generator=g), torch.randint(0, 4, (n,), generator=g))


def run(out: Path, seed: int, resume: Path | None = None) -> dict:
    """The recipe: the EMA of the DDP model, updated after each step, synced and saved by rank 0."""
    model = DistributedDataParallel(net(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = ModelEMA(model, decay=0.99, tau=3)
    if resume is not None:
        state = torch.load(resume, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        ema.load_state_dict(state["ema"])
    data = dataset()
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    for i, (x, y) in enumerate(loader, 1):
        if i <= ema.updates:  # the batches the checkpoint has seen
            continue
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
        if ema.updates == SAVE_AT and resume is None:
            ema.sync_buffers()
            if dist.get_rank() == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "ema": ema.state_dict()}, out / "state.tmp")
                os.replace(out / "state.tmp", out / "state.pt")
            dist.barrier()
    ema.sync_buffers()
    return ema.ema.state_dict()


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = Path(sys.argv[1])
    uninterrupted = run(out, seed=0)
    resumed = run(out, seed=3, resume=out / "state.pt")
    rank = dist.get_rank()
    torch.save(uninterrupted, out / f"uninterrupted-rank{rank}.pt")
    torch.save(resumed, out / f"resumed-rank{rank}.pt")
    dist.destroy_process_group()
