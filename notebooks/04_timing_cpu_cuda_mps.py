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
# # 04 · Timing on CPU, CUDA and MPS
#
# - Warm up, and on a GPU synchronise, before you read the clock.
# - Times spread and drift: alternate the versions you compare; report medians.
# - Compare machines by the speed-ups each measured within one run.

# %% [markdown]
# ![Course map](figures/course_map_04.svg)
#
# Notebooks 01 to 03 quoted times; here you learn to take them, on a CPU and on a GPU.

# %% tags=["nbval-ignore-output"]
import statistics
import time
from copy import deepcopy
from functools import partial

import torch

from ema_lab.bench import models

torch.set_num_threads(1)  # one intra-op thread below, unless a cell says otherwise
print(f"torch {torch.__version__}, {torch.get_num_threads()} thread")


def ema_after(ema, model, d):  # the PR's after-code (notebook 01): one _foreach_lerp_
    msd = model.state_dict()
    pairs = [(v, msd[k]) for k, v in ema.state_dict().items() if v.dtype.is_floating_point]
    torch._foreach_lerp_([e for e, _ in pairs], [m for _, m in pairs], 1 - d)


model = models.build("yolo")  # the zoo's yolo, shaped like yolo26n: 594 float tensors
ema = deepcopy(model).eval()
for call in range(1, 6):  # timed by hand
    t0 = time.perf_counter()
    ema_after(ema, model, 0.9999)
    print(f"call {call}: {1e3 * (time.perf_counter() - t0):6.2f} ms")

# %% [markdown]
# Five calls of the PR's after-code (one `_foreach_lerp_`, notebook 01), five different times. Which one
# is *the* time? Each section answers one question on the way to a timer that can say.

# %% [markdown]
# ## 1. What does one reading include? Warm-up and the GPU's queue
#
# A first call often pays once (memory allocated, caches filled, CUDA set up), so throw a **warm-up**
# call away. On a GPU, a call only *queues* kernels (the programs the GPU runs) and returns.
#
# ![The host queues kernels; the GPU runs them later](figures/04_host_device.svg)
#
# `torch.cuda.synchronize()` (`torch.mps.synchronize()` on a Mac) waits until the queue is empty:


# %%
def sync(device: str) -> None:
    """Wait until the work queued on ``device`` is done (nothing to wait for on a CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def clock_ms(fn, device: str, synced: bool) -> float:
    """One call of ``fn`` in ms, with or without a synchronisation before the clock is read."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    if synced:
        sync(device)
    return 1e3 * (time.perf_counter() - t0)


# %% [markdown]
# Time a 128 MiB `lerp_` and `ModelEMA`'s update (ema_lab's EMA, notebook 02) both ways, alternating
# the two, on every device you have:

# %% tags=["nbval-ignore-output"]
from ema_lab import ModelEMA

present = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
for device in [d for d, ok in present.items() if ok]:
    a, b = torch.rand(2**25, device=device), torch.rand(2**25, device=device)  # 128 MiB each
    net = models.build("yolo").to(device)
    net_ema = ModelEMA(net)
    work = {"one lerp_ of 128 MiB": partial(a.lerp_, b, 0.1), "ModelEMA update": partial(net_ema.update, net)}
    for name, step in work.items():
        step()  # warm-up
        runs = {False: [], True: []}
        for _ in range(9):
            for synced in runs:
                runs[synced].append(clock_ms(step, device, synced))
        ms = {s: statistics.median(r) for s, r in runs.items()}
        print(f"{device}, {name}: without sync {ms[False]:.3f} ms, with sync {ms[True]:.3f} ms")
print("not present:", ", ".join(d for d, ok in present.items() if not ok) or "none")

# %% [markdown]
# On a CPU the two differ only by noise: a call returns when its work is done. An NVIDIA H200 (torch
# 2.11, one host thread) ran an earlier version of this cell on the same two jobs;
# [a results file](../docs/results/h200-update-costs-2026-12-04.md) keeps its medians:

# %%
import json
from pathlib import Path

h200_costs = json.loads(
    (Path(models.__file__).parents[2] / "docs" / "results" / "h200-update-costs-2026-12-04.json").read_text()
)
print(h200_costs["machine"]["gpu"], "| torch", h200_costs["machine"]["torch"])
for work, ms in h200_costs["sync"]["ms"].items():
    print(f"cuda, {work}: without sync {ms['without_sync']:.3f} ms, with sync {ms['with_sync']:.3f} ms")
lerp = h200_costs["sync"]["ms"]["one lerp_ of 128 MiB"]
tbs, peak_tbs = 3 * 2**27 / lerp["with_sync"] / 1e9, 4.8  # peak: NVIDIA's H200 data sheet
print(f"the lerp_ with sync / without: {lerp['with_sync'] / lerp['without_sync']:.0f}x")
print(f"it reads a and b and writes a: 3 x 128 MiB in {lerp['with_sync']} ms = {tbs:.1f} TB/s", end=", ")
print(f"{tbs / peak_tbs:.0%} of the memory's {peak_tbs} TB/s peak")

# %% [markdown]
# With sync the `lerp_` takes 13x longer: the host queues one kernel in 0.008 ms, and the GPU moves
# 3 x 128 MiB at 3.8 TB/s, near its memory's peak. For the update, sync hardly matters: the host works on
# it for 0.286 ms and the GPU's small part is nearly done when the call returns. The update is
# **host-bound**: the CPU sets its time.

# %% [markdown]
# Any line that needs a value on the host waits for the GPU: `x.item()`, `print(x)`, `x.cpu()`,
# `if x > 0:`. Such a hidden wait is a **sync point**; on CUDA, `torch.cuda.set_sync_debug_mode("warn")`
# warns at each one.
#
# ![x.item() waits until the queued kernels are done](figures/04_sync_points.svg)
#
# `torch.utils.benchmark.Timer` is this clock, packaged by PyTorch: `timeit(n)` first runs a short
# warm-up (n/100 calls, at least 2), then n calls, and synchronises the GPU around them (MPS only since
# mid-2025, [compat](../docs/compat.md)).

# %% [markdown]
# Host-bound means that fewer kernels need not be faster. The H200 also timed ultralytics' EMA (8.4.190:
# one `_foreach_lerp_` over lists it never checks) beside ema_lab's default, on five models:

# %%
for name, row in h200_costs["ms_per_update"].items():
    kernels = h200_costs["kernels_per_update"].get(name)
    counts = f"; kernels {kernels['ultralytics']} vs {kernels['default']}" if kernels else ""
    print(f"{row['model']} ({row['float_tensors']} float tensors)")
    print(f"    ms per update: ultralytics {row['ultralytics']:.3f} vs ema_lab {row['default']:.3f}{counts}")

# %% [markdown]
# ultralytics' class was faster on all five, with more kernels where they were counted. In these H200
# figures the default spends host time checking that the model's tensors have not moved, gathering
# tensors under 2,048 elements (notebook 05), copying the counters; without that check, ultralytics'
# lists go stale (notebook 02).
#
# Three YOLO-shaped models appear in this course; only the zoo's `yolo` is timed on your machine:

# %%
print(f"{'name':<10}{'float tensors':>14}  what it is, where it is timed")
print(
    f"{'yolo':<10}{models.describe(model).float_tensors:>14}  ema_lab's zoo, built above: notebooks 01 to 05"
)
for key in ("yolo26n", "yolo_like"):
    row = h200_costs["ms_per_update"][key]
    print(f"{key:<10}{row['float_tensors']:>14}  {row['model']}: the H200 results file only")

# %% [markdown]
# ## 2. How much do times spread?
#
# Time `ModelEMA`'s update 40 times in a row. `Timer.timeit(5)` times 5 updates and returns the mean
# per call: one *measurement*.

