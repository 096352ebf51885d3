"""The flat strategy and flatten_model: views into one buffer, group modes, staleness, training twins."""

from __future__ import annotations

import warnings
from copy import deepcopy

import pytest
import torch
from torch import nn

from ema_lab import (
    ModelEMA,
    flat_step,  # the flat step's private pieces: these tests are about them
    flatten_model,
    unflatten_model,
)
from ema_lab.bench import models
from ema_lab.bench.counting import count_ops
from ema_lab.buffers import tiles_in_order
from ema_lab.ema import resolve_strategy
from ema_lab.flat_step import CAT_MAX_NUMEL
from ema_lab.flatten import flatten_tensors
from ema_lab.pairs import collect_pairs

from ..helpers import one_rank_group


def _tiles(tensors: list[torch.Tensor]) -> bool:
    """The tensors cover one whole storage, in any order."""
    return tiles_in_order(sorted(tensors, key=torch.Tensor.storage_offset))


def _back_to_back(tensors: list[torch.Tensor]) -> bool:
    """The tensors lie back to back in memory (one buffer), each on a storage of its own that covers it (a
    slice of the buffer's: what the EMA's are, so that every save format keeps each entry)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    own = all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
    return own and all(end == start for (_, end), (start, _) in zip(spans, spans[1:]))


def _ema(model: nn.Module, strategy: str, **kwargs) -> ModelEMA:
    """``"flatten_model"``: the model flattened first, then the default EMA."""
    if strategy == "flatten_model":
        flatten_model(model)
        strategy = "auto"
    return ModelEMA(model, strategy=strategy, **kwargs)


def _shift(model: nn.Module, value: float | None = None, seed: int = 0) -> None:
    """Stand-in for an optimizer step: every float parameter and buffer moves."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                noise = torch.randn(t.shape, generator=gen)
                new = torch.full_like(t, value) if value is not None else t + noise
                t.copy_(new)


def _floats(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}


def _assert_follows(ema: ModelEMA, model: nn.Module) -> None:
    """With decay 0 one update must copy the model exactly: proof the EMA reads live memory."""
    _shift(model, value=3.0)
    ema.update(model, decay=0.0)
    for k, v in _floats(ema.ema).items():
        assert torch.equal(v, _floats(model)[k].to(v.dtype)), k


@pytest.mark.parametrize("name", ["tiny_cnn", "tiny_transformer", "tiny_tensors"])
@pytest.mark.parametrize("strategy", ["flat", "flatten_model"])
def test_flat_matches_the_loop_and_ema_tensors_are_views(name, strategy):
    model, twin = models.build(name), models.build(name)
    flat, loop = _ema(model, strategy, tau=5), ModelEMA(twin, tau=5, strategy="loop")
    for step in range(4):
        _shift(model, seed=step), _shift(twin, seed=step)
        flat.update(model), loop.update(twin)
    ref = _floats(loop.ema)
    for k, v in _floats(flat.ema).items():
        torch.testing.assert_close(v, ref[k], rtol=1e-6, atol=1e-6)
    pairs = collect_pairs([flat.ema], model)
    assert _back_to_back(pairs.ema_floats()), "EMA tensors are not views tiling one buffer"
    assert _tiles(pairs.model_floats()) == (strategy == "flatten_model")
    assert (flat.modes == ["fused"]) == (strategy == "flatten_model") and flat.rebuilds == 1


def _modes(tensors: list[torch.Tensor], ema_dtype: torch.dtype = torch.float32, **kwargs) -> list[str]:
    model = nn.ParameterList(tensors)
    ema = ModelEMA(model, **kwargs)
    ema.ema.to(ema_dtype)
    ema.update(model)
    return ema.modes


def test_group_modes_follow_the_documented_rule():
    small = [torch.zeros(4, 4) for _ in range(3)]
    big = [torch.zeros(CAT_MAX_NUMEL + 1) for _ in range(2)]
    assert _modes(big[:1]) == ["fused"]  # one whole tensor tiles its own storage
    assert _modes(small) == ["cat"]
    assert _modes(big) == ["foreach"]
    assert _modes([*small, *big]) == ["cat+foreach"]  # a detector: BN vectors + conv weights
    assert _modes([t.bfloat16() for t in small]) == ["cast"]
    assert _modes(big, cat_max_numel=CAT_MAX_NUMEL + 2) == ["cat"]  # the threshold is a keyword
    flatten_tensors(small)
    assert _modes(small) == ["fused"]
    assert not tiles_in_order(small[:2])  # a part of a storage is not a tiling


def test_a_tensor_without_storage_is_no_tiling():
    """A sparse tensor after a dense one: False, not the NotImplementedError of reading its storage."""
    buf = torch.zeros(4)
    assert not tiles_in_order([buf, torch.zeros(4).to_sparse()])
    assert not tiles_in_order([buf[:2], torch.zeros(2).to_sparse()])


