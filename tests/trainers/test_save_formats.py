"""An EMA through every way users save one, with and without ``ema_lab.flatten_model(model)``: torch.save,
safetensors' save_file/save_model, accelerate's save_model and save_state/load_state, a Lightning checkpoint
and timm's CheckpointSaver. Each round trip loads into fresh objects and compares every entry, bitwise.

The EMA's tensors lie in one buffer (strategy "flat", what "auto" picks here), each on a storage of its own,
and a flattened model's state_dict() gives copies: safetensors' tooling, which takes tensors sharing a storage
for tied weights, keeps every entry.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

for _name in ("timm", "lightning", "accelerate", "safetensors"):
    pytest.importorskip(
        _name, reason=f"{_name} is not installed: the test-only extra trainers (nox -s trainers)"
    )

import lightning.pytorch as pl
import safetensors.torch
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import load_checkpoint_in_model
from timm.models import load_checkpoint, resume_checkpoint
from timm.utils import CheckpointSaver
from torch import nn

from ema_lab import ModelEMA, flatten_model
from ema_lab.schedules import constant
from ema_lab.trainers.lightning import EMACallback
from ema_lab.trainers.timm import ModelEmaV3

from .ddp_run import net
from .lightning_ddp import DECAY, Net, data

Saved = dict[str, dict[str, torch.Tensor]]  # what was saved and what came back, by part ("ema", "model")


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)
    ]


def trained(flat: bool, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, ModelEMA]:
    """ddp_run's net (convolution, BatchNorm, linear: 9 entries), flattened or not, its EMA after 3 steps."""
    model = net(seed)
    if flat:
        flatten_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = ModelEMA(model, decay=0.9, tau=3)
    for x, y in batches():
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
    return model, optimizer, ema


