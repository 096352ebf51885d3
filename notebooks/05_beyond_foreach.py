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
# - Views go stale when the model moves, so check them; a bf16 EMA stops moving, so keep it in fp32.
# - On a GPU, launches are the cost: flatten the model, or replay the update as one CUDA graph.

# %% tags=["nbval-ignore-output"]
import copy
import os
import platform
import statistics

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


def time_rounds(fns: dict[str, object], rounds: int = 5 if QUICK else 15) -> dict[str, list[float]]:
    """ms per call of each function in every round; they take turns, so load hits all alike."""
    timers = {name: Timer("fn()", globals={"fn": fn}) for name, fn in fns.items()}
    runs = {name: [] for name in fns}
    for _ in range(rounds):
        for name, timer in timers.items():
            runs[name].append(timer.timeit(5).median * 1e3)  # 5 calls per sample
    return runs


def medians(runs: dict[str, list[float]]) -> dict[str, float]:
    return {name: round(statistics.median(r), 2) for name, r in runs.items()}


# %% tags=["nbval-ignore-output"]
print(medians(time_rounds({"loop": ema_loop, "foreach": ema_foreach})))


# %% [markdown]
# foreach wins, but on a CPU `_foreach_lerp_` still runs one `lerp_` per tensor inside: 594 small
# calls. The floor is one `lerp_` over all 2.6 million elements at once. For that, the elements must
# sit in one contiguous buffer.

# %% [markdown]
# ## 2. One buffer, many views
#
# Copy every EMA tensor into one flat buffer, then re-point the tensor at its slice: a *view*, a
# tensor that reads and writes another tensor's memory. `t.data = view` keeps the tensor object (a
# `Parameter` stays the module's `Parameter`) and swaps its memory.
#
# ![EMA tensors as views into one flat buffer, and one lerp_ between two buffers](figures/05_flat_views.svg)


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


print(medians(time_rounds({"foreach": ema_foreach, "flat EMA + cat": ema_cat_lerp})))

# %% [markdown]
# No faster than foreach, often slower: `cat` copies all 2.6 million model elements every step. So flatten
# the model too: the update becomes one `lerp_` over two buffers, and it must equal foreach to the bit:


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
print(medians(time_rounds({"foreach": ema_foreach, "one lerp_": ema_one_lerp})))

# %% [markdown]
# Bitwise equal: the same formula on the same elements, in one call. It skips foreach's 594
# per-tensor calls; what that saves depends on their share next to the work on 2.6 million elements
# (exercise 1 tries 2,000 tiny tensors).

# %% [markdown]
# ## 3. Views go stale
#
# The buffers are built once and reused, so they can go stale. `model.half()` gives every parameter
# new fp16 memory. `model_flat` is then no longer the model's memory, and `ema_one_lerp` would average
# a frozen copy forever, with no error. The check from section 2 sees it: run it before every update,
# and rebuild when it fails.

# %%
print("before:", all_views_of(M, model_flat))
model.half()
print("after model.half():", all_views_of(M, model_flat), "| parameter dtype:", M[0].dtype)

# %% [markdown]
# ## 4. Keep the EMA in fp32
#
# Should the EMA of a bf16 model be bf16 too? bf16 (bfloat16: 16 bits, float32's range) keeps 7 bits of
# mantissa, so near 1.0 its values are 2^-7 apart. Run 1,000 updates of a one-element EMA at 1.0
# towards a model 0.01 above it:


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
# bf16 and fp16 never leave 1.0: each step is far below half their spacing (the *half-ulp*, half a unit
# in the last place), so it rounds away. fp32 tracks the exact value. So keep an fp32 EMA of a bf16
# model; then each (EMA, model) pair differs in dtype, and `_foreach_lerp_` refuses such pairs.

# %% [markdown]
# ## 5. What ema_lab packages
#
# `ema_lab.ModelEMA` packages sections 2-4: it flattens its EMA copy, checks the views before every
# update (rebuilding when they moved), and updates an fp32 EMA (`ema.ema.float()`) from a bf16 model.
# `ema_lab.flatten_model` is our `flatten` for the model, and `ema_lab.lessons.precision.ema_stall` our
# `stall`. `ema.modes` names how each buffer is updated; a ten-line op counter (notebook 01) shows what
# one update calls:

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
# By default one `cat` gathers the small tensors (BatchNorm vectors, biases) and one `_foreach_lerp_`
# updates them with the large conv weights; the second `cat` copies BatchNorm's integer counters. A flattened model: one `lerp_`, one `copy_`. Time all six ways in turns, after turning
# section 3's model back to float32:

# %% tags=["nbval-ignore-output"]
import matplotlib.pyplot as plt

