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
# # 01 · Launch overhead: why a loop over many small tensors is slow
#
# - Every op called from Python pays a fixed cost before it touches a single number.
# - A loop over many small tensors pays it per op; `torch._foreach_lerp_` pays most of it once per list.
# - One `lerp_` over one flat buffer pays it once in all: the floor.

# %% [markdown]
# ![Course map](figures/course_map_01.svg)
#
# You start here: an op counter, a timer, a cost line, and the change the course is about.

# %% tags=["nbval-ignore-output"]
# %matplotlib inline
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import LogLocator
from torch.utils.benchmark import Timer

from ema_lab.bench.environment import environment, quick_mode

torch.set_num_threads(1)  # one thread: we compare ops, not cores
env = environment()
print(f"torch {env['torch']} on {env['cpu']} ({env['cpu_count']} cores), 1 thread")

# %% [markdown]
# ## 1. Same numbers, more tensors
#
# An [EMA](../docs/glossary.md#ema) update moves each weight `e` of an averaged copy a fraction `w`
# towards the model's weight `m`: `e += w * (m - e)`, a [lerp](../docs/glossary.md#lerp) (linear
# interpolation), in place: `e.lerp_(m, w)`. Here are 2^18 numbers in `n` tensors:


# %%
def make(n, total=2**18):
    """n EMA tensors and n model tensors of random numbers, `total` numbers on each side."""
    return [torch.rand(total // n) for _ in range(n)], [torch.rand(total // n) for _ in range(n)]


def loop(ema, model, w):  # one lerp_ per tensor: n ops
    for e, m in zip(ema, model):
        e.lerp_(m, w)


def foreach(ema, model, w):  # one call for the whole list
    torch._foreach_lerp_(ema, model, w)


# %% [markdown]
# `torch._foreach_lerp_` updates a whole list in one call ([foreach](../docs/glossary.md#foreach)). Its
# leading underscore marks a [private API](../docs/glossary.md#private-api): it works, but torch makes no
# promise to keep it as it is. A third way keeps all the numbers in one flat buffer per side: one
# `lerp_`. First, do the three agree?

# %%
ema_t, model_t = make(1024)
ema_flat, model_flat = [torch.cat(ema_t)], [torch.cat(model_t)]  # the same numbers, one tensor a side
by_loop, by_foreach = [e.clone() for e in ema_t], [e.clone() for e in ema_t]
loop(by_loop, model_t, 0.1)
foreach(by_foreach, model_t, 0.1)
by_flat = ema_flat[0].clone().lerp_(model_flat[0], 0.1)
torch.testing.assert_close(torch.cat(by_loop), by_flat)  # raises if any number differs
torch.testing.assert_close(torch.cat(by_foreach), by_flat)
print(f"{len(ema_t)} tensors of {ema_t[0].numel()} numbers, or one of {by_flat.numel()}: the same result")

# %% [markdown]
# Same result. Now the cost: time the loop over 1024 tensors against the flat `lerp_` with
# `torch.utils.benchmark.Timer`, PyTorch's stopwatch (it repeats a statement, reports the median):

# %% tags=["nbval-ignore-output"]
first = {}
for name, stmt in [
    ("loop over 1024", "loop(ema_t, model_t, 0.1)"),
    ("one flat lerp_", "ema_flat[0].lerp_(model_flat[0], 0.1)"),
]:
    t = Timer(stmt, globals=globals()).blocked_autorange(min_run_time=0.2 if quick_mode() else 1)
    first[name] = t.median * 1e3
    print(f"{name:<15} {first[name]:6.3f} ms")
print(f"the loop takes {first['loop over 1024'] / first['one flat lerp_']:.1f}x the flat lerp_'s time")

# %% [markdown]
# One `Timer` run can catch a busy moment of your computer, so time in turns instead: each round
# times every way once, and each keeps its median over the rounds and its range.


# %% tags=["nbval-ignore-output"]
def interleaved(ways, rounds):
    """{name: [ms in round 1, round 2, ...]}: each round times every way once, in turn."""
    ms = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            t = Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.05)
            ms[name].append(t.median * 1e3)
    return ms


from functools import partial

turns = interleaved(
    {
        "loop over 1024": partial(loop, ema_t, model_t, 0.1),
        "one flat lerp_": partial(ema_flat[0].lerp_, model_flat[0], 0.1),
    },
    rounds=5,
)
for name, ms in turns.items():
    print(f"{name:<15} median {np.median(ms):.3f} ms, range {min(ms):.3f} to {max(ms):.3f} ms")
print(f"loop / flat: {np.median(turns['loop over 1024']) / np.median(turns['one flat lerp_']):.1f}x")

# %% [markdown]
# The range shows how much one measurement can move: when two ways' ranges overlap, their difference
# is within the noise.
# `ema_lab.bench.timing.time_candidates` is this timer, packaged: it also shuffles the order from
# round to round and reports the quartiles. It times the sweep of `n` from 1 to 4096 tensors:

# %% tags=["nbval-ignore-output"]
from ema_lab.bench.timing import time_candidates

TENSORS = [1, 4, 16, 64, 256, 1024, 4096]
sweep = {"loop": [], "foreach": [], "one flat lerp_": []}
for n in TENSORS:
    ema_t, model_t = make(n)
    ways = {
        "loop": partial(loop, ema_t, model_t, 0.1),
        "foreach": partial(foreach, ema_t, model_t, 0.1),
        "one flat lerp_": partial(ema_flat[0].lerp_, model_flat[0], 0.1),
    }
    for name, r in time_candidates(ways, rounds=3 if quick_mode() else 7).items():
        sweep[name].append(r.median_s * 1e3)

fig, ax = plt.subplots(figsize=(6.5, 3.8))
for (name, ms), color in zip(sweep.items(), ["C3", "C0", "C2"]):
    ax.plot(TENSORS, ms, "o-", color=color)
    ax.annotate(
        name, (TENSORS[-1], ms[-1]), xytext=(6, 0), textcoords="offset points", color=color, va="center"
    )
ax.set(xscale="log", yscale="log", xlabel="number of tensors (2^18 numbers in all)", ylabel="ms per update")
ax.set_title("Same work, split into more tensors")
ax.set_xlim(0.7, 4096 * 10)
ax.set_xticks(TENSORS, [str(n) for n in TENSORS])
ax.minorticks_off()
ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # 0.01, 0.02, 0.05, 0.1, ...
ax.yaxis.set_major_formatter("{x:g}")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The flat `lerp_` stays level: the work is the same at every `n`. The loop climbs: past a few dozen
# tensors its time is mostly the fixed price of each op, called [launch
# overhead](../docs/glossary.md#kernel-launch). `_foreach_lerp_` climbs too, below the loop.
#
# ## 2. What an op goes through
#
# ![A loop pays Python, dispatcher and kernel per tensor; _foreach_lerp_ pays Python once per list](figures/op_path.svg)
#
# Python reads the arguments; the [dispatcher](../docs/glossary.md#dispatcher) (PyTorch's C++ layer) runs
# the autograd layer (it records ops for `backward()`; here it only checks that no tensor needs that)
# and picks a kernel for the device and dtype; the kernel does the arithmetic.
# The first two cost the same for one number or a million.

# %% [markdown]
# On a CPU nothing is "launched": the kernel is a function call. `_foreach_lerp_` pays Python and the
# autograd layer once per list (bottom row); its CPU kernel then calls `lerp_` per tensor, and each call
# goes through the dispatcher again (autograd already passed): so its line climbs too.
#
# **Count the ops.** A `TorchDispatchMode` is a Python hook that sees every op reaching the
# dispatcher. Ten lines count them:

# %%
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1  # one op reached the dispatcher
        return func(*args, **(kwargs or {}))


# %%
ema_t, model_t = make(1024)
for name, fn in [("loop", loop), ("foreach", foreach)]:
    with CountOps() as counter:
        fn(ema_t, model_t, 0.1)
    print(f"{name:<8} {dict(counter.counts)}")
with CountOps() as counter:
    ema_flat[0].lerp_(model_flat[0], 0.1)
print(f"{'flat':<8} {dict(counter.counts)}")

# %% [markdown]
# 1024 ops for the loop, one for each of the others: the hook is switched off while an op it caught
# runs, so it misses the `lerp_` calls inside `_foreach_lerp_`. `ema_lab.bench.counting.count_ops` is
# this counter, packaged.
#
# ## 3. The price of one op
#
# If each op has a fixed price, the loop's time is a line in the number of ops:
# `time = price × ops + work`. `numpy.polyfit` fits it to the sweep (weighted by `1 / time`, so that
# fast points count as much as slow ones):

# %% tags=["nbval-ignore-output"]
loop_ms, foreach_ms = np.array(sweep["loop"]), np.array(sweep["foreach"])
price_ms, work_ms = np.polyfit(TENSORS, loop_ms, 1, w=1 / loop_ms)
per_tensor_ms, _ = np.polyfit(TENSORS, foreach_ms, 1, w=1 / foreach_ms)
print(f"loop:    {price_ms * 1e3:.2f} us per op, plus {work_ms:.3f} ms of work on the 2^18 numbers")
print(f"foreach: {per_tensor_ms * 1e3:.2f} us per tensor inside the one call")
flat_ms = np.median(sweep["one flat lerp_"])  # the same op at every n: its median over the sweep
print(f"one flat lerp_ on the 2^18 numbers, measured: {flat_ms:.3f} ms (median over the sweep)")
at, line_ms = TENSORS.index(1024), price_ms * 1024 + work_ms
print(f"loop over 1024: the line says {line_ms:.3f} ms, the sweep measured {loop_ms[at]:.3f} ms", end=" ")
print(f"({line_ms / loop_ms[at] - 1:+.1%})")

# %% [markdown]
# The slope is one op's price on your machine; the work should be near one flat `lerp_`'s time. The last
# line tests the line on one point: a gap of more than a few percent means a noisy sweep (run it again).
# Inside `_foreach_lerp_` a tensor costs less: Python and autograd are paid once.
#
# ## 4. The real change: ultralytics PR #25315, on a CPU and a GPU
#
# [The PR](https://github.com/ultralytics/ultralytics/pull/25315) changed ultralytics' EMA update, from
# this to this (the after-code first checks the torch version and device: notebook 02's gate):


# %%
def ema_before(ema, model, d):  # the PR's before-code: 3 ops per float tensor
    msd = model.state_dict()
    for k, v in ema.state_dict().items():
        if v.dtype.is_floating_point:
            v *= d
            v += (1 - d) * msd[k].detach()


def ema_after(ema, model, d):  # the PR's after-code: one op for all float tensors
    msd = model.state_dict()
    pairs = [(v, msd[k]) for k, v in ema.state_dict().items() if v.dtype.is_floating_point]
    torch._foreach_lerp_([e for e, _ in pairs], [m for _, m in pairs], 1 - d)


# %% [markdown]
# Run both on a model shaped like the yolo26n detector. What does its `state_dict()` hold?

# %%
from copy import deepcopy

from ema_lab.bench import models

model = models.build("yolo")
ema = deepcopy(model)
sd = model.state_dict()
sizes = sorted((v.numel() for v in sd.values() if v.is_floating_point()), reverse=True)
print(f"{len(sd)} entries: {len(sizes)} float tensors, {len(sd) - len(sizes)} integer ones")
print(f"float numbers: {sum(sizes):,}; median tensor {np.median(sizes):.0f}, largest {sizes[0]:,}")
big = [s for s in sizes if s > 32_768]
print(f"the {len(big)} tensors of over 32,768 numbers hold {sum(big) / sum(sizes):.1%} of them")

# %% [markdown]
# Most of the 594 float tensors are small, but a few large ones hold most of the numbers. The 114
# integer entries are [counters](../docs/glossary.md#float-tensor-and-integer-counter)
# (`num_batches_tracked`, one per BatchNorm layer); the EMA skips them. Count both updates' ops:

# %%
from ema_lab.bench.counting import count_ops

print(f"torch {torch.__version__}")
for fn in (ema_before, ema_after):
    counts = count_ops(fn, ema, model, 0.9999)
    print(f"{fn.__name__}: {sum(counts.values())} ops {dict(counts)}")

# %% [markdown]
# The before-code dispatches 3 ops per float tensor (`mul_`, `mul`, `add_`); the after-code one
# `_foreach_lerp_`. Both also dispatch a `detach` for every entry of the two `state_dict()` walks
# (2 x 708 = 1416), and the before-code one per tensor (`msd[k].detach()`: 1416 + 594 = 2010). Time
# both, the walks alone, the after-code's
# `_foreach_lerp_` alone (lists collected once), `ModelEMA(model, strategy="foreach")` (ema_lab's EMA,
# which keeps its lists) and one flat `lerp_` (the floor):

# %% tags=["nbval-ignore-output"]
from ema_lab import ModelEMA

numbers = models.describe(model).float_elements
flat_e, flat_m = torch.zeros(numbers), torch.ones(numbers)
msd = model.state_dict()
kept = [(v, msd[k]) for k, v in ema.state_dict().items() if v.dtype.is_floating_point]
kept_e, kept_m = [e for e, _ in kept], [m for _, m in kept]
kept_ema = ModelEMA(model, strategy="foreach")
kept_ema.update(model)  # its first update collects the lists
pr = time_candidates(
    {
        "before": lambda: ema_before(ema, model, 0.9999),
        "after": lambda: ema_after(ema, model, 0.9999),
        "two state_dict() walks": lambda: (ema.state_dict(), model.state_dict()),
        "after, lists kept": lambda: torch._foreach_lerp_(kept_e, kept_m, 1e-4),
        'ModelEMA "foreach"': lambda: kept_ema.update(model),
        "one flat lerp_": lambda: flat_e.lerp_(flat_m, 1e-4),
    },
    rounds=3 if quick_mode() else 9,
)
for name, r in pr.items():
    print(f"{name:<22} {r.median_s * 1e3:6.2f} ms  (quartiles {r.q1_s * 1e3:.2f} to {r.q3_s * 1e3:.2f})")


def ratio(before, after):  # median ratio, and its range from the quartiles of both sides
    return before.median_s / after.median_s, before.q1_s / after.q3_s, before.q3_s / after.q1_s


print("before / after: {:.1f}x (range {:.1f}x to {:.1f}x)".format(*ratio(pr["before"], pr["after"])))

# %% [markdown]
# The walks take much of the after-code's time. The ratio is your machine's version of the PR's 2.2x
# (12.8 -> 5.8 ms, yolo26n, Apple M-series). Yours, beside saved runs (a bar spans the ratios that
# the quartiles of both times allow):

# %% tags=["nbval-ignore-output"]
import json
from types import SimpleNamespace

from ema_lab.bench.results import results_dir

RUNS = {  # file in results/ -> label
    "linux-amd-epyc-2c_2026-12-02.json": "2-core AMD EPYC VM, Dec 2",
    "linux-amd-epyc-2c_2026-12-03T093048Z_full_t1_cpu.json": "2-core AMD EPYC VM, Dec 3",
    "gpu-linux-intel-xeon-16c-nvidia-h200/linux-intel-xeon-16c-nvidia-h200_2026-12-04T154528Z_full_t1_cuda.json": "NVIDIA H200, Dec 4",
    "gpu-linux-intel-xeon-16c-nvidia-h200/linux-intel-xeon-16c-nvidia-h200_2026-12-04T154430Z_quick_t1_cuda.json": "NVIDIA H200, Dec 4, short run",
}
ref = {label: json.loads((results_dir() / f).read_text()) for f, label in RUNS.items()}


# The bench names the PR's before- and after-code seed_before and seed_after, one flat lerp_ floor.
def yolo_row(run, candidate):  # one timing of the bench's yolo model, in seconds, as time_candidates gives it
    r = next(r for r in run["results"] if r["model"] == "yolo" and r["candidate"] == candidate)
    return SimpleNamespace(median_s=r["median_ms"] / 1e3, q1_s=r["q1_ms"] / 1e3, q3_s=r["q3_ms"] / 1e3)


rows = {
    "the PR: Apple M-series, yolo26n": (12.8 / 5.8, None, None),
    "your CPU (above)": ratio(pr["before"], pr["after"]),
}
rows |= {
    label: ratio(yolo_row(run, "seed_before"), yolo_row(run, "seed_after")) for label, run in ref.items()
}
fig, ax = plt.subplots(figsize=(6.5, 2.8))
for i, (mid, lo, hi) in enumerate(rows.values()):
    ax.plot([lo or mid, hi or mid], [i, i], color="C0", lw=6, alpha=0.35, solid_capstyle="butt")
    ax.plot(mid, i, "o", color="C0")
    ax.annotate(f"{mid:.1f}x", (hi or mid, i), xytext=(6, 0), textcoords="offset points", va="center")
ax.set_yticks(range(len(rows)), list(rows))
ax.invert_yaxis()
ax.set(xscale="log", xlabel="before-code time / after-code time (bar: quartile range)")
ax.set_xticks([1, 2, 4, 8], ["1x", "2x", "4x", "8x"])
ax.minorticks_off()
ax.set_title("The PR's speed-up on a yolo-sized model")
ax.grid(alpha=0.3, axis="x")
plt.show()
print("the PR's own figures: 12.8 -> 5.8 ms per update")
for label, (mid, lo, hi) in rows.items():
    print(f"{label:<34} {mid:.1f}x" + (f"  (quartiles allow {lo:.1f}x to {hi:.1f}x)" if lo else ""))

# %% [markdown]
# On the 2-core CPU the speed-up was 1.4x one day and 1.8x the next; on the H200, 4.2x in a short run
# and 5.8x in a full one.
#
# <details><summary>The saved runs</summary>
#
# `python3 dev.py bench` runs in `results/` (torch 2.13 on the CPU; 2.11, CUDA 13.0 on the H200, logs:
# [full](../results/gpu-linux-intel-xeon-16c-nvidia-h200/bench-full.log),
# [short](../results/gpu-linux-intel-xeon-16c-nvidia-h200/bench-quick.log)). They time the PR's code as
# written above.
# </details>
#
# **On a GPU** the kernel step is a launch: the CPU queues work for the device. A loop launches one kernel
# per op; on CUDA, `_foreach_lerp_` packs many tensors into each launch. With a CUDA device, the
# profiler counts them:

# %% tags=["nbval-ignore-output"]
from ema_lab.bench.counting import kernel_launches_or_reason

device = "cuda" if torch.cuda.is_available() else "cpu"
ema_g, model_g = ([t.to(device) for t in side] for side in make(600))
for name, fn in [("loop over 600", loop), ("foreach over 600", foreach)]:
    k = kernel_launches_or_reason(fn, ema_g, model_g, 0.1, device=device)
    print(f"{device}, {name}:", k if isinstance(k, str) else f"{sum(k.values())} kernel launches")

# %% [markdown]
# Without CUDA the cell says why. The H200 run above counted the launches of one update, on the
# yolo-sized model and on 2,000 tiny tensors:

# %%
h200 = ref["NVIDIA H200, Dec 4"]
gpu = h200["devices"]["cuda"]["environment"]
print(f"{gpu['device_name']}, torch {gpu['torch']}, CUDA {gpu['cuda']}: kernel launches per update")
for m in ("yolo", "tiny_tensors"):
    rows = {r["candidate"]: r for r in h200["results"] if r["model"] == m}
    launches = {c: r["kernel_launches"] for c, r in rows.items()}
    per_launch = rows["seed_after"]["stats"]["float_tensors"] / launches["seed_after"]
    print(
        f"  {m:<13} before-code {launches['seed_before']:>5}, after-code {launches['seed_after']:>3}"
        f" ({per_launch:.1f} tensors each), one flat lerp_ {launches['floor']}"
    )

# %% [markdown]
# The before-code launches one kernel per `mul_`, `mul` and `add_` (3 x 594); `detach` launches none.
# The after-code's `_foreach_lerp_` took 10 launches for 594 tensors and 32 for 2,000: 59.4 and 62.5
# tensors a launch in that torch build (count yours above). One flat `lerp_` is one launch.
#
# Why does the GPU gain more? The prices differ. Fit one op of the before-code's loop (four per tensor,
# `detach` included) with section 3's line, beside the prices the bench fitted on the saved machines:


# %% tags=["nbval-ignore-output"]
def before_loop(ema, model, d):  # the before-code's arithmetic over two lists: 4 ops per tensor
    for e, m in zip(ema, model):
        e *= d
        e += (1 - d) * m.detach()


COUNTS = [16, 64, 256, 1024]
before_ms = []
for n in COUNTS:
    ema_t, model_t = make(n)
    r = time_candidates(
        {"loop": partial(before_loop, ema_t, model_t, 0.9999)}, rounds=3 if quick_mode() else 7
    )
    before_ms.append(r["loop"].median_s * 1e3)
op_ms, _ = np.polyfit([4 * n for n in COUNTS], before_ms, 1, w=1 / np.array(before_ms))

cpu_run, h200 = ref["2-core AMD EPYC VM, Dec 3"], ref["NVIDIA H200, Dec 4"]
runs = [(cpu_run, "cpu"), (h200, "cuda")]


def fit(name):  # a price the bench fitted in a saved run: us per op (loop) or per tensor (foreach)
    return [run["cost_model"][device]["fits"][name]["overhead_per_op_us"] for run, device in runs]


def yolo_ms(yours, candidate):  # your time above, then the saved runs' (the same code in each)
    return [pr[yours].median_s * 1e3] + [yolo_row(run, candidate).median_s * 1e3 for run, _ in runs]


op_us, tensor_us = [op_ms * 1e3] + fit("loop"), [per_tensor_ms * 1e3] + fit("foreach")
price_ratio = [a / b for a, b in zip(op_us, tensor_us)]
before, after = yolo_ms("before", "seed_before"), yolo_ms("after", "seed_after")
table = {
    "one op of the before-code's loop (us)": op_us,
    "one tensor inside _foreach_lerp_ (us)": tensor_us,
    "price ratio (row 1 / row 2)": price_ratio,
    "speed-up the prices predict (4 x row 3)": [4 * r for r in price_ratio],
    f"one flat lerp_ of {numbers / 1e6:.1f}M numbers (ms)": yolo_ms("one flat lerp_", "floor"),
    "before-code on yolo (ms)": before,
    "after-code on yolo (ms)": after,
    "speed-up measured (before / after)": [b / a for b, a in zip(before, after)],
}
print(f"your CPU: {env['cpu']}; the saved CPU run's: {cpu_run['environment']['cpu']}, 2 cores\n")
print(f"{'':<45}{'your CPU':>10}{'2-core CPU':>12}{'H200':>8}")
for label, values in table.items():
    print(f"{label:<45}" + "".join(f"{v:>{w}.{3 if v < 1 else 2}f}" for v, w in zip(values, (10, 12, 8))))

# %% [markdown]
# A loop's op costs a few times a tensor inside `_foreach_lerp_` on a CPU, about 21 times on the H200,
# where its ops launch kernels. The before-code pays the first price four times per tensor, the
# after-code the second once: on the H200 the prices predict 86x; measured: 5.8x. Both versions also pay
# the two `state_dict()` walks (timed in section 4): without them the ratio moves toward the
# prediction; only code that keeps its lists (notebooks 02 and 05) escapes them.


# %% [markdown]
# ## Summary
#
# - Each op called from Python pays a fixed price (Python, then the dispatcher) before any arithmetic.
# - At a fixed total size, a loop's time grows with the number of tensors; one flat `lerp_` does not.
# - `_foreach_lerp_` is one call from Python; on a CPU its kernel still dispatches one `lerp_` per tensor.
# - The PR's speed-up is larger on a GPU, where a loop's op costs far more; two `state_dict()` walks per
#   update, paid by both versions, keep it far below what the prices predict.

# %% [markdown]
# ## Exercises
#
# Try each exercise in the empty cell below it before you open its solution; to run a solution,
# paste it into that cell.
#
# **Exercise 1.** `tiny = models.build("tiny_tensors")` has 2,000 float tensors and no integer ones.
# *Predict* how many ops `ema_before` dispatches on it, then count them:
# `count_ops(ema_before, deepcopy(tiny), tiny, 0.9999)`.

# %%
# Exercise 1: your code here

# %% [markdown]
# <details><summary>Solution 1</summary>
#
# ```python
# tiny = models.build("tiny_tensors")
# counts = count_ops(ema_before, deepcopy(tiny), tiny, 0.9999)
# print(f"{sum(counts.values())} ops {dict(counts)}")
# ```
#
# Six ops per float tensor, times 2,000: three arithmetic ops (`mul_`, `mul`, `add_`) and three
# `detach`, one per entry of each of the two `state_dict()` walks and one per model tensor.
#
# </details>

# %% [markdown]
# **Exercise 2.** What runs inside one `_foreach_lerp_` over 600 tensors on a CPU? *Predict* it from
# section 2, then look: with `ema_t, model_t = make(600)`, call `foreach(ema_t, model_t, 0.1)` inside
# `with torch.profiler.profile() as prof:` and print each top-level event of `prof.events()` (its
# `cpu_parent` is `None`) with the names of its `cpu_children` (ignore the profiler's two log
# lines).

# %%
# Exercise 2: your code here

# %% [markdown]
# <details><summary>Solution 2</summary>
#
# ```python
# ema_t, model_t = make(600)
# with torch.profiler.profile() as prof:
#     foreach(ema_t, model_t, 0.1)
# for event in prof.events():
#     if event.cpu_parent is None:  # the top-level calls only
#         print(event.name, "runs inside it:", dict(Counter(c.name for c in event.cpu_children)))
# ```
#
# `aten::_foreach_lerp_ runs inside it: {'aten::lerp_': 600}`: one call from Python, and inside it one
# `lerp_` per tensor, each seen by the profiler because it went through the dispatcher.
#
# </details>

# %% [markdown]
# **Exercise 3.** *Predict* the loop's time over 2,000 tensors of 136 numbers from the line of section
# 3 (`price_ms` per op, plus `work_ms` per 2^18 numbers), then measure it with `Timer`.

# %%
# Exercise 3: your code here

# %% [markdown]
# <details><summary>Solution 3</summary>
#
# ```python
# ema_t, model_t = make(2000, total=2000 * 136)
# t = Timer("loop(ema_t, model_t, 0.1)", globals=globals()).blocked_autorange(min_run_time=0.2)
# predicted = 2000 * price_ms + work_ms * 2000 * 136 / 2**18
# print(f"predicted {predicted:.2f} ms, measured {t.median * 1e3:.2f} ms")
# ```
#
# The same order of magnitude, not equal: a line fitted on other sizes, and a noisy price.
#
# </details>
