"""Small helpers for reproducing the thop float64 buffer bug (notebook 03 and its tests).

The reproduction itself (``thop.profile`` in place, the cast EMA copy, the failing
``torch._foreach_lerp_``, the deep-copy fix) stands in notebook 03's cells and in
``tests/test_float64_bug.py``; this module holds only what both reuse.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..bench.models import Conv
from .profiling import THOP_BUFFERS, import_thop, remove_thop_buffers

__all__ = ["leaked_keys", "shared_act_leak", "train_step"]


def leaked_keys(model: nn.Module) -> list[str]:
    """The state_dict keys that are thop's buffers (``total_ops``/``total_params``), in state_dict order."""
    return [k for k in model.state_dict() if k.rsplit(".", 1)[-1] in THOP_BUFFERS]


@contextmanager
def shared_act_leak(cls: type[nn.Module] = Conv) -> Iterator[nn.Module]:
    """Profile one ``cls(3, 16, 3)`` in place, leaking onto ``cls.default_act``; remove that leak on exit.

    Refuses (``RuntimeError``) when ``cls.default_act`` already carries thop buffers: that leak is
    someone else's, and removing it on exit would hide it.
    """
    thop = import_thop()
    act = cls.default_act
    leaked = [n for n in THOP_BUFFERS if n in act._buffers]
    if leaked:
        raise RuntimeError(
            f"{cls.__name__}.default_act already carries thop buffers {leaked} from an earlier in-place "
            f"profile: remove them first (remove_thop_buffers({cls.__name__}.default_act), "
            "ema_lab.lessons.profiling)"
        )
    try:
        block = cls(3, 16, 3)
        thop.profile(block, inputs=(torch.randn(1, 3, 32, 32),), verbose=False)
        yield block
    finally:
        remove_thop_buffers(act)


def train_step(model: nn.Module, seed: int = 0) -> None:
    """One deterministic SGD step (lr 0.1) on random 4x3x32x32 images, so weights and BN statistics move."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 32, 32, generator=gen)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