# %% tags=["nbval-ignore-output"]
import matplotlib.pyplot as plt
from torch.utils.benchmark import Timer

model_ema = ModelEMA(model)
timer = Timer("e.update(m)", globals={"e": model_ema, "m": model}, num_threads=1)
times_ms = [1e3 * timer.timeit(5).mean for _ in range(40)]
q1, med, q3 = statistics.quantiles(times_ms, n=4)
print(f"median {med:.2f} ms, IQR {q3 - q1:.2f} ms (the middle half of the 40)")

fig, ax = plt.subplots(figsize=(7, 2.8))
ax.axhspan(q1, q3, color="tab:blue", alpha=0.2)
ax.axhline(med, color="tab:blue")
ax.plot(range(1, 41), times_ms, "o", color="k", ms=4)
running = [statistics.median(times_ms[max(0, i - 7) : i + 1]) for i in range(40)]  # trend: last 8
ax.plot(range(1, 41), running, color="tab:orange")
above = med >= running[-1]  # the upper label sits above its line, the lower one below: no overlap
ax.text(40.5, med, " median", va="bottom" if above else "top", color="tab:blue")
ax.text(40.5, running[-1], " running\n median", va="top" if above else "bottom", color="tab:orange")
ax.set(
    xlabel="measurement", ylabel="ms per update", title="One update, timed 40 times in a row", xlim=(0, 48)
)
plt.show()

# %% [markdown]
# The black points scatter: other programs share the cores; caches and clock speeds change.
# The **median** (blue line) and the **IQR** (interquartile range: the middle half, shaded) describe
# them without being pulled by outliers. Where the orange running median (of the last 8) rises or falls
# over a stretch, the times **drift**, and a version timed in that stretch looks slower or faster than
# it is.

# %% [markdown]
# ## 3. Is one version faster? Alternate them, and compare with the noise
#
# Time the PR's before-code (a Python loop of three ops per tensor) and after-code (one
# `torch._foreach_lerp_`) in alternating *rounds*, so that a drift hits both:
#
# ![A disturbance hits one version in blocks, both when interleaved](figures/04_interleaved.svg)


# %% tags=["nbval-ignore-output"]
def ema_before(ema, model, d):  # the PR's before-code (notebook 01): 3 ops per float tensor
    msd = model.state_dict()
    for k, v in ema.state_dict().items():
        if v.dtype.is_floating_point:
            v *= d
            v += (1 - d) * msd[k].detach()


args = {"e": deepcopy(model).eval(), "m": model, "d": 0.9999}
timers = {
    name: Timer("f(e, m, d)", globals={"f": fn, **args}, num_threads=1)
    for name, fn in (("PR before", ema_before), ("PR after", ema_after))
}
rounds = {name: [] for name in timers}
for _ in range(9):
    for name, t in timers.items():  # one round: each version once
        rounds[name].append(1e3 * t.timeit(3).mean)
ratios = [b / a for b, a in zip(rounds["PR before"], rounds["PR after"])]
print(
    f"median per round: {statistics.median(ratios):.2f}x faster (rounds: {min(ratios):.2f}x to {max(ratios):.2f}x)"
)

# %% [markdown]
# Your machine's counterpart of the PR's speed-up (notebook 01 quotes it); the range shows how far one round
# could mislead. `ema_lab.bench.timing.time_candidates` is this loop, packaged: a warm-up, measurements
# of about 20 ms, the order shuffled every round. Add `ModelEMA(model, strategy="foreach")`, one
# `_foreach_lerp_` over lists it keeps:

# %% tags=["nbval-ignore-output"]
from ema_lab.bench.timing import time_candidates

