"""Run by tests/trainers/test_accelerate.py: the docs/trainers.md recipe for accelerate.

``torchrun --nproc-per-node 2 accelerate_ddp.py OUT``: an uninterrupted run of STEPS steps that saves
``save_state`` after SAVE_AT, then, in the same processes, a run from other weights that ``load_state``\\s
that folder and goes on to STEPS. Each rank saves both EMAs to ``<out>/<run>-rank<r>.pt``.

``python accelerate_ddp.py OUT kill``: one process saves by the docs' ``save`` after each step and is
killed (SIGKILL) in the middle of its third ``save_state``, after the model and optimizer are written.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from ema_lab import ModelEMA
from tests.trainers.ddp_run import SAVE_AT, dataset, net


def loader() -> DataLoader:
    """ddp_run.py's data, shuffled (accelerate restores the sampler's place)."""
    return DataLoader(dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))


def prepared(seed: int, **options: object) -> tuple:
    """The recipe's start: the EMA made before prepare(), registered for checkpointing; returns
    (accelerator, model, optimizer, data, ema)."""
    accelerator = Accelerator(cpu=True, **options)
    model = net(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = ModelEMA(model, decay=0.99, tau=3)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader())
    accelerator.register_for_checkpointing(ema)
    return accelerator, model, optimizer, data, ema


def train_step(accelerator: Accelerator, model, optimizer, ema: ModelEMA, x, y) -> None:
    """One optimizer step, then the EMA's update."""
    accelerator.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    ema.update(model)


def run(out: Path, seed: int, resume: Path | None = None) -> dict:
    """The recipe: trained, saved after SAVE_AT (its buffers synced first), or resumed from that save."""
    accelerator, model, optimizer, data, ema = prepared(seed)
    if resume is not None:
        accelerator.load_state(resume)
        data = accelerator.skip_first_batches(data, ema.updates)  # 1 epoch, 1 batch a step: the docs' skip
    for x, y in data:
        train_step(accelerator, model, optimizer, ema, x, y)
        if ema.updates == SAVE_AT and resume is None:
            ema.sync_buffers()
            accelerator.save_state(out / "state")
    ema.sync_buffers()
    return ema.ema.state_dict()


def recipe() -> list[str]:
    """The Python blocks of docs/trainers.md's accelerate section: setup, loop, resume, save."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "trainers.md").read_text()
    section = text.split("\n## accelerate\n")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 4, f"expected 4 Python blocks in the accelerate section, found {len(blocks)}"
    return blocks


# The docs' save: a new folder per step, then ``latest`` names it (one atomic rename), so a save killed
# halfway leaves the last complete one named.
_names: dict = {}
exec(recipe()[3], _names)
save = _names["save"]


def killed_save(root: Path) -> None:
    """Train one process, save after each step, die in the third save's EMA (model and optimizer written)."""
    accelerator, model, optimizer, data, ema = prepared(0)
    for x, y in data:
        train_step(accelerator, model, optimizer, ema, x, y)
        if ema.updates == 3:
            ema.state_dict = lambda: os.kill(os.getpid(), signal.SIGKILL)
        save(accelerator, ema, root)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    if sys.argv[2:] == ["kill"]:
        killed_save(out)
        sys.exit("not killed")
    uninterrupted = run(out, seed=0)
    resumed = run(out, seed=3, resume=out / "state")
    rank = torch.distributed.get_rank()
    torch.save(uninterrupted, out / f"uninterrupted-rank{rank}.pt")
    torch.save(resumed, out / f"resumed-rank{rank}.pt")
