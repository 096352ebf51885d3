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
# # 05 · Beyond foreach: one `lerp_` over one buffer
#
# - Put the EMA and the model each in one contiguous buffer, and the whole update is one `lerp_`.
# - Views into a buffer go stale when the model moves: check before you trust them.
# - Keep the EMA of a bf16 model in fp32, and pass the decay as a tensor under `torch.compile`.

# %% tags=["nbval-ignore-output"]
import copy
import os
import platform

import torch
from torch.utils.benchmark import Timer

from ema_lab.bench import models

torch.set_num_threads(1)  # one thread, so timings compare across runs
QUICK = os.environ.get("EMA_LAB_QUICK", "0") not in ("", "0")  # a shorter run with the same steps
print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}")
print("threads:", torch.get_num_threads())

model = models.build("yolo")  # a conv net shaped like ultralytics' yolo26n
ema = copy.deepcopy(model).requires_grad_(False)


def float_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's own floating-point parameters and buffers: what an EMA averages."""
    return [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]


E, M = float_tensors(ema), float_tensors(model)
print(f"{len(E)} float tensors, {sum(t.numel() for t in E):,} elements")

# %% [markdown]
# ## 1. The slow way: one `lerp_` per tensor
#
# `torch.lerp(a, b, w)` is `a + w * (b - a)`, so an EMA step with decay `d` is `lerp_(ema, model, 1 - d)`.
# ultralytics PR #25315 replaced a Python loop over tensors with one `torch._foreach_lerp_` over the two
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


