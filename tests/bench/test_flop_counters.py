"""benchmarks/flop_counters.py (docs/flop_counters.md): thop's count beside FlopCounterMode's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("thop", reason="thop is not installed (the notebooks extra)")

from ema_lab.bench.models import tiny_cnn, tiny_transformer
from ema_lab.lessons.profiling import profile_flops

from ..helpers import changes, fingerprint, load_script

flop_counters = load_script("flop_counters")
compare_flop_counts = flop_counters.compare_flop_counts


def test_the_script_prints_the_comparison_for_the_three_models(capsys):
    assert flop_counters.main() == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("---")] == [
        "--- tiny_cnn, input (1, 3, 32, 32)",
        "--- yolo, input (1, 3, 64, 64)",
        "--- tiny_transformer, input (1, 16)",
    ]
    assert out.count("-> equal to FlopCounterMode") == 2 and out.count("NOT equal") == 1


def test_conv_and_linear_counts_agree_exactly_with_flop_counter_mode():
    model = tiny_cnn()
    before = fingerprint(model)
    cmp = compare_flop_counts(model, (torch.randn(1, 3, 32, 32),))
    assert changes(before, fingerprint(model)) == []
    assert cmp.matmuls_agree
    assert cmp.thop_matmul_flops == cmp.counter_flops == sum(cmp.counter_by_op.values())
    assert set(cmp.counter_by_op) == {"aten.convolution", "aten.addmm"}
    # Everything else thop counts is what FlopCounterMode has no formula for.
    assert set(cmp.thop_only) == {"BatchNorm2d", "AdaptiveAvgPool2d"}
    assert cmp.thop_flops == cmp.thop_matmul_flops + sum(cmp.thop_only.values())
    gflops, _ = profile_flops(model, torch.randn(1, 3, 32, 32))
    assert cmp.thop_flops == round(gflops * 1e9)
    assert "equal to FlopCounterMode" in cmp.explain()


HEAD_FLOPS = 2 * 16 * 32 * 64  # tiny_transformer's output head: 16 tokens x 32 features -> 64 logits
THOP_TRANSFORMER_FLOPS = 348_160  # thop sees the feed-forward Linears, LayerNorm and the head only


def _sdpa_flops(cmp) -> int:
    """FLOPs FlopCounterMode gave a scaled-dot-product-attention op: 0 where its torch has no formula."""
    return sum(v for k, v in cmp.counter_by_op.items() if "scaled_dot_product" in k)


def test_counts_differ_on_a_transformer_and_the_explanation_says_so():
    cmp = compare_flop_counts(tiny_transformer(), (torch.randint(0, 64, (1, 16)),))
    # Eval + no_grad runs nn.TransformerEncoderLayer's fused fast path; thop cannot see attention (no
    # rule for MultiheadAttention). Both see the head; which fused ops FlopCounterMode has formulas for
    # depends on the torch version, so only the head is pinned here.
    assert cmp.thop_flops == THOP_TRANSFORMER_FLOPS
    assert cmp.counter_by_op["aten.mm"] == HEAD_FLOPS
    assert not cmp.matmuls_agree
    assert "NOT equal" in cmp.explain() and "fused kernels" in cmp.explain()


def test_without_the_fast_path_flop_counter_mode_sees_the_projections():
    """Notebook 03 exercise 4: thop's count stays; FlopCounterMode's grows by the layers' matmuls."""
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        cmp = compare_flop_counts(tiny_transformer(), (torch.randint(0, 64, (1, 16)),))
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert cmp.thop_flops == THOP_TRANSFORMER_FLOPS
    # 2 layers x (in_proj 16x32x96 + out_proj 16x32x32 + feed-forward 2 x 16x32x64) MACs, x2 FLOPs
    assert cmp.counter_by_op["aten.addmm"] == 2 * 2 * 16 * 32 * (96 + 32 + 2 * 64) == 524_288
    assert cmp.counter_by_op["aten.mm"] == HEAD_FLOPS
    # torch 2.15 also counts the CPU attention kernel (2 layers x (QK^T + AV) = 65,536); 2.13 does not.
    sdpa = _sdpa_flops(cmp)
    assert sdpa in (0, 2 * 2 * 2 * 16 * 16 * 32)
    assert cmp.counter_flops == 524_288 + HEAD_FLOPS + sdpa
