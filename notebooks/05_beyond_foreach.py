# ---
# jupyter:
#   jupytext:
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Beyond foreach: one `lerp_` over one buffer
#
# - Put the EMA and the model each in one contiguous buffer, and the whole update is one `lerp_`.
# - Views go stale when the model moves, so check them; keep the EMA in fp32.
# - A safe update checks every tensor it does not read live; bare foreach trusts the model never to change.

# %% [markdown]
# ![Course map](figures/course_map_05.svg)
#
# You build: flat buffers for the EMA and the model, a stale-view check, an fp32 EMA; then meet
# `ema_lab.ModelEMA` on a CPU and a GPU.

# %% tags=["nbval-ignore-output"]
import copy

import torch

from ema_lab.bench import models
from ema_lab.bench.environment import quick_mode

torch.set_num_threads(1)  # one thread, so timings compare across runs
QUICK = quick_mode()  # EMA_LAB_QUICK=1: 5 timing rounds instead of 15, smaller images in Exercise 2
print(f"torch {torch.__version__}, threads: {torch.get_num_threads()}")

model = models.build("yolo")  # the zoo's yolo: a conv net shaped like ultralytics' yolo26n
ema = copy.deepcopy(model).requires_grad_(False)


def float_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's own floating-point parameters and buffers: what an EMA averages."""
    return [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]


E, M = float_tensors(ema), float_tensors(model)
elements = sum(t.numel() for t in E)
print(f"{len(E)} float tensors, {elements:,} elements ({elements / 1e6:.1f} million)")

# %% [markdown]
# ## 1. From the before-code to foreach
#
# `torch.lerp(a, b, w)` is `a + w * (b - a)`, so an EMA step with decay `d` is `lerp_(ema, model, 1 - d)`.
# ultralytics PR #25315 replaced a Python loop over tensors with one `torch._foreach_lerp_` over two
# lists. Both, with the lists built once:

# %%
D = 0.9999  # the decay; the lerp weight is 1 - D


@torch.no_grad()
def ema_loop() -> None:  # the PR's before-code: three ops and a temporary per tensor
    for e, m in zip(E, M):
        e *= D
        e += (1 - D) * m


@torch.no_grad()
def ema_foreach() -> None:  # the PR's after-code: one call for all tensors
    torch._foreach_lerp_(E, M, 1 - D)


# %% [markdown]
# Time both with notebook 04's `time_candidates` (turns, medians, IQR):

# %% tags=["nbval-ignore-output"]
from ema_lab.bench.timing import time_candidates


def timed(fns: dict[str, object], rounds: int = 5 if QUICK else 15) -> dict[str, float]:
    """Time the functions in turns; print each one's median and IQR; return the medians in ms."""
    results = time_candidates(fns, rounds=rounds)
    for name, r in results.items():
        print(f"{name:<25} {r.median_s * 1e3:6.2f} ms (IQR {r.iqr_s * 1e3:.2f})")
    return {name: r.median_s * 1e3 for name, r in results.items()}


first = timed({"loop": ema_loop, "foreach": ema_foreach})
print(f"foreach over loop: {first['loop'] / first['foreach']:.1f}x")

# %% [markdown]
# Here the lists are built once; the PR's code rebuilds them from two `state_dict()` walks per call
# (notebook 01 measures that). On a CPU `_foreach_lerp_` still runs one `lerp_` per tensor inside.

# %% [markdown]
# ## 2. One buffer, many views
#
# The *floor*, the fastest an update can be, is one `lerp_` over all 2.6 million elements at once, which
# must sit in one contiguous buffer. Copy every EMA tensor into one flat buffer and re-point it at its
# slice: a *view*, a tensor that reads and writes another's memory.
#
# ![Tensors as views of one flat buffer](figures/05_flat_views.svg)


# %%
@torch.no_grad()
def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Copy the tensors into one buffer and make each a view of its slice; return the buffer."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    start = 0
    for t in tensors:
        view = flat[start : start + t.numel()].view_as(t)
        view.copy_(t)
        t.data = view  # same tensor object (a Parameter stays the module's Parameter), new memory
        start += t.numel()
    return flat


def all_views_of(tensors: list[torch.Tensor], flat: torch.Tensor) -> bool:
    """True while every tensor lives in the flat buffer's memory (its storage)."""
    return all(t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for t in tensors)


