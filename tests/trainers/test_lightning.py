"""ema_lab.trainers.lightning.EMACallback in Lightning: DDP on 2 processes (gloo) with BatchNorm, beside
Lightning's own EMAWeightAveraging, checkpointed and resumed; one process for gradient accumulation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "lightning", reason="lightning is not installed: the test-only extra trainers (nox -s trainers)"
)

import lightning.pytorch as pl
import torch

from ema_lab.schedules import constant
from ema_lab.trainers.lightning import EMACallback

from ..processes import leftovers, marked_env
from .lightning_ddp import DECAY, Net, data

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    """The three fits of lightning_ddp.py under torchrun, 2 processes: their output folder."""
    out = tmp_path_factory.mktemp("lightning_ddp")
    env, mark = marked_env({**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = subprocess.run(
        [*command, str(Path(__file__).with_name("lightning_ddp.py")), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not leftovers(mark), "torchrun left processes behind"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def load(folder: Path, name: str) -> dict:
    return torch.load(folder / name, weights_only=True)


def _trainer(tmp_path: Path, **options: object) -> pl.Trainer:
    """One CPU process, quiet: no logger, checkpoint files, progress bar or model summary."""
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **options,
    )


@pytest.mark.parametrize("run", ["ours", "ours-unvalidated"])
def test_every_rank_holds_the_same_ema(ddp_runs: Path, run: str) -> None:
    """BatchNorm's statistics differ between ranks; the EMA's are rank 0's on both (sync_buffers), with or
    without validation and checkpoints."""
    rank0, rank1 = load(ddp_runs, f"{run}-rank0.pt"), load(ddp_runs, f"{run}-rank1.pt")
    assert [k for k in rank0 if not torch.equal(rank0[k], rank1[k])] == []
    assert "net.1.running_var" in rank0


def test_lightnings_own_ema_differs_between_ranks_without_validation(ddp_runs: Path) -> None:
    """Why the callback syncs when fit ends: EMAWeightAveraging's buffers end equal only where a validation
    ran after the last update (at each validation DDP's forward broadcasts rank 0's buffers into the model,
    which then holds the average)."""
    for run, equal in (("lightning", True), ("lightning-unvalidated", False)):
        rank0, rank1 = load(ddp_runs, f"{run}-rank0.pt"), load(ddp_runs, f"{run}-rank1.pt")
        assert torch.equal(rank0["net.1.running_var"], rank1["net.1.running_var"]) is equal, run


def test_close_to_lightnings_own_ema(ddp_runs: Path) -> None:
    """The same decays as EMAWeightAveraging(decay=0.9): its ``decay * e + (1 - decay) * p`` and ema_lab's
    ``lerp`` round differently (a few float32 ulps over 8 updates); its integer counter is averaged too."""
    ours, theirs = load(ddp_runs, "ours-rank0.pt"), load(ddp_runs, "lightning-rank0.pt")
    for k, v in ours.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, theirs[k], rtol=0, atol=1e-6, msg=k)
    assert ours["net.1.num_batches_tracked"] == 8  # copied from the model: 8 steps of batches on this rank


def test_saved_in_the_checkpoint_and_resumed_bitwise(ddp_runs: Path) -> None:
    """Rank 0's checkpoint holds the EMA; fit(ckpt_path=) from the first epoch's ends bitwise where the
    uninterrupted run did, on both ranks."""
    saved = torch.load(ddp_runs / "ckpt" / "epoch=1.ckpt", weights_only=True)["callbacks"]["EMACallback"]
    assert saved["updates"] == 8 and saved["schedules"] == [repr(constant(DECAY))]
    for rank in (0, 1):
        final, resumed = load(ddp_runs, f"ours-rank{rank}.pt"), load(ddp_runs, f"resumed-rank{rank}.pt")
        assert [k for k in final if not torch.equal(final[k], resumed[k])] == []
        assert [k for k in final if not torch.equal(final[k], saved["emas"][0][k])] == []


def test_once_per_optimizer_step_and_validation_leaves_the_weights(tmp_path: Path) -> None:
    """With gradient accumulation the EMA moves once per optimizer step; validating mid-epoch with the
    EMA's weights puts the training weights back exactly."""

    class Checked(Net):
        def on_validation_start(self) -> None:
            self.before = {k: v.clone() for k, v in self.state_dict().items()}

        def on_validation_end(self) -> None:
            after = self.state_dict()
            assert all(torch.equal(after[k], v) for k, v in self.before.items())
            self.validated = getattr(self, "validated", 0) + 1

    callback = EMACallback(decay=constant(DECAY))
    trainer = _trainer(
        tmp_path,
        max_epochs=1,
        accumulate_grad_batches=2,
        val_check_interval=4,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        callbacks=[callback],
    )
    model = Checked()
    trainer.fit(model, data(64, 1), data(32, 2))
    assert trainer.global_step == 4 and callback.ema.updates == 4  # 8 batches, 2 per optimizer step
    assert model.validated == 2
    assert not torch.equal(callback.ema.ema.net[0].weight, model.net[0].weight)


def test_a_checkpoint_of_another_schedule_is_refused(ddp_runs: Path, tmp_path: Path) -> None:
    """fit(ckpt_path=) with an EMA of another decay: Lightning stops with ModelEMA's one-line error."""
    trainer = _trainer(
        tmp_path,
        max_epochs=3,
        callbacks=[EMACallback(decay=constant(0.5))],
    )
    with pytest.raises(ValueError, match="schedule") as error:
        trainer.fit(Net(), data(64, 1), data(32, 2), ckpt_path=str(ddp_runs / "ckpt" / "epoch=0.ckpt"))
    assert "\n" not in str(error.value)


def test_resumed_on_one_process(ddp_runs: Path, tmp_path: Path) -> None:
    """The 2-rank checkpoint resumes on one process: the EMA goes on from its saved count, once per step."""
    callback = EMACallback(decay=constant(DECAY))
    trainer = _trainer(
        tmp_path,
        max_epochs=2,
        callbacks=[callback],
    )
    trainer.fit(Net(), data(64, 1), data(32, 2), ckpt_path=str(ddp_runs / "ckpt" / "epoch=0.ckpt"))
    assert (
        trainer.global_step == 4 + 8 and callback.ema.updates == trainer.global_step
    )  # 4 steps a rank, 8 alone
