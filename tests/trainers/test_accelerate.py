"""docs/trainers.md's accelerate recipe: ``register_for_checkpointing(ema)``, so ``save_state``/``load_state``
carry the EMA. Two processes (gloo) with BatchNorm, resumed bitwise; resumed on one process; a checkpoint of
another model or schedule refused; a process killed inside ``save_state``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "accelerate", reason="accelerate is not installed: the test-only extra trainers (nox -s trainers)"
)

import torch
from accelerate.state import AcceleratorState

from ema_lab import ModelEMA

from ..processes import leftovers, marked_env
from .accelerate_ddp import prepared
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
