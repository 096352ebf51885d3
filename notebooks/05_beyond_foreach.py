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
# # 05 · Beyond foreach: down to the floor of one `lerp_` over contiguous buffers
#
# **Take-aways**
# 1. After ultralytics PR #25315 most of an EMA update's time on a detector is still overhead:
#    walking `state_dict()`, and one dispatched `lerp_` per tensor inside `_foreach_lerp_`.
# 2. Cached lists remove the walk; flat buffers remove the per-tensor work, down to one `lerp_` per
#    (device, dtype) group, whose time is set by memory bandwidth (cache or DRAM).
# 3. In a whole CPU training step at batch 16 the EMA is a small share (section 4 measures it); keep
#    the EMA of a bf16 model in fp32, and pass a tensor decay to stay sync- and recompile-free.
#
# **Time** on the 2-core CI machine, measured with `time python3 dev.py notebooks
# notebooks/05_beyond_foreach.py`: 73-90 s in full mode with nothing else running, about 2 minutes
# while other jobs kept its load average near 4; quick mode (`EMA_LAB_QUICK=1`) ran its cells in 17 s
# quiet (under nbval) and about 30 s under that load.
#
# After PR #25315 an EMA update is one `torch._foreach_lerp_` call. On a model with hundreds of
# small tensors most of its time is still overhead, not arithmetic: walking `state_dict()`, and on
# CPU one dispatched `lerp_` per tensor inside the foreach call (notebook 01, section 2). The floor
# for the update is one `lerp_` over two contiguous buffers holding the same elements. This notebook
# goes from the PR's before-code to that floor, one step at a time, and checks that every step stays
# correct.
#
# **You will learn**
# - the steps: per-tensor loop → `state_dict` walk + foreach → cached lists → flat buffers, with
#   the ATen op count of each (deterministic) and its time (measured here);
# - how to read a log-log plot of time against bytes moved, with the floor's line per memory regime;
# - what share of a whole training step the EMA update takes on this CPU;
# - why a flat buffer can live in 2 MiB pages, and what that saves when it streams from DRAM;
# - why a cached list is a hazard (`model.double()` and the EMA silently stops) and how a flat
#   buffer makes checking it O(1): count the references to the buffer's storage;
# - how `flat_model` (opt-in) turns the whole update into one kernel, and that training a flattened
#   model gives bitwise the same weights;
# - why a bf16 EMA at decay 0.9999 never moves, and how the flat strategy keeps an fp32 EMA of a
#   bf16 model without a per-tensor path;
# - what `torch.compile` does with a changing Python-float decay, and why a tensor decay avoids it.

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
# ## 2. The steps, counted
#
# Each step, as an update function on the same `yolo` model (`ema_lab.bench.count_candidate_ops`
# builds them; `seed_before`/`seed_after` are the PR's before- and after-code verbatim,
# `CachedListEMA` is not in the bench but behaves like `foreach` without any check):
#
# | candidate | what one update does |
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
import ema_lab.flat

steps = ["seed_before", "seed_after", "gated", "flat", "flat_model", "floor"]
for name in ("yolo", "tiny_tensors"):
    ops = count_candidate_ops(name, steps)
    print(name)
    for k in steps:
        compute = without_views(ops[k])
        top = ", ".join(f"{op} x{n}" for op, n in compute.most_common(3))
        print(f"  {k:<12} {sum(ops[k].values()):>6} ops, {sum(compute.values()):>5} compute: {top}")
print("CAT_MAX_NUMEL:", ema_lab.flat.CAT_MAX_NUMEL)

# %% [markdown]
# The PR's before-code dispatches 1782 compute ops per update on `yolo` (three per float tensor)
# plus 2010 `detach` views (2 × 708 from its two `state_dict()` walks, one per float tensor). The
# after-code is one `_foreach_lerp_` but still pays for the walks (1416 views). From `gated` on there
# is no walk; `gated`'s extra `_foreach_copy_` on `yolo` copies BatchNorm's integer
# `num_batches_tracked` entries. `flat` gathers the small tensors (at most `ema_lab.flat.CAT_MAX_NUMEL`
# elements each, printed below: BatchNorm vectors, biases) with one `cat` and one `lerp_`, leaves the
# large ones (conv weights) to one `_foreach_lerp_`, and gathers the integer counters into their EMA
# buffer with a second `cat`; on `tiny_tensors` everything is small, so it is `cat` + `lerp_`. (These
# counts are at one thread. With two or more, `flat` gathers the small tensors in runs of under 32768
# elements, one `cat` and one `lerp_` per run: a larger CPU `cat` on several threads copies its
# inputs one by one, about 1 us each, instead of in one serial pass.) `ModelEMA` reads the small
# tensors it gathers as the module holds them at that moment, so a replaced BatchNorm vector is
# simply read, not a reason to rebuild.
# `flat_model` is one `lerp_` on both models, exactly the floor's op, plus on `yolo` one `copy_` of
# BatchNorm's counters, which it flattens too.
#
# ## 3. The steps, timed
#
# Op counts say how much is dispatched; the clock says what it costs. Medians of interleaved rounds at
# one thread (`ema_lab.bench.timing.time_candidates`), as `python -m ema_lab bench` does.

