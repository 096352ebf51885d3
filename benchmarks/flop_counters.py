"""thop's FLOP count beside ``torch.utils.flop_counter.FlopCounterMode``'s (docs/flop_counters.md).

    PYTHONPATH=. python benchmarks/flop_counters.py

Counts one eval-mode forward of tiny_cnn, yolo and tiny_transformer twice, each on its own deep copy of the
model: thop (module hooks, 2 x MACs) and ``FlopCounterMode`` (ATen ops), and says where they agree and why
they differ. Needs thop (the notebooks extra).
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from copy import deepcopy
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from ema_lab.bench.models import build
from ema_lab.lessons.profiling import import_thop


def _thop_macs_by_type(root: nn.Module, layers: dict, total: float) -> dict[str, float]:
    """Attribute thop's per-layer MACs (``ret_layer_info``) to the leaf module types that produced them."""
    out: Counter[str] = Counter()

    def walk(module: nn.Module, tree: dict) -> None:
        for name, (ops, _params, sub) in tree.items():
            child = module.get_submodule(name)
            if sub:
                walk(child, sub)
            else:
                out[type(child).__name__] += ops

    walk(root, layers)
    rest = total - sum(out.values())
    if rest:  # a root with its own rule (e.g. a bare nn.Linear) has no children to walk
        out[type(root).__name__] += rest
    return dict(out)


def _thop_matmul_types(thop: ModuleType) -> frozenset[str]:
    """Module types thop counts with its conv/linear rules: the ops FlopCounterMode also counts."""
    # `thop.profile` is the function; the module holding the rule table sits in sys.modules.
    hooks = importlib.import_module("thop.profile").register_hooks
    rules = {thop.vision.basic_hooks.count_convNd, thop.vision.basic_hooks.count_linear}
    return frozenset(t.__name__ for t, fn in hooks.items() if fn in rules)


@dataclass(frozen=True)
class FlopComparison:
    """One forward counted twice: thop (module hooks, x2) and ``torch.utils.flop_counter.FlopCounterMode``."""

    thop_flops: int  # 2 x thop's MACs
    counter_flops: int  # FlopCounterMode's total
    thop_by_type: dict[str, int]  # 2 x MACs per leaf module type, thop's view
    counter_by_op: dict[str, int]  # FLOPs per aten op, FlopCounterMode's view
    matmul_types: frozenset[str] = field(repr=False)

    @property
    def thop_matmul_flops(self) -> int:
        """thop's count for conv and linear layers only, the ops FlopCounterMode has formulas for."""
        return sum(v for k, v in self.thop_by_type.items() if k in self.matmul_types)

    @property
    def thop_only(self) -> dict[str, int]:
        """Non-zero thop counts for module types that are not conv/linear (BatchNorm, pooling, upsample)."""
        return {k: v for k, v in self.thop_by_type.items() if k not in self.matmul_types and v}

    @property
    def matmuls_agree(self) -> bool:
        """True when thop's conv/linear part equals FlopCounterMode's total exactly."""
        return self.thop_matmul_flops == self.counter_flops

    def explain(self) -> str:
        """A few lines saying where the two counts agree and why they differ."""
        ops = ", ".join(f"{k} {v:,}" for k, v in self.counter_by_op.items()) or "nothing"
        extra = ", ".join(f"{k} {v:,}" for k, v in self.thop_only.items()) or "nothing"
        lines = [
            f"thop (2 x MACs):  {self.thop_flops:>14,} FLOPs",
            f"FlopCounterMode:  {self.counter_flops:>14,} FLOPs ({ops})",
            f"thop conv/linear: {self.thop_matmul_flops:>14,} FLOPs -> "
            + ("equal to FlopCounterMode" if self.matmuls_agree else "NOT equal to FlopCounterMode"),
            f"thop only:        {extra} (FlopCounterMode has no formula for these ops)",
        ]
        if not self.matmuls_agree:
            lines.append(
                "the matmul parts differ: thop skips modules without a rule (attention, embeddings, "
                "functional calls) and FlopCounterMode skips fused kernels it has no formula for"
            )
        return "\n".join(lines)


def compare_flop_counts(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> FlopComparison:
    """Count one eval-mode forward with thop and with ``FlopCounterMode``, each on its own deep copy."""
    from torch.utils.flop_counter import FlopCounterMode

    thop = import_thop()
    copy, args = deepcopy(model), deepcopy(inputs)
    macs, _params, layers = thop.profile(copy, inputs=args, verbose=False, ret_layer_info=True)
    by_type = {k: round(2 * v) for k, v in _thop_macs_by_type(copy, layers, macs).items()}

    copy, args = deepcopy(model), deepcopy(inputs)
    copy.eval()  # thop profiles in eval mode; count the same computation
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        copy(*args)
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return FlopComparison(
        thop_flops=round(2 * macs),
        counter_flops=int(counter.get_total_flops()),
        thop_by_type=by_type,
        counter_by_op=by_op,
        matmul_types=_thop_matmul_types(thop),
    )


def main() -> int:
    """Print the comparison for tiny_cnn, yolo and tiny_transformer."""
    for name, x in [("tiny_cnn", torch.randn(1, 3, 32, 32)), ("yolo", torch.randn(1, 3, 64, 64))]:
        print(f"--- {name}, input {tuple(x.shape)}")
        print(compare_flop_counts(build(name), (x,)).explain())
    print("--- tiny_transformer, input (1, 16)")
    print(compare_flop_counts(build("tiny_transformer"), (torch.randint(0, 64, (1, 16)),)).explain())
    return 0


if __name__ == "__main__":
    sys.exit(main())
