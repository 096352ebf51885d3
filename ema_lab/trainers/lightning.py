"""``EMACallback``: ``ema_lab.ModelEMA`` in a Lightning ``Trainer``, validated, synced and checkpointed.

``Trainer(callbacks=[EMACallback(decay=constant(0.999))])``: the keyword arguments are ``ModelEMA``'s (a
number is ultralytics' ramp, a schedule from :mod:`ema_lab.schedules` anything else). It updates once per
optimizer step (not per micro-batch under gradient accumulation), validates the EMA weights (copied into
the model for the validation loop, the training weights copied back after), gives every DDP rank rank 0's
EMA buffers before validating, saving and returning from ``fit`` (a collective: Lightning runs these hooks
on every rank), and keeps the EMA in the checkpoint's callback state, so ``Trainer.fit(ckpt_path=...)``
resumes it bit for bit. At the end of ``fit`` the model keeps its own weights; ``callback.ema.ema`` is the
EMA model.
Lightning's own ``EMAWeightAveraging`` differs there: it saves the EMA as the checkpoint's ``state_dict``
and copies it into the model when training ends.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ..ema import ModelEMA

__all__ = ["EMACallback"]


class EMACallback(Callback):
    """The LightningModule's EMA, ``ModelEMA(pl_module, **kwargs)``, made when ``fit`` starts
    (``on_fit_start``: on the model's device, after a checkpoint's weights are loaded)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.ema: ModelEMA | None = None
        self._pending: dict | None = None  # a checkpoint's EMA state, loaded before the EMA is made
        self._kept: list[torch.Tensor] | None = None  # the training weights during validation

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here, not in setup(): the strategy has moved the model to its device (and precision), and a
        # checkpoint's weights are loaded, so the EMA starts from them where the checkpoint has no EMA.
        if self.ema is None:
            self.ema = ModelEMA(pl_module, **self.kwargs)
            self.ema.ranks_checked = True  # no warning to call sync_buffers(): this callback calls it
            if self._pending is not None:
                self.ema.load_state_dict(self._pending)
                self._pending = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step > self.ema.updates:  # once per optimizer step, as Lightning's own
            self.ema.update(pl_module)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.ema is None:  # validate() without fit(): nothing to swap in
            return
        self.ema.sync_buffers()
        model = list(pl_module.state_dict().values())
        self._kept = [t.clone() for t in model]
        torch._foreach_copy_(model, list(self.ema.ema.state_dict().values()))

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._kept is not None:
            torch._foreach_copy_(list(pl_module.state_dict().values()), self._kept)
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