# %%
# NBVAL_IGNORE_OUTPUT
from ema_lab.bench.roofline import floor_points, format_floor, plot_time_vs_bytes

bench_models = ("yolo", "tiny_tensors") if quick_mode() else DEFAULT_MODELS
record = run_bench(
    models=bench_models, strategies=[*steps, "auto"], threads=1, quick=quick_mode(), progress=False
)
points = floor_points(record)
print(format_floor(points))

# %% [markdown]
# Read each model's rows top to bottom: `floor/time` is the floor's time over the candidate's (1.0 =
# as fast as one `lerp_` over contiguous buffers of the same elements, up to timing noise; it is the
# same op over the same bytes, so no byte-counting convention enters). GB/s counts the update's
# three streams (read EMA, read model, write EMA). The PR's code is far from the floor on the
# tensor-heavy models; caching removes the walks; the flat strategies remove the per-tensor work.
# (Your numbers will differ; the ratios are what carries over.)
#
# ### Time against bytes
#
# The same rows on log-log axes: time per update against the bytes it must move. The black lines are
# the floor's fitted cost from the same run's cost model (notebook 01, section 5): solid while the
# EMA and the model fit in the last-level cache, dashed beyond it, where every byte comes from DRAM
# (the dotted line marks the cache size; quick mode does not sweep into DRAM). A candidate on the
# line streams memory as fast as one kernel; one far above it spends its time on overhead.

# %%
# NBVAL_IGNORE_OUTPUT
fig = plot_time_vs_bytes(points, record["cost_model"]["cpu"])

# %%
# NBVAL_IGNORE_OUTPUT
for name in bench_models:
    pts = {p.candidate: p for p in points if p.model == name}
    best = max(
        (k for k in pts if k not in ("copy", "seed_before", "seed_after")), key=lambda k: pts[k].of_floor
    )
    print(
        f"{name:<13} fastest strategy: {best:<10} at {pts[best].of_floor:.2f} of the floor's speed | "
        f"default (auto): {pts['auto'].of_floor:.2f}, {pts['seed_after'].median_ms / pts['auto'].median_ms:.1f}x "
        f"faster than the PR's after-code"
    )

# %% [markdown]
# The printed lines are this run's results. What to look for: on the tensor-heavy models (`yolo`,
# `tiny_tensors`) the PR's code runs at a few percent of the floor's speed and each step raises the
# fraction, most of all the flat strategies, which remove the per-tensor work; the cached foreach
# (`gated`) and the default (`auto`, the flat EMA without touching the model) still pay the
# `_foreach_lerp_` over the large tensors and the per-slot staleness check of the model's tensors
# (section 5). On `resnet50` and `gpt2`, whose tensors are large and live in DRAM, every candidate
# after the PR's before-code is within a small factor of the floor: there is little overhead left
# to remove. On this 2-core machine other jobs compete for the cores and for memory bandwidth, so
# even a one-kernel update (`flat_model`) can read well below 1.0 in one run and near it in the next.

# %% [markdown]
# ### Where the buffer lives: 4 KiB or 2 MiB pages
#
# A flat buffer has one more advantage that tensors stored one by one lack: it is big enough for
# *huge pages*. The CPU translates every address it touches through the TLB, a small cache of page
# mappings. A stream through 100 MB of ordinary 4 KiB pages needs a new mapping every 4 KiB, and each
# miss is a walk of the page tables (of two sets of them inside a virtual machine, like this one); one
# 2 MiB page covers 512 small ones. Linux hands out 2 MiB pages to memory that asks for them
# (`madvise(MADV_HUGEPAGE)` on a private mapping aligned to 2 MiB), and `ema_lab.flat.empty_flat` does
# exactly that for every flat buffer ema_lab allocates (the EMA's, and with `flat_model` the model's)
# from 2 MiB up, where the kernel allows it (`/sys/kernel/mm/transparent_hugepage/enabled` not
# `never`); elsewhere it is ordinary memory. The bench's floor above uses it too, so no strategy beats
# the floor by having better memory. Here is the same `lerp_` over the same number of floats, in
# buffers from `torch.rand` and from `empty_flat`:

