# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Beyond foreach: an EMA update at the memory-bandwidth roofline
#
# After ultralytics PR #25315 an EMA update is one `torch._foreach_lerp_` call. On a model with
# hundreds of small tensors most of its time is still overhead, not arithmetic: walking
# `state_dict()`, and on CPU a C++ loop that pays about half a microsecond per tensor. The floor for
# the update is one `lerp_` over two contiguous buffers holding the same elements. This notebook
# walks from the seed's before-code to that floor, one step at a time, and checks that every step
# stays correct.
#
# **You will learn**
# - the ladder: per-tensor loop → `state_dict` walk + foreach → cached lists → flat buffers, with
#   the ATen op count of each rung (deterministic) and its time (measured here);
# - why a cached list is a hazard (`model.double()` and the EMA silently stops) and how a flat
#   buffer makes checking it O(1): count the references to the buffer's storage;
# - how `flat_model` (opt-in) turns the whole update into one kernel, and that training a flattened
#   model gives bitwise the same weights;
# - why a bf16 EMA at decay 0.9999 never moves, and how the flat strategy keeps an fp32 EMA of a
#   bf16 model without a per-tensor path;
# - how a tensor decay keeps the update free of host syncs and of `torch.compile` recompiles;
# - how to read a roofline plot: achieved GB/s against a single-kernel copy.

# %%
# NBVAL_IGNORE_OUTPUT
import torch

from ema_lab import ModelEMA
from ema_lab.bench import DEFAULT_MODELS, count_candidate_ops, run_bench
from ema_lab.bench.counting import without_views
from ema_lab.bench.environment import format_environment, quick_mode
from ema_lab.lessons import models

torch.set_num_threads(1)  # every timing below is single-threaded; counts and numerics do not care
print(format_environment())
print("quick mode:", quick_mode())

# %% [markdown]
# ## 1. What the update has to touch
#
# An EMA update reads every floating-point element of the EMA and of the model and writes the EMA:
# three element-sized transfers per element. The zoo spans the two regimes: many small tensors
# (`yolo`, `tiny_tensors`) where per-tensor overhead dominates, and few large ones (`resnet50`,
# `gpt2`) where bandwidth does.

# %%
print(f"{'model':<13} {'entries':>8} {'float tensors':>14} {'float elements':>15} {'mean elems':>11}")
for name in DEFAULT_MODELS:
    s = models.describe(models.build(name))
    print(
        f"{name:<13} {s.entries:>8} {s.float_tensors:>14} {s.float_elements:>15,} "
        f"{s.float_elements // s.float_tensors:>11,}"
    )

# %% [markdown]
# `tiny_tensors` has 2000 tensors of 136 elements on average: at 0.5 µs or more per tensor a foreach
# call costs a millisecond or more there, while one `lerp_` over its 272,000 elements takes a few
# tens of µs.
#
# ## 2. The ladder, counted
#
# Each rung, as an update function on the same `yolo` model (`ema_lab.bench.count_candidate_ops`
# builds them; `seed_*` are the seed's code verbatim, `CachedListEMA` is not in the bench but behaves
# like `foreach` without any check):
#
# | rung | what one update does |
# |---|---|
# | `seed_before` | two `state_dict()` walks, then `mul_`, `mul`, `add_` per float tensor |
# | `seed_after` | two `state_dict()` walks, then one `_foreach_lerp_` |
# | `gated` | cached (EMA, model) lists, checked per slot, one `_foreach_lerp_` per (device, dtype) |
# | `flat` | the EMA in one buffer; model gathered by `cat` (tiny tensors) or read by one foreach |
# | `flat_model` | the model also in one buffer (opt-in): one `lerp_` |
# | `floor` | one `lerp_` over two contiguous buffers: the best any EMA update can do |
#
# The counter records every ATen op that reaches the dispatcher (views such as `detach` included);
# "compute" drops the views.

# %%
ladder = ["seed_before", "seed_after", "gated", "flat", "flat_model", "floor"]
for name in ("yolo", "tiny_tensors"):
    ops = count_candidate_ops(name, ladder)
    print(name)
    for k in ladder:
        compute = without_views(ops[k])
        top = ", ".join(f"{op} x{n}" for op, n in compute.most_common(3))
        print(f"  {k:<12} {sum(ops[k].values()):>6} ops, {sum(compute.values()):>5} compute: {top}")

