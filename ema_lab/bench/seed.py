"""The seed's code verbatim (ultralytics ``ModelEMA.update`` before and after PR #25315), for baselines.

These walk ``state_dict()`` of both modules on every call, exactly as the original did, and keep
its flaws: no validation, non-float entries left alone, tied weights decayed twice, and a
``_foreach_lerp_`` that fails part-way leaves the EMA half-updated. Use :class:`ema_lab.ModelEMA`
for real work; these exist to measure and to reproduce.

:class:`CachedListEMA` reproduces the step ultralytics took after the seed (8.4.190): the tensor
lists are built once and reused forever, which is fast and silently wrong once a tensor is replaced.
It runs :func:`seed_after`'s body over the ``state_dict()`` results it kept.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ema import ModelEMA
from ..gates import foreach_lerp_supported

__all__ = ["seed_before", "seed_after", "CachedListEMA"]


def seed_before(ema: nn.Module, model: nn.Module, d: float) -> None:
    """The pre-change update: per float entry ``v *= d; v += (1 - d) * msd[k].detach()``."""
    with torch.no_grad():
        msd = model.state_dict()
        for k, v in ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


def seed_after(ema: nn.Module, model: nn.Module, d: float) -> None:
    """The post-change update: collect float entries, one gated ``_foreach_lerp_``, else mul_/add_."""
    _lerp_float_entries(ema.state_dict(), model.state_dict(), d)


def _lerp_float_entries(esd: dict[str, torch.Tensor], msd: dict[str, torch.Tensor], d: float) -> None:
    """The body of :func:`seed_after`, over two given ``state_dict()`` results."""
    with torch.no_grad():
        ema_v, model_v = [], []
        for k, v in esd.items():
            if v.dtype.is_floating_point:
                ema_v.append(v)
                model_v.append(msd[k])
        # TORCH_2_0 and (TORCH_2_4 or device != "mps"), as a call to the pure gate.
        if ema_v and foreach_lerp_supported(None, ema_v[0].device.type):
            torch._foreach_lerp_(ema_v, model_v, 1 - d)
        else:
            for v, m in zip(ema_v, model_v):
                v.mul_(d).add_(m, alpha=1 - d)


class CachedListEMA(ModelEMA):
    """UNSAFE ON PURPOSE: ultralytics 8.4.190's cached-list update, reproduced to show a cache going stale.

    The first ``update`` keeps the ``state_dict()`` of the EMA and of the model (ultralytics kept the float
    tensors of each as ``self._pairs``); every later update lerps those same tensor objects.
    ``state_dict()`` returns detached aliases of the parameters' memory at that moment, and
    ``model.double()`` / ``.to()`` or an in-place ``ema.ema.half()`` give the modules new memory.
    From then on the update averages dead tensors: the EMA module either stops moving or follows a
    frozen snapshot of the model, with no error. :class:`ema_lab.ModelEMA` checks the tensors' memory
    (``data_ptr()``) on every update instead.
    """

    _cached: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None  # (ema, model), built once

    def update(self, model: nn.Module) -> None:
        """Move the (cached) EMA tensors one step towards the (cached) model tensors."""
        if not self.enabled:
            return
        if self._cached is None:
            self._cached = (self.ema.state_dict(), model.state_dict())
        self.updates += 1
        _lerp_float_entries(*self._cached, self.decay(self.updates))