def test_one_kernel_per_group_with_the_model_flattened():
    model = models.build("yolo")
    ema = _ema(model, "flatten_model")
    ema.update(model)
    ops = count_ops(ema.update, model)
    assert ops["aten.lerp_.Scalar"] == 1 and "aten._foreach_lerp_.Scalar" not in ops
    assert ema.modes == ["fused"]
    # The model's BatchNorm counters are flattened too: one copy_ of their buffer, no cat over each of them.
    assert ops["aten.copy_.default"] == 1 and "aten.cat.out" not in ops
    assert sum(ops.values()) == 2


def test_flattened_counters_are_one_buffer_and_follow_the_model():
    model = models.build("tiny_cnn")
    ema = _ema(model, "flatten_model")
    ema.update(model)
    counters = [b for b in model.buffers() if not b.is_floating_point()]
    assert len(counters) > 1 and tiles_in_order([c.view(-1) for c in counters])
    model.train()
    model(torch.randn(2, 3, 16, 16))  # BatchNorm in train mode: num_batches_tracked.add_(1) in place
    ema.update(model)
    ema_counters = [b.item() for b in ema.ema.buffers() if not b.is_floating_point()]
    assert ema_counters == [c.item() for c in counters]
    assert ema.rebuilds == 1  # an in-place step is not a replacement
    model[0].bn.num_batches_tracked = torch.tensor(41)  # a replacement: followed (rebuilt, one cat now)
    ema.update(model)
    assert ema.ema[0].bn.num_batches_tracked.item() == 41 and ema.rebuilds == 2
    model[0].bn._buffers["num_batches_tracked"] = torch.tensor(42)  # no hook fires: the count sees it
    ema.update(model)
    assert ema.ema[0].bn.num_batches_tracked.item() == 42 and ema.rebuilds == 3


def test_flatten_is_reversible_and_keeps_objects_values_and_grad_flags():
    model = models.build("tiny_transformer")
    params = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (buf,) = flatten_tensors([t for t in (*params, *model.buffers()) if t.is_floating_point()])
    assert list(model.parameters()) == params and all(p.requires_grad for p in params)
    assert all(p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for p in params)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    unflatten_model(model)
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    assert len(ptrs) == len(params) and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


OPTIMIZERS = {
    "SGD momentum for-loop": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "SGD momentum foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "AdamW for-loop": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "AdamW fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}
FUSED_ON_CPU = pytest.mark.requires_torch("2.4", "fused AdamW on CPU")