model.float()
M = float_tensors(model)  # the model's tensors now (.half() and .float() replaced its buffers)
model_flat = flatten(M)  # fresh flat memory for the float model
ways = {"loop": ema_loop, "foreach": ema_foreach, "flat EMA + cat": ema_cat_lerp, "one lerp_": ema_one_lerp}
ways["ModelEMA"] = lambda: ema_default.update(net)
ways["flatten_model + ModelEMA"] = lambda: ema_fused.update(net_flat)
runs = time_rounds(ways)
times = medians(runs)

fig, ax = plt.subplots(figsize=(6.5, 2.8))
names = list(times)[::-1]
colors = ["tab:blue" if "ModelEMA" in k else "tab:gray" for k in names]  # blue: ema_lab, gray: built above
ax.barh(names, [times[k] for k in names], color=colors)
for y, k in enumerate(names):
    ax.text(times[k], y, f" {times[k]:.2f} ms", va="center", fontsize=9)
ax.set_xlim(0, 1.25 * max(times.values()))
ax.set_xlabel("ms per EMA update, yolo-sized model, 1 thread")
fig.tight_layout()
plt.show()

ratio = [a / b for a, b in zip(runs["ModelEMA"], runs["foreach"])]  # per round
lo, mid, hi = statistics.quantiles(ratio, n=4)
verdict = "slower" if lo > 1 else "faster" if hi < 1 else "within the noise"
print(f"ModelEMA / our foreach: {mid:.2f}x (middle half of the rounds: {lo:.2f}x to {hi:.2f}x) -> {verdict}")

# %% [markdown]
# Gray: built here; blue: `ema_lab`. `flatten_model` + `ModelEMA` runs the floor's `lerp_` plus the
# counters' `copy_` and the check. The default leaves your model alone, so it reads the scattered
# tensors like our foreach, adds the check and the counters, and saves per-tensor calls with its `cat`
# of the small ones. The last line says how that nets out against our bare foreach on your machine.

# %% [markdown]
# The check from section 3, packaged: make the flattened model fp16 and update once. With decay 0 the
# EMA must equal the model:

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
# Rebuilt, and the EMA stayed fp32: mode "cast". Count what an fp32 EMA of a bf16 model costs per
# update with `strategy="gated"` and with the default. (The PR's own after-code raises on such a pair:
# `_foreach_lerp_` wants one dtype; "gated" is the PR's gate plus a fallback.)

# %%
bf16_net = models.build("yolo").bfloat16()
for strategy in ("gated", "auto"):
    fp32_ema = ema_lab.ModelEMA(bf16_net, strategy=strategy)
    fp32_ema.ema.float()  # an fp32 EMA of a bf16 model
    fp32_ema.update(bf16_net)
    ops = ops_of(fp32_ema.update, bf16_net)
    print(f"{strategy:<6} {sum(ops.values())} ops: {ops}")

# %% [markdown]
# "gated" falls back to a `mul_` and an `add_` per mixed pair. The default copies the bf16 model
# into an fp32 scratch buffer with one `_foreach_copy_`, then runs one `lerp_`.

# %% [markdown]
# ## 6. On a GPU: launches, CUDA graphs and a tensor decay
#
# On CUDA every op that computes is a kernel launch, queued by the CPU (notebook 04). An NVIDIA H200 run (torch 2.11)
# counted the kernels of one update on the yolo-sized model:

# %%
import json

from ema_lab.bench.results import results_dir

launches = json.loads(
    (results_dir() / "gpu-linux-intel-xeon-16c-nvidia-h200" / "kernel-launches.json").read_text()
)
for strategy, n in launches["yolo"].items():
    if isinstance(n, dict) and "total" in n:
        print(f"{strategy:<22} {n['total']:>5} kernels")

# %% [markdown]
# Flattening took the loop's one launch per op down to two. A *CUDA graph* takes any number of
# launches down to one: record an update's kernels once (*capture*), then launch them all at once
# (*replay*).
#
# ![Eager: the host launches each kernel. A graph: one launch replays them all](figures/05_cuda_graph.svg)
#
# The costs:
#
# - A replay reuses the recorded addresses: if the model's memory moves (section 3), it silently
#   updates the old tensors. Check the slots before each replay; recapture when they moved.
# - Numbers are recorded too: the ramp's changing decay must live on the device, in a tensor the
#   graph reads.
# - The capture: a warm-up on a side stream, then recording, each time the step is rebuilt.
#
# A replay saves the host's work per launch (notebook 01 priced it): it pays where launches dominate,
# not where moving the bytes does.

# %% [markdown]
# `ModelEMA(model, cuda_graph=True)` pays those three costs: it checks the slots before every replay,
# writes the weight `1 - decay` into a device tensor first (`fill_` passes the number inside the launch,
# so the CPU never waits for the GPU), and records again after every rebuild. It records the flat step
# without `torch.cat` gathers, which copy the small tensors once more. It has not been timed on a GPU
# yet: measure it on yours as notebook 04 does before you rely on it.