before = [t.clone() for t in E]
ema_flat = flatten(E)
print("values unchanged:", all(torch.equal(a, b) for a, b in zip(before, E)))
print("every EMA tensor lives in ema_flat:", all_views_of(E, ema_flat))
print("the module holds the same Parameter objects:", next(ema.parameters()) is E[0])


# %% [markdown]
# The module did not notice: same objects, same values, new memory. The model's tensors are still
# scattered; the obvious next step gathers them with `torch.cat` every update. Time it against foreach:


# %% tags=["nbval-ignore-output"]
@torch.no_grad()
def ema_cat_lerp() -> None:  # flat EMA; the model copied into one tensor each step
    ema_flat.lerp_(torch.cat([m.reshape(-1) for m in M]), 1 - D)


cat_ms = timed({"foreach": ema_foreach, "flat EMA + cat": ema_cat_lerp})
print(f"flat EMA + cat / foreach: {cat_ms['flat EMA + cat'] / cat_ms['foreach']:.2f}x")

# %% [markdown]
# The gather costs more than it saves: `cat` copies all 2.6 million model elements every update. So
# flatten the model too: one `lerp_` over two buffers, equal to foreach to the bit:


# %% tags=["nbval-ignore-output"]
model_flat = flatten(M)


@torch.no_grad()
def ema_one_lerp() -> None:  # both flat: the floor
    ema_flat.lerp_(model_flat, 1 - D)


with torch.no_grad():
    for m in M:
        m.add_(1.0)  # move the model away from the EMA, so the update changes something
    start = ema_flat.clone()
    ema_foreach()
    by_foreach = ema_flat.clone()
    ema_flat.copy_(start)
    ema_one_lerp()
print("one lerp_ == foreach, bitwise:", torch.equal(ema_flat, by_foreach))
flat_ms = timed({"foreach": ema_foreach, "one lerp_": ema_one_lerp})

# %% [markdown]
# Bitwise equal: the same formula on the same elements, in one call instead of 594 inside one.
# Times drift between cells (notebook 04): compare within one cell.

# %% [markdown]
# ## 3. Views go stale
#
# The buffers are built once and reused, so they can go stale. `model.half()` gives every parameter
# new fp16 memory; `model_flat` is no longer the model's, and `ema_one_lerp` would average a frozen copy
# forever, with no error.
#
# ![After model.half() the parameters no longer live in model_flat](figures/05_stale_views.svg)
#
# The check from section 2 sees it:

# %%
print("before:", all_views_of(M, model_flat))
model.half()
print("after model.half():", all_views_of(M, model_flat), "| parameter dtype:", M[0].dtype)

# %% [markdown]
# So run the check before every update, and rebuild the buffers when it fails.
#
# ## 4. Keep the EMA in fp32
#
# Should a bf16 model's EMA be bf16 too? bf16 (bfloat16: 16 bits, float32's range) stores 7 bits of
# [*mantissa*](../docs/glossary.md#mantissa-bits) (8 bits with the implicit leading 1): near 1.0 its values
# lie 2^-7 apart, one *ulp* (unit in the last place). A result within half an ulp of 1.0 rounds back to 1.0:
#
# ![A bf16 step far below half an ulp from 1.0 rounds back to 1.0](figures/05_ulp.svg)
#
# Move a one-element EMA at 1.0 towards 1.01, 1,000 times:


# %%
def stall(dtype: torch.dtype, decay: float = 0.9999, steps: int = 1000) -> str:
    ema, model = torch.full((1,), 1.0, dtype=dtype), torch.full((1,), 1.01, dtype=dtype)
    for _ in range(steps):
        ema.lerp_(model, 1 - decay)
    gap = model.item() - 1.0  # 0.01 as the dtype stores it
    exact = 1.0 + gap * (1 - decay**steps)
    half_ulp = torch.finfo(dtype).eps / 2  # half the spacing of the dtype at 1.0
    return f"{str(dtype)[6:]:>8}: {ema.item():.6f} (exact {exact:.6f}); step {(1 - decay) * gap:.1e}, half-ulp {half_ulp:.1e}"


for dtype in (torch.bfloat16, torch.float16, torch.float32):
    print(stall(dtype))

# %% [markdown]
# bf16 and fp16 never leave 1.0: each step is far below their half-ulp and rounds away; fp32 tracks the
# exact value. So keep an fp32 EMA of a bf16 model. `_foreach_lerp_` refuses a pair of two dtypes: the
# update must first *cast* (convert) the model's values to fp32.

