"""The seed's code verbatim (ultralytics ``ModelEMA.update`` before and after PR #25315), for baselines.

These walk ``state_dict()`` of both modules on every call, exactly as the original did, and keep
its flaws: no validation, non-float entries left alone, tied weights decayed twice, and a
``_foreach_lerp_`` that fails part-way leaves the EMA half-updated. Use :class:`ema_lab.ModelEMA`
for real work; these exist to measure and to reproduce.
"""

from __future__ import annotations

import torch
from torch import nn

from .gates import foreach_lerp_supported

__all__ = ["seed_before", "seed_after"]


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
    with torch.no_grad():
        msd = model.state_dict()
        ema_v, model_v = [], []
        for k, v in ema.state_dict().items():
            if v.dtype.is_floating_point:
                ema_v.append(v)
                model_v.append(msd[k])
        # TORCH_2_0 and (TORCH_2_4 or device != "mps"), as a call to the pure gate.
        if ema_v and foreach_lerp_supported(None, ema_v[0].device.type):
            torch._foreach_lerp_(ema_v, model_v, 1 - d)
        else:
            for v, m in zip(ema_v, model_v):
                v.mul_(d).add_(m, alpha=1 - d)
