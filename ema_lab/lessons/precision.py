"""Why the EMA of a bf16/fp16 model is kept in fp32: at decay 0.9999 a low-precision EMA stops moving."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ema_stall"]


@dataclass(frozen=True)
class Stall:
    """One EMA held in ``dtype`` chasing a model that sits ``gap`` above it."""

    dtype: torch.dtype
    decay: float
    steps: int
    start: float
    gap: float
    end: float  # the EMA after ``steps`` updates
    exact: float  # what exact arithmetic gives: start + gap * (1 - decay ** steps)
    step_size: float  # (1 - decay) * gap: the increment one update should add
    half_ulp: float  # half the spacing of ``dtype`` at ``start``: anything smaller rounds away

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return (
            f"{name:>9}: {self.steps} updates at decay {self.decay}: {self.start} -> {self.end:.6f} "
            f"(exact {self.exact:.6f}); step {self.step_size:.1e} vs half-ulp {self.half_ulp:.1e}"
        )


def ema_stall(
    dtype: torch.dtype, decay: float = 0.9999, steps: int = 1000, start: float = 1.0, gap: float = 0.01
) -> Stall:
    """Run ``steps`` lerp updates of an EMA in ``dtype`` towards a constant model ``start + gap``."""
    ema = torch.full((1,), start, dtype=dtype)
    model = torch.full((1,), start + gap, dtype=dtype)
    for _ in range(steps):
        ema.lerp_(model, 1 - decay)
    ulp = (torch.nextafter(ema.new_full((1,), start), ema.new_full((1,), 2 * start + 1)) - start).item()
    return Stall(
        dtype=dtype,
        decay=decay,
        steps=steps,
        start=start,
        gap=float(model.item() - start),
        end=ema.item(),
        exact=start + float(model.item() - start) * (1 - decay**steps),
        step_size=(1 - decay) * float(model.item() - start),
        half_ulp=ulp / 2,
    )