e, m, d = args["e"], args["m"], args["d"]
cached = ModelEMA(model, strategy="foreach")
cached.update(model)  # its first call builds the tensor lists it then keeps
packaged = time_candidates(
    {
        "PR before": lambda: ema_before(e, m, d),
        "PR after": lambda: ema_after(e, m, d),
        'ModelEMA "foreach"': lambda: cached.update(model),
    },
    rounds=9,
)
base = packaged["PR before"].median_s
for name, r in packaged.items():
    print(f"{name:<19} {1e3 * r.median_s:6.2f} ms, IQR {1e3 * r.iqr_s:5.2f}, {base / r.median_s:5.1f}x")

# %% [markdown]
# The after-code rebuilds its lists from two `state_dict()` walks on every call (notebook 01 times
# them); `ModelEMA` keeps them. Cross-check with a second instrument: `Timer.blocked_autorange` picks
# its own number of calls per measurement, and `torch.utils.benchmark.Compare` tabulates the results:

# %% tags=["nbval-ignore-output"]
from torch.utils.benchmark import Compare

checks = [
    Timer(
        stmt,
        globals={"ema_before": ema_before, "ema_after": ema_after, "cached": cached, **args},
        label="EMA update, yolo",
        sub_label=name,
        description="1 thread",
    ).blocked_autorange(min_run_time=1)
    for name, stmt in [
        ("PR before", "ema_before(e, m, d)"),
        ("PR after", "ema_after(e, m, d)"),
        ('ModelEMA "foreach"', "cached.update(m)"),
    ]
]
Compare(checks).print()
for (name, r), c in zip(packaged.items(), checks):
    apart, iqr = 1e3 * abs(r.median_s - c.median), 1e3 * r.iqr_s
    print(
        f"{name:<19} time_candidates {1e3 * r.median_s:6.2f} ms, blocked_autorange {1e3 * c.median:6.2f} ms:",
        end=" ",
    )
    print(f"{apart:.2f} ms apart, {'within' if apart <= iqr else 'beyond'} its IQR ({iqr:.2f})")

# %% [markdown]
# Where two medians lie further apart than the IQR, your computer changed between the cells, or the
# instruments see different things: `blocked_autorange` repeats one version, its data warm in the cache;
# `time_candidates` alternates them. Compare ratios from one instrument and one run.
#
# Does a second thread help? `torch.set_num_threads(n)` lets an op split its elements over n threads,
# but ATen (PyTorch's C++ tensor library) splits an element-wise op only above 32,768 elements. Time
# 2,000 tiny tensors and one of 2.6M at 1 and 2 threads, and 1 thread twice (the noise):

# %% tags=["nbval-ignore-output"]
import random

GRAIN_SIZE = 32_768  # ATen's at::internal::GRAIN_SIZE (ATen/TensorIterator.h)
print(f"ATen splits an element-wise op over threads only above {GRAIN_SIZE:,} elements")
small = {"e": [torch.rand(136) for _ in range(2000)], "m": [torch.rand(136) for _ in range(2000)]}
big = {"e": torch.rand(2_600_144), "m": torch.rand(2_600_144)}
stmts = {
    "2,000 x 136 elements": ("torch._foreach_lerp_(e, m, 1e-4)", small),
    "1 x 2.6M elements": ("e.lerp_(m, 1e-4)", big),
}
settings = {"1 thread": 1, "1 thread again": 1, "2 threads": 2}
for op, (stmt, g) in stmts.items():  # each op alone: the large one would evict the small ones from the cache
    timers = {r: Timer(stmt, globals=g, num_threads=n) for r, n in settings.items()}
    times = {r: [] for r in settings}
    for i in range(9):
        for r in random.Random(i).sample(list(settings), k=3):  # one round, in a new order
            times[r].append(1e3 * timers[r].timeit(10).mean)
    med = {r: statistics.median(t) for r, t in times.items()}  # ms, median of the 9 rounds
    print(f"{op:<21}", ", ".join(f"{r} {ms:.3f} ms" for r, ms in med.items()))
    print(
        f"{'':<21} 1 thread / 2 threads: {med['1 thread'] / med['2 threads']:.2f}x;"
        f" 1 thread / itself: {med['1 thread'] / med['1 thread again']:.2f}x"
    )