# %%
# NBVAL_IGNORE_OUTPUT
from ema_lab.bench.timing import time_candidates
from ema_lab.flat import HUGE_PAGE, empty_flat

n = 4_000_000 if quick_mode() else 25_600_000  # full mode: resnet50's 25.6M floats, 100 MiB per buffer
plain = [torch.rand(n), torch.rand(n)]
huge = [empty_flat(n, torch.float32).copy_(t) for t in plain]
print("empty_flat buffers start on a 2 MiB boundary:", all(t.data_ptr() % HUGE_PAGE == 0 for t in huge))
pages = time_candidates(
    {
        "4 KiB pages (torch.rand)": lambda: plain[0].lerp_(plain[1], 1e-4),
        "2 MiB pages (empty_flat)": lambda: huge[0].lerp_(huge[1], 1e-4),
    },
    rounds=5 if quick_mode() else 21,
    threads=1,
)
for k, r in pages.items():
    print(f"{k:<26} {1e3 * r.median_s:8.3f} ms per lerp_ over {n:,} floats")
t_4k, t_2m = (r.median_s for r in pages.values())
print(f"time with huge pages / time with 4 KiB pages: {t_2m / t_4k:.2f}")

# %% [markdown]
# A ratio below 1 means the huge pages saved time. How much depends on the machine: on this 2-core
# VM the 2 MiB floor ran at 0.87 of the 4 KiB floor's time on resnet50's size and 0.92 on gpt2's,
# one thread, in `results/peers-2026-12-03-huge.md` (the 4 KiB floor's own time moves by about 10 %
# between fresh allocations, so repeat the cell before trusting a small difference). An EMA that
# keeps each tensor in its own torch allocation, like ultralytics', gets 4 KiB pages, and most of a
# detector's tensors are smaller than one 2 MiB page anyway. `ModelEMA`'s default still reads the
# model's own tensors, which stay in whatever pages torch gave them; `flat_model` moves them into
# one `empty_flat` buffer too. torch offers the same for every CPU allocation of 2 MiB or more with
# the environment variable `THP_MEM_ALLOC_ENABLE=1`, set before the process starts.

# %% [markdown]
# ## 4. The EMA in a whole training step
#
# How much does any of this matter for training? One step of training the YOLO-sized model on this
# CPU (forward, a stand-in loss over the detector heads, backward, SGD step), timed with one thread,
# next to each EMA update measured in section 3. Full mode uses batch 16 at 320 × 320 pixels
# (ultralytics trains yolo26n at 640, four times the pixels, which only makes the step longer);
# quick mode a batch of 2 at 64 × 64 so the tests stay fast.

# %%
# NBVAL_IGNORE_OUTPUT
import statistics
import time

batch, size = (2, 64) if quick_mode() else (16, 320)
net = models.build("yolo").train()
opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
images = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def train_step() -> None:
    """Forward, a stand-in loss, backward and one optimizer step (no EMA)."""
    opt.zero_grad(set_to_none=True)
    loss = sum(out.float().square().mean() for out in net(images))
    loss.backward()
    opt.step()


train_step()  # warm-up
# A plain median of a few runs: torch.utils.benchmark's extra warm-up calls would double a multi-second step.
runs = []
for _ in range(3 if quick_mode() else 4):
    t0 = time.perf_counter()
    train_step()
    runs.append(time.perf_counter() - t0)
step_ms = 1e3 * statistics.median(runs)
print(f"training step (batch {batch}, {size} x {size}, {torch.get_num_threads()} thread): {step_ms:.1f} ms")
ema_ms = {p.candidate: p.median_ms for p in points if p.model == "yolo" and p.candidate != "copy"}
ema_ms["floor"] = next(p.floor_ms for p in points if p.model == "yolo")
for name, ms in ema_ms.items():
    print(f"  EMA update {name:<12} {ms:7.2f} ms = {ms / (step_ms + ms):6.2%} of a step with it")

