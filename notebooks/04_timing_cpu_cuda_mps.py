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
# # 04 · Timing on CPU, CUDA and MPS
#
# - Warm up, and on a GPU synchronise, before you read the clock.
# - Times spread from one measurement to the next: report the median and the spread, threads fixed.
# - Compare versions in alternating rounds, and machines by the speed-ups each one measured.

# %% tags=["nbval-ignore-output"]
import json
import os
import statistics
import time
from functools import partial

import matplotlib.pyplot as plt
import torch

from ema_lab import ModelEMA
from ema_lab.bench import models

torch.set_num_threads(1)  # one intra-op thread below, unless a cell says otherwise
print(f"torch {torch.__version__}, {os.cpu_count()} logical cores, 1 thread")

model = models.build("yolo")  # shaped like yolo26n: 594 float tensors
ema = ModelEMA(model)
for call in range(1, 6):
    t0 = time.perf_counter()
    ema.update(model)
    print(f"call {call}: {1e3 * (time.perf_counter() - t0):7.2f} ms   (update built {ema.rebuilds} time)")

# %% [markdown]
# The first call is the slow one: `ModelEMA` (ema_lab's moving average of a model's weights) builds its
# update then, and any first run pays for memory, caches and, on a GPU, CUDA's setup. So measure after
# a **warm-up**: a few calls thrown away.

# %% [markdown]
# ## 1. Synchronise: a GPU works after the call returns
#
# On CUDA and MPS a call only *queues* kernels (the programs the GPU runs) and returns; the GPU runs
# them later. A clock read right after the call measures the queueing.
#
# ![The host queues kernels; the GPU runs them later](figures/04_host_device.svg)
#
# `torch.cuda.synchronize()` (`torch.mps.synchronize()` on a Mac) waits until the queue is empty. Time
# both ways on every device you have:


# %% tags=["nbval-ignore-output"]
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


present = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
for device in [d for d, ok in present.items() if ok]:
    net = models.build("yolo").to(device)
    a, b = torch.rand(2**25, device=device), torch.rand(2**25, device=device)  # 128 MiB each
    work = {
        "EMA update of yolo": partial(ModelEMA(net).update, net),
        "one lerp_ of 128 MiB": partial(a.lerp_, b, 0.1),
    }
    for name, step in work.items():
        step()  # warm-up
        runs = {False: [], True: []}
        for _ in range(9):  # alternate the two, so that a disturbance hits both
            for synced in runs:
                runs[synced].append(clock_ms(step, device, synced))
        ms = {synced: statistics.median(r) for synced, r in runs.items()}
        print(
            f"{device}, {name}: without sync {ms[False]:.3f} ms, with sync {ms[True]:.3f} ms (medians of 9)"
        )
print("not present:", ", ".join(d for d, ok in present.items() if not ok) or "none")

# %% [markdown]
# On a CPU there is nothing to wait for: the call returns when the work is done. On an NVIDIA H200 (torch
# 2.11) the same cell measured the 128 MiB `lerp_` at 0.008 ms without sync and 0.107 ms with it
# (section 5 shows that saved run). `torch.utils.benchmark.Timer`, used from here on, synchronises.

# %% [markdown]
# ## 2. One measurement is not enough
#
# Time the same warm update 40 times. `Timer.timeit(5)` runs it 5 times and returns the mean per call:
# one *measurement*.

# %% tags=["nbval-ignore-output"]
from torch.utils.benchmark import Timer

timer = Timer("ema.update(model)", globals={"ema": ema, "model": model}, num_threads=1)
times_ms = [1e3 * timer.timeit(5).mean for _ in range(40)]
q1, med, q3 = statistics.quantiles(times_ms, n=4)
print(f"median {med:.2f} ms, IQR {q3 - q1:.2f} ms, min {min(times_ms):.2f} ms, max {max(times_ms):.2f} ms")

fig, ax = plt.subplots(figsize=(7, 2.8))
ax.axhspan(q1, q3, color="tab:blue", alpha=0.2)
ax.axhline(med, color="tab:blue")
ax.plot(range(1, 41), times_ms, "o", color="k", ms=4)
ax.text(40.5, med, " median", va="center", color="tab:blue")
ax.text(40.5, q3, " middle half", va="bottom", color="tab:blue")
ax.set(xlabel="measurement", ylabel="ms per update", title="One update, timed 40 times in a row")
ax.set_xlim(0, 50)
plt.show()