def copied(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def fresh() -> nn.Module:
    """Other weights and statistics than any trained one's: an entry not loaded stays different."""
    return net(7)


def via_torch_save(flat: bool, folder: Path) -> Saved:
    _, _, ema = trained(flat)
    torch.save(ema.ema.state_dict(), folder / "ema.pt")
    return {"ema": (copied(ema.ema), torch.load(folder / "ema.pt", weights_only=True))}


def via_save_file(flat: bool, folder: Path) -> Saved:
    _, _, ema = trained(flat)
    safetensors.torch.save_file(ema.ema.state_dict(), folder / "ema.safetensors")
    return {"ema": (copied(ema.ema), safetensors.torch.load_file(folder / "ema.safetensors"))}


def via_save_model(flat: bool, folder: Path) -> Saved:
    _, _, ema = trained(flat)
    safetensors.torch.save_model(ema.ema, folder / "ema.safetensors")
    loaded = fresh()
    safetensors.torch.load_model(loaded, folder / "ema.safetensors")
    return {"ema": (copied(ema.ema), copied(loaded))}


def accelerate_save_model(safe_serialization: bool) -> Callable[[bool, Path], Saved]:
    def via(flat: bool, folder: Path) -> Saved:
        _, _, ema = trained(flat)
        Accelerator(cpu=True).save_model(ema.ema, folder, safe_serialization=safe_serialization)
        loaded = fresh()
        load_checkpoint_in_model(loaded, folder)
        return {"ema": (copied(ema.ema), copied(loaded))}

    return via


def via_save_state(flat: bool, folder: Path) -> Saved:
    """docs/trainers.md's accelerate recipe: the EMA registered for checkpointing; loaded by fresh ones."""
    model, optimizer, ema = trained(flat)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(ema)
    accelerator.save_state(folder)
    saved = {"ema": copied(ema.ema), "model": copied(model)}
    AcceleratorState._reset_state(True)
    model, optimizer, ema = trained(flat, seed=7)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(ema)
    accelerator.load_state(folder)
    return {"ema": (saved["ema"], copied(ema.ema)), "model": (saved["model"], copied(model))}


class FlatNet(Net):
    """lightning_ddp's Net, flattened when made (before Lightning builds its optimizer and the EMA)."""

    def __init__(self) -> None:
        super().__init__()
        flatten_model(self)


def lightning_fit(flat: bool, root: Path, ckpt_path: Path | None = None) -> tuple[pl.Trainer, EMACallback]:
    callback = EMACallback(decay=constant(DECAY))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(FlatNet() if flat else Net(), data(64, 1), ckpt_path=ckpt_path)
    return trainer, callback


def via_lightning(flat: bool, folder: Path) -> Saved:
    """trainer.save_checkpoint, then fit(ckpt_path=) with nothing left to train: the EMA and the model it
    loads (into a model with the initial weights, which 3 steps changed)."""
    trainer, callback = lightning_fit(flat, folder)
    trainer.save_checkpoint(folder / "last.ckpt")
    resumed, again = lightning_fit(flat, folder, ckpt_path=folder / "last.ckpt")
    assert resumed.global_step == trainer.global_step == 3  # nothing trained after the load
    return {
        "ema": (copied(callback.ema.ema), copied(again.ema.ema)),
        "model": (copied(trainer.lightning_module), copied(resumed.lightning_module)),
    }


def via_timm_saver(flat: bool, folder: Path) -> Saved:
    """timm's CheckpointSaver with ema_lab's ModelEmaV3, loaded back as train.py does: resume_checkpoint
    for the model, load_checkpoint(model_ema.module, use_ema=True) for the EMA."""
    model = net(0)
    if flat:
        flatten_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model_ema = ModelEmaV3(model, decay=0.9)
    for step, (x, y) in enumerate(batches(), 1):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        model_ema.update(model, step=step)
    saver = CheckpointSaver(
        model,
        optimizer,
        args=argparse.Namespace(model="net"),
        model_ema=model_ema,
        checkpoint_dir=str(folder),
        recovery_dir=str(folder),
    )
    saver.save_checkpoint(0, metric=0.0)
    path = saver.checkpoint_files[0][0]
    loaded_model, loaded_ema = fresh(), ModelEmaV3(fresh(), decay=0.9)
    resume_checkpoint(loaded_model, path, optimizer=torch.optim.SGD(loaded_model.parameters(), lr=0.1))
    load_checkpoint(loaded_ema.module, path, use_ema=True)
    return {
        "ema": (copied(model_ema.module), copied(loaded_ema.module)),
        "model": (copied(model), copied(loaded_model)),
    }


FORMATS: dict[str, Callable[[bool, Path], Saved]] = {  # name: its round trip
    "torch.save": via_torch_save,
    "safetensors.save_file": via_save_file,
    "safetensors.save_model": via_save_model,
    "accelerate.save_model": accelerate_save_model(True),
    "accelerate.save_model(safe_serialization=False)": accelerate_save_model(False),
    "accelerate.save_state": via_save_state,
    "lightning": via_lightning,
    "timm.CheckpointSaver": via_timm_saver,
}


def cases() -> list:
    return [
        pytest.param(name, flat, id=f"{name}-{'flat' if flat else 'plain'}")
        for name in FORMATS
        for flat in (False, True)
    ]


@pytest.fixture
def accelerate_reset() -> None:
    """accelerate keeps its state in process-wide singletons: reset after the test."""
    yield
    AcceleratorState._reset_state(True)


@pytest.mark.parametrize("name, flat", cases())
def test_every_entry_comes_back(tmp_path: Path, accelerate_reset: None, name: str, flat: bool) -> None:
    """Saved, loaded into fresh objects: the same entries (9 of 9), bitwise, for the EMA and, where the
    format saves it, the model."""
    round_trip = FORMATS[name]
    for part, (saved, loaded) in round_trip(flat, tmp_path).items():
        assert len(saved) == 9 and sorted(loaded) == sorted(saved), f"{part}: {len(loaded)} of {len(saved)}"
        different = [k for k in saved if not torch.equal(saved[k], loaded[k])]
        assert different == [], f"{part}: {len(different)} of {len(saved)} entries differ: {different}"