# %% [markdown]
# ## 5. What ema_lab packages
#
# `ema_lab.ModelEMA` packages sections 2-4: it flattens its EMA copy, checks before every update that
# nothing it relies on moved (rebuilding if so), and casts a bf16 model's values into an fp32 copy (its
# copy has the model's dtype: call `ema.ema.float()`). `ema_lab.flatten_model` is our `flatten` for the
# model; `count_ops` (notebook 01's
# op counter) shows what an update calls:

# %%
import ema_lab
from ema_lab.bench.counting import count_ops


def show(name: str, e: ema_lab.ModelEMA, m: torch.nn.Module) -> None:
    """The modes and ops of one update, and how many slots it checks first (_step: its cached update)."""
    print(f"{name:<10} {e.modes} {dict(count_ops(e.update, m))}")
    print(f"{'':<10} slots checked per update: {len(e._step.watch.keys):,}")


net = models.build("yolo")
ema_default = ema_lab.ModelEMA(net)
ema_default.update(net)  # the first update builds the flat buffers
show("default", ema_default, net)
net_flat = models.build("yolo")
ema_lab.flatten_model(net_flat)
ema_fused = ema_lab.ModelEMA(net_flat)
ema_fused.update(net_flat)
show("flattened", ema_fused, net_flat)
small = [t for t in float_tensors(net) if t.numel() < 2048]
print(f"small float tensors (under 2,048 elements): {len(small)} of {len(float_tensors(net))}")

# %% [markdown]
# `ema.modes` names what each group of tensors got ([all modes](../docs/glossary.md#strategies-and-modes)):
#
# | mode | the model's tensors | one update |
# |---|---|---|
# | `cat+foreach` | scattered, small and large | one `cat` of the small tensors, one `_foreach_lerp_` |
# | `fused` | flattened | one `lerp_` |
# | `cast` | another dtype | one `_foreach_copy_` into fp32, one `lerp_` |
#
# *Small*: under 2,048 elements, gathered by the `cat`; most are read live from their *slots* (a module's
# entries, such as `bn.weight`), so they cannot go stale. Every other slot's address is checked: the EMA's
# and the model's rest; of a flattened model, every slot (1,416 against 946). `cat.out` and `copy_` copy
# BatchNorm's integer counters. Time all six ways:

# %% tags=["nbval-ignore-output"]
import matplotlib.pyplot as plt

model.float()
M = float_tensors(model)  # the model's tensors now (.half() and .float() replaced them)
model_flat = flatten(M)  # fresh flat memory for the float model
ways = {"loop": ema_loop, "foreach": ema_foreach, "flat EMA + cat": ema_cat_lerp, "one lerp_": ema_one_lerp}
ways["ModelEMA"] = lambda: ema_default.update(net)
ways["flatten_model + ModelEMA"] = lambda: ema_fused.update(net_flat)
results = time_candidates(ways, rounds=5 if QUICK else 15)
times = {k: r.median_s * 1e3 for k, r in results.items()}  # ms

fig, ax = plt.subplots(figsize=(6.5, 2.8))
names = list(times)[::-1]
colors = ["tab:blue" if "ModelEMA" in k else "tab:gray" for k in names]  # blue: ema_lab, gray: built above
iqr = [
    [1e3 * (results[k].median_s - results[k].q1_s) for k in names],
    [1e3 * (results[k].q3_s - results[k].median_s) for k in names],
]  # the middle half of the rounds
ax.barh(names, [times[k] for k in names], xerr=iqr, color=colors, error_kw={"lw": 1})
for y, k in enumerate(names):
    ax.text(1e3 * results[k].q3_s, y, f" {times[k]:.2f} ms", va="center", fontsize=9)
ax.set_xlim(0, 1.3 * max(1e3 * r.q3_s for r in results.values()))
ax.set_xlabel("ms per EMA update (median; line: IQR), yolo-sized model, 1 thread")
ax.set_title("gray: built in this notebook, blue: ema_lab", fontsize=10, loc="left")
fig.tight_layout()
plt.show()
print(f"ModelEMA default / bare foreach of section 1: {times['ModelEMA'] / times['foreach']:.2f}")

