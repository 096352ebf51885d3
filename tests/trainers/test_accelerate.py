"""docs/trainers.md's accelerate recipe: ``register_for_checkpointing(ema)``, so ``save_state``/``load_state``
carry the EMA. Two processes (gloo) with BatchNorm, resumed bitwise; resumed on one process; a checkpoint of
another model or schedule refused; a process killed inside ``save_state``."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "accelerate", reason="accelerate is not installed: the test-only extra trainers (nox -s trainers)"
)

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader, TensorDataset

from ema_lab import ModelEMA

from ..processes import leftovers, marked_env
from .accelerate_ddp import prepared, recipe
from .ddp_run import SAVE_AT, net

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("accelerate_ddp.py"))


def run_script(*args: str) -> subprocess.CompletedProcess:
    env, mark = marked_env({**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    run = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
    assert not leftovers(mark), "the run left processes behind"
    return run


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    """accelerate_ddp.py under torchrun, 2 processes: its output folder."""
    out = tmp_path_factory.mktemp("accelerate_ddp")
    run = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


@pytest.fixture
def one_process() -> None:
    """accelerate keeps its state in process-wide singletons: reset after the test."""
    yield
    AcceleratorState._reset_state(True)


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def different(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_resumed_run_equals_the_uninterrupted_one(ddp_runs: Path) -> None:
    """load_state from other weights, then the same batches: bitwise the same EMA, on both ranks."""
    final = load(ddp_runs / "uninterrupted-rank0.pt")
    assert different(final, load(ddp_runs / "uninterrupted-rank1.pt")) == []
    for rank in (0, 1):
        assert different(final, load(ddp_runs / f"resumed-rank{rank}.pt")) == []
    saved = torch.load(ddp_runs / "state" / "custom_checkpoint_0.pkl", weights_only=True)
    assert saved["updates"] == SAVE_AT


def test_resumed_on_one_process(ddp_runs: Path, one_process: None) -> None:
    """The 2-rank state loads on 1 process: the EMA as saved, its update count, and it goes on."""
    accelerator, model, _, _, ema = prepared(5)
    accelerator.load_state(ddp_runs / "state")
    saved = torch.load(ddp_runs / "state" / "custom_checkpoint_0.pkl", weights_only=True)
    assert ema.updates == SAVE_AT and different(ema.ema.state_dict(), saved["emas"][0]) == []
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    ema.update(model)
    assert ema.updates == SAVE_AT + 1 and different(ema.ema.state_dict(), before) != []


@pytest.mark.parametrize(
    "other", [lambda: ModelEMA(torch.nn.Sequential(net(0), torch.nn.ReLU())), lambda: ModelEMA(net(0), 0.999)]
)
def test_a_checkpoint_of_another_model_or_schedule_is_refused(ddp_runs: Path, other) -> None:
    """load_custom_state's call, by hand: a one-line ValueError, the EMA left as it was."""
    ema = other()
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    with pytest.raises(ValueError) as error:
        ema.load_state_dict(torch.load(ddp_runs / "state" / "custom_checkpoint_0.pkl", weights_only=False))
    assert "\n" not in str(error.value)
    assert ema.updates == 0 and different(ema.ema.state_dict(), before) == []


def test_killed_inside_save_state(tmp_path: Path, one_process: None) -> None:
    """accelerate writes the model and optimizer first: a save killed in the EMA's leaves a folder with new
    weights and no (or an old) EMA. The recipe's ``latest`` still names the last complete save: loading it
    gives an EMA and a model of the same step."""
    run = run_script(SCRIPT, str(tmp_path), "kill")
    assert run.returncode == -9, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "latest").read_text() == "step-2"
    assert not (tmp_path / "step-3" / "custom_checkpoint_0.pkl").exists()  # the killed save's folder
    accelerator, _, _, _, ema = prepared(5)
    accelerator.load_state(tmp_path / (tmp_path / "latest").read_text())
    assert ema.updates == 2  # the EMA of the step whose model was loaded


def test_gradient_accumulation_updates_once_per_optimizer_step(one_process: None) -> None:
    """The recipe's ``if accelerator.sync_gradients: ema.update(model)``: 2 micro-batches per step, one update
    (without the guard the EMA would move on every micro-batch, twice per optimizer step)."""
    accelerator, model, optimizer, data, ema = prepared(0, gradient_accumulation_steps=2)
    calls = 0
    for x, y in data:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        calls += 1
        if accelerator.sync_gradients:
            ema.update(model)
    assert calls == 16 and ema.updates == 8


def docs_run(root: Path, seed: int, batches: int, resume: bool = False) -> dict:
    """docs/trainers.md's accelerate blocks as a reader runs them: gradient accumulation 2, 3 epochs of
    ``batches`` shuffled batches, a save after every optimizer step; ``resume``: the resume line first."""
    setup, loop, resume_line, save = recipe()
    g = torch.Generator().manual_seed(1)
    n = 4 * batches
    data = TensorDataset(torch.randn(n, 3, 12, 12, generator=g), torch.randint(0, 4, (n,), generator=g))
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=5)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=config)
    model = net(seed)
    names = {
        "accelerator": accelerator,
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "loader": DataLoader(data, batch_size=4, shuffle=True),
        "loss_fn": F.cross_entropy,
        "epochs": 3,
        "root": root,
        "save_every": 1,
    }
    for block in (setup, save, resume_line, loop) if resume else (setup, save, loop):
        exec(block, names)
    ema, model = names["ema"], accelerator.unwrap_model(names["model"])
    state = {"updates": torch.tensor(ema.updates)}
    return {**state, **{f"ema.{k}": v for k, v in ema.ema.state_dict().items()}, **model.state_dict()}


@pytest.mark.parametrize("batches", [8, 7])  # 7: the epoch's last optimizer step takes one batch
def test_the_docs_loop_resumes_bitwise_across_epochs(tmp_path: Path, one_process: None, batches: int) -> None:
    """The docs' loop cut after each of several saves (mid-epoch, at an epoch's end, in the next epoch) and
    resumed by the docs' resume line: the same updates and bitwise the same EMA and model as the uncut run."""
    uncut = docs_run(tmp_path / "uncut", 0, batches)
    assert uncut["updates"] == 3 * math.ceil(batches / 2)  # 3 epochs
    for cut in (2, 4, 5, 7):
        root = tmp_path / f"cut-{cut}"
        shutil.copytree(tmp_path / "uncut" / f"step-{cut}", root / f"step-{cut}")
        (root / "latest").write_text(f"step-{cut}")
        AcceleratorState._reset_state(True)
        resumed = docs_run(root, 3, batches, resume=True)  # other weights: load_state replaces them
        assert different(resumed, uncut) == [], f"cut at {cut}"  # the update count included