# %% [markdown]
# Same code, same data, yet the times spread: other programs share the cores, and caches and clock
# speeds change. The **median** (the middle measurement) and the **IQR** (interquartile range: the
# width of the middle half, shaded) describe the times without being pulled by outliers.

# %% [markdown]
# ## 3. Compare two versions: alternate them
#
# ultralytics PR #25315 replaced a Python loop of three ops per tensor (the *before-code*) with one
# `torch._foreach_lerp_` (the *after-code*). Time them in alternating *rounds*, so that a disturbance
# hits both:
#
# ![A disturbance hits one version in blocks, both when interleaved](figures/04_interleaved.svg)
#
# `ema_lab.bench.seed` holds both versions, verbatim:

# %% tags=["nbval-ignore-output"]
from copy import deepcopy

from ema_lab.bench import seed

args = {"e": deepcopy(model).eval(), "m": model, "d": 0.9999}
timers = {
    name: Timer("f(e, m, d)", globals={"f": fn, **args}, num_threads=1)
    for name, fn in (("PR before", seed.seed_before), ("PR after", seed.seed_after))
}
rounds = {name: [] for name in timers}
for _ in range(9):
    for name, t in timers.items():  # one round: each version once
        rounds[name].append(1e3 * t.timeit(3).mean)
for name, ms in rounds.items():
    q1, med, q3 = statistics.quantiles(ms, n=4)
    print(f"{name:<10} median {med:6.2f} ms, IQR {q3 - q1:5.2f} ms")
ratios = [b / a for b, a in zip(rounds["PR before"], rounds["PR after"])]
print(
    f"speed-up: {statistics.median(rounds['PR before']) / statistics.median(rounds['PR after']):.2f}x "
    f"(per round: {min(ratios):.2f}x to {max(ratios):.2f}x)"
)

# %% [markdown]
# Your machine's counterpart of the PR's 2.2x (Apple M-series); the per-round range shows how far one
# round alone could mislead.
#
# `ema_lab.bench.timing.time_candidates` is this loop, packaged: a warm-up, measurements of about 20 ms,
# the order rotated every round. The same two versions through it:

# %% tags=["nbval-ignore-output"]
from ema_lab.bench.timing import time_candidates

e, m, d = args["e"], args["m"], args["d"]
packaged = time_candidates(
    {"PR before": lambda: seed.seed_before(e, m, d), "PR after": lambda: seed.seed_after(e, m, d)}, rounds=9
)
for name, r in packaged.items():
    print(f"{name:<10} median {1e3 * r.median_s:6.2f} ms, IQR {1e3 * r.iqr_s:5.2f} ms")
print(f"speed-up: {packaged['PR before'].median_s / packaged['PR after'].median_s:.2f}x")

# %% [markdown]
# A second estimate of the same ratio. It differs from the first by noise and by the calls per
# measurement; the per-round range above tells how far apart they may fairly be.

# %% [markdown]
# ## 4. Threads: which ops can use a second core?
#
# `torch.set_num_threads(n)` lets one op split its elements over n threads, but ATen (PyTorch's C++
# tensor library) splits an element-wise op only above 32,768 elements. Time 2,000 tiny tensors and
# one of 2.6M elements at 1 and 2 threads, and 1 thread twice: those two differ by chance alone.

# %% tags=["nbval-ignore-output"]
small = {"e": [torch.rand(136) for _ in range(2000)], "m": [torch.rand(136) for _ in range(2000)]}
big = {"e": torch.rand(2_600_144), "m": torch.rand(2_600_144)}
stmts = {
    "2,000 x 136 elements": ("torch._foreach_lerp_(e, m, 1e-4)", small),
    "1 x 2.6M elements": ("e.lerp_(m, 1e-4)", big),
}
runs = {"1 thread": 1, "1 thread again": 1, "2 threads": 2}
timers = {
    (op, r): Timer(s, globals=g, num_threads=n) for op, (s, g) in stmts.items() for r, n in runs.items()
}
times = {key: [] for key in timers}
for _ in range(9):
    for key, t in timers.items():  # one round: both ops, every setting
        times[key].append(1e3 * t.timeit(10).mean)
