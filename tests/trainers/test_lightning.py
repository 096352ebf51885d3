"""ema_lab.trainers.lightning.EMACallback in Lightning: DDP on 2 processes (gloo) with BatchNorm, beside
Lightning's own EMAWeightAveraging, checkpointed and resumed; one process for gradient accumulation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip(
    "lightning", reason="lightning is not installed: the test-only extra trainers (nox -s trainers)"
)

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment

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
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **{**quiet, **options},
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


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the tensors the module computes with, read from them, not from state_dict() (which gives
    the training weights while the callback has the EMA in the model)."""
    return {k: v.clone() for k, v in [*module.named_parameters(), *module.named_buffers()]}


def same(a: dict, b: dict) -> bool:
    """Equal keys and bitwise equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class InValidation(Net):
    """At its first validation_step after training began (the EMA in the model), runs ``act(trainer)``: a
    save, a signal or an exception; keeps the training weights and the EMA of that moment."""

    def __init__(self, act: Callable[[pl.Trainer], None] = lambda trainer: None) -> None:
        super().__init__()
        self.act = act
        self.acted = False

    def on_validation_start(self) -> None:  # before the callback's swap (on_validation_epoch_start)
        if not self.acted:
            self.training_weights = weights(self)

    def on_train_start(self) -> None:  # after a checkpoint is loaded: what training goes on from
        self.start_weights = weights(self)

    def validation_step(self, batch: list, batch_idx: int) -> None:
        if not self.acted and not self.trainer.sanity_checking:
            self.acted = True
            self.ema_weights = weights(self)
            self.act(self.trainer)
        super().validation_step(batch, batch_idx)


def _fit(tmp_path: Path, model: Net, ckpt_path: Path | None = None, **options: object) -> EMACallback:
    """Two epochs, validated after each (2 batches), with the callback: returns it."""
    callback = EMACallback(decay=constant(DECAY))
    options = {"callbacks": [callback], "num_sanity_val_steps": 2, "limit_val_batches": 2, **options}
    trainer = _trainer(tmp_path, max_epochs=2, **options)
    trainer.fit(model, data(64, 1), data(32, 2), ckpt_path=ckpt_path)
    return callback


@pytest.mark.parametrize("weights_only", [False, True])
def test_a_checkpoint_saved_during_validation_holds_the_training_weights(
    tmp_path: Path, weights_only: bool
) -> None:
    """trainer.save_checkpoint in validation_step, the EMA in the model: the checkpoint's state_dict is the
    training weights, the EMA is in the callback's entry, and fit(ckpt_path=) from it ends bitwise where
    the run that saved it does."""
    path = tmp_path / "in-validation.ckpt"
    model = InValidation(lambda trainer: trainer.save_checkpoint(path, weights_only=weights_only))
    callback = _fit(tmp_path, model)
    assert not same(model.training_weights, model.ema_weights)  # the EMA was in the model
    saved = torch.load(path, weights_only=True)
    assert same(saved["state_dict"], model.training_weights)
    if weights_only:
        return
    assert same(saved["callbacks"]["EMACallback"]["emas"][0], model.ema_weights)
    resumed = InValidation()
    again = _fit(tmp_path, resumed, ckpt_path=path)
    assert same(resumed.start_weights, model.training_weights)
    assert same(weights(resumed), weights(model))
    assert same(again.ema.ema.state_dict(), callback.ema.ema.state_dict())


SLURM = {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}


def test_a_slurm_requeue_during_validation_resumes_from_the_training_weights(
    tmp_path: Path, monkeypatch
) -> None:
    """SIGUSR1 during validation on SLURM: Lightning's handler saves hpc_ckpt_1.ckpt (its scontrol call
    fails here); the requeued job's fit resumes from it, from the training weights, and ends bitwise where
    the run that got the signal does."""
    for name, value in {**SLURM, "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "train"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: the requeue fails, the run goes on
    plugins = [SLURMEnvironment(auto_requeue=True)]
    model = InValidation(lambda trainer: os.kill(os.getpid(), signal.SIGUSR1))
    callback = _fit(tmp_path, model, plugins=plugins)
    saved = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)
    assert same(saved["state_dict"], model.training_weights)
    assert same(saved["callbacks"]["EMACallback"]["emas"][0], model.ema_weights)
    requeued = InValidation()
    again = _fit(tmp_path, requeued, plugins=plugins)  # no ckpt_path: Lightning takes the hpc checkpoint
    assert same(requeued.start_weights, model.training_weights)
    assert same(weights(requeued), weights(model))
    assert same(again.ema.ema.state_dict(), callback.ema.ema.state_dict())


@pytest.fixture
def sigint() -> None:
    """Lightning ignores SIGINT after a KeyboardInterrupt (for its shutdown): Python's handler back after."""
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _raise(error: BaseException) -> Callable[[pl.Trainer], None]:
    def act(trainer: pl.Trainer) -> None:
        raise error

    return act


