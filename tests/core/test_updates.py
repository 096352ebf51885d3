"""The three pure strategies: correctness against a float64 reference, validation, atomicity."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("hypothesis", reason="hypothesis is not installed (the dev extra)")

from hypothesis import given, settings
from hypothesis import strategies as st

from ema_lab import updates
from ema_lab.bench import models
from ema_lab.updates import foreach_update, gated_update, loop_update

from ..helpers import float_entries, reference_step

STRATEGIES = {"loop": loop_update, "foreach": foreach_update, "gated": gated_update}
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _close(actual: list[torch.Tensor], ref: list[torch.Tensor], model: list[torch.Tensor]) -> None:
    for a, r, m in zip(actual, ref, model):
        if not a.numel():
            continue
        # Each step rounds to the coarser dtype of the pair (the loop's (1 - d) * m temporary is in the
        # model's dtype); the EMA contracts older errors, so the total stays a few eps.
        eps = max(torch.finfo(a.dtype).eps, torch.finfo(m.dtype).eps)
        scale = max(1.0, r.abs().max().item())
        assert (a.double() - r).abs().max().item() <= 16 * eps * scale


def _run(
    strategy: str, ema: list[torch.Tensor], model: list[torch.Tensor], steps: int, seed: int = 0
) -> None:
    gen = torch.Generator().manual_seed(seed)
    ref = [e.double() for e in ema]
    for n in range(steps):
        d = 0.5 + 0.45 * n / max(steps - 1, 1)
        for m in model:
            m.copy_(torch.randn(m.shape, generator=gen).to(m.dtype))
        STRATEGIES[strategy](ema, model, d)
        reference_step(ref, model, d)
    _close(ema, ref, model)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", ["tiny_cnn", "tiny_transformer", "yolo"])
def test_strategies_match_float64_reference_on_models(strategy: str, model_name: str) -> None:
    model = models.build(model_name, seed=1)
    ema = models.build(model_name, seed=2)
    ema_sd, model_sd = float_entries(ema), float_entries(model)
    # tiny_transformer ties its head to its embedding: pass that tensor once.
    keys = [k for k in ema_sd if k != "head.weight"]
    steps = 5 if model_name == "yolo" else 30
    _run(strategy, [ema_sd[k] for k in keys], [model_sd[k] for k in keys], steps)


@pytest.mark.parametrize("strategy", ["loop", "gated"])
def test_mixed_dtype_pairs_promote_like_the_loop(strategy: str) -> None:
    # EMA fp32/bf16, model fp64 (thop's leftover buffers) or bf16 into fp32: the loop's promotion.
    ema = [torch.zeros(3), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(2)]
    model = [
        torch.randn(3, dtype=torch.float64),
        torch.randn(4),
        torch.randn(5, dtype=torch.bfloat16),
        torch.randn(2),
    ]
    _run(strategy, ema, model, 20)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
            st.sampled_from(FLOATS),
            st.sampled_from(FLOATS),
        ),
        min_size=0,
        max_size=8,
    ),
    st.sampled_from(list(STRATEGIES)),
    st.integers(0, 2**16),
)
def test_random_lists_match_reference(spec, strategy: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    if strategy == "foreach":  # foreach requires equal dtypes in each pair
        spec = [(shape, d1, d1) for shape, d1, _ in spec]
    ema = [torch.randn(shape, generator=gen).to(d1) for shape, d1, _ in spec]
    model = [torch.randn(shape, generator=gen).to(d2) for shape, _, d2 in spec]
    _run(strategy, ema, model, 4, seed)


def test_float64_buffer_pair_gated_and_loop_agree_foreach_refuses() -> None:
    ema = [torch.ones(4), torch.full((2,), 2.0), torch.ones(3)]
    model = [torch.zeros(4), torch.zeros(2, dtype=torch.float64), torch.zeros(3)]  # thop's float64 buffer
    outs = {}
    for name in ("loop", "gated"):
        e = [t.clone() for t in ema]
        STRATEGIES[name](e, model, 0.9)
        outs[name] = e
    for a, b in zip(outs["loop"], outs["gated"]):
        torch.testing.assert_close(a, b)
    assert outs["gated"][1].dtype == torch.float32
    before = [t.clone() for t in ema]
    with pytest.raises(ValueError, match=r"entry 1 \('total_ops'\).*torch.float32.*torch.float64"):
        foreach_update(ema, model, 0.9, names=["a", "total_ops", "b"])
    assert all(torch.equal(a, b) for a, b in zip(ema, before))  # nothing touched, not even entry 0


def test_raw_foreach_lerp_is_not_atomic() -> None:
    """The hazard every strategy guards against: torch._foreach_lerp_ fails part-way."""
    ema = [torch.ones(4), torch.ones(2), torch.ones(3)]
    model = [torch.zeros(4), torch.zeros(2, dtype=torch.float64), torch.zeros(3)]
    with pytest.raises(RuntimeError, match="expected dtype float for `end` but got dtype double"):
        torch._foreach_lerp_(ema, model, 0.5)
    assert torch.equal(ema[0], torch.full((4,), 0.5))  # already updated before the failure
    assert torch.equal(ema[2], torch.ones(3))


BAD_INPUTS = {
    "length": ([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)], r"got 1 EMA tensors but 2 model tensors"),
    "shape": (
        [torch.zeros(2), torch.zeros(3)],
        [torch.zeros(2), torch.zeros(1)],
        r"entry 1 \('b'\): EMA shape \(3,\), torch.float32, cpu does not match model shape \(1,\)",
    ),
    "device": (
        [torch.zeros(2), torch.zeros(2)],
        [torch.zeros(2), torch.zeros(2, device="meta")],
        r"entry 1 \('b'\).*cpu does not match model shape \(2,\), torch.float32, meta",
    ),
    "non-float": (
        [torch.zeros(2), torch.zeros(2)],
        [torch.zeros(2), torch.zeros(2, dtype=torch.int64)],
        r"entry 1 \('b'\): EMA and model tensors must be floating point, got EMA torch.float32 and model "
        r"torch.int64",
    ),
    "not a tensor": ([torch.zeros(2), torch.zeros(2)], [torch.zeros(2), [0.0, 0.0]], r"expected two tensors"),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_and_changes_nothing(strategy: str, case: str) -> None:
    ema, model, message = BAD_INPUTS[case]
    ema = [t.clone() + 1 for t in ema]
    before = [t.clone() for t in ema]
    names = ["a", "b"][: len(ema)] if case != "length" else None
    with pytest.raises(ValueError, match=message):
        STRATEGIES[strategy](ema, model, 0.5, names=names)
    assert all(torch.equal(a, b) for a, b in zip(ema, before))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_ema_tensor_listed_twice_is_refused(strategy: str) -> None:
    w = torch.ones(3)
    alias = w.view(3)  # the same memory, as state_dict() returns a tied weight under two keys
    with pytest.raises(ValueError, match=r"entry 1 \('head'\) is the same memory as entry 0 \('embed'\)"):
        STRATEGIES[strategy]([w, alias], [torch.zeros(3), torch.zeros(3)], 0.5, names=["embed", "head"])
    assert torch.equal(w, torch.ones(3))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("decay", [-0.1, 1.5, math.nan, math.inf])
def test_bad_decay(strategy: str, decay: float) -> None:
    with pytest.raises(ValueError, match="decay must be a finite number in"):
        STRATEGIES[strategy]([torch.zeros(1)], [torch.zeros(1)], decay)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_input_is_a_no_op(strategy: str) -> None:
    STRATEGIES[strategy]([], [], 0.9)  # _foreach_lerp_([], [], w) itself would raise


def test_gated_groups_by_device_and_dtype_and_promotes_mixed_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    foreach = torch._foreach_lerp_
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda e, m, w: calls.append(len(e)) or foreach(e, m, w))
    ema = [torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(1), torch.zeros(1)]
    model = [
        torch.ones(1),
        torch.ones(1, dtype=torch.float64),
        torch.ones(1),
        torch.ones(1, dtype=torch.bfloat16),
    ]
    gated_update(ema, model, 0.75)
    assert sorted(calls) == [1, 2]  # one foreach per (device, dtype) group; the mixed pair per tensor
    assert all(e.item() == 0.25 for e in ema)


def test_gate_closed_takes_the_per_tensor_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(updates, "foreach_lerp_supported", lambda v, dev: calls.append(dev) or False)
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda *a: pytest.fail("foreach used behind a closed gate"))
    ema, model = [torch.ones(3), torch.ones(2)], [torch.zeros(3), torch.zeros(2)]
    gated_update(ema, model, 0.75)
    assert calls == ["cpu"]
    assert torch.equal(ema[0], torch.full((3,), 0.75)) and torch.equal(ema[1], torch.full((2,), 0.75))


def test_decay_must_be_a_number_here() -> None:
    with pytest.raises(TypeError, match="decay must be a Python number"):
        gated_update([torch.zeros(1)], [torch.zeros(1)], torch.tensor(0.5))


def test_unknown_strategy() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        updates.prepare("fast", [], [])
