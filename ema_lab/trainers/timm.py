"""timm's ``ModelEmaV3``, run by ``ema_lab.ModelEMA``: change one import and timm's train.py uses it.

``from ema_lab.trainers.timm import ModelEmaV3`` in place of ``from timm.utils.model_ema import ModelEmaV3``
(timm's ``timm/task/task.py`` makes train.py's EMA). The constructor's arguments keep timm's meaning:
``decay`` is a constant, ``use_warmup`` with ``warmup_gamma``/``warmup_power``/``min_decay`` its warm-up, and
``update_after_step`` its delay; ``update(model, step=n)`` takes the decay of step ``n``, and without a step
the constant ``decay`` (:class:`ema_lab.schedules.Warmup` and :class:`~ema_lab.schedules.Constant` are
timm's ``get_decay``, bit for bit).

It is an ``nn.Module``, as timm's is, because timm's code treats it as one: its train.py calls it to validate
(after ``.eval()``), ``torch.compile``\\s it, walks its buffers (``distribute_bn``), and reads ``.module``
(``unwrap_model``, ``load_checkpoint(model_ema.module, ..., use_ema=True)``, the ``CheckpointSaver``).
Its ``state_dict()`` is timm's (``module.<key>``), so checkpoints go both ways between the two classes. The
update count lives in the plain ``ModelEMA`` (``.core``), so an update pays no ``Module.__setattr__``.
This module does not import timm.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ema import ModelEMA, unwrap_model
from ..schedules import Constant, Warmup

__all__ = ["ModelEmaV3"]


def _on(actual: torch.device, wanted: torch.device) -> bool:
    """Whether a tensor on ``actual`` is on ``wanted`` ("cuda" means any CUDA device)."""
    return actual.type == wanted.type and wanted.index in (None, actual.index)


class ModelEmaV3(nn.Module):
    """timm's ``ModelEmaV3`` (same arguments, attributes and state_dict), updated by ``ema_lab.ModelEMA``.

    ``foreach`` is kept but changes nothing: timm's two paths compute the same ``lerp`` as ema_lab's step.
    ``stochastic_rounding`` (timm's bfloat16 rounding) is not in ema_lab: a bfloat16 EMA with it on is
    refused; keep the EMA in float32 (``dtype=torch.float32``) or pass ``stochastic_rounding=False``.
    ``device`` may only name the model's device: an EMA on another device (timm's ``--model-ema-force-cpu``)
    is refused, as ema_lab's step reads the model where it lies.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_warmup: bool = False,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2 / 3,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        stochastic_rounding: bool = True,
        stochastic_rounding_seed: int = 0,
        foreach: bool = True,
        exclude_buffers: bool = False,
    ) -> None:
        super().__init__()
        if use_warmup:
            schedule = Warmup(decay, warmup_gamma, warmup_power, min_decay, update_after_step)
        else:
            schedule = Constant(decay, update_after_step)
        where = next(unwrap_model(model).parameters()).device
        if device is not None and not _on(where, torch.device(device)):
            raise ValueError(
                f"ModelEmaV3: ema_lab keeps the EMA on the model's device ({where}), got device={device!r} "
                "(timm's --model-ema-force-cpu): leave device unset"
            )
        core = ModelEMA(model, decay=schedule)
        if dtype is not None:  # before the first update builds the step
            core.ema.to(dtype=dtype)
        if stochastic_rounding and any(t.dtype == torch.bfloat16 for t in core.ema.state_dict().values()):
            raise ValueError(
                "ModelEmaV3: ema_lab has no stochastic rounding for a bfloat16 EMA; pass dtype=torch.float32 "
                "(an EMA kept in float32) or stochastic_rounding=False (plain rounding)"
            )
        self.core = core  # a plain object: not a submodule, not in state_dict()
        self.module = core.ema  # the EMA model, a submodule, as timm's
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.use_warmup, self.warmup_gamma, self.warmup_power = use_warmup, warmup_gamma, warmup_power
        self.device, self.dtype, self.foreach, self.exclude_buffers = device, dtype, foreach, exclude_buffers
        self.stochastic_rounding = stochastic_rounding
        self.stochastic_rounding_seed = stochastic_rounding_seed

    def get_decay(self, step: int | None = None) -> float:
        """timm's decay of ``step``: the constant ``decay`` without one."""
        return self.decay if step is None else self.core.schedule(max(step, 1))  # 0 and 1 both copy

    def update(self, model: nn.Module, step: int | None = None) -> None:
        """Move the EMA one step towards ``model`` by the decay of ``step`` (timm's ``get_decay``)."""
        if self.core.ema is not self.module:  # a module assigned to .module (a loaded one): move that one
            self.core.ema = self.module
        self.core.update(model, self.get_decay(step))
        if self.exclude_buffers:  # timm averages the parameters only and copies the buffers
            torch._foreach_copy_(list(self.module.buffers()), list(unwrap_model(model).buffers()))

    def set(self, model: nn.Module) -> None:
        """Copy ``model``'s state into the EMA, in place (its keys checked)."""
        self.module.load_state_dict(unwrap_model(model).state_dict())

    def forward(self, *args, **kwargs):
        """The EMA model's forward."""
        return self.module(*args, **kwargs)