# %% [markdown]
# A gain counts when it is much further from 1x than 1 thread against itself. Tiny tensors have nothing
# to split (1.01x printed, 1.01x for 1 thread against itself); the large `lerp_` gained 1.39x. A busy
# second core turns that gain into a loss: rerun the cell.

# %% [markdown]
# ## 4. How do two machines compare? By their speed-ups
#
# `python3 dev.py bench` times every EMA strategy on models of ema_lab's zoo and saves a results file
# in `results/`. The committed runs this section discusses, then yours (any other run there):

# %% tags=["nbval-ignore-output"]
from ema_lab.bench.results import results_dir
from ema_lab.lessons.runs import discussed_runs, own_runs, run_name

committed = discussed_runs(results_dir())  # the committed runs this section discusses, by name
yours = own_runs(results_dir())  # every other run in results/: yours, newest first
reference_name = "linux-amd-epyc-2c_2026-12-03T093048Z_full_t1_cpu.json"  # the CPU reference of notebook 01
reference = next(rec for f, rec in committed if f.name == reference_name)


def measured(rec: dict) -> list[str]:
    return [d for d, s in rec["devices"].items() if s["status"] == "measured"]


for _, rec in committed + yours:
    mode = "quick" if rec["settings"]["quick"] else "full"
    print(f"{rec['created'][:16]}  {rec['machine']:<34} {'+'.join(measured(rec)):<5} {mode:<5}", end=" ")
    print(f"torch {rec['environment']['torch']}", "<- reference" if rec is reference else "")

# %% [markdown]
# Plot each run's speed-ups on `tiny_tensors` (2,000 tensors) over the before-code; a line spans the
# ratios the quartiles allow:


# %% tags=["nbval-ignore-output"]
def speedup(rec: dict, cand: str, device: str, threads: int = 1) -> tuple[float, float, float] | None:
    """(low, median, high) speed-up of ``cand`` over the before-code on tiny_tensors, or None."""
    key = ("tiny_tensors", device, threads)
    rows = {r["candidate"]: r for r in rec["results"] if (r["model"], r["device"], r["threads"]) == key}
    if cand not in rows or "seed_before" not in rows:
        return None
    b, c = rows["seed_before"], rows[cand]
    return b["q1_ms"] / c["q3_ms"], b["median_ms"] / c["median_ms"], b["q3_ms"] / c["q1_ms"]


def rows_of(runs: list, thread_counts: tuple | None = None) -> list:
    """(label, record, device, threads) per run and thread count measured on tiny_tensors (None: all)."""
    return [
        (run_name(rec, n), rec, d, n)
        for _, rec in runs
        for d in measured(rec)
        for n in thread_counts or rec["settings"]["threads"]
        if speedup(rec, "foreach", d, n)
    ]


committed_rows = rows_of(committed, (1,))
your_rows = rows_of(yours)
shown = committed_rows + your_rows[:8]

CANDIDATES = [("seed_after", "PR after-code"), ("foreach", 'ModelEMA "foreach"')]  # the bench's names
fig, axes = plt.subplots(1, 2, figsize=(9.5, 0.8 + 0.42 * len(shown)), sharey=True, layout="constrained")
for ax, (cand, title) in zip(axes, CANDIDATES):
    for y, (_, rec, device, n) in enumerate(shown):
        if s := speedup(rec, cand, device, n):
            color = "tab:green" if device == "cuda" else "tab:orange" if rec is reference else "tab:blue"
            color = "tab:purple" if y >= len(committed_rows) else color
            ax.plot([s[0], s[2]], [y, y], color=color, lw=4, alpha=0.4)
            ax.plot(s[1], y, "o", color=color)
            ax.text(s[2], y, f"  {s[1]:.1f}x", va="center", fontsize=9)
    if len(shown) > len(committed_rows):
        ax.axhline(len(committed_rows) - 0.5, color="grey", lw=0.8)  # committed above, yours below
    ax.set(xscale="log", xlim=(1, 300))
    ax.set_xticks([1, 2, 5, 10, 20, 50, 100, 200], ["1", "2", "5", "10", "20", "50", "100", "200"])
    ax.set_title(title, fontsize=10)