# %% [markdown]
# The seed's before-code dispatches 1782 compute ops per update on `yolo` (three per float tensor)
# plus 2010 `detach` views (2 × 708 from its two `state_dict()` walks, one per float tensor). The
# after-code is one `_foreach_lerp_` but still pays for the walks (1416 views). From `gated` on there
# is no walk; the extra `_foreach_copy_` on `yolo` copies BatchNorm's integer `num_batches_tracked`
# entries. `flat` gathers the small tensors (under `CAT_MAX_NUMEL` = 1024 elements: BatchNorm vectors,
# biases) with one `cat` and one `lerp_` and leaves the large ones (conv weights) to one
# `_foreach_lerp_`; on `tiny_tensors` everything is small, so it is `cat` + `lerp_`. `flat_model` is
# one `lerp_` on both models, exactly the floor's op.
#
# ## 3. The ladder, timed
#
# Op counts say how much is dispatched; the clock says what it costs. Medians of interleaved rounds at
# one thread (`ema_lab.bench.timing.time_candidates`), as `python -m ema_lab bench` does.

# %%
# NBVAL_IGNORE_OUTPUT
from ema_lab.bench.roofline import format_roofline, plot_roofline, roofline_points

bench_models = ("yolo", "tiny_tensors") if quick_mode() else DEFAULT_MODELS
record = run_bench(
    models=bench_models, strategies=[*ladder, "auto"], threads=1, quick=quick_mode(), progress=False
)
points = roofline_points(record)
print(format_roofline(points))

# %% [markdown]
# Read each model's rows top to bottom: the seed's code is tens of times slower than the floor on the
# tensor-heavy models; caching removes the walks; the flat strategies remove the per-tensor loop.
# On `resnet50` and `gpt2` every rung after the seed is close to the floor, because a few hundred large
# tensors leave little overhead to remove. (Your numbers will differ; the ratios are what carries over.)
#
# ## 4. The roofline
#
# Achieved bandwidth = 3 × float bytes / time. The red line is one `copy_` of the same bytes: a single
# large kernel, the most this machine moves in one call at one thread. A rung close to the line is
# spending its time moving bytes; one far left of it is spending it on overhead.

# %%
# NBVAL_IGNORE_OUTPUT
fig = plot_roofline(points)

# %% [markdown]
# At one thread the copy line is a reference, not a hard ceiling: the floor's single `lerp_` moves
# its three streams faster than `copy_` moves two (here 1.3-1.7× the copy's GB/s), so "at the
# roofline" means "as fast as one kernel over the same bytes". `flat_model` gets there on every model
# (within 1.5× of the floor). On `yolo` and `tiny_tensors` the cached foreach (`gated`) and the
# default (`auto`, i.e. `flat` without touching the model) reach a fraction of it: the per-tensor
# work left is the `_foreach_lerp_` over the large tensors and the per-slot staleness check of the
# model's tensors (section 5). On `resnet50` and `gpt2` every cached rung is at the floor.
#
# ## 5. The stale-cache hazard
#
# Caching the tensor lists is what makes today's ultralytics fast, and what makes it unsafe: after
# `model.double()` the module's parameters get new memory, the cached list still points at the old
# memory, and the EMA averages dead tensors forever, silently. `ema_lab.lessons.staleness.follows_after`
# converts, shifts every model weight by 1.0 and runs 20 updates at decay 0.5: a working EMA ends
# within 0.5^20 of the model.

# %%
from ema_lab.lessons.seed import CachedListEMA
from ema_lab.lessons.staleness import CONVERSIONS, follows_after

for cls in (CachedListEMA, ModelEMA):
    for conversion in CONVERSIONS:
        r = follows_after(cls, conversion)
        moved = f"EMA moved: {r.ema_moved!s:<5}"
        print(f"{cls.__name__:<14} after {conversion:<15} {moved} gap to model: {r.gap:.6f}")