for op in stmts:
    noise = [a / b for a, b in zip(times[op, "1 thread"], times[op, "1 thread again"])]
    gain = statistics.median(a / b for a, b in zip(times[op, "1 thread"], times[op, "2 threads"]))
    verdict = "faster" if gain > max(noise) else "slower" if gain < min(noise) else "within the noise"
    print(
        f"{op:<21} 2 threads: {gain:.2f}x; 1 thread vs itself: {min(noise):.2f}x to {max(noise):.2f}x -> {verdict}"
    )

# %% [markdown]
# First the median gain over rounds, then the range chance alone gives. The tiny tensors have nothing to
# split: expect "within the noise". The large `lerp_` gains if the second core is free; if another
# program holds it, the threads wait for each other and lose.

# %% [markdown]
# ## 5. The benchmark, on your CPU and on an H200
#
# `python3 dev.py bench` times every EMA strategy on several zoo models, on every device present, and
# writes a results file to `results/`. `run_bench` is the same in Python; here it runs small (seconds).

# %% tags=["nbval-ignore-output"]
from ema_lab.bench import run_bench

record = run_bench(
    "all", models=["tiny_tensors"], strategies=["seed_after", "foreach"], quick=True, progress=False
)
for device, status in record["devices"].items():
    print(f"{device}: {status['status']}")
for r in record["results"]:
    iqr = r["q3_ms"] - r["q1_ms"]
    print(
        f"  {r['device']} {r['candidate']:<12} {r['median_ms']:8.3f} ms, IQR {iqr:6.3f}, {r['speedup_vs_seed_before']:7.1f}x"
    )

# %% [markdown]
# Each row: a median over interleaved rounds, and its speed-up over `seed_before` (the before-code).
# `floor` is one `lerp_` over two buffers holding all the model's floats (the fastest an update can be);
# `copy` one `copy_` of the same bytes.

# %% [markdown]
# Without a GPU, read what a run on an NVIDIA H200 saved in `results/`: the sync lesson of section 1,
# and the CUDA kernels each update launched, counted with `torch.profiler`:

# %%
from ema_lab.bench.results import bench_files, load, results_dir

h200 = results_dir() / "gpu-linux-intel-xeon-16c-nvidia-h200"
print("NVIDIA H200, torch", json.loads((h200 / "summary.json").read_text())["torch"])
saved_nb = json.loads((h200 / "notebooks" / "04_timing_cpu_cuda_mps.ipynb").read_text())
for cell in saved_nb["cells"]:  # the sync cell of section 1, as the H200 ran it
    text = "".join("".join(out.get("text", "")) for out in cell.get("outputs", []))
    if "cuda, " in text:
        print("\n".join(line for line in text.splitlines() if line.startswith("cuda, ")))
        break
launches = json.loads((h200 / "kernel-launches.json").read_text())
print("CUDA kernels per EMA update:")
for name in ("yolo", "tiny_tensors"):
    counts = {k: v["total"] for k, v in launches[name].items() if isinstance(v, dict) and "total" in v}
    print(f"  {name:<13}", ", ".join(f"{k} {n}" for k, n in counts.items()))

# %% [markdown]
# The loop launches a kernel per arithmetic op: 3 per tensor. One `_foreach_lerp_` carries at most 64 tensors per
# launch in that build, so yolo's 594 tensors take 10 launches, plus one for BatchNorm's integer
# counters. A flattened model (notebook 05) needs one or two.
#
# <details><summary>Will a newer torch pack more tensors into one launch?</summary>
#
# The limit comes from the 4 KB a CUDA kernel's arguments may fill. torch's
# `aten/src/ATen/native/cuda/MultiTensorApply.cuh` can give a foreach kernel 32 KB of arguments (448
# tensors per launch) where the build, the driver and the GPU allow it, and not while a CUDA graph is
# recorded. The H200 run's torch 2.11 (CUDA 13.0) still packed 64 tensors into each `_foreach_lerp_`
# launch. Count on your own build before you quote a number. Mixed dtypes or devices in one list leave
# this fast path: one kernel per tensor.
# </details>

# %% [markdown]
# ## 6. Compare machines by their speed-ups
#
# Every run of `python3 dev.py bench` leaves a file in `results/` that keeps what it measured and how.
# `results_dir()` finds the folder, `bench_files` lists the runs and `load` reads one. Yours appear
# here once you have made one (newest first):

