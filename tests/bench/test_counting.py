"""count_ops: deterministic op counts for every strategy on every zoo model; the kernel counter's honesty."""

from __future__ import annotations

import inspect
from collections import Counter
from copy import deepcopy

import pytest
import torch

from ema_lab import ModelEMA
from ema_lab.bench import models
from ema_lab.bench.counting import (
    KernelCountUnavailable,
    count_host_launches,
    count_kernel_launches,
    count_ops,
    is_view_op,
    kernel_launches_or_reason,
    without_views,
)
from ema_lab.bench.seed import seed_after, seed_before
from ema_lab.ema import STRATEGIES
from ema_lab.flat_step import MIN_LIVE_RUN

D = 0.9999


def test_count_ops_keys_by_overload_and_drops_nothing():
    x = torch.zeros(4)
    counts = count_ops(lambda: (x.add_(1), x.view(2, 2), x.detach(), torch.add(x, x)))
    assert counts == Counter(
        {"aten.add_.Tensor": 1, "aten.view.default": 1, "aten.detach.default": 1, "aten.add.Tensor": 1}
    )
    assert without_views(counts) == Counter({"aten.add_.Tensor": 1, "aten.add.Tensor": 1})
    assert is_view_op("aten.detach.default") and not is_view_op("aten._foreach_lerp_.Scalar")


def test_ops_inside_a_foreach_are_not_counted():
    ema, model = [torch.zeros(3) for _ in range(10)], [torch.ones(3) for _ in range(10)]
    # CPU runs a per-tensor lerp loop inside this one op; the counter sees only the op it dispatched.
    assert count_ops(torch._foreach_lerp_, ema, model, 0.5) == Counter({"aten._foreach_lerp_.Scalar": 1})
    assert ema[9].tolist() == [0.5] * 3  # the op still ran


def test_count_ops_passes_arguments_and_is_deterministic():
    a, b = torch.zeros(5), torch.ones(5)
    first = count_ops(torch.lerp, a, b, weight=0.25)
    assert first == count_ops(torch.lerp, a, b, weight=0.25) == Counter({"aten.lerp.Scalar": 1})


def _expected(name: str, stats: models.ModelStats, distinct: int, other: int, floats: list) -> Counter:
    """Op counts of one steady-state update, from the model's entry counts."""
    f, e = stats.float_tensors, stats.entries
    # Every strategy keeps the EMA's counters in one buffer: one cat of the model's fills it.
    copy_other = Counter({"aten.cat.out": 1} if other else {})
    if (
        name == "seed_before"
    ):  # v *= d; v += (1 - d) * msd[k].detach(); two state_dict() walks detach each entry
        return Counter(
            {
                "aten.mul_.Tensor": f,
                "aten.mul.Tensor": f,
                "aten.add_.Tensor": f,
                "aten.detach.default": 2 * e + f,
            }
        )
    if name == "seed_after":
        return Counter({"aten._foreach_lerp_.Scalar": 1, "aten.detach.default": 2 * e})
    if name == "loop":  # cached pairs: no state_dict walk, tied weights once
        per = {"aten.mul_.Tensor", "aten.mul.Tensor", "aten.add_.Tensor", "aten.detach.default"}
        return Counter(dict.fromkeys(per, distinct)) + copy_other
    if name in {"foreach", "gated", "auto"}:  # every zoo model is one (cpu, float32) group
        return Counter({"aten._foreach_lerp_.Scalar": 1}) + copy_other
    if name == "flat_model":  # the model flattened too (its counters included): one lerp_, one copy_
        return Counter({"aten.lerp_.Scalar": 1}) + Counter({"aten.copy_.default": 1} if other else {})
    if name == "flat":  # small tensors: read live from their slots, one cat per trailing shape that at least
        # MIN_LIVE_RUN share, one for the 1-D ones and the rarer shapes' (each viewed flat), at 2+ threads in
        # runs, each run viewed flat; then one _foreach_lerp_ over the runs and the large tensors (one lerp_
        # if that is one target)
        limit = inspect.signature(ModelEMA).parameters["cat_max_numel"].default
        small = [t for t in floats if t.numel() < limit]
        shapes: dict[object, list[torch.Tensor]] = {}
        for t in small:
            shapes.setdefault(tuple(t.shape[1:]) if t.dim() else None, []).append(t)
        rare = [t for ts in shapes.values() if ts[0].dim() != 1 and len(ts) < MIN_LIVE_RUN for t in ts]
        rare.sort(key=lambda t: next(i for i, f in enumerate(floats) if f is t))
        vectors = [t.numel() for t in small if t.dim() == 1] + [t.numel() for t in rare]
        gathers = [
            [t.numel() for t in ts] for ts in shapes.values() if ts[0].dim() != 1 and len(ts) >= MIN_LIVE_RUN
        ]
        gathers += [vectors] if vectors else []
        runs = sum(_cat_runs(n) if torch.get_num_threads() > 1 else 1 for n in gathers)
        targets = runs + len(floats) - len(small)
        lerp = "aten._foreach_lerp_.Scalar" if targets > 1 else "aten.lerp_.Scalar"
        reads = Counter({"aten.cat.default": runs, "aten.view.default": runs + len(rare)} if runs else {})
        return reads + Counter({lerp: 1}) + copy_other
    raise AssertionError(f"no expected op count for strategy {name!r}: add it to _expected")


