"""The float64 buffer bug, step by step, against the real installed thop 0.1.1.post2209072238.

Each test does what a section of notebook 03 shows, on the zoo's ``tiny_cnn`` and ``yolo`` (built from
``ema_lab.bench.models.Conv``, whose activation is shared at class level), and asserts it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from copy import deepcopy
from importlib import metadata

import pytest
import torch
from torch import nn

pytest.importorskip("thop", reason="thop is not installed (the notebooks extra)")

from ema_lab import ModelEMA, foreach_update, gated_update
from ema_lab.bench.models import Conv, tiny_cnn, yolo
from ema_lab.bench.seed import seed_after, seed_before
from ema_lab.lessons.profiling import THOP_BUFFERS, import_thop, profile_flops

from ..helpers import changes, clear_thop_buffers, fingerprint, kept_clean

THOP_PIN = "0.1.1.post2209072238"
D = 0.9  # far from 1: one step and two steps differ clearly
BLOCK_INPUT = (1, 3, 32, 32)


def leaked_keys(model: nn.Module) -> list[str]:
    """The state_dict keys that are thop's buffers (``total_ops``/``total_params``), in state_dict order."""
    return [k for k in model.state_dict() if k.rsplit(".", 1)[-1] in THOP_BUFFERS]


@contextmanager
def shared_act_leak() -> Iterator[nn.Module]:
    """Profile ``Conv(3, 16, 3)`` in place, leaking onto the shared ``Conv.default_act``; clean it on exit."""
    thop = import_thop()
    try:
        block = Conv(3, 16, 3)
        thop.profile(block, inputs=(torch.randn(BLOCK_INPUT),), verbose=False)
        yield block
    finally:
        clear_thop_buffers(Conv.default_act)


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


def _thop_rules() -> set[type]:
    thop = import_thop()
    return set(thop.profile.__globals__["register_hooks"])


@pytest.fixture(autouse=True)
def _shared_act_stays_clean():
    """Conv.default_act is process-wide: fail if a test leaks onto it, and clean it either way."""
    with kept_clean(Conv.default_act):
        yield


def _leaky_setup() -> tuple[nn.Module, nn.Module]:
    """Inside a leak: a seeded tiny_cnn, its EMA cast with .float() (as a validator does), one train step."""
    torch.manual_seed(0)
    model = tiny_cnn()
    ema = deepcopy(model).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    ema.float()
    train_step(model)
    return model, ema


def _float_keys(module: nn.Module) -> list[str]:
    return [k for k, v in module.state_dict().items() if v.dtype.is_floating_point]


def test_the_installed_thop_is_the_leaky_release():
    from packaging.version import Version

    assert Version(metadata.version("thop")) == Version(THOP_PIN), (
        f"these tests reproduce the leak of PyPI thop {THOP_PIN}; "
        "another thop (or ultralytics-thop) is installed"
    )


# --- 1. in-place thop.profile ------------------------------------------------------------------------


def test_in_place_profile_leaves_float64_buffers_on_modules_without_a_rule():
    thop, rules = import_thop(), _thop_rules()
    block = Conv(3, 16, 3)
    before = set(block.state_dict())
    try:
        macs, params = thop.profile(block, inputs=(torch.randn(BLOCK_INPUT),), verbose=False)
        out = 16 * 32 * 32
        assert macs == out * 3 * 3 * 3 + 4 * out  # conv MACs + affine BatchNorm; SiLU counts 0
        assert params == 16 * 27 + 2 * 16
        sd = block.state_dict()
        assert [k for k in sd if k not in before] == leaked_keys(block)
        assert leaked_keys(block) == ["total_ops", "total_params", "act.total_ops", "act.total_params"]
        assert all(sd[k].dtype == torch.float64 and sd[k].shape == (1,) for k in leaked_keys(block))
        kept = [(p, type(m).__name__) for p, m in block.named_modules() if "total_ops" in m._buffers]
        assert kept == [("", "Conv"), ("act", "SiLU")]
        assert [(p, type(m).__name__) for p, m in block.named_modules() if type(m) in rules] == [
            ("conv", "Conv2d"),
            ("bn", "BatchNorm2d"),
        ]
    finally:
        clear_thop_buffers(Conv.default_act)


def test_a_failing_forward_leaves_buffers_hooks_and_eval_mode():
    thop = import_thop()
    block = Conv(3, 16, 3).train()
    try:
        with pytest.raises(RuntimeError, match=r"^Given groups=1, weight of size \[16, 3, 3, 3\]"):
            thop.profile(block, inputs=(torch.randn(1, 1, 32, 32),), verbose=False)  # 1 channel, not 3
        assert set(leaked_keys(block)) == {
            f"{p}{n}" for p in ("", "conv.", "bn.", "act.") for n in ("total_ops", "total_params")
        }
        assert sum(len(m._forward_hooks) for m in block.modules()) == 4  # ops + params on conv and bn
        assert not block.training
    finally:
        clear_thop_buffers(Conv.default_act)


