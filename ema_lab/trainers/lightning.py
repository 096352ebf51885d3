"""``EMACallback``: ``ema_lab.ModelEMA`` in a Lightning ``Trainer``, validated, synced and checkpointed.

``Trainer(callbacks=[EMACallback(decay=constant(0.999))])``: the keyword arguments are ``ModelEMA``'s (a
number is ultralytics' ramp, a schedule from :mod:`ema_lab.schedules` anything else). It updates once per
optimizer step (not per micro-batch under gradient accumulation, also when resumed from a checkpoint
without an EMA), validates the EMA weights (copied into the model for the validation loop, the training
weights copied back after, or when validation stops on an exception or Ctrl-C), gives every DDP rank rank
0's EMA buffers before validating, saving and returning from ``fit`` (a collective: Lightning runs these
hooks on every rank), and keeps the EMA in the checkpoint's callback state, so ``Trainer.fit(ckpt_path=...)``
resumes it bit for bit. While the EMA is in the model, the model's ``state_dict()`` gives the training
weights, so a checkpoint saved during validation holds them too. At the end of ``fit`` the model keeps its
own weights; ``callback.ema.ema`` is the EMA model.
Lightning's own ``EMAWeightAveraging`` differs there: it saves the EMA as the checkpoint's ``state_dict``
and copies it into the model when training ends.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.hooks import RemovableHandle

from ..ema import ModelEMA

__all__ = ["EMACallback"]


class EMACallback(Callback):
    """The LightningModule's EMA, ``ModelEMA(pl_module, **kwargs)``, made when ``fit`` starts
    (``on_fit_start``: on the model's device, after a checkpoint's weights are loaded)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.ema: ModelEMA | None = None
        self._pending: dict | None = None  # a checkpoint's EMA state, loaded before the EMA is made
        self._kept: dict[str, torch.Tensor] | None = None  # the training weights during validation
        self._hook: RemovableHandle | None = None  # gives them to the model's state_dict() meanwhile
        self._step = 0  # the global step of the last update

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here, not in setup(): the strategy has moved the model to its device (and precision), and a
        # checkpoint's weights are loaded, so the EMA starts from them where the checkpoint has no EMA.
        if self.ema is None:
            self.ema = ModelEMA(pl_module, **self.kwargs)
            self.ema.ranks_checked = True  # no warning to call sync_buffers(): this callback calls it
            if self._pending is not None:
                self.ema.load_state_dict(self._pending)
                self._pending = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here, not in on_fit_start: Lightning restores a checkpoint's loops (its global step) in between.
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # Once per optimizer step: the global step moved since the last update. (Comparing it with the
        # update count instead let a fresh EMA, resumed from a checkpoint without one, update on every
        # micro-batch under gradient accumulation until the count caught up.)
        if trainer.global_step > self._step:
            self._step = trainer.global_step
            self.ema.update(pl_module)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.ema is None:  # validate() without fit(): nothing to swap in
            return
        self.ema.sync_buffers()
        # keep_vars: the module's own tensors (a flattened model's state_dict() gives copies).
        model = pl_module.state_dict(keep_vars=True)
        kept = {k: t.detach().clone() for k, t in model.items()}

        def training_weights(module: torch.nn.Module, state: dict, prefix: str, metadata: Any) -> None:
            state.update((prefix + k, t) for k, t in kept.items())

        # While the EMA is in the model, its state_dict() gives the training weights: whatever saves then
        # (a save in validation_step, a callback, SLURM's requeue handler) stores them. A hook here rather
        # than on_save_checkpoint: Lightning skips that for weights-only checkpoints, and a user's own
        # torch.save(model.state_dict()) never calls it. torch < 2.5 has the hook under a private name only.
        register = getattr(pl_module, "register_state_dict_post_hook", pl_module._register_state_dict_hook)
        self._kept, self._hook = kept, register(training_weights)
        with torch.no_grad():
            torch._foreach_copy_(list(model.values()), list(self.ema.ema.state_dict().values()))

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._put_back(pl_module)

    # An exception or Ctrl-C during validation skips on_validation_epoch_end; Lightning then calls
    # on_exception (before OnExceptionCheckpoint's, which it orders last), and teardown on the paths
    # without on_exception (a tuner's exit): the model gets its training weights back on every path.
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._put_back(pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._put_back(pl_module)

    def _put_back(self, pl_module: LightningModule) -> None:
        """The training weights back into the model, if the EMA is in it."""
        if self._kept is not None:
            self._hook.remove()  # first: state_dict() gives the model's own tensors again
            with torch.no_grad():
                model = pl_module.state_dict(keep_vars=True).values()
                torch._foreach_copy_(list(model), list(self._kept.values()))
            self._kept = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.ema.sync_buffers()  # equal on every rank when fit returns, validated or not

    def state_dict(self) -> dict[str, Any]:
        if self.ema is None:
            return {}
        self.ema.sync_buffers()  # Lightning builds a checkpoint on every rank and writes rank 0's
        return self.ema.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.ema is None:
            self._pending = state_dict
        else:
            self.ema.load_state_dict(state_dict)