# %% [markdown]
# The printed shares answer "does it matter here": compare the share of the PR's before-code
# (`seed_before`) with that of the fastest strategy; the difference is the most any EMA change can
# save per step on this machine at this batch. The share grows when the step is short: a small batch
# or image (as in quick mode), or a fast GPU with a launch-bound EMA. ultralytics measured the PR end
# to end on a GH200 GPU (PR #26046, yolo26n, 100 epochs): 82.2 s vs 83.4 s on coco8 and 157.7 s vs
# 160.0 s on coco128 with and without the change, within noise; those are that project's figures,
# not measured here. The EMA update is worth optimising when it is a visible part of the step (many
# small tensors, a short step), and when it must not block the device (section 8).
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
# tensor (1188 on `yolo`). (`ema.prepared_step` is the cached update step, a `FlatStep` here.)

# %%
from ema_lab.flat import storage_refs

model = models.build("tiny_cnn")
ema = ModelEMA(model, strategy="flat_model")
ema.update(model)
step = ema.prepared_step
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
# waits for the device. Under `torch.compile`, what does a Python float decay do? Count the graphs
# Dynamo builds for the flat step over the first 100 decays of the ramp, with
# `torch._dynamo.testing.CompileCounter` as the backend (it counts graphs and runs them as they are,
# no code generation):

# %%
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

model = models.build("tiny_cnn")
ema = ModelEMA(model, strategy="flat")
ema.update(model)
step = ema.prepared_step
decays = [ema.decay(n) for n in range(1, 101)]


def graphs_per_call(as_tensor: bool, **config: object) -> list[int]:
    """Graphs compiled so far after each of the 100 calls of the compiled step."""
    torch._dynamo.reset()
    counters.clear()
    compiled_graphs = CompileCounter()
    history = []
    with torch._dynamo.config.patch(**config):
        compiled = torch.compile(lambda d: step(d), backend=compiled_graphs)
        for d in decays:
            compiled(torch.tensor(d) if as_tensor else d)
            history.append(compiled_graphs.frame_count)
    return history


for label, as_tensor, config in (
    ("tensor decay", True, {}),
    ("float decay", False, {}),
    ("float decay, automatic dynamic off", False, {"automatic_dynamic_shapes": False}),
):
    history = graphs_per_call(as_tensor, **config)
    breaks = sorted({reason.splitlines()[0] for reason in counters["graph_break"]})
    print(
        f"{label}: graphs after calls 1-10: {history[:10]}, after 100: {history[-1]}; graph breaks: {breaks}"
    )
torch._dynamo.reset()
print("Dynamo's recompile limit per function:", torch._dynamo.config.recompile_limit)
ops = count_ops(ema.update, model, decay=torch.tensor(0.999))
print(
    "host syncs (aten._local_scalar_dense) in one tensor-decay update:",
    ops["aten._local_scalar_dense.default"],
)

# %% [markdown]
# What happens with a Python float, step by step (`TORCH_LOGS=recompiles,graph_breaks` prints the
# same story):
#
# 1. The first call compiles one graph with the float baked in as a constant, guarded by
#    `d == <that value>`.
# 2. The second value fails the guard. On a recompile Dynamo's *automatic dynamic* treats the value
#    that changed as a symbolic input instead of a constant. A symbolic float cannot go through the
#    step's argument check `math.isfinite(d)` (it returns a Python bool, not a tensor), so Dynamo
#    breaks the graph there and compiles the code before and after the break as separate frames.
# 3. Each new frame again starts specialised on the value it first saw and is recompiled once as
#    dynamic; after a few calls every frame is dynamic, and the remaining values reuse the graphs.
#
# So the count stops at a handful of graphs, not 100. With automatic dynamic turned off (third line),
# every new float recompiles until Dynamo's recompile limit (printed), after which it stops compiling
# that function and runs it eagerly with a warning. A 0-dim tensor decay is data, not a constant:
# one graph, no graph break, no recompile, and no host sync. On CUDA `tests/test_flat.py` also runs
# the update under `torch.cuda.set_sync_debug_mode("error")` (skipped on machines without CUDA).
#
# ## Try it yourself
#
# 1. Set `ema_lab.flat.CAT_MAX_NUMEL = 0` (no `cat` gathering) before building a `flat` `ModelEMA`
#    on `tiny_tensors`. What does one update dispatch now, and how much slower is it?
# 2. Flatten a model's parameters with `ema_lab.flat.flatten_tensors`, then call `model.half()`:
#    what do `storage_refs` and the next `ModelEMA.update` do?
# 3. Run `ema_stall(torch.bfloat16, decay=0.99)`. Does a bf16 EMA move at decay 0.99?
# 4. Pass a tensor decay to a `ModelEMA` with `strategy="gated"`. What happens, and why?
#
# ## Solutions
#
# **1.** Without gathering, the 2000 small tensors go to one `_foreach_lerp_` (one inner `lerp_` per
# tensor) instead of one `cat` and one `lerp_`:

# %%
import ema_lab.flat
from ema_lab.bench.timing import time_candidates

tiny = models.build("tiny_tensors")
saved_cat_max = ema_lab.flat.CAT_MAX_NUMEL
flats = {}
for label, cat_max in (("with cat", saved_cat_max), ("CAT_MAX_NUMEL = 0", 0)):
    ema_lab.flat.CAT_MAX_NUMEL = cat_max
    flats[label] = ModelEMA(tiny, strategy="flat")
    flats[label].update(tiny)
ema_lab.flat.CAT_MAX_NUMEL = saved_cat_max
for label, e in flats.items():
    print(f"{label:<18} modes {e.modes}, ops {dict(without_views(count_ops(e.update, tiny)))}")

# %%
# NBVAL_IGNORE_OUTPUT
t = time_candidates({k: (lambda e=e: e.update(tiny)) for k, e in flats.items()}, rounds=5, threads=1)
for label, r in t.items():
    print(f"{label:<18} {1e3 * r.median_s:.3f} ms per update")

# %% [markdown]
# **2.** `model.half()` gives every parameter new fp16 memory, so the flat buffer loses the
# references the parameters held; the EMA notices and rebuilds on the next update:

# %%
from ema_lab.flat import flatten_tensors

net = models.build("tiny_cnn")
ema = ModelEMA(net)
ema.update(net)
(buffer,) = flatten_tensors(list(net.parameters()))
print("references to the flat buffer after flattening:", storage_refs(buffer))
net.half()
print("after model.half():", storage_refs(buffer), "| parameter dtype:", next(net.parameters()).dtype)
before = ema.rebuilds
ema.update(net)
print("the next update rebuilt its cached step:", ema.rebuilds == before + 1)

# %% [markdown]
# **3.** At decay 0.99 one update moves 1 % of the gap (1e-4 for a gap of 0.01), still below half of
# bf16's spacing near 1.0, so the bf16 EMA still does not move; fp32 does:

# %%
for dtype in (torch.bfloat16, torch.float32):
    print(ema_stall(dtype, decay=0.99))

# %% [markdown]
# **4.** Only the flat strategies keep the weight `1 - decay` as a tensor through the whole update;
# the per-tensor and foreach paths need a Python number, so `ModelEMA` refuses with a clear error
# instead of syncing silently:

# %%
gated = ModelEMA(net, strategy="gated")
try:
    gated.update(net, decay=torch.tensor(0.99))
except TypeError as err:
    print("TypeError:", err)

# %% [markdown]
# ## Summary
#
# - The PR's after-code removed the per-tensor ops but kept two `state_dict()` walks; caching the
#   lists removes those, but a cache that is not checked goes stale silently.
# - A flat EMA buffer makes the check O(1) (a reference count per buffer) and lets tiny tensors be
#   gathered with one `cat`; flattening the model too (opt-in, reversible, optimizer-transparent)
#   makes the whole update one `lerp_` per (device, dtype) group, the floor's op (section 3 prints
#   how close each strategy comes).
# - The floor itself runs at cache bandwidth while EMA and model fit in the last-level cache and at
#   DRAM bandwidth beyond; a time-vs-bytes plot shows which candidates stream and which pay overhead.
# - A flat buffer is big enough for 2 MiB pages (`ema_lab.flat.empty_flat`), which cut the page-table
#   walks of a stream from DRAM; the bench's floor gets them too.
# - In a whole CPU training step the EMA's share is printed in section 4; ultralytics found the
#   change within noise end to end on a GH200.
# - Keep the EMA of a bf16/fp16 model in fp32: at decay 0.9999 a bf16 EMA rounds every update away.
# - A 0-dim tensor decay keeps the update free of host syncs and of `torch.compile` recompiles; a
#   Python float costs a few recompiles and a graph break (automatic dynamic), or one recompile per
#   value up to the recompile limit without it.