def median_ms(fns: dict[str, object], rounds: int = 5 if QUICK else 15) -> dict[str, float]:
    """Median ms per call of each function, timed in turns (round by round) so load hits all alike."""
    timers = {name: Timer("fn()", globals={"fn": fn}) for name, fn in fns.items()}
    runs = {name: [] for name in fns}
    for _ in range(rounds):
        for name, timer in timers.items():
            runs[name].append(timer.timeit(5).median * 1e3)  # 5 calls per sample
    return {name: round(sorted(r)[len(r) // 2], 2) for name, r in runs.items()}


# %% tags=["nbval-ignore-output"]
print(median_ms({"loop": ema_loop, "foreach": ema_foreach}))


# %% [markdown]
# foreach wins, but on a CPU `_foreach_lerp_` still runs one `lerp_` per tensor inside: 594 small
# calls. The floor is one `lerp_` over all 2.6 million elements at once. For that, the elements must
# sit in one contiguous buffer.

# %% [markdown]
# ## 2. One buffer for the EMA
#
# Copy every EMA tensor into one flat buffer, then re-point the tensor at its slice. `t.data = view`
# keeps the tensor object (a `Parameter` stays the module's `Parameter`) and swaps its memory for a
# *view*: a tensor that reads and writes another tensor's memory.


# %%
@torch.no_grad()
def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Copy the tensors into one buffer and make each a view of its slice; return the buffer."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    start = 0
    for t in tensors:
        view = flat[start : start + t.numel()].view_as(t)
        view.copy_(t)
        t.data = view  # same tensor object, new memory
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
# scattered, so the obvious next step gathers them with `torch.cat` on every update:


# %% tags=["nbval-ignore-output"]
@torch.no_grad()
def ema_cat_lerp() -> None:  # flat EMA; the model copied into one tensor each step
    ema_flat.lerp_(torch.cat([m.reshape(-1) for m in M]), 1 - D)


print(median_ms({"foreach": ema_foreach, "flat EMA + cat": ema_cat_lerp}))

# %% [markdown]
# Usually no faster than foreach: `cat` copies all 2.6 million model elements every step, two more
# passes over memory on top of the `lerp_`'s three (read EMA, read model, write EMA).

# %% [markdown]
# ## 3. Flatten the model too
#
# The same `flatten` on the model's own parameters and buffers makes the update one `lerp_` over two
# buffers. It must give the same EMA as foreach, to the bit:

# %%
model_flat = flatten(M)
with torch.no_grad():
    for m in M:
        m.add_(1.0)  # move the model away from the EMA, so the update changes something
    start = ema_flat.clone()
    ema_foreach()
    by_foreach = ema_flat.clone()
    ema_flat.copy_(start)
    ema_flat.lerp_(model_flat, 1 - D)
print("one lerp_ == foreach, bitwise:", torch.equal(ema_flat, by_foreach))


# %% [markdown]
# Bitwise equal: the same formula on the same elements, just in one call. Now the clock:


# %% tags=["nbval-ignore-output"]
@torch.no_grad()
def ema_one_lerp() -> None:  # both flat: the floor
    ema_flat.lerp_(model_flat, 1 - D)


print(median_ms({"foreach": ema_foreach, "one lerp_": ema_one_lerp}))

# %% [markdown]
# The one `lerp_` skips foreach's 594 per-tensor calls. What that saves depends on their share of the
# time next to the work on 2.6 million elements; exercise 1 tries 2000 tiny tensors.

# %% [markdown]
# ## 4. What ema_lab packages
#
# `ema_lab.ModelEMA` flattens its EMA copy by default. The model it leaves alone, unless you call
# `ema_lab.flatten_model(model)`: that moves the model's parameters and buffers into one buffer per
# (device, dtype), as our `flatten` did. `ema.modes` names how each buffer is updated. A ten-line op
# counter, as in notebook 01, shows which tensor operations one update calls:

# %%
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

import ema_lab


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops (PyTorch's C++ tensor operations) called while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def ops_of(fn: object, *args: object) -> dict[str, int]:
    """Run fn(*args) once; how many times each ATen op was called."""
    with OpCounter() as counter:
        fn(*args)
    return dict(counter.ops)


net = models.build("yolo")
ema_default = ema_lab.ModelEMA(net)
ema_default.update(net)  # the first update builds the flat buffers
print("default:  ", ema_default.modes, ops_of(ema_default.update, net))
net_flat = models.build("yolo")
buffers = ema_lab.flatten_model(net_flat)
ema_fused = ema_lab.ModelEMA(net_flat)
ema_fused.update(net_flat)
print("flattened:", ema_fused.modes, ops_of(ema_fused.update, net_flat))
print("model buffers:", [(b.dtype, b.numel()) for b in buffers])

# %% [markdown]
# By default the small tensors (BatchNorm vectors, biases) are gathered with one `cat` and one `lerp_`,
# and the large conv weights go to one `_foreach_lerp_`: `cat` only pays for small tensors. The second
# `cat` copies BatchNorm's integer counters (`num_batches_tracked`: copied, not averaged). On a
# flattened model, mode "fused": one `lerp_` for the float buffer, one `copy_` for the counters.
# All six ways, timed in turns:

# %% tags=["nbval-ignore-output"]
import matplotlib.pyplot as plt

ways = {"loop": ema_loop, "foreach": ema_foreach, "flat EMA + cat": ema_cat_lerp, "one lerp_": ema_one_lerp}
ways["ModelEMA"] = lambda: ema_default.update(net)
ways["flatten_model + ModelEMA"] = lambda: ema_fused.update(net_flat)
times = median_ms(ways)

fig, ax = plt.subplots(figsize=(6.5, 2.8))
names = list(times)[::-1]
colors = ["tab:blue" if "ModelEMA" in k else "tab:gray" for k in names]  # blue: ema_lab, gray: built above
ax.barh(names, [times[k] for k in names], color=colors)
for y, k in enumerate(names):
    ax.text(times[k], y, f" {times[k]:.2f} ms", va="center", fontsize=9)
ax.set_xlim(0, 1.25 * max(times.values()))
ax.set_xlabel(f"ms per EMA update, yolo-sized model, 1 thread (torch {torch.__version__})")
fig.tight_layout()
plt.show()


# %% [markdown]
# Gray bars were built in this notebook, blue ones are `ema_lab`. One `lerp_` over flat buffers is the
# floor. `flatten_model` + `ModelEMA` runs that same `lerp_`, plus the counters' `copy_` and a
# staleness check (section 5). The default leaves your model alone, so every update reads its
# scattered tensors (`cat`, `_foreach_lerp_`) as our foreach does: compare those two bars.
# `ema_lab.unflatten_model` undoes the flattening.

# %% [markdown]
# ## 5. Stale views
#
# The flat buffers are built once and reused, so they can go stale. `model.half()` gives every parameter
# new fp16 memory. Our `model_flat` is then no longer the model's memory, and `ema_one_lerp` would
# average a frozen copy forever, with no error. The check from section 2 sees it:

# %%
print("before:", all_views_of(M, model_flat))
model.half()
print("after model.half():", all_views_of(M, model_flat), "| parameter dtype:", M[0].dtype)

# %% [markdown]
# `ModelEMA` runs such a check before each update and rebuilds its step when the model's memory moved
# (`ema.rebuilds` counts the builds). Try it on `net_flat`; with decay 0 the EMA must equal the model:

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
# The EMA follows the fp16 model; its group is now "cast": the EMA stays fp32 and reads the fp16 model
# through one cast-copy (section 7).

# %% [markdown]
# ## 6. The EMA in a training step
#
# Does any of this matter for training? Time one training step of the same model (forward, a stand-in
# loss, backward, SGD), and each EMA update's share of a step that includes it:

# %% tags=["nbval-ignore-output"]
import time

batch, size = (2, 64) if QUICK else (8, 256)
train_net = models.build("yolo").train()
opt = torch.optim.SGD(train_net.parameters(), lr=0.01, momentum=0.9)
images = torch.randn(batch, 3, size, size)


def train_step() -> None:
    opt.zero_grad()
    sum(out.square().mean() for out in train_net(images)).backward()
    opt.step()


train_step()  # warm-up
runs = []
for _ in range(3):
    t0 = time.perf_counter()
    train_step()
    runs.append(1e3 * (time.perf_counter() - t0))
step_ms = sorted(runs)[1]
print(f"training step, batch {batch} at {size}x{size}: {step_ms:.0f} ms")
for k in ("loop", "foreach", "ModelEMA", "flatten_model + ModelEMA"):
    print(f"  {k:<25} {times[k]:6.2f} ms = {times[k] / (step_ms + times[k]):6.2%} of the step")

# %% [markdown]
# On a CPU at this batch size the step dwarfs every EMA update. The share grows when the step is
# short: small batches, small images, a fast GPU.
#
# <details><summary>What ultralytics measured end to end</summary>
#
# ultralytics PR #26046 (not merged) swapped their foreach `ModelEMA` for torch's `AveragedModel` and
# trained yolo26n for 100 epochs on a GH200 GPU: 82.2 s with `ModelEMA` vs 83.4 s with `AveragedModel`
# (coco8), 157.7 s vs 160.0 s (coco128), same mAP. Both sides already used a foreach EMA, so this
# compares two foreach EMAs, not foreach against the loop. Their figures, not measured here.
# </details>

# %% [markdown]
# ## 7. Mixed precision: keep the EMA in fp32
#
# bf16 (bfloat16: 16 bits, float32's range) stores 7 bits of mantissa, so near 1.0 its values are 2^-7
# apart. At decay 0.9999 an update should add 1e-4 of the gap: far less than half that spacing (the
# *half-ulp*, half a unit in the last place), so it rounds away.
# `ema_lab.lessons.precision.ema_stall` runs 1000 updates towards a model 0.01 above the EMA:

# %%
from ema_lab.lessons.precision import ema_stall

for dtype in (torch.bfloat16, torch.float16, torch.float32):
    print(ema_stall(dtype))

# %% [markdown]
# bf16 and fp16 never leave 1.0; fp32 tracks the exact value. So keep an fp32 EMA of a bf16 model.
# Then each (EMA, model) pair differs in dtype, which `_foreach_lerp_` refuses. Count what each
# strategy calls instead:

# %%
bf16_net = models.build("yolo").bfloat16()
for strategy in ("gated", "auto"):
    fp32_ema = ema_lab.ModelEMA(bf16_net, strategy=strategy)
    fp32_ema.ema.float()  # an fp32 EMA of a bf16 model
    fp32_ema.update(bf16_net)
    ops = ops_of(fp32_ema.update, bf16_net)
    print(f"{strategy:<6} {sum(ops.values())} ops: {ops}")

# %% [markdown]
# The foreach path ("gated") falls back to a `mul_` and an `add_` per tensor. The default "cast" mode
# copies the bf16 model into an fp32 scratch buffer with one `_foreach_copy_`, then runs one `lerp_`.

# %% [markdown]
# ## 8. Under `torch.compile`: pass the decay as a tensor
#
# `torch.compile` starts with Dynamo, which reads your Python function and records its tensor ops into
# a *graph*, guarded by checks on the inputs. A Python float is baked into the graph as a constant, so
# a new decay fails the guard and Dynamo recompiles. Count the graphs over the ramp's first 20 decays
# (`CompileCounter` counts graphs and runs them without compiling further):

# %% tags=["nbval-ignore-output"]
import logging

import torch._dynamo
from torch._dynamo.testing import CompileCounter

ramp = [ema_default.decay(n) for n in range(1, 21)]  # the decay ramps up over the first updates
flat_a, flat_b = torch.zeros(10_000), torch.ones(10_000)


def step(decay: float | torch.Tensor) -> None:
    flat_a.lerp_(flat_b, 1 - decay)


def graphs_after_each_call(fn: object, as_tensor: bool, **dynamo_config: object) -> list[int]:
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled, history = torch.compile(fn, backend=counter), []
    with torch._dynamo.config.patch(**dynamo_config):
        for d in ramp:
            compiled(torch.tensor(d) if as_tensor else d)
            history.append(counter.frame_count)
    return history


torch._logging.set_logs(dynamo=logging.ERROR)  # the recompile-limit warning is the point, not noise
print("torch", torch.__version__, "| graphs after each of 20 calls:")
print("  tensor decay:                    ", graphs_after_each_call(step, True))
print("  float decay:                     ", graphs_after_each_call(step, False))
print(
    "  float, automatic dynamic off:    ", graphs_after_each_call(step, False, automatic_dynamic_shapes=False)
)
print("  Dynamo's recompile limit:", torch._dynamo.config.recompile_limit)
torch._logging.set_logs()

# %% [markdown]
# A 0-dim tensor decay is data, not a constant: one graph. A float recompiles once, then *automatic
# dynamic* (Dynamo marking an input that changed between calls as symbolic) makes it a variable. With
# automatic dynamic off, every new float compiles a graph until the recompile limit, after which Dynamo
# gives up and runs the function uncompiled.
#
# `ModelEMA.update` takes a tensor decay too. It also never calls `.item()`, so nothing makes the CPU
# wait for the GPU (a *host sync*, op `_local_scalar_dense`):

# %% tags=["nbval-ignore-output"]
small = models.build("tiny_cnn")
small_ema = ema_lab.ModelEMA(small)
print("torch", torch.__version__, "| ModelEMA.update, tensor decay, graphs after each call:")
print(" ", graphs_after_each_call(lambda d: small_ema.update(small, decay=d), True))
print(
    "host syncs in one update:",
    ops_of(small_ema.update, small, torch.tensor(0.999)).get("_local_scalar_dense", 0),
)

# %% [markdown]
# The count stops growing after the first few calls: the decay changes, the graphs stay. (An update's
# Python-side checks split it into several graphs; that is fine.)
#
# <details><summary>Why the counts depend on the torch version</summary>
#
# How Dynamo treats a Python float (`torch._dynamo.config.specialize_float`, automatic dynamic) and where
# it splits a function into graphs change between releases, so the counts printed above hold for the
# torch version printed with them. A tensor decay is an ordinary graph input, so it needs no new graph.
# </details>

# %% [markdown]
# ## Summary
#
# - On a CPU, foreach still runs one `lerp_` per tensor; flat buffers make the update one `lerp_`.
# - `ModelEMA` flattens its EMA by default; `ema_lab.flatten_model(model)` flattens the model too.
# - Views go stale after `model.half()` or `.to()`: check them every update, as `ModelEMA` does.
# - Keep the EMA in fp32; pass the decay as a 0-dim tensor under `torch.compile`.

# %% [markdown]
# ## Exercises
#
# 1. `models.build("tiny_tensors")` holds 2000 tensors of 136 elements. Time foreach against one `lerp_`
#    over flat buffers there. Is the gain larger than on the yolo-sized model?
# 2. Does a bf16 EMA move at decay 0.99 (`ema_stall(torch.bfloat16, decay=0.99)`)?
# 3. Flatten a fresh `models.build("tiny_cnn")`, update a `ModelEMA` of it, then call
#    `ema_lab.unflatten_model` on the model. What does `ema.modes` say after the next update?

# %% [markdown]
# ## Solutions
#
# Each solution cell is collapsed: click it to open.

# %% jupyter={"source_hidden": true, "outputs_hidden": true} tags=["nbval-ignore-output"]
# 1. Far larger: 2000 tiny tensors are almost all per-tensor overhead.
tiny, tiny_ema = models.build("tiny_tensors"), models.build("tiny_tensors").requires_grad_(False)
tE, tM = float_tensors(tiny_ema), float_tensors(tiny)
tE_flat, tM_flat = flatten(tE), flatten(tM)
tiny_times = median_ms(
    {
        "foreach": torch.no_grad()(lambda: torch._foreach_lerp_(tE, tM, 1 - D)),
        "one lerp_": torch.no_grad()(lambda: tE_flat.lerp_(tM_flat, 1 - D)),
    }
)
print("tiny_tensors:", tiny_times, f"{tiny_times['foreach'] / tiny_times['one lerp_']:.0f}x")
print(f"yolo-sized:   {times['foreach'] / times['one lerp_']:.1f}x")

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
# 2. No: at decay 0.99 a step is under 1e-4, far below half of bf16's spacing near 1.0 (2^-8 = 3.9e-3).
print(ema_stall(torch.bfloat16, decay=0.99))

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
# 3. "fused" before; after unflatten_model each tensor has its own memory again, so the next update
#    rebuilds and runs the default's "cat+foreach", as for any model that is not flattened.
cnn = models.build("tiny_cnn")
ema_lab.flatten_model(cnn)
cnn_ema = ema_lab.ModelEMA(cnn)
cnn_ema.update(cnn)
print("flattened:  ", cnn_ema.modes, "| builds:", cnn_ema.rebuilds)
ema_lab.unflatten_model(cnn)
cnn_ema.update(cnn)
print("unflattened:", cnn_ema.modes, "| builds:", cnn_ema.rebuilds)
