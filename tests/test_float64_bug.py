"""The float64 buffer bug, step by step, against the real installed thop 0.1.1.post2209072238."""

from __future__ import annotations

import contextlib
import io
from importlib import metadata

import pytest
import torch
from torch import nn

from ema_lab.lessons import float64_bug as bug
from ema_lab.lessons.models import Conv, yolo
from ema_lab.lessons.profiling import import_thop, remove_thop_buffers

THOP_PIN = "0.1.1.post2209072238"


def _thop_bufs(module: nn.Module) -> list[str]:
    return [n for n in ("total_ops", "total_params") if n in module._buffers]


@pytest.fixture(autouse=True)
def _shared_act_stays_clean():
    """Conv.default_act is process-wide: fail if a test leaks onto it, and clean it either way."""
    assert not _thop_bufs(Conv.default_act), "Conv.default_act was already leaked before this test"
    try:
        yield
        assert not _thop_bufs(Conv.default_act), "this test leaked thop buffers onto Conv.default_act"
    finally:
        remove_thop_buffers(Conv.default_act)


@pytest.fixture(scope="module")
def run():
    """run_all() once for the module (about 8 s): every step test reads its result and the printed text."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        results = bug.run_all()
    return results, out.getvalue()


def test_the_installed_thop_is_the_leaky_release():
    from packaging.version import Version

    assert Version(metadata.version("thop")) == Version(THOP_PIN), (
        "these tests reproduce the leak of PyPI thop "
        + THOP_PIN
        + "; another thop (or ultralytics-thop) is installed"
    )


def test_run_all_prints_six_steps_and_cleans_up(run):
    results, text = run
    assert len(results) == 6
    assert [line for line in text.splitlines() if line.startswith("== step")] == [
        f"== step {i}: {title}" for i, (title, _) in enumerate(bug.STEPS, 1)
    ]
    assert "expected dtype float for `end` but got dtype double" in text
    assert not _thop_bufs(Conv.default_act)


def test_step1_in_place_profile_leaves_float64_buffers_on_modules_without_a_rule(run):
    s1 = run[0][0]
    out = 16 * 32 * 32
    assert s1.macs == out * 3 * 3 * 3 + 4 * out  # conv MACs + affine BatchNorm, SiLU counts 0
    assert s1.params == 16 * 27 + 2 * 16
    assert s1.added.added == (
        ("total_ops", "float64", (1,)),
        ("total_params", "float64", (1,)),
        ("act.total_ops", "float64", (1,)),
        ("act.total_params", "float64", (1,)),
    )
    assert not (s1.added.removed or s1.added.dtype_changed or s1.added.value_changed)
    assert s1.kept_on == (("", "Conv"), ("act", "SiLU"))
    assert s1.cleaned == (("conv", "Conv2d"), ("bn", "BatchNorm2d"))
    # No try/finally in thop: a failing forward leaves buffers on all four modules, hooks, eval mode.
    assert s1.failed_error.startswith("RuntimeError: Given groups=1, weight of size [16, 3, 3, 3]")
    assert {k for k, _, _ in s1.failed_added.added} == {
        f"{p}{n}" for p in ("", "conv.", "bn.", "act.") for n in ("total_ops", "total_params")
    }
    assert s1.failed_hooks_left == 4  # op counter + parameter counter on conv and on bn
    assert s1.failed_training == (True, False)


def test_step2_shared_activation_carries_the_leak_into_new_models(run):
    s2 = run[0][1]
    assert s2.clean_entries == 708  # models.yolo's documented size
    assert s2.conv_refs == sum(isinstance(m, Conv) for m in yolo().modules())
    assert s2.fresh_stray == 2 * s2.conv_refs
    assert s2.fresh_entries == s2.clean_entries + s2.fresh_stray
    assert all(dt == "float64" for _, dt in s2.fresh_example)
    # Profiled in place: two keys per module reference thop has no rule for (custom blocks, ModuleList,
    # the root, every reference to the shared SiLU); Conv2d/BatchNorm2d/Sequential/Upsample are cleaned.
    rules = set(importlib_rules())
    no_rule = sum(type(m) not in rules for _, m in yolo().named_modules(remove_duplicate=False))
    assert s2.profiled_stray == 2 * no_rule
    assert s2.profiled_entries == s2.clean_entries + s2.profiled_stray


def importlib_rules() -> list[type]:
    import importlib

    import_thop()
    return list(importlib.import_module("thop.profile").register_hooks)


def test_step3_cast_ema_disagrees_exactly_on_the_stray_keys(run):
    s3 = run[0][2]
    assert s3.float_pairs == 27 + 10  # tiny_cnn's 27 float tensors + 2 stray keys on each of 5 Conv
    assert len(s3.mismatched_after_float) == 10
    assert all(k.endswith((".act.total_ops", ".act.total_params")) for k, _, _ in s3.mismatched_after_float)
    assert {(e, m) for _, e, m in s3.mismatched_after_float} == {("float32", "float64")}
    assert s3.mismatched_after_half == s3.float_pairs


def test_step4_foreach_raises_after_a_partial_update_and_the_naive_fallback_decays_twice(run):
    s4 = run[0][3]
    assert s4.error == "RuntimeError: expected dtype float for `end` but got dtype double"
    assert (s4.bad_index, s4.bad_key) == (5, "0.act.total_ops")
    # Not atomic: exactly the pairs before the bad one were updated.
    assert s4.updated_before_failure == (
        "0.conv.weight",
        "0.bn.weight",
        "0.bn.bias",
        "0.bn.running_mean",
        "0.bn.running_var",
    )
    d = bug.DECAY
    assert s4.model_value != s4.ema0
    assert s4.after_failed_call == pytest.approx(s4.one_step, rel=1e-6)
    assert s4.after_naive_fallback == pytest.approx(d * d * s4.ema0 + (1 - d * d) * s4.model_value, rel=1e-6)
    assert s4.effective_model_weight == pytest.approx(1 - d * d, rel=1e-3)
    assert s4.model_weight == pytest.approx(1 - d)
    # Per pair: 1 - d^2 before the bad pair, 1 - d after it (the loop alone), no gap on the thop buffers.
    for i, (key, w) in enumerate(s4.weights):
        if key.endswith(("total_ops", "total_params")):
            assert w is None, key
        else:
            assert w == pytest.approx(1 - d * d if i < s4.bad_index else 1 - d, abs=2e-3), key
    assert s4.ema_lab_error == (
        "ValueError: entry 5 ('0.act.total_ops'): EMA shape (1,), torch.float32, cpu "
        "does not match model shape (1,), torch.float64, cpu"
    )
    assert s4.ema_lab_unchanged


def test_step5_loop_promotes_and_the_fixes_agree_with_it(run):
    s5 = run[0][4]
    assert s5.loop_error is None and s5.loop_dtypes_kept
    assert 0 < s5.decay < 1e-3  # ModelEMA's first ramped decay: 0.9999 * (1 - exp(-1 / 2000))
    assert s5.gated_max_diff <= 1e-6 and s5.model_ema_max_diff <= 1e-6  # lerp vs mul/add rounding only
    assert s5.model_ema_foreach_error.startswith("ValueError: entry 5 ('0.act.total_ops')")


def test_step6_profiling_a_deep_copy_leaves_nothing(run):
    s6 = run[0][5]
    assert s6.block_changes == () and s6.shared_act_keys == () and s6.new_model_stray == 0
    assert s6.seed_after_error is None
    assert s6.gflops == run[0][0].macs / 1e9 * 2 and s6.params == run[0][0].params
    assert s6.thop_version == THOP_PIN
    assert "ultralytics-thop >= 2.0.21" in s6.fact and ">= 2.1 keeps plain ints" in s6.fact


def test_a_failing_step_body_still_removes_the_shared_leak():
    with pytest.raises(KeyError), bug.shared_act_leak():
        assert _thop_bufs(Conv.default_act) == ["total_ops", "total_params"]
        raise KeyError("fails mid-step")
    assert not _thop_bufs(Conv.default_act)


def test_steps_refuse_to_run_on_an_already_leaked_class():
    Conv.default_act.register_buffer("total_ops", torch.zeros(1, dtype=torch.float64))
    try:
        with pytest.raises(RuntimeError, match="already carries thop buffers"):
            bug.step1_profile_in_place()
        with pytest.raises(RuntimeError, match="already carries thop buffers"):
            bug.step6_deepcopy_fix()
        with pytest.raises(RuntimeError, match="already carries thop buffers"), bug.shared_act_leak():
            pass
        assert _thop_bufs(Conv.default_act) == ["total_ops"]  # someone else's leak is not touched
    finally:
        remove_thop_buffers(Conv.default_act)