def _cat_runs(numels: list[int]) -> int:
    # At 2+ threads a CPU torch.cat of 32768 (ATen's GRAIN_SIZE) or more elements copies input by input,
    # so the small tensors are gathered in runs of consecutive ones under that many elements.
    runs, total = 1, 0
    for n in numels:
        if total + n >= 32768 and total:
            runs, total = runs + 1, 0
        total += n
    return runs


@pytest.fixture(scope="module", params=list(models.ZOO))
def zoo_model(request):
    return request.param, models.build(request.param)


def test_op_counts_for_every_strategy_on_every_zoo_model(zoo_model):
    name, model = zoo_model
    stats = models.describe(model)
    sd = model.state_dict()
    by_ptr = {v.data_ptr(): v for v in sd.values() if v.is_floating_point()}
    distinct, floats = len(by_ptr), list(by_ptr.values())
    other = sum(not v.is_floating_point() for v in sd.values())
    ema_module = deepcopy(model)
    got = {
        "seed_before": count_ops(seed_before, ema_module, model, D),
        "seed_after": count_ops(seed_after, ema_module, model, D),
    }
    resolved = {"seed_before": "seed_before", "seed_after": "seed_after"}
    for strategy in STRATEGIES:  # read at run time: strategies added later are covered too
        layout = [v.data_ptr() for v in model.state_dict().values()]
        ema = ModelEMA(model, strategy=strategy)
        ema.update(model)  # the first update collects the pairs; count the steady state
        got[strategy] = count_ops(ema.update, model)
        assert count_ops(ema.update, model) == got[strategy], f"{strategy}: not deterministic"
        resolved[strategy] = ema.resolved_strategy  # "auto" is checked as what it runs
        if [v.data_ptr() for v in model.state_dict().values()] != layout:
            model = models.build(name)  # flat_model re-pointed the model's tensors: the next gets a fresh one
        del ema
    for strategy, counts in got.items():
        assert counts == _expected(resolved[strategy], stats, distinct, other, floats), f"{name} / {strategy}"
    # The seed's figure: 3 compute ops per float tensor before, one foreach op after.
    assert sum(without_views(got["seed_before"]).values()) == 3 * stats.float_tensors
    assert sum(without_views(got["seed_after"]).values()) == 1


def test_kernel_counter_says_not_available_instead_of_a_number():
    x = torch.zeros(3)
    for device in ("cpu", "mps"):
        with pytest.raises(KernelCountUnavailable, match=r"^not available: "):
            count_kernel_launches(x.add_, 1, device=device)
        with pytest.raises(KernelCountUnavailable, match=r"^not available: "):
            count_host_launches(x.add_, 1, device=device)
        assert kernel_launches_or_reason(x.add_, 1, device=device).startswith("not available: ")
    if not torch.cuda.is_available():
        assert "no CUDA device" in kernel_launches_or_reason(x.add_, 1, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")
def test_cuda_kernel_launches_foreach_vs_loop():  # pragma: no cover - needs a GPU
    ema = [torch.zeros(100, device="cuda") for _ in range(64)]
    model = [torch.ones(100, device="cuda") for _ in range(64)]
    fused = count_kernel_launches(torch._foreach_lerp_, ema, model, 0.1)
    looped = count_kernel_launches(lambda: [e.lerp_(m, 0.1) for e, m in zip(ema, model)])
    assert sum(looped.values()) == 64
    assert 1 <= sum(fused.values()) < 64  # multi_tensor_apply: a few chunked launches
    assert count_host_launches(lambda: [e.lerp_(m, 0.1) for e, m in zip(ema, model)]) == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")
def test_cuda_graph_update_is_two_host_launches():  # pragma: no cover - needs a GPU
    model = models.build("tiny_tensors").cuda()
    ema = ModelEMA(model, cuda_graph=True)
    for _ in range(2):  # eager, then recorded and replayed
        ema.update(model)
    assert count_host_launches(ema.update, model) == 2  # the weight's fill_, the graph's launch
    assert sum(count_kernel_launches(ema.update, model).values()) >= 2  # what the replay ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")
def test_cuda_a_tensor_decay_keeps_the_fused_foreach_kernel():  # pragma: no cover - needs a GPU
    model = models.build("tiny_tensors").cuda()  # 2,000 tensors: one kernel each would be 2,000
    ema = ModelEMA(model, cat_max_numel=0)  # every tensor in the foreach, none gathered
    decay = torch.tensor(0.999, device="cuda")
    ema.update(model, decay=decay)
    with_float = sum(count_kernel_launches(ema.update, model).values())
    with_tensor = sum(count_kernel_launches(ema.update, model, decay=decay).values())
    # A third list (the weights) packs fewer tensors per launch (48 against 64 in torch 2.11's
    # MultiTensorApply.cuh), plus 1 - decay, its clamp to [0, 1] (nan_to_num_, clamp_: checks.weight_of) and
    # the buffer's fill; one launch per tensor would be 2,000.
    assert with_tensor <= 2 * with_float < 200