# %% tags=["nbval-ignore-output"]
saved = sorted(((load(f), f) for f in bench_files(results_dir())), key=lambda x: x[0]["created"])[::-1]
reference_name = "linux-amd-epyc-2c_2026-12-02.json"  # the CPU reference: a full run on a 2-core AMD EPYC VM


def measured(rec: dict) -> list[str]:
    return [d for d, s in rec["devices"].items() if s["status"] == "measured"]


for rec, f in saved:
    quick = "quick" if rec["settings"]["quick"] else "full"
    print(f"{rec['created'][:16]}  {rec['machine']:<34} {'+'.join(measured(rec)):<5} {quick:<5}", end=" ")
    print(f"torch {rec['environment']['torch']}", "<- reference" if f.name == reference_name else "")

# %% [markdown]
# Milliseconds depend on the machine and its load; a speed-up measured within one run cancels part of
# that. Plot the speed-ups on `tiny_tensors` of the CPU reference, your newest CPU runs, the H200 and
# the run above; each line runs from the least to the most favourable ratio of the two times' quartiles:


# %% tags=["nbval-ignore-output"]
def speedup(rec: dict, cand: str, device: str) -> tuple[float, float, float] | None:
    """(low, median, high) speed-up of ``cand`` over the before-code on tiny_tensors, or None."""
    key = ("tiny_tensors", device, 1)  # the model, the device, one thread
    rows = {r["candidate"]: r for r in rec["results"] if (r["model"], r["device"], r["threads"]) == key}
    if cand not in rows or "seed_before" not in rows:
        return None
    b, c = rows["seed_before"], rows[cand]
    return b["q1_ms"] / c["q3_ms"], b["median_ms"] / c["median_ms"], b["q3_ms"] / c["q1_ms"]


reference = next(r for r, f in saved if f.name == reference_name)
others = [r for r, f in saved if speedup(r, "foreach", "cpu") and f.name != reference_name][:3]  # newest
shown = [(f"CPU reference, {reference['machine']}", reference, "cpu")]
shown += [
    (f"{r['created'][:10]} {'quick' if r['settings']['quick'] else 'full'}, {r['machine']}", r, "cpu")
    for r in others
]
shown += [
    (f"H200, {'quick' if r['settings']['quick'] else 'full'} run", r, "cuda")
    for r, _ in saved
    if "cuda" in measured(r)
]
shown += [(f"this notebook, {d}", record, d) for d in measured(record)]

fig, axes = plt.subplots(1, 2, figsize=(9, 0.6 + 0.42 * len(shown)), sharey=True, layout="constrained")
for ax, (cand, title) in zip(axes, [("seed_after", "PR after-code"), ("foreach", 'ModelEMA "foreach"')]):
    for y, (_, rec, device) in enumerate(shown):
        s = speedup(rec, cand, device)
        if s:
            color = "tab:green" if device == "cuda" else "tab:blue"
            ax.plot([s[0], s[2]], [y, y], color=color, lw=4, alpha=0.4)
            ax.plot(s[1], y, "o", color=color)
            ax.text(s[2], y, f"  {s[1]:.1f}x", va="center", fontsize=9)
    ax.set(xscale="log", xlim=(1, 300))
    ax.set_title(f"{title} over the before-code", fontsize=10)
axes[0].set_yticks(range(len(shown)), [label for label, *_ in shown], fontsize=9)
axes[0].invert_yaxis()
fig.supxlabel("speed-up on tiny_tensors (2,000 tensors), 1 thread, log scale", fontsize=10)
plt.show()

# %% [markdown]
# The H200's speed-ups are several times the CPUs'. The reason is in the cost model (notebook 01): the
# price of one op in the loop against the price of one tensor inside `_foreach_lerp_`. Each run fitted
# both:

# %%
h200_full = load(h200 / "linux-intel-xeon-16c-nvidia-h200_2026-12-04T154528Z_full_t1_cuda.json")
for label, rec, device in [("CPU reference", reference, "cpu"), ("H200", h200_full, "cuda")]:
    fits = rec["cost_model"][device]["fits"]
    per_op, per_tensor = fits["loop"]["overhead_per_op_us"], fits["foreach"]["overhead_per_op_us"]
    print(f"{label}: {per_op:.2f} us per op of the loop, {per_tensor:.2f} us per tensor in one foreach")
    print(
        f"  3 ops per tensor: 3 x {per_op:.2f} / {per_tensor:.2f} = {3 * per_op / per_tensor:.0f}x", end=", "
    )
    print(f"measured on tiny_tensors: {speedup(rec, 'foreach', device)[1]:.0f}x")

# %% [markdown]
# On the H200 an op of the loop costs *more* than on the CPU: each one is a kernel launch, queued from
# Python. A tensor inside `_foreach_lerp_` costs *less*: 64 tensors share one launch, while a CPU still
# runs one `lerp_` per tensor inside it. The before-code pays three ops per tensor, so three times the
# ratio of the two prices roughly predicts the speed-up where bytes cost next to nothing.

# %% [markdown]
# To add your machine: run `python3 dev.py bench` (`--quick` for a first look, `--threads 1 2` for two
# thread counts), then rerun this section, or `python3 dev.py compare results/*.json` to see runs side
# by side with the settings in which they differ.

# %% [markdown]
# ## Summary
#
# - Warm up first; on a GPU, synchronise before reading the clock (`Timer` does).
# - One run's times spread: report the median and IQR, at a fixed, recorded thread count.
# - Compare versions in alternating rounds; call a difference real only outside the noise.
# - Compare machines by speed-ups; the cost model's prices per op and per tensor explain them.

# %% [markdown]
# ## Exercises
#
# 1. How many calls does `ModelEMA` need before its time settles? Time the first five updates of a
#    fresh `ModelEMA` on `models.build("tiny_tensors")`, printing `rebuilds` after each.
# 2. Which zoo models (`yolo`, `resnet50`, `gpt2`, `tiny_tensors`) hold most of their elements in
#    tensors large enough to split over threads?
# 3. In the CPU reference run, on which model does `foreach` gain most over the PR's before-code, and why?

# %% [markdown]
# ## Solutions (click to expand)

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["nbval-ignore-output"]
# 1. The first call builds the update (rebuilds stays 1) and costs tens of times more; the next one or
#    two can still be a little slower (caches warming up); then the times settle.
net = models.build("tiny_tensors")
fresh = ModelEMA(net)
for call in range(1, 6):
    t0 = time.perf_counter()
    fresh.update(net)
    print(f"call {call}: {1e3 * (time.perf_counter() - t0):7.2f} ms, rebuilds {fresh.rebuilds}")

# %% jupyter={"outputs_hidden": true, "source_hidden": true}
# 2. The share of each model's float elements in tensors over 32,768 elements (ATen's grain size).
for name in ("yolo", "resnet50", "gpt2", "tiny_tensors"):
    sizes = [v.numel() for v in models.build(name).state_dict().values() if v.is_floating_point()]
    large = [n for n in sizes if n > 32_768]
    print(
        f"{name:<13} {len(large):>3} of {len(sizes):>4} tensors are large; they hold {sum(large) / sum(sizes):6.1%}"
    )

# %% [markdown] jupyter={"source_hidden": true}
# resnet50 and gpt2 hold almost everything in large tensors, so every update that works tensor by
# tensor with few ops (`foreach`) can use a second thread there. yolo's 28 large tensors hold almost two
# thirds; tiny_tensors has none, so only an update over one flat buffer (like `floor`) gives a second
# thread something to split.

# %% jupyter={"outputs_hidden": true, "source_hidden": true}
# 3. The speed-up of foreach over the PR's before-code, per model, from the reference file.
for row in reference["results"]:
    if row["candidate"] == "foreach":
        print(
            f"{row['model']:<13} {row['stats']['float_tensors']:>5} tensors, "
            f"{row['stats']['float_bytes'] / 2**20:7.1f} MiB: {row['speedup_vs_seed_before']:5.1f}x"
        )

# %% [markdown] jupyter={"source_hidden": true}
# tiny_tensors: 2,000 tensors holding only 1 MiB, so the before-code's time is almost all per-op cost,
# which one `_foreach_lerp_` removes. gpt2 and resnet50 gain least: most of their time goes into moving
# 325 and 98 MiB, which any update has to do.