labels = [lab for lab, *_ in committed_rows] + [f"yours: {lab}" for lab, *_ in your_rows[:8]]
axes[0].set_yticks(range(len(shown)), labels, fontsize=9)
axes[0].invert_yaxis()
fig.supxlabel(
    "speed-up over the before-code on tiny_tensors, log scale\n(orange: the CPU reference, green: H200, purple: yours)",
    fontsize=10,
)
plt.show()
if len(your_rows) > 8:
    print(f"{len(your_rows) - 8} older rows of your runs are not drawn")

for label, rec, device, n in shown:  # the dots above, as numbers
    ratios = {title: speedup(rec, cand, device, n) for cand, title in CANDIDATES}
    print(f"{label:<44}", ", ".join(f"{t} {s[1]:.1f}x" for t, s in ratios.items() if s))

# %% [markdown]
# See the green rows (H200) far to the right, and the CPU rows (blue; orange: the reference) apart.
# Of the four runs listed, one quick run timed 2 threads only; the three plotted `linux-amd-epyc-2c` runs
# are the same kind of 2-core VM, yet `foreach` gained 11.8x, 8.3x and 7.0x. Put the two full runs of that
# VM side by side:
#
# <details><summary>Which code</summary>
#
# Left: the PR's after-code, the same in every run. Right: ema_lab's `foreach` as it was on each run's
# date (2026-12-02 to 12-04).
# </details>

# %%
earlier = next(rec for f, rec in committed if f.name == "linux-amd-epyc-2c_2026-12-02.json")
for rec in (earlier, reference):
    rows = {r["candidate"]: r for r in rec["results"] if (r["model"], r["threads"]) == ("tiny_tensors", 1)}
    cells = [
        f"{c} {rows[c]['median_ms']:5.1f} ms (IQR {rows[c]['q3_ms'] - rows[c]['q1_ms']:4.1f})"
        for c in ("seed_before", "foreach")
    ]
    print(rec["created"][:10], " | ".join(cells), f"| {speedup(rec, 'foreach', 'cpu')[1]:.1f}x")

# %% [markdown]
# On 12-03 every time was longer and the quartiles wider, and the short `foreach` calls lost more than
# the loop; the runs do not record why. Interleaving protects a ratio from drift within a run, not
# between runs: compare runs with their spreads, and keep one reference (the 12-03 run, as in notebook
# 01; 8.3x was a 3-round quick run).
#
# Why are the H200's speed-ups several times the CPUs'? The cost model (notebook 01): the price of a
# loop's op against that of a tensor inside `_foreach_lerp_`. Each run fitted both:

# %%
h200_full = committed[-1][1]  # the H200's full run
for name, rec, device in [("CPU reference", reference, "cpu"), ("H200", h200_full, "cuda")]:
    fits = rec["cost_model"][device]["fits"]
    per_op, per_tensor = fits["loop"]["overhead_per_op_us"], fits["foreach"]["overhead_per_op_us"]
    print(f"{name}: {per_op:.2f} us per op of the loop, {per_tensor:.2f} us per tensor in one foreach")
    print(f"  4 x {per_op:.2f} / {per_tensor:.2f} = {4 * per_op / per_tensor:.0f}x", end=", ")
    print(f"measured on tiny_tensors: {speedup(rec, 'foreach', device)[1]:.0f}x")