# %% [markdown]
# The flattened model's `ModelEMA` adds the counters' `copy_` and the check of its 1,416 slots to the
# floor's `lerp_`, so its bar is longer than the floor's.
#
# The ratio: the default over section 1's bare `_foreach_lerp_` (under 1: faster).
# The default lerps fewer, larger pieces, but pays for its `cat`s and for checking every slot it does not
# read live (946 here, each cold after a training step: [measured](../docs/results/watch-costs-2026-12-07-cold.md));
# the bare lists check nothing. The check is the cost of being safe.
#
# The check, packaged: make the flattened model fp16, update once with decay 0; the EMA must equal it:

# %%
before = ema_fused.rebuilds
net_flat.half()
ema_fused.update(net_flat, decay=0.0)
print("rebuilt:", ema_fused.rebuilds == before + 1, "| modes now:", ema_fused.modes)
print(
    "EMA equals the fp16 model:",
    all(torch.equal(e, m.float()) for e, m in zip(ema_fused.ema.parameters(), net_flat.parameters())),
)

# %% [markdown]
# Rebuilt, and the EMA stayed fp32: mode `cast` ([the details](../docs/beyond_foreach_details.md)).
#
# ## 6. On a GPU: host time, not bytes
#
# On CUDA the host queues kernels for each op (notebook 04). An NVIDIA H200 run (2026-12-04) timed one
# update of this notebook's model and counted its kernels (notebook 04's 0.385 ms is the real yolo26n):

# %%
from ema_lab.bench.results import load, results_dir

h200 = results_dir() / "gpu-linux-intel-xeon-16c-nvidia-h200"
run = load(h200 / "linux-intel-xeon-16c-nvidia-h200_2026-12-04T154528Z_full_t1_cuda.json")
print(f"measured {run['created'][:10]}, torch {run['environment']['torch']}, model: the zoo's yolo")
rows = {r["candidate"]: r for r in run["results"] if r["model"] == "yolo"}
floor_ms = rows["floor"]["median_ms"]
for name, cand in [
    ("PR before-code", "seed_before"),
    ("PR after-code", "seed_after"),
    ('ModelEMA "foreach"', "foreach"),
    ("ModelEMA default", "auto"),
    ("flatten_model + ModelEMA", "flat_model"),
    ("floor: one lerp_", "floor"),
]:
    ms, n = rows[cand]["median_ms"], rows[cand]["kernel_launches"]
    print(f"{name:<25} {ms:7.3f} ms = {ms / floor_ms:5.0f}x the floor, {n:>5} kernels")

# %% [markdown]
# The PR's after-code launches 10 kernels (notebook 01) but walks `state_dict()` twice per call;
# `ModelEMA`'s "foreach" adds a `cat` for BatchNorm's counters, which the PR skips. The default took 32x
# the floor's time for nearly the same bytes: host work. ultralytics' class, with more kernels and no
# check, was faster on every model there ([H200 results, 2026-12-04](../docs/results/h200-update-costs-2026-12-04.md)).
# A flattened model: 2 kernels, 4x the floor. These figures predate the per-slot check of
# section 5: time yours (notebook 04).

# %% [markdown]
# A *CUDA graph* takes any number of launches down to one: record an update's kernels once
# (*capture*), then launch them all at once (*replay*).
#
# ![One launch replays all the kernels](figures/05_cuda_graph.svg)
#
# A replay reuses the recorded addresses and numbers: check the addresses before each replay, and keep
# the decay in a device tensor. `ModelEMA(model, cuda_graph=True)` does both; no published run has timed
# it. On the H200 ([results, 2026-12-04](../docs/results/h200-update-costs-2026-12-04.md)),
# the default update of the real yolo26n, captured in a CUDA graph by hand, replayed in 0.17 ms (0.385 ms
# eager); one captured `_foreach_lerp_` in 0.070 ms (ultralytics, eager: 0.250 ms).

# %% [markdown]
# ## Summary
#
# - foreach removes Python's per-tensor ops; flat buffers make the whole update one `lerp_`.
# - Views go stale after `model.half()` or `.to()`: `ModelEMA` checks them every update, at the price
#   section 5 prints against bare foreach.
# - Keep the EMA in fp32: at decay 0.9999 a bf16 EMA's steps round away (`ModelEMA` copies the model's
#   dtype: call `ema.ema.float()`).
# - On a GPU the update is host work: on the H200 (2026-12-04) a flattened model took 2 kernels, 4x the floor.