@pytest.mark.parametrize(
    "error, stops", [(RuntimeError("in validation_step"), RuntimeError), (KeyboardInterrupt(), SystemExit)]
)
def test_an_exception_during_validation_leaves_the_training_weights(
    tmp_path: Path, sigint: None, error: BaseException, stops: type
) -> None:
    """An error or Ctrl-C in validation_step, the EMA in the model: the model after fit and
    OnExceptionCheckpoint's checkpoint hold the training weights, the checkpoint's callback entry the EMA."""
    model = InValidation(_raise(error))
    saver = OnExceptionCheckpoint(dirpath=tmp_path)
    with pytest.raises(stops):
        _fit(
            tmp_path, model, callbacks=[EMACallback(decay=constant(DECAY)), saver], enable_checkpointing=True
        )
    assert not same(model.training_weights, model.ema_weights)
    assert same(weights(model), model.training_weights)
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert same(saved["state_dict"], model.training_weights)
    assert same(saved["callbacks"]["EMACallback"]["emas"][0], model.ema_weights)


def test_resumed_without_ema_state_counts_optimizer_steps(tmp_path: Path) -> None:
    """From a checkpoint written without the callback (global_step 8, no EMA), with gradient accumulation:
    one update per optimizer step of the resumed run, not one per micro-batch until the count catches up."""
    first = _trainer(tmp_path, max_epochs=1, limit_val_batches=0)
    first.fit(Net(), data(64, 1))
    first.save_checkpoint(tmp_path / "plain.ckpt")
    callback = EMACallback(decay=constant(DECAY))
    trainer = _trainer(
        tmp_path, max_epochs=2, accumulate_grad_batches=2, limit_val_batches=0, callbacks=[callback]
    )
    trainer.fit(Net(), data(64, 1), ckpt_path=tmp_path / "plain.ckpt")
    assert trainer.global_step == 8 + 4 and callback.ema.updates == 4


def test_a_flattened_model_validates_with_the_ema_and_gets_its_weights_back(tmp_path: Path) -> None:
    """After flatten_model the model's state_dict() gives copies: the swap writes through its own tensors."""
    from ema_lab import flatten_model

    class Seen(Net):
        def validation_step(self, batch: object, batch_idx: int) -> object:
            self.seen = [p.detach().clone() for p in self.parameters()]
            return super().validation_step(batch, batch_idx)

    callback = EMACallback(decay=constant(DECAY))
    trainer = _trainer(
        tmp_path, max_epochs=1, num_sanity_val_steps=0, limit_val_batches=1, callbacks=[callback]
    )
    model = Seen()
    flatten_model(model)
    trainer.fit(model, data(64, 1), data(32, 2))
    ema = [p.detach() for p in callback.ema.ema.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(model.seen, ema))  # validated with the EMA's weights
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), ema))  # its own weights back
