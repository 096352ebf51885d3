"""profile_flops leaves the caller's model alone, whatever the module tree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("thop", reason="thop is not installed (the notebooks extra)")
pytest.importorskip("hypothesis", reason="hypothesis is not installed (the dev extra)")

from hypothesis import given, settings
from hypothesis import strategies as st

from ema_lab.bench.models import Conv, tiny_cnn
from ema_lab.lessons.profiling import import_thop, profile_flops

from ..helpers import changes, clear_thop_buffers, fingerprint, kept_clean, thop_buffers

C = 4  # channels every random tree keeps, so any composition has a valid forward


@pytest.fixture(autouse=True)
def _shared_act_stays_clean():
    """Conv.default_act is process-wide: fail if a test leaks onto it, and clean it either way."""
    with kept_clean(Conv.default_act):
        yield


def _conv_block_macs(cin: int, cout: int, k: int, h: int, w: int) -> int:
    """thop's count for Conv(cin, cout, k) at stride 1: conv MACs + BatchNorm (2 per element, x2 affine)."""
    out = cout * h * w
    return out * cin * k * k + 4 * out


# --- profile_flops --------------------------------------------------------------------------------------


def test_profile_flops_reports_ultralytics_gflops_and_thop_params():
    block = Conv(3, 16, 3)
    gflops, params = profile_flops(block, torch.randn(1, 3, 32, 32))
    assert gflops == _conv_block_macs(3, 16, 3, 32, 32) / 1e9 * 2
    assert params == 16 * 3 * 3 * 3 + 2 * 16  # conv weight + BN affine (SiLU has none)


def test_profile_flops_leaves_model_hooks_and_modes_untouched():
    model = tiny_cnn()
    model[
        1
    ].eval()  # a mixed train/eval tree: thop calls model.eval() then model.train(prev) on the root only
    calls = []
    model[0].register_forward_hook(lambda *a: calls.append(1))
    model[2].register_forward_pre_hook(lambda *a: None)
    before = fingerprint(model)
    x = torch.randn(2, 3, 32, 32)
    x0 = x.clone()
    profile_flops(model, x)
    assert changes(before, fingerprint(model)) == []
    assert torch.equal(x, x0)
    assert model.training and not model[1].training


def test_profile_flops_untouched_when_forward_raises():
    model = tiny_cnn().train()
    before = fingerprint(model)
    with pytest.raises(RuntimeError, match="expected input"):
        profile_flops(model, torch.randn(1, 5, 32, 32))  # 5 channels into a 3-channel conv
    assert changes(before, fingerprint(model)) == []


def test_in_place_thop_is_caught_by_the_fingerprint():
    """Negative control: the same check does see what an in-place thop.profile does."""
    thop = import_thop()
    model = nn.Sequential(Conv(3, 8, 3), nn.Linear(32, 4))  # Linear over the last dim keeps it simple
    model.train()
    before = fingerprint(model)
    try:
        with pytest.raises(RuntimeError):
            thop.profile(model, inputs=(torch.randn(1, 3, 8, 8),), verbose=False)  # 8 != 32 features
        seen = changes(before, fingerprint(model))
        assert any("total_ops" in c for c in seen)
        assert any(c.startswith("hooks changed") for c in seen)
        assert any(c.startswith("training mode changed") for c in seen)
    finally:
        clear_thop_buffers(model)


def test_input_mutated_in_place_by_the_forward_is_protected():
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(3, 4, 1))
    x = torch.randn(1, 3, 4, 4)
    x0 = x.clone()
    profile_flops(model, x)
    assert torch.equal(x, x0)
    profile_flops(model, [x])  # a sequence of inputs works too
    assert torch.equal(x, x0)


def test_profile_flops_rejects_bad_models():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        profile_flops(lambda x: x, torch.randn(1))  # type: ignore[arg-type]
    model = nn.Linear(2, 2)
    model.cache = torch.ones(2, requires_grad=True) * 2  # a non-leaf tensor: deepcopy refuses it
    with pytest.raises(TypeError, match="cannot be deep-copied"):
        profile_flops(model, torch.randn(1, 2))
    assert thop_buffers(model) == []


# --- inspection helpers -----------------------------------------------------------------------------------


def test_fingerprint_sees_replaced_tensors_and_non_persistent_buffers():
    m = nn.Linear(2, 2)
    m.register_buffer("scratch", torch.zeros(1), persistent=False)
    fp = fingerprint(m)
    m.scratch.add_(1)
    assert changes(fp, fingerprint(m)) == ["values changed: scratch"]
    fp = fingerprint(m)
    m.weight = nn.Parameter(m.weight.detach().clone())  # same values, new object
    assert changes(fp, fingerprint(m)) == ["tensor object replaced: weight"]


# --- property: random module trees ---------------------------------------------------------------------

SHARED_ACT = nn.SiLU()  # shared at module level across every tree, like ultralytics' Conv.default_act


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Chain(nn.Module):
    def __init__(self, mods: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = m(x)
        return x


class Scale(nn.Module):
    """A custom leaf with a parameter and a float64 buffer, no thop rule."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(C, 1, 1))
        self.register_buffer("ref", torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


LEAVES = {
    "conv": lambda: nn.Conv2d(C, C, 3, padding=1),
    "bn": lambda: nn.BatchNorm2d(C),
    "silu": nn.SiLU,
    "relu": lambda: nn.ReLU(inplace=True),
    "shared": lambda: SHARED_ACT,
    "scale": Scale,
    "boom": Boom,
}
trees = st.recursive(
    st.sampled_from(sorted(LEAVES)),
    lambda kids: st.tuples(
        st.sampled_from(["seq", "residual", "chain"]), st.lists(kids, min_size=1, max_size=3)
    ),
    max_leaves=8,
)


def build(spec: object) -> nn.Module:
    if isinstance(spec, str):
        return LEAVES[spec]()
    kind, kids = spec
    mods = [build(k) for k in kids]
    if kind == "seq":
        return nn.Sequential(*mods)
    if kind == "residual":
        return Residual(nn.Sequential(*mods))
    return Chain(mods)


@settings(max_examples=100, deadline=None)
@given(spec=trees, flags=st.lists(st.booleans(), max_size=24), hook_every=st.integers(2, 5))
def test_profile_flops_never_changes_the_model(spec, flags, hook_every):
    model = build(spec)
    mods = list(model.modules())
    for m, f in zip(mods, flags):
        m.training = f  # per module, not recursive: any mix of modes
    for i, m in enumerate(mods):
        if i % hook_every == 0:
            m.register_forward_hook(lambda *a: None)
    before = fingerprint(model)
    shared_before = fingerprint(SHARED_ACT)
    try:
        gflops, params = profile_flops(model, torch.randn(1, C, 6, 6))
        assert gflops >= 0 and params >= 0
    except ValueError as e:  # a tree containing Boom
        assert str(e) == "boom"
    assert changes(before, fingerprint(model)) == []
    assert changes(shared_before, fingerprint(SHARED_ACT)) == []