# --- 2. the class-level activation ------------------------------------------------------------------


def test_shared_activation_carries_the_leak_into_every_model_holding_it():
    thop = import_thop()
    clean = yolo()
    assert len(clean.state_dict()) == 708 and leaked_keys(clean) == []  # models.yolo's documented size
    conv_refs = sum(isinstance(m, Conv) for m in clean.modules())
    with shared_act_leak():
        fresh = yolo()
        stray = leaked_keys(fresh)
        assert len(stray) == 2 * conv_refs == 228
        assert all(fresh.state_dict()[k].dtype == torch.float64 for k in stray)
        assert len(fresh.state_dict()) == 708 + 228
        assert len(leaked_keys(clean)) == 228  # built before the leak, but holds the same SiLU
        profiled = yolo()
        thop.profile(profiled, inputs=(torch.randn(1, 3, 64, 64),), verbose=False)
        # Two keys per module reference thop has no rule for (custom blocks, ModuleList, the root, every
        # reference to the shared SiLU); Conv2d/BatchNorm2d/Sequential/Upsample are cleaned.
        rules = _thop_rules()
        no_rule = sum(type(m) not in rules for _, m in yolo().named_modules(remove_duplicate=False))
        assert len(leaked_keys(profiled)) == 2 * no_rule == 572
    assert leaked_keys(fresh) == [] and leaked_keys(clean) == []  # the leak left with the shared SiLU


# --- 3. the cast EMA copy ---------------------------------------------------------------------------


def test_cast_ema_disagrees_exactly_on_the_stray_keys():
    with shared_act_leak():
        model, ema = _leaky_setup()
        esd, msd = ema.state_dict(), model.state_dict()
        floats = _float_keys(ema)
        bad = [(k, esd[k].dtype, msd[k].dtype) for k in floats if esd[k].dtype != msd[k].dtype]
        assert len(floats) == 27 + 10  # tiny_cnn's 27 float tensors + 2 stray keys on each of 5 Conv
        assert len(bad) == 10
        assert all(k.endswith((".act.total_ops", ".act.total_params")) for k, _, _ in bad)
        assert {(e, m) for _, e, m in bad} == {(torch.float32, torch.float64)}
        half = deepcopy(model).half().state_dict()
        assert sum(half[k].dtype != msd[k].dtype for k in floats) == len(floats)


# --- 4. _foreach_lerp_ fails part-way ----------------------------------------------------------------


def test_foreach_lerp_raises_after_a_partial_update_and_a_loop_fallback_decays_twice():
    with shared_act_leak():
        model, ema = _leaky_setup()
        esd, msd = ema.state_dict(), model.state_dict()
        floats = _float_keys(ema)
        bad_index = next(i for i, k in enumerate(floats) if esd[k].dtype != msd[k].dtype)
        assert (bad_index, floats[bad_index]) == (5, "0.act.total_ops")
        before = {k: v.clone() for k, v in esd.items()}

        with pytest.raises(RuntimeError) as e:
            seed_after(ema, model, D)  # the PR's after-code: one _foreach_lerp_
        assert str(e.value) == "expected dtype float for `end` but got dtype double"
        updated = [k for k in floats if not torch.equal(esd[k], before[k])]
        assert updated == [
            "0.conv.weight",
            "0.bn.weight",
            "0.bn.bias",
            "0.bn.running_mean",
            "0.bn.running_var",
        ]
        for k in updated:  # exactly one correct step on each, nothing on the rest
            torch.testing.assert_close(esd[k], before[k].lerp(msd[k], 1 - D))
        assert all(torch.equal(esd[k], before[k]) for k in floats[bad_index:])

        seed_before(ema, model, D)  # a hypothetical `except RuntimeError:` fallback to the loop
        for i, k in enumerate(floats):
            if k.endswith(("total_ops", "total_params")):
                assert torch.equal(msd[k].float(), before[k]), k  # no gap: nothing to average
                continue
            w = 1 - D * D if i < bad_index else 1 - D  # decayed twice before the bad pair, once after
            expected = before[k].double().lerp(msd[k].double(), w).float()
            torch.testing.assert_close(esd[k], expected, rtol=1e-5, atol=1e-6, msg=k)
            gap = (msd[k].double() - before[k].double()).flatten()
            j = int(gap.abs().argmax())  # the weight actually applied, where it is best resolved
            applied = (esd[k].double().flatten()[j] - before[k].double().flatten()[j]) / gap[j]
            assert applied.item() == pytest.approx(w, abs=2e-3), k


def test_foreach_update_refuses_before_touching_anything():
    with shared_act_leak():
        model, ema = _leaky_setup()
        esd, msd = ema.state_dict(), model.state_dict()
        floats = _float_keys(ema)
        before = fingerprint(ema)
        with pytest.raises(ValueError) as e:
            foreach_update([esd[k] for k in floats], [msd[k] for k in floats], D, floats)
        assert str(e.value) == (
            "entry 5 ('0.act.total_ops'): EMA shape (1,), torch.float32, cpu "
            "does not match model shape (1,), torch.float64, cpu"
        )
        assert changes(before, fingerprint(ema)) == []