# %% [markdown]
# ## Exercises
#
# Try each exercise in the empty cell below it before you open its solution; to run a solution, paste it into that cell.
#
# **Exercise 1.** `models.build("tiny_tensors")` holds 2,000 float tensors, the weights and biases of
# 1,000 `Linear(16, 16)`. Flatten one and its EMA copy with `flatten`, and time `foreach` against one
# `lerp_` with `timed`. *Predict*: does one `lerp_` gain more over foreach there than on the yolo-sized
# model?

# %%
# Exercise 1: your code here

# %% [markdown]
# <details><summary>Solution 1</summary>
#
# ```python
# tiny, tiny_ema = models.build("tiny_tensors"), models.build("tiny_tensors").requires_grad_(False)
# tE, tM = float_tensors(tiny_ema), float_tensors(tiny)
# tE_flat, tM_flat = flatten(tE), flatten(tM)
# tiny_ms = timed(
#     {
#         "foreach": torch.no_grad()(lambda: torch._foreach_lerp_(tE, tM, 1 - D)),
#         "one lerp_": torch.no_grad()(lambda: tE_flat.lerp_(tM_flat, 1 - D)),
#     }
# )
# ratio = tiny_ms["foreach"] / tiny_ms["one lerp_"]
# print(f"tiny_tensors: {ratio:.0f}x; yolo-sized: {times['foreach'] / times['one lerp_']:.1f}x")
# ```
#
# Far more (the printed ratios): 2,000 tiny tensors cost almost only per-tensor work, which one `lerp_`
# removes; the yolo-sized model's 2.6 million elements must move either way.
#
# </details>

# %% [markdown]
# **Exercise 2.** Time one training step of `models.build("yolo")`: input `torch.randn(8, 3, 256, 256)`
# (quick mode: 2 images of 64x64), loss `sum(o.square().mean() for o in
# net(images))`, backward, an SGD step with momentum. Compare it with section 5's `times`. *Predict*: what
# share of step plus update does the EMA update take?

# %%
# Exercise 2: your code here

# %% [markdown]
# <details><summary>Solution 2</summary>
#
# ```python
# from torch.utils.benchmark import Timer
#
# batch, size = (2, 64) if QUICK else (8, 256)
# net = models.build("yolo").train()
# opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
# images = torch.randn(batch, 3, size, size)
#
#
# def train_step() -> None:
#     opt.zero_grad()
#     sum(o.square().mean() for o in net(images)).backward()
#     opt.step()
#
#
# train_step()  # warm-up
# step_ms = Timer("train_step()", globals=globals()).timeit(3).mean * 1e3
# print(f"training step, batch {batch} at {size}x{size}: {step_ms:.0f} ms")
# for k in ("loop", "foreach", "ModelEMA", "flatten_model + ModelEMA"):
#     print(f"  {k:<25} {times[k]:6.2f} ms = {times[k] / (step_ms + times[k]):6.2%} of the step")
# ```
#
# Small at batch 8 of 256x256 (the printed shares; the loop's is the largest): the passes touch every
# pixel of every image, the update each weight once. The step grows with the batch and the images, the
# update does not: in quick mode the step is over ten times shorter and every share larger.
#
# </details>

# %% [markdown]
# **Exercise 3.** Flatten `models.build("tiny_cnn")` with `ema_lab.flatten_model`, update a `ModelEMA`
# of it, call `ema_lab.unflatten_model` on the model, update again. *Predict* `modes` and `rebuilds`
# after each update.

# %%
# Exercise 3: your code here

# %% [markdown]
# <details><summary>Solution 3</summary>
#
# ```python
# cnn = models.build("tiny_cnn")
# ema_lab.flatten_model(cnn)
# cnn_ema = ema_lab.ModelEMA(cnn)
# cnn_ema.update(cnn)
# print("flattened:  ", cnn_ema.modes, "| builds:", cnn_ema.rebuilds)
# ema_lab.unflatten_model(cnn)
# cnn_ema.update(cnn)
# print("unflattened:", cnn_ema.modes, "| builds:", cnn_ema.rebuilds)
# ```
#
# `['fused']` with 1 build, then `['cat+foreach']` with 2: unflattened, each tensor has its own memory
# again, the check fails, and the update rebuilds as for any model that is not flattened.
#
# </details>
