"""The seed's code verbatim (ultralytics ``ModelEMA.update`` before and after PR #25315), for baselines.

These walk ``state_dict()`` of both modules on every call, exactly as the original did, and keep
its flaws: no validation, non-float entries left alone, tied weights decayed twice, and a
``_foreach_lerp_`` that fails part-way leaves the EMA half-updated. Use :class:`ema_lab.ModelEMA`
for real work; these exist to measure and to reproduce.

The after-code's body is :func:`lerp_float_entries`, over two ``state_dict()`` results: ``seed_after``
passes fresh ones; the tests' cached-list EMA (ultralytics 8.4.190) passes the ones it kept.
"""

from __future__ import annotations

import torch
from torch import nn

from ..gates import foreach_lerp_supported

__all__ = ["seed_before", "seed_after", "lerp_float_entries"]


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
    lerp_float_entries(ema.state_dict(), model.state_dict(), d)


def lerp_float_entries(esd: dict[str, torch.Tensor], msd: dict[str, torch.Tensor], d: float) -> None:
    """The body of :func:`seed_after`, over two given ``state_dict()`` results: the EMA's float entries
    move towards the model's entries of the same keys."""
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