# %% [markdown]
# In both cases the cached list's EMA module never moves again (gap 1.0: it missed the whole shift);
# after `ema.ema.half()` the update lerps fp32 tensors that the module no longer holds. `ModelEMA`
# (its default "auto" is the flat strategy) rebuilds and closes the gap (to fp16 rounding after
# `.half()`).
#
# How does the flat strategy notice, cheaply? The step keeps no reference to the module tensors that
# are views into its buffers, so the buffer's storage is referenced exactly by "our own views + the
# modules' tensors". Anything that moves a tensor out (`.to()`, `.half()`, `p.data = ...`, a
# replaced buffer) drops a reference. One integer per buffer, instead of one `data_ptr()` read per
# tensor (1188 on `yolo`):

# %%
from ema_lab.flat import storage_refs

model = models.build("tiny_cnn")
ema = ModelEMA(model, strategy="flat_model")
ema.update(model)
step = ema._state.step
print(
    "group modes:", step.modes, "| references to the model buffer:", storage_refs(step.groups[0].model_flat)
)
print("intact:", step.refs_unchanged())
first = next(model.parameters())
first.data = first.detach().clone()  # what an optimizer that replaces tensors does
print(
    "after p.data = clone:",
    storage_refs(step.groups[0].model_flat),
    "references, intact:",
    step.refs_unchanged(),
)
ema.update(model, decay=0.0)  # rebuilt: with decay 0 the EMA must equal the model exactly
print("EMA equals the new parameter:", torch.equal(ema.ema[0].conv.weight, first))

# %% [markdown]
# One reference fewer, the exact per-slot check confirms the break, the step is rebuilt, and the EMA
# reads the parameter's new memory. A view somebody keeps alive adds a reference without breaking
# anything; then the exact check passes and the new count becomes the baseline. (The one case the
# count cannot see: a tensor re-pointed *and* a new view of the same buffer kept alive between two
# updates. `ema_lab/flat.py` documents it.)
#
# ## 6. Optimizers on a flattened model
#
# `flat_model` re-points the model's parameters into one buffer with `p.data = view`: the `Parameter`
# objects, their values, `requires_grad` and gradients stay; only the storage moves. The tests
# (`tests/test_flat.py`) train a flattened and a plain twin for four steps with SGD+momentum and
# AdamW (for-loop, foreach and fused) and require bitwise equal weights. Here is one of them:

# %%
torch.manual_seed(0)
flat_net, plain_net = models.build("tiny_cnn"), models.build("tiny_cnn")
ModelEMA(flat_net, strategy="flat_model").update(flat_net)  # flattens flat_net
opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (flat_net, plain_net)]
gen = torch.Generator().manual_seed(1)
for _ in range(4):
    x, y = torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    for net, opt in zip((flat_net, plain_net), opts):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
same = all(torch.equal(a, b) for a, b in zip(flat_net.state_dict().values(), plain_net.state_dict().values()))
print("bitwise equal after 4 AdamW steps:", same)

# %% [markdown]
# ## 7. Mixed precision: keep the EMA in fp32
#
# With a bf16 or fp16 model it is tempting to keep the EMA in the same dtype. At decay 0.9999 one
# update adds (1 - d) × gap, about 1e-6 for a gap of 0.01, while bf16's spacing around 1.0 is 2^-7:
# every update rounds back to the old value. `ema_lab.lessons.precision.ema_stall` runs 1000 updates:

# %%
from ema_lab.lessons.precision import ema_stall

for dtype in (torch.bfloat16, torch.float16, torch.float32):
    print(ema_stall(dtype))

# %% [markdown]
# bf16 and fp16 stay exactly at 1.0: the step is hundreds of times smaller than half a unit in the last
# place. fp32 tracks the exact value. So the EMA of a bf16 model should be fp32, and then every
# (EMA, model) pair disagrees in dtype: `_foreach_lerp_` refuses, and `gated` falls back to a
# per-tensor `mul_`/`add_`. The flat strategy puts such a group in `cast` mode: one `_foreach_copy_`
# casts the model into an fp32 scratch buffer, one `lerp_` updates the EMA:

# %%
from ema_lab.bench.counting import count_ops

bf16_model = models.build("yolo").bfloat16()
for strategy in ("gated", "flat"):
    ema = ModelEMA(bf16_model, strategy=strategy)
    ema.ema.float()  # an fp32 EMA of a bf16 model
    ema.update(bf16_model)
    compute = without_views(count_ops(ema.update, bf16_model))
    print(f"{strategy:<6} {sum(compute.values()):>5} compute ops: {dict(compute.most_common(3))}")