# %% [markdown]
# `torch.compile` has the same rule. Dynamo, its front end, records a function's tensor ops into a
# graph and bakes a Python float in as a constant, so a new decay compiles again. Count the graphs over
# the ramp's first 20 decays (`CompileCounter` counts them without compiling further):

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
small = models.build("tiny_cnn")
small_ema = ema_lab.ModelEMA(small)
print("torch", torch.__version__, "| graphs after each of 20 calls:")
print("  tensor decay:                ", graphs_after_each_call(step, True))
print("  float decay:                 ", graphs_after_each_call(step, False))
print("  float, automatic dynamic off:", graphs_after_each_call(step, False, automatic_dynamic_shapes=False))
config = torch._dynamo.config  # older torch names the limit cache_size_limit
print("  Dynamo's recompile limit:", getattr(config, "recompile_limit", None) or config.cache_size_limit)
print(
    "  ModelEMA.update, tensor decay:",
    graphs_after_each_call(lambda d: small_ema.update(small, decay=d), True),
)
print(
    "host syncs in one ModelEMA update:",
    ops_of(small_ema.update, small, torch.tensor(0.999)).get("_local_scalar_dense", 0),
)
torch._logging.set_logs()

# %% [markdown]
# A 0-dim tensor decay is data, not a constant: one graph. A float recompiles once, then *automatic
# dynamic* (Dynamo marking an input that changed as symbolic) makes it a variable; with that off, every
# new float compiles until the recompile limit. `ModelEMA.update` compiles in several pieces on its
# first call (Dynamo splits a function where it meets code it cannot trace); with a tensor decay its
# count then stops growing, and it never waits for the GPU (a *host sync*, op `_local_scalar_dense`).
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
# - Views go stale after `model.half()` or `.to()`: check them every update, as `ModelEMA` does.
# - Keep the EMA in fp32: at decay 0.9999 a bf16 EMA's small steps round away.
# - On a GPU a captured graph replays all launches at once; the decay then lives in a tensor
#   (`ModelEMA(model, cuda_graph=True)`, not yet timed on a GPU).

# %% [markdown]
# ## Exercises
#
# 1. `models.build("tiny_tensors")` holds 2,000 tensors of 136 elements. Time foreach against one `lerp_`
#    over flat buffers there. Is the gain larger than on the yolo-sized model?
# 2. Does any of this matter in training? Time one training step of the yolo-sized model (forward, a
#    stand-in loss, backward, SGD) and each EMA update's share of a step.
# 3. Flatten a fresh `models.build("tiny_cnn")`, update a `ModelEMA` of it, then call
#    `ema_lab.unflatten_model` on the model. What does `ema.modes` say after the next update?

# %% [markdown]
# ## Solutions
#
# Each solution cell is collapsed: click it to open.

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["nbval-ignore-output"]
# 1. Far larger: 2,000 tiny tensors are almost all per-tensor overhead.
tiny, tiny_ema = models.build("tiny_tensors"), models.build("tiny_tensors").requires_grad_(False)
tE, tM = float_tensors(tiny_ema), float_tensors(tiny)
tE_flat, tM_flat = flatten(tE), flatten(tM)
tiny_runs = time_rounds(
    {
        "foreach": torch.no_grad()(lambda: torch._foreach_lerp_(tE, tM, 1 - D)),
        "one lerp_": torch.no_grad()(lambda: tE_flat.lerp_(tM_flat, 1 - D)),
    }
)
print("tiny_tensors:", medians(tiny_runs))
ratio = statistics.median(tiny_runs["foreach"]) / statistics.median(tiny_runs["one lerp_"])
print(f"tiny_tensors: {ratio:.0f}x")  # of the unrounded medians
print(f"yolo-sized:   {times['foreach'] / times['one lerp_']:.1f}x")

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["nbval-ignore-output"]
# 2. Hardly, on a CPU: the step dwarfs every EMA update. The share grows as the step shortens
#    (smaller batches or images) while the update stays the same.
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
runs_ms = []
for _ in range(3):
    t0 = time.perf_counter()
    train_step()
    runs_ms.append(1e3 * (time.perf_counter() - t0))
step_ms = statistics.median(runs_ms)
print(f"training step, batch {batch} at {size}x{size}: {step_ms:.0f} ms")
for k in ("loop", "foreach", "ModelEMA", "flatten_model + ModelEMA"):
    print(f"  {k:<25} {times[k]:6.2f} ms = {times[k] / (step_ms + times[k]):6.2%} of the step")

# %% jupyter={"outputs_hidden": true, "source_hidden": true}
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