@pytest.mark.parametrize(
    "opt_name", [pytest.param(n, marks=FUSED_ON_CPU) if "fused" in n else n for n in OPTIMIZERS]
)
def test_training_a_flattened_model_is_bitwise_the_same(opt_name):
    torch.manual_seed(0)
    flat_model, plain = models.build("tiny_cnn"), models.build("tiny_cnn")
    make = OPTIMIZERS[opt_name]
    flatten_model(flat_model)  # before the optimizer is built
    flat_opt, plain_opt = make(flat_model.parameters()), make(plain.parameters())
    flat_ema = ModelEMA(flat_model, tau=3)
    plain_ema = ModelEMA(plain, tau=3, strategy="gated")
    flat_ema.update(flat_model)
    plain_ema.update(plain)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        for model, opt, ema in ((flat_model, flat_opt, flat_ema), (plain, plain_opt, plain_ema)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            ema.update(model)
    assert flat_ema.modes == ["fused"], "the optimizer broke the views"
    for a, b in zip(flat_model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(flat_ema.ema.state_dict().values(), plain_ema.ema.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # lerp_ vs _foreach_lerp_ may round apart


BREAKERS = {
    "model.double()": lambda model, ema: model.double(),
    "ema.ema.half()": lambda model, ema: ema.ema.half(),
    "p.data = clone (optimizer replaces a tensor)": lambda model, ema: setattr(
        next(model.parameters()), "data", next(model.parameters()).detach().clone()
    ),
    "reassigned parameter": lambda model, ema: setattr(
        model[-1], "weight", nn.Parameter(model[-1].weight.detach().clone())
    ),
    "replaced buffer": lambda model, ema: setattr(
        model[0].bn, "running_var", model[0].bn.running_var.clone()
    ),
}


@pytest.mark.parametrize("strategy", ["flat", "flatten_model"])
@pytest.mark.parametrize("breaker", list(BREAKERS))
def test_anything_that_breaks_the_views_is_detected(strategy, breaker):
    model = models.build("tiny_cnn")
    ema = _ema(model, strategy)
    ema.update(model)
    BREAKERS[breaker](model, ema)
    _assert_follows(ema, model)  # rebuilt, never averaging the memory the modules left behind
    _assert_follows(ema, model)  # and the rebuilt step is cached and still live


def test_a_transient_extra_view_costs_an_exact_check_not_a_rebuild():
    model = models.build("tiny_cnn")
    ema = _ema(model, "flatten_model")
    ema.update(model)
    keep = model[0].conv.weight.view(-1)  # a live view changes the reference count, breaks nothing
    _assert_follows(ema, model)
    assert ema.rebuilds == 1
    del keep
    _assert_follows(ema, model)
    assert ema.rebuilds == 1


def test_bf16_model_into_an_fp32_ema_without_the_per_tensor_path():
    model = models.build("yolo").bfloat16()
    ema = ModelEMA(model, strategy="auto")
    ema.ema.float()
    ema.update(model)
    assert ema.resolved_strategy == "flat" and ema.modes == ["cast"]
    ops = count_ops(ema.update, model)
    assert ops["aten._foreach_copy_.default"] == 1 and ops["aten.lerp_.Scalar"] == 1
    assert ops["aten.cat.out"] == 1  # the counters (num_batches_tracked): one cat into the EMA's buffer
    assert "aten.add_.Tensor" not in ops and "aten.mul_.Scalar" not in ops
    _assert_follows(ema, model)
    flat_model = models.build("tiny_cnn").half()
    ema = _ema(flat_model, "flatten_model")
    ema.ema.float()
    ema.update(flat_model)
    assert ema.modes == ["fused"]  # one cast-copy + one lerp_
    _assert_follows(ema, flat_model)


def test_a_bf16_ema_at_decay_0_9999_rounds_every_update_away():
    """Notebook 05's stall: 1,000 lerp_ updates of an EMA at 1.0 towards a model 0.01 above it."""
    ends = {}
    for dtype in (torch.bfloat16, torch.float32):
        ema, model = torch.full((1,), 1.0, dtype=dtype), torch.full((1,), 1.01, dtype=dtype)
        for _ in range(1000):
            ema.lerp_(model, 1 - 0.9999)
        ends[dtype] = (ema.item(), model.item() - 1.0)  # the gap as the dtype stores it
    (bf16, bf16_gap), (fp32, gap) = ends[torch.bfloat16], ends[torch.float32]
    step, half_ulp = (1 - 0.9999) * bf16_gap, torch.finfo(torch.bfloat16).eps / 2  # the spacing at 1.0
    assert step < half_ulp and bf16 == 1.0  # each step rounds away: not one update moved it
    assert fp32 == pytest.approx(1.0 + gap * (1 - 0.9999**1000), abs=1e-5)


def test_a_tensor_decay_gives_the_same_ema_and_no_host_sync():
    model = models.build("tiny_cnn")
    by_float, by_tensor = ModelEMA(model, strategy="flat"), ModelEMA(model, strategy="flat")
    for step in range(3):
        _shift(model, seed=step)
        d = by_float.decay(step + 1)
        by_float.update(model, decay=d)
        by_tensor.update(model, decay=torch.tensor(d, dtype=torch.float64))
    for a, b in zip(by_float.ema.state_dict().values(), by_tensor.ema.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    ops = count_ops(by_tensor.update, model, decay=torch.tensor(0.999))
    assert "aten._local_scalar_dense.default" not in ops  # what .item() dispatches


def test_bad_decays_raise_before_touching_the_ema():
    model = models.build("tiny_cnn")
    ema = ModelEMA(model, strategy="flat")
    ema.update(model)
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    with pytest.raises(ValueError, match="0-dim floating tensor"):
        ema.update(model, decay=torch.tensor([0.9, 0.9]))
    with pytest.raises(ValueError, match=r"finite number in \[0, 1\]"):
        ema.update(model, decay=1.5)
    with pytest.raises(TypeError, match="'flat' takes a 0-dim tensor"):
        ModelEMA(model, strategy="gated").update(model, decay=torch.tensor(0.9))
    assert all(torch.equal(v, before[k]) for k, v in ema.ema.state_dict().items())


def test_auto_picks_flat_caches_it_and_stays_safe_with_mixed_dtypes():
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    assert ema.resolved_strategy == "flat"
    ema.update(model)
    model.double()  # every pair now disagrees in dtype: still flat (cast groups), same cached choice
    _assert_follows(ema, model)
    assert ema.resolved_strategy == "flat" and ema.modes == ["cast"]
    sparse = [torch.zeros(2, 2).to_sparse()]
    assert resolve_strategy("auto", sparse) == "gated"


def test_no_recompiles_across_100_steps_of_a_changing_tensor_decay():
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    model = models.build("tiny_cnn")
    ema = ModelEMA(model, strategy="flat")
    ema.update(model)
    step = ema._step  # the arithmetic alone: the staleness check reads Python dicts, not tensors
    compiles = []

    def backend(gm, example_inputs):  # called once per (re)compilation
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    dynamo.reset()
    try:  # a broken compiler stack is an environment fact, reported; a failure of the step is not
        torch.compile(lambda x: x + 1, backend=lambda gm, _: gm.forward, fullgraph=True)(torch.ones(1))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"skipped: torch.compile unusable here ({type(exc).__name__}: {exc})")
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda d: step.apply([d], [1 - d]), backend=backend, fullgraph=True)
    for n in range(1, 101):
        compiled(torch.tensor(ema.decay(n)))
    assert len(compiles) == 1 and counters["stats"]["unique_graphs"] == 1
    dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")
def test_cuda_update_is_sync_free():
    model = models.build("tiny_cnn").cuda()
    ema = ModelEMA(model, strategy="flat")
    decay = torch.tensor(0.999, device="cuda")
    ema.update(model, decay=decay)  # builds the flat buffers (may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ema.update(model, decay=decay)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_an_unrelated_in_place_buffer_increment_does_not_invalidate_the_cache():
    other = nn.Module()
    other.register_buffer("step", torch.zeros((), dtype=torch.long))
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    ema.update(model)
    other.step += 1  # what AveragedModel and ema-pytorch do on every update: same object re-registered
    ema.update(model)
    assert ema.rebuilds == 1
    other.step = torch.zeros((), dtype=torch.long)  # a replacement in another module: not this EMA's
    ema.update(model)
    assert ema.rebuilds == 1
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    bn.num_batches_tracked = torch.zeros((), dtype=torch.long)  # a replacement in the model: rebuild
    ema.update(model)
    assert ema.rebuilds == 2


def test_converting_only_the_buffers_of_a_flattened_model_is_detected():
    model = models.build("tiny_cnn")
    model[0].bn.running_var = model[0].bn.running_var.half()  # a model with one fp16 buffer
    ema = _ema(model, "flatten_model")
    ema.update(model)
    assert sorted(ema.modes) == ["fused", "fused"]
    model.float()  # parameters untouched; the fp16 buffer is replaced by a new fp32 object, no hook fires
    _assert_follows(ema, model)


def test_cat_runs_stay_under_the_grain_and_cover_every_tensor_in_order() -> None:
    numels = [1000] * 70 + [30000, 5, 40000, 7]
    runs = flat_step._runs(numels, 32768)  # the private run splitter: this test is about it
    assert [i for r in runs for i in r] == list(range(len(numels)))
    assert all(sum(numels[i] for i in r) < 32768 or len(r) == 1 for r in runs)
    assert [len(r) for r in runs] == [32, 32, 6, 2, 1, 1]  # a 33rd 1000 would reach 32768; 40000 runs alone
    assert flat_step._runs([], 32768) == []


def test_the_cat_part_gives_the_same_bits_built_at_one_and_two_threads() -> None:
    # tiny_tensors: 2000 small tensors, 272K elements, gathered in 9 runs when built at 2 threads, at 1 in
    # 2 (one cat per trailing shape: the biases, then the 16x16 weights)
    model = models.build("tiny_tensors")
    emas = [ModelEMA(model) for _ in range(2)]
    before = torch.get_num_threads()
    try:
        for threads, e in zip((1, 2), emas):
            torch.set_num_threads(threads)
            e.update(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        for e in emas:
            e.update(model, decay=0.9)
    finally:
        torch.set_num_threads(before)
    assert [len(e._step.groups[0].runs) for e in emas] == [
        2,
        9,
    ]  # the step's private runs: this test's subject
    for (k, a), b in zip(emas[0].ema.state_dict().items(), emas[1].ema.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_flat_ema_saves_copies_and_converts_like_any_other(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024))
    ema = ModelEMA(model)
    _shift(model)
    ema.update(model)
    want = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    torch.save(ema.ema.state_dict(), tmp_path / "ema.pt")
    loaded = torch.load(tmp_path / "ema.pt")
    for k, v in want.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    copy = deepcopy(ema)  # what ultralytics' checkpoint does before .half()
    copy.ema.half()
    assert all(v.dtype == torch.float16 for v in copy.ema.parameters())
    torch.testing.assert_close(copy.ema[0].weight.float(), want["0.weight"].half().float(), rtol=0, atol=0)
    copy.update(model)  # the copy rebuilds its own step over its own buffers
    assert copy.rebuilds == 2 and ema.rebuilds == 1


def test_views_made_and_dropped_of_the_emas_buffer_cost_no_rebuild() -> None:
    """The watch reads each slot's data_ptr(): a view made elsewhere neither rebuilds nor blinds it."""
    model = models.build("tiny_cnn")
    ema = ModelEMA(model, strategy="flat")
    ema.update(model)
    extra = next(ema.ema.parameters()).view(-1)  # one more tensor on the flat storage
    ema.update(model)
    assert ema.rebuilds == 1
    ema.ema.half()  # the extra view keeps the old storage alive; the EMA's slots hold new memory
    ema.update(model)
    assert ema.rebuilds == 2 and extra.dtype == torch.float32
    del extra
    ema.update(model)
    assert ema.rebuilds == 2


def test_flatten_model_makes_every_group_fused_and_unflatten_undoes_it():
    from ema_lab import unflatten_model

    model = models.build("tiny_cnn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = flatten_model(model)
    assert {b.dtype for b in buffers} == {torch.float32, torch.int64}
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    ema = ModelEMA(model)
    ema.update(model)
    assert ema.modes == ["fused"]
    unflatten_model(model)
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    ema.update(model)
    assert ema.modes != ["fused"] and ema.rebuilds == 2


def test_a_tensor_weight_where_foreach_is_fused_goes_as_views_of_one_filled_buffer(monkeypatch) -> None:
    # On CUDA _foreach_lerp_ keeps its fused kernel only with a weight shaped like each tensor: a 0-dim weight
    # per tensor launches one kernel per tensor. Here the CPU stands in for such a device.
    model = models.build("tiny_cnn")
    per_tensor = ModelEMA(model)
    decay = torch.tensor(0.75)
    per_tensor.update(model, decay=decay)  # builds its step before the patch: 0-dim weights
    monkeypatch.setattr(flat_step, "fused_foreach_devices", lambda: ["cpu"])
    monkeypatch.setattr(flat_step, "DENSE_WEIGHT_NUMEL", 3000)  # tiny_cnn's 4608-element weight goes alone
    dense = ModelEMA(model)
    dense.update(model, decay=decay)
    with torch.no_grad():
        for v in model.parameters():
            v.add_(1.0)
    counts = count_ops(dense.update, model, decay=decay)
    per_tensor.update(model, decay=decay)
    assert dense.modes == ["cat+foreach"]
    assert counts["aten.fill_.Tensor"] == 1  # the weight buffer, from the device tensor: no .item()
    assert counts["aten._foreach_lerp_.List"] == 1 and counts["aten.lerp_.Tensor"] == 1
    want = per_tensor.ema.state_dict()
    for k, v in dense.ema.state_dict().items():
        assert torch.equal(v, want[k]), k


# flatten_model checks everything before it moves anything (issue 45): each case that once broke training
# silently is refused with one line naming the tensor, the model untouched, or kept and said so.


#: The check of memory held outside the model reads storages' use counts (flatten.py says where not).
USE_COUNT = pytest.mark.requires_torch("2.1", "torch._C._storage_Use_Count")


def _layout(model: nn.Module) -> dict[str, tuple]:
    """Where and how each parameter and buffer lies, and its value: equal before and after is untouched."""
    out = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers()):
        if t.layout != torch.strided or t.is_nested or t.device.type == "meta" or isinstance(t, _Wrapper):
            out[name] = (id(t), t.layout, t.device)
        else:
            out[name] = (id(t), t.data_ptr(), t.stride(), t.storage_offset(), t.detach().clone())
    return out


def _assert_untouched(model: nn.Module, before: dict[str, tuple]) -> None:
    after = _layout(model)
    assert after.keys() == before.keys()
    for name, was in before.items():
        now = after[name]
        assert now[:-1] == was[:-1], name
        assert torch.equal(now[-1], was[-1]) if isinstance(was[-1], torch.Tensor) else now == was, name


def _flattened(model: nn.Module) -> bool:
    """Each dtype's tensors of ``model`` tile one storage."""
    tensors = [*model.parameters(), *model.buffers()]
    return all(_tiles([t for t in tensors if t.dtype == d]) for d in {t.dtype for t in tensors})


def _shared_by_data() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight.data = model[0].weight.data  # two Parameters, one memory
    return model


def _buffer_viewing_a_parameter_as_ints() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].register_buffer("bits", model[0].bias.detach()[2:].view(torch.int32))  # bytes 8-16 of 0.bias
    return model


def _buffer_viewing_a_parameter() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].register_buffer("flat_weight", model[1].weight.detach().view(-1))
    return model


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (_shared_by_data, "'0.weight' and '1.weight'"),
        (_buffer_viewing_a_parameter, "'1.weight' and '1.flat_weight'"),
        (_buffer_viewing_a_parameter_as_ints, "'0.bias' and '0.bits'"),
    ],
)
def test_tensors_sharing_memory_are_refused_with_the_model_untouched(build, names):
    model = build()
    before = _layout(model)
    with pytest.raises(ValueError, match=f"cannot flatten {names}: they share memory"):
        flatten_model(model)
    _assert_untouched(model, before)
    with pytest.raises(ValueError, match="share memory"):
        unflatten_model(model)  # giving each its own memory would untie them just the same
    _assert_untouched(model, before)