# %% [markdown]
# `gated` dispatches two ops per float tensor (1188) plus the integer copy; `flat` dispatches three ops
# in all (the cast-copy, the `lerp_`, and the integer copy). With `flat_model` the cast-copy is one
# `copy_` of a contiguous buffer.
#
# ## 8. Sync-free and compile-stable
#
# `ModelEMA.update(model, decay=...)` accepts a 0-dim tensor on the model's device with the flat
# strategies: the weight `1 - decay` stays a tensor, nothing calls `.item()`, and the update never
# waits for the device. Under `torch.compile` a Python float decay is a constant that Dynamo guards on,
# so a changing decay recompiles; a tensor decay is data. Counting graph compilations over 100 updates
# of the ramp (`ema_lab.flat.count_compiles`, Dynamo only, no code generation):

# %%
from ema_lab.flat import count_compiles

model = models.build("tiny_cnn")
ema = ModelEMA(model, strategy="flat")
ema.update(model)
decays = [ema.decay(n) for n in range(1, 101)]
print("compilations, tensor decay:", count_compiles(ema._state.step, decays, as_tensor=True))
print("compilations, float decay: ", count_compiles(ema._state.step, decays, as_tensor=False))
ops = count_ops(ema.update, model, decay=torch.tensor(0.999))
print(
    "host syncs (aten._local_scalar_dense) in one tensor-decay update:",
    ops["aten._local_scalar_dense.default"],
)

# %% [markdown]
# One graph for 100 different tensor decays; with a Python float Dynamo compiled the same function
# six times over the same 100 values. On CUDA `tests/test_flat.py` also runs the update under
# `torch.cuda.set_sync_debug_mode("error")` (skipped on machines without CUDA, as here).
#
# ## 9. The targets
#
# The issue asked for the fastest strategy within 1.5× of the floor on every zoo model, and for the
# default `ModelEMA` to be no slower than the fastest peer (the peers are timed by
# `benchmarks/peers.py` in a separate environment; see `results/peers-*.md`). The ratios measured
# in section 3:

# %%
# NBVAL_IGNORE_OUTPUT
for name in bench_models:
    pts = {p.candidate: p.median_ms for p in points if p.model == name}
    best = min((k for k in pts if k not in ("floor", "seed_before", "seed_after")), key=pts.get)
    print(
        f"{name:<13} fastest: {best:<10} {pts[best] / pts['floor']:.2f}x floor | "
        f"default (auto): {pts['auto'] / pts['floor']:.2f}x floor, "
        f"{pts['seed_after'] / pts['auto']:.1f}x faster than seed_after"
    )

# %% [markdown]
# ## Try it yourself
#
# 1. Set `ema_lab.flat.CAT_MAX_NUMEL = 0` (no `cat` gathering) and re-time `flat` on `tiny_tensors`.
#    How much of the gap to `flat_model` was the gather?
# 2. Flatten a model with `ema_lab.flat.flatten_tensors`, then call `model.half()`: what do
#    `storage_refs` and the next `ModelEMA.update` do? Undo it with `unflatten_tensors`.
# 3. Run `ema_stall(torch.bfloat16, decay=0.99)`. At which decay does a bf16 EMA start moving?
# 4. Compile `ema._state.step` with `backend="inductor"` (needs a C++ compiler) and time it against
#    the eager flat step on `yolo`.
#
# ## Summary
#
# - The seed's after-code removed the per-tensor ops but kept two `state_dict()` walks; caching the
#   lists removes those, but a cache that is not checked goes stale silently.
# - A flat EMA buffer makes the check O(1) (a reference count per buffer) and lets tiny tensors be
#   gathered with one `cat`; flattening the model too (opt-in, reversible, optimizer-transparent)
#   makes the whole update one `lerp_` per (device, dtype) group, at the copy roofline.
# - Keep the EMA of a bf16/fp16 model in fp32: at decay 0.9999 a bf16 EMA rounds every update away.
#   The flat strategy does that with one cast-copy and one `lerp_` per group.
# - A 0-dim tensor decay makes the update free of host syncs and of `torch.compile` recompiles.