# %% [markdown]
# On the H200 an op of the loop costs *more* than on the CPU: most are kernel launches through the CUDA
# driver. A tensor inside `_foreach_lerp_` costs *less*: many share one launch (up to 64 in that torch
# build, [results](../docs/results/h200-update-costs-2026-12-04.md); other builds pack more), where a CPU
# runs one `lerp_` per tensor. The loop dispatches four ops per tensor: four times the ratio of the
# prices gives the speed-up's order of magnitude, not its value.

# %% [markdown]
# ## Summary
#
# - Warm up; on a GPU, synchronise before reading the clock, and watch for hidden sync points.
# - A small update on a GPU is host-bound: fewer kernels need not mean less time.
# - Times spread and drift: report median and IQR at a fixed, recorded thread count.
# - Compare versions in alternating rounds; a difference counts only outside the noise.
# - Compare machines by speed-ups, with their spreads.

# %% [markdown]
# ## Exercises
#
# Try each exercise in the empty cell below it before you open its solution; to run a solution,
# paste it into that cell.

# %% [markdown]
# **Exercise 1.** Time ten `update(net)` calls of a fresh `ModelEMA(net)` on
# `net = models.build("tiny_tensors")` with `time.perf_counter()`, printing `rebuilds` (builds so far)
# after each. *Predict* how the first call compares with the median of the others.

# %%
# Exercise 1: your code here

# %% [markdown]
# <details><summary>Solution 1</summary>
#
# ```python
# net = models.build("tiny_tensors")
# fresh, ms = ModelEMA(net), []
# for call in range(1, 11):
#     t0 = time.perf_counter()
#     fresh.update(net)
#     ms.append(1e3 * (time.perf_counter() - t0))
#     print(f"call {call}: {ms[-1]:7.2f} ms, rebuilds {fresh.rebuilds}")
# print(f"first call / median of calls 2-10: {ms[0] / statistics.median(ms[1:]):.0f}x")
# ```
#
# Only the first call builds (`rebuilds` stays 1), and it costs many times a later one; later calls
# still jump, so compare with their median.
#
# </details>

# %% [markdown]
# **Exercise 2.** For each zoo model (`yolo`, `resnet50`, `gpt2`, `tiny_tensors`), compute from
# `state_dict()` the share of float elements in tensors above 32,768 elements (section 3). *Predict*
# which model has the largest share.

# %%
# Exercise 2: your code here

# %% [markdown]
# <details><summary>Solution 2</summary>
#
# ```python
# for name in ("yolo", "resnet50", "gpt2", "tiny_tensors"):
#     sizes = [v.numel() for v in models.build(name).state_dict().values() if v.is_floating_point()]
#     large = [n for n in sizes if n > 32_768]
#     print(f"{name:<13} {len(large):>3} of {len(sizes):>4} large, holding {sum(large) / sum(sizes):6.1%}")
# ```
#
# gpt2 most (nearly all), then resnet50, yolo (under two thirds), tiny_tensors none: the same on any
# machine. ATen can split most of gpt2's elements over a second thread (a gain if that core is
# free), none of tiny_tensors'.
#
# </details>

# %% [markdown]
# **Exercise 3.** Print `speedup_vs_seed_before` of each row of `reference["results"]` (section 4) whose
# `candidate` is `foreach`. *Predict* on which model `foreach` gains most.

# %%
# Exercise 3: your code here

# %% [markdown]
# <details><summary>Solution 3</summary>
#
# ```python
# for row in reference["results"]:
#     if row["candidate"] == "foreach":
#         print(f"{row['model']:<13} {row['speedup_vs_seed_before']:5.1f}x")
# ```
#
# A committed run ([2-core AMD EPYC VM, 1 thread](../results/linux-amd-epyc-2c_2026-12-03T093048Z_full_t1_cpu.json)),
# the same everywhere: tiny_tensors gains most (7.0x), its time almost all per-tensor cost; gpt2 (2.6x)
# and resnet50 (2.3x) least: their time goes into moving bytes, which any update must do.
#
# </details>