def test_tied_weights_one_parameter_under_two_names_still_flatten_and_train_alike():
    def tied() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
        return model

    flat, plain = tied(), tied()
    (buf,) = flatten_model(flat)
    assert flat[1].weight is flat[0].weight and buf.numel() == 40  # stored once
    for model in (flat, plain):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(3):
            opt.zero_grad()
            model(torch.arange(10)).logsumexp(-1).sum().backward()
            opt.step()
    assert torch.equal(flat[0].weight, plain[0].weight)


class _DataCachingOptimizer:
    """An optimizer that, like some hand-written ones, keeps ``p.data`` and writes there."""

    def __init__(self, params) -> None:
        self.params = [p.data for p in params]

    def step(self) -> None:
        for p in self.params:
            p.sub_(1.0)


@USE_COUNT
def test_memory_held_outside_the_model_is_refused_until_released():
    model = models.build("tiny_cnn")
    opt = _DataCachingOptimizer(model.parameters())
    before = _layout(model)
    with pytest.raises(
        ValueError, match=r"cannot flatten '0\.conv\.weight': 1 more tensor\(s\) hold its memory outside"
    ):
        flatten_model(model)
    _assert_untouched(model, before)
    ema = ModelEMA(model)  # an EMA built before flattening holds the model's memory too
    ema.update(model)
    del opt
    with pytest.raises(ValueError, match="hold its memory outside the model"):
        flatten_model(model)
    _assert_untouched(model, before)
    del ema
    flatten_model(model)
    assert _flattened(model)