# --- 5. the loop promotes; ema_lab handles the mixed pairs -------------------------------------------


def test_loop_promotes_and_keeps_the_ema_dtypes():
    with shared_act_leak():
        model, ema = _leaky_setup()
        dtypes = {k: v.dtype for k, v in ema.state_dict().items()}
        before = {k: v.clone() for k, v in ema.state_dict().items()}
        seed_before(ema, model, D)  # the PR's before-code: no error
        assert {k: v.dtype for k, v in ema.state_dict().items()} == dtypes  # in-place ops cast back
        assert not torch.equal(ema.state_dict()["0.conv.weight"], before["0.conv.weight"])


def test_model_ema_averages_mixed_pairs_like_the_loop_over_several_ramped_steps():
    """Notebook 03 section 5: a check that fails for an EMA that skips steps or copies the model."""
    with shared_act_leak():
        model, _ = _leaky_setup()
        decay, tau = 0.9, 3.0  # 1 - d stays large, so every step shows
        auto = ModelEMA(model, decay=decay, tau=tau)
        auto.ema.float()  # the validator's cast: thop's buffers become float32 in the EMA only
        ref = deepcopy(auto.ema)
        start = {k: v.clone() for k, v in ref.state_dict().items()}
        floats = _float_keys(ref)
        for n in range(1, 11):
            train_step(model, seed=n)
            auto.update(model)
            seed_before(ref, model, decay * (1 - math.exp(-n / tau)))  # the loop with the same ramp
        assert auto.updates == 10
        assert "cast" in auto.modes  # the float32/float64 pairs get their own group
        got, want, msd = auto.ema.state_dict(), ref.state_dict(), model.state_dict()
        assert {k: got[k].dtype for k in floats} == {k: start[k].dtype for k in floats}
        torch.testing.assert_close(
            {k: got[k] for k in floats}, {k: want[k] for k in floats}, rtol=1e-5, atol=1e-6
        )

        def gap(a: dict, b: dict) -> float:
            return max((a[k].double() - b[k].double()).abs().max().item() for k in floats)

        # The comparison discriminates: neither the starting EMA nor the model itself would pass it.
        assert gap(want, start) > 1e-2 and gap(want, msd) > 1e-2
        # ema_lab also copies the integer num_batches_tracked, which the loop leaves alone.
        assert got["0.bn.num_batches_tracked"] == msd["0.bn.num_batches_tracked"]

        strict = ModelEMA(model, strategy="foreach")
        strict.ema.float()
        with pytest.raises(ValueError, match=r"^entry 5 \('0\.act\.total_ops'\)"):
            strict.update(model)


def test_gated_update_averages_the_mixed_pairs_when_each_tensor_comes_once():
    with shared_act_leak():
        model, ema = _leaky_setup()
        loop = deepcopy(ema)

        def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
            # Each tensor once: the shared SiLU's buffers appear under every Conv in state_dict() only.
            return {
                n: t
                for n, t in (*module.named_parameters(), *module.named_buffers())
                if t.is_floating_point()
            }

        e, m = tensors(ema), tensors(model)
        assert len(e) == 27 + 2  # tiny_cnn's float tensors + the one shared SiLU's two thop buffers
        start = e["0.conv.weight"].clone()
        gated_update(list(e.values()), [m[n] for n in e], D, list(e))
        seed_before(loop, model, D)  # visits the shared buffers once per Conv; they hold equal values
        want = {k: v for k, v in loop.state_dict().items() if v.is_floating_point()}
        got = ema.state_dict()
        assert not torch.equal(got["0.conv.weight"], start)  # the update moved the EMA
        torch.testing.assert_close({k: got[k] for k in want}, want, rtol=1e-6, atol=1e-6)


# --- 6. the deep-copy fix -----------------------------------------------------------------------------


def test_profiling_a_deep_copy_leaves_nothing_and_the_foreach_update_runs():
    thop = import_thop()
    block = Conv(3, 16, 3)
    fp, act_fp = fingerprint(block), fingerprint(Conv.default_act)
    x = torch.randn(BLOCK_INPUT)
    macs, params = thop.profile(deepcopy(block), inputs=(x,), verbose=False)  # the PR's fix
    gflops, n_params = profile_flops(block, x)
    assert changes(fp, fingerprint(block)) == [] and changes(act_fp, fingerprint(Conv.default_act)) == []
    assert dict(Conv.default_act.state_dict()) == {}
    assert gflops == macs / 1e9 * 2 and n_params == params == 16 * 27 + 2 * 16
    model = tiny_cnn()
    assert leaked_keys(model) == []
    ema = deepcopy(model).eval().float()
    train_step(model)
    seed_after(ema, model, D)  # no float64 pair left: the one _foreach_lerp_ runs