def test_a_view_held_only_by_a_reference_cycle_is_collected_not_refused():
    model = models.build("tiny_cnn")
    cycle: list = [model[0].conv.weight.view(-1)]
    cycle.append(cycle)  # garbage that only the cycle collector frees
    del cycle
    flatten_model(model)
    assert _flattened(model)


def test_without_the_use_count_binding_memory_held_outside_is_not_checked(monkeypatch):
    from ema_lab import flatten

    monkeypatch.setattr(flatten, "USE_COUNT", None)  # the use-count binding: this test is about it
    model = models.build("tiny_cnn")
    kept = model[0].conv.weight.data
    flatten_model(model)  # as the docstring says: not checked, so not refused
    assert kept.data_ptr() != model[0].conv.weight.data_ptr()


class _Wrapper(torch.Tensor):
    """A wrapper subclass with no memory of its own, as DTensor is."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def _with_buffer(name: str, make) -> nn.Module:
    """tiny_cnn with one more buffer, registered last: a half-done move would have moved the rest first."""
    model = models.build("tiny_cnn")
    model[6].register_buffer(name, make())
    return model


UNMOVABLE = {
    "sparse": (lambda: torch.eye(3).to_sparse(), "a torch.sparse_coo tensor has no strided memory"),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), "a torch.sparse_csr tensor"),
    "nested": (lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), "a nested tensor"),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8),
        "a quantized tensor",
    ),
    "meta": (lambda: torch.zeros(3, device="meta"), "a meta tensor has no memory"),
    "expanded": (lambda: torch.zeros(3, 1).expand(3, 4), r"strides \(1, 0\) of shape \(3, 4\) leave gaps"),
    "strided slice": (lambda: torch.zeros(4, 6)[:, ::2], r"strides \(6, 2\) of shape \(4, 3\) leave gaps"),
    "wrapper subclass": (lambda: _Wrapper(torch.zeros(3)), "a _Wrapper \\(a tensor subclass\\)"),
}


@pytest.mark.filterwarnings("ignore:.*quantiz", "ignore:Sparse CSR", "ignore:The PyTorch API of nested")
@pytest.mark.parametrize("case", list(UNMOVABLE))
def test_a_tensor_that_cannot_be_a_view_is_refused_before_anything_moves(case):
    make, reason = UNMOVABLE[case]
    model = _with_buffer("odd", make)
    before = _layout(model)
    with pytest.raises(ValueError, match=f"cannot flatten '6.odd': {reason}.*nothing moved"):
        flatten_model(model)
    _assert_untouched(model, before)


def test_a_lazy_parameter_is_refused_until_its_first_forward():
    model = nn.Sequential(nn.Linear(3, 4), nn.LazyLinear(2))
    before = model[0].weight.data_ptr(), model[0].bias.data_ptr()
    with pytest.raises(ValueError, match="cannot flatten '1.weight': an uninitialized lazy parameter"):
        flatten_model(model)
    assert (model[0].weight.data_ptr(), model[0].bias.data_ptr()) == before
    model(torch.zeros(1, 3))
    flatten_model(model)
    assert _flattened(model)


def test_a_failure_while_moving_leaves_the_model_as_it_was(monkeypatch):
    from ema_lab import flatten as flat

    model = models.build("tiny_cnn")  # two groups: float32 and int64 (BatchNorm's counters)
    before = _layout(model)
    calls = []

    def out_of_memory_on_the_second(numel, dtype, device="cpu"):
        calls.append(dtype)
        if len(calls) == 2:
            raise RuntimeError("out of memory (a stand-in)")
        return flat.empty_flat(numel, dtype, device)

    monkeypatch.setattr(flat, "empty_flat", out_of_memory_on_the_second)
    with pytest.raises(RuntimeError, match="out of memory"):
        flatten_model(model)
    assert len(calls) == 2
    _assert_untouched(model, before)


def test_a_failure_while_pointing_the_tensors_puts_back_those_already_pointed():
    from ema_lab.flatten import _assign

    a, b, c = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    ptrs = [t.data_ptr() for t in (a, b, c)]
    unusable = torch.zeros(2).to_sparse()  # `.data = ` refuses a sparse tensor for a dense one
    with pytest.raises(RuntimeError):
        _assign([(a, torch.full((2,), 5.0)), (b, torch.full((2,), 6.0)), (c, unusable)])
    assert [t.data_ptr() for t in (a, b, c)] == ptrs
    assert a.tolist() == [0.0, 0.0] and b.tolist() == [1.0, 1.0]


def _channels_last_cnn() -> nn.Module:
    return models.build("tiny_cnn").to(memory_format=torch.channels_last)


def test_channels_last_is_kept_inside_the_buffer_and_trains_bit_for_bit():
    flat_model, plain = _channels_last_cnn(), _channels_last_cnn()
    flatten_model(flat_model)
    convs = [m.weight for m in flat_model.modules() if isinstance(m, nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convs)
    assert len({w.untyped_storage().data_ptr() for w in convs}) == 1
    gen = torch.Generator().manual_seed(1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (flat_model, plain)]
    emas = [ModelEMA(flat_model, tau=3), ModelEMA(plain, tau=3, strategy="loop")]
    for _ in range(3):
        x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        for model, opt, ema in zip((flat_model, plain), opts, emas):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            ema.update(model)
    for a, b in zip(flat_model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b) and a.stride() == b.stride()
    # Not one lerp_ (the fused update wants contiguous tensors, as the docstring says), but the same EMA.
    assert emas[0].modes != ["fused"]
    for a, b in zip(emas[0].ema.state_dict().values(), emas[1].ema.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    unflatten_model(flat_model)
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert len({w.untyped_storage().data_ptr() for w in convs}) == len(convs)


@USE_COUNT
def test_a_second_call_moves_nothing_even_with_the_first_buffers_kept():
    model = models.build("tiny_cnn")
    first = flatten_model(model)
    ema = ModelEMA(model)  # its fused step holds the buffers too
    ema.update(model)
    before = _layout(model)
    second = flatten_model(model)
    _assert_untouched(model, before)
    assert [b.untyped_storage().data_ptr() for b in second] == [b.untyped_storage().data_ptr() for b in first]
    assert ema.modes == ["fused"] and ema.rebuilds == 1
    model[6].bias = nn.Parameter(torch.zeros(10))  # one tensor of its own: that group moves again, if free
    with pytest.raises(ValueError, match="hold its memory outside the model"):
        flatten_model(model)
    del first, second, ema
    flatten_model(model)
    assert _flattened(model)


def test_zero_size_and_complex_tensors_flatten_and_come_back():
    model = nn.Module()
    model.empty = nn.Parameter(torch.zeros(0, 3))
    model.weight = nn.Parameter(torch.randn(3))
    model.register_buffer("phase", torch.randn(2, dtype=torch.complex64))
    model.register_buffer("none_yet", torch.zeros(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = flatten_model(model)
    assert [(b.dtype, b.numel()) for b in buffers] == [(torch.float32, 3), (torch.complex64, 2)]
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    ema = ModelEMA(model)
    ema.update(model)
    assert ema.modes == ["fused"]  # the complex buffer is copied like a counter, not averaged
    unflatten_model(model)
    assert model.weight.untyped_storage().nbytes() == 12
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


def _parametrized(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    if kind == "parametrize":

        class Symmetric(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x.triu() + x.triu(1).transpose(-1, -2)

        nn.utils.parametrize.register_parametrization(model[0], "weight", Symmetric())
    elif kind == "weight_norm (parametrizations)":
        nn.utils.parametrizations.weight_norm(model[0])
    elif kind == "spectral_norm (hooks)":  # its power iteration writes buffers u and v in place
        nn.utils.spectral_norm(model[0])
        with torch.no_grad():  # until a forward computes it, model[0].weight is a view of weight_orig
            model(torch.zeros(1, 6))
    else:
        with warnings.catch_warnings():  # deprecated in favour of the parametrization, still used
            warnings.simplefilter("ignore")
            nn.utils.weight_norm(model[0])
    return model


@pytest.mark.parametrize(
    "kind", ["parametrize", "weight_norm (parametrizations)", "weight_norm (hooks)", "spectral_norm (hooks)"]
)
def test_parametrized_weights_flatten_and_train_bit_for_bit(kind):
    flat, plain = _parametrized(kind), _parametrized(kind)
    flatten_model(flat)
    assert _flattened(flat)
    # Some CPUs' BLAS matrix-vector product (spectral_norm's power iteration) rounds by where a tensor starts
    # in memory; flatten_model packs tensors back to back, off the 64-byte boundary of a fresh tensor. The
    # plain model's tensors are moved to the same offsets (mod 64 bytes), so only flatten_model differs.
    with torch.no_grad():
        for a, b in zip(flat.state_dict(keep_vars=True).values(), plain.state_dict(keep_vars=True).values()):
            start = a.data_ptr() % 64 // a.element_size()
            b.data = torch.empty(start + b.numel() + 64)[start : start + b.numel()].view(b.shape).copy_(b)
    gen = torch.Generator().manual_seed(2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (flat, plain)]
    for _ in range(3):
        x = torch.randn(5, 6, generator=gen)
        for model, opt in zip((flat, plain), opts):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for (k, a), b in zip(flat.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k


@USE_COUNT
def test_flattened_in_the_middle_of_training_trains_bit_for_bit():
    """Flattened after some steps (momentum state exists); refused between a forward and its backward,
    whose graph holds views of the weights (Linear saves ``weight.t()``)."""
    torch.manual_seed(0)
    flat, plain = models.build("tiny_cnn"), models.build("tiny_cnn")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, foreach=True) for m in (flat, plain)]
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        for model, opt in zip((flat, plain), opts):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if step == 2 and model is flat:
                before = _layout(flat)
                with pytest.raises(ValueError, match="cannot flatten '6.weight'.*autograd graph"):
                    flatten_model(flat)
                _assert_untouched(flat, before)
            loss.backward()
            opt.step()
            if step == 2 and model is flat:
                flatten_model(flat)  # the graph is freed
    assert _flattened(flat)
    for (k, a), b in zip(flat.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")
def test_a_model_on_two_devices_gets_one_buffer_per_device():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).cuda())
    buffers = flatten_model(model)
    assert sorted(b.device.type for b in buffers) == ["cpu", "cuda"]
    assert model[0].weight.device.type == "cpu" and model[1].weight.device.type == "cuda"
    assert _tiles([model[1].weight, model[1].bias])


def test_flattened_under_inference_mode_the_model_still_trains():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with torch.inference_mode():
        flatten_model(model)
    assert _flattened(model) and not any(p.is_inference() for p in model.parameters())
    x = torch.randn(2, 3, requires_grad=True)
    model(x).sum().backward()  # an inference tensor here: "Inference tensors cannot be saved for backward"
    assert x.grad is not None and model[0].weight.grad is not None


def test_unflatten_leaves_tensors_that_own_their_memory_where_they_are():
    model = models.build("tiny_cnn")
    before = _layout(model)
    unflatten_model(model)
    _assert_untouched(model, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device (pinned memory needs one)")
def test_pinned_memory_stays_pinned():
    model = nn.Linear(4, 4)
    model.weight.data = model.weight.data.pin_memory()
    flatten_model(model)
    assert model.weight.is_pinned() and model.bias.is_pinned() and _flattened(model)
    unflatten_model(model)
    assert model.weight.is_pinned()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory):
    """A one-rank gloo process group in this process (DDP and FSDP2 wrap models only inside one)."""
    with one_rank_group(tmp_path_factory.mktemp("pg")):
        yield


@pytest.mark.parametrize("when", ["before", "after"])
def test_flattened_before_or_after_ddp_wraps_it_trains_bit_for_bit(one_rank, when):
    ddp = nn.parallel.DistributedDataParallel
    flat, plain = models.build("tiny_cnn"), models.build("tiny_cnn")
    if when == "before":
        flatten_model(flat)
    wrapped = ddp(flat)
    if when == "after":
        flatten_model(wrapped)  # DDP holds the Parameter objects, no view of their memory
    both = (wrapped, ddp(plain))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in both]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        for model, opt in zip(both, opts):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert _flattened(flat)
    for (k, a), b in zip(flat.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k


def test_an_fsdp2_sharded_model_is_refused_by_name(one_rank):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        pytest.skip(f"skipped: torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (2.6+)")
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ValueError, match=r"cannot flatten '0\.weight': a DTensor \(a tensor subclass\)"):
        flatten_model(model)


def test_a_model_compiled_and_run_before_it_is_flattened_still_gives_the_same_output():
    model, plain = models.build("tiny_cnn").eval(), models.build("tiny_cnn").eval()
    x = torch.randn(2, 3, 16, 16)
    try:  # a broken compiler stack is an environment fact, reported; a failure of flatten_model is not
        compiled = torch.compile(model, backend="eager")
        compiled(x)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"skipped: torch.compile unusable here ({type(exc).__name__}: {exc})")
    flatten_model(model)  # the compiled graphs hold no view of the weights' memory
    with torch.no_grad():
        for p in (*model.parameters(), *plain.parameters()):
            p.mul_(1.5)  # the compiled model must read the new memory
    assert _flattened(model) and torch.equal(compiled(x), plain(x))
    torch._dynamo.reset()


@USE_COUNT
def test_spectral_norm_is_refused_until_a_forward_replaces_its_view_of_the_weight():
    model = nn.utils.spectral_norm(nn.Linear(3, 3))  # sets model.weight = weight_orig.data, a plain attribute
    with pytest.raises(ValueError, match="cannot flatten 'weight_orig': 1 more tensor"):
        flatten_model(model)
    with torch.no_grad():
        model(torch.zeros(1, 3))  # the hook computes model.weight: new memory
    flatten_model(model)
    assert _flattened(model)


def test_a_flattened_model_under_autocast_and_a_state_dict_round_trip_trains_bit_for_bit():
    flat, plain = models.build("tiny_cnn"), models.build("tiny_cnn")
    flatten_model(flat)
    flat.load_state_dict(plain.state_dict())  # copied in place: still flattened
    assert _flattened(flat)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (flat, plain)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        for model, opt in zip((flat, plain), opts):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
    assert _flattened(flat)
    for (k, a), b in zip(flat.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k
