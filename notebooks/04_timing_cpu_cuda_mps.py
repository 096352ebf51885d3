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
# - Compare machines by speed-ups measured within one run, with their settings side by side.

# %% tags=["nbval-ignore-output"]
import statistics
import time
from functools import partial

import matplotlib.pyplot as plt
import torch

from ema_lab import ModelEMA
from ema_lab.bench import models
from ema_lab.bench.environment import available_devices, environment

torch.set_num_threads(1)  # one intra-op thread below, unless a cell says otherwise
env = environment()
print(f"torch {env['torch']}, {env['cpu']} ({env['cpu_count']} logical cores), 1 thread")

model = models.build("yolo")  # shaped like yolo26n: 594 float tensors
ema = ModelEMA(model)
for call in range(1, 6):
    t0 = time.perf_counter()
    ema.update(model)
    print(f"call {call}: {1e3 * (time.perf_counter() - t0):7.2f} ms   (update built {ema.rebuilds} time)")

# %% [markdown]
# The first call is the slow one. `ModelEMA` (ema_lab's moving average of a model's weights) builds its
# update then, and anything run for the first time pays for memory, caches and, on a GPU, setting up
# CUDA. So measure only after a **warm-up**: a few calls made and thrown away.

# %% [markdown]
# ## 1. Synchronise: a GPU works after the call returns
#
# On CUDA and MPS a call only *queues* kernels (the programs the GPU runs) and returns; the GPU runs
# them later. A clock read right after the call measures the queueing. `torch.cuda.synchronize()`
# (`torch.mps.synchronize()` on a Mac) waits until the queue is empty. On a CPU the call returns when
# the work is done.


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


for device, reason in available_devices().items():
    if reason is not None:
        print(f"{device}: {reason}")
        continue
    net = models.build("yolo").to(device)
    a, b = torch.rand(2**25, device=device), torch.rand(2**25, device=device)  # 128 MiB each
    work = {
        "EMA update of yolo": partial(ModelEMA(net).update, net),
        "one lerp_ of 128 MiB": partial(a.lerp_, b, 0.1),
    }
    for name, step in work.items():
        step()  # warm-up
        ms = {s: statistics.median(clock_ms(step, device, s) for _ in range(9)) for s in (False, True)}
        print(
            f"{device}, {name}: without sync {ms[False]:.3f} ms, with sync {ms[True]:.3f} ms (medians of 9)"
        )

# %% [markdown]
# On a CPU the two agree up to noise. On a GPU the first is only the queueing: far below the second
# for the large `lerp_`, still running when the call returns; yolo's small kernels finish about as fast
# as they are queued. `ema_lab.bench.timing.unsynced_vs_synced` packages this cell;
# `torch.utils.benchmark.Timer`, used from here on, synchronises CUDA before reading the clock (recent
# torch: MPS too).

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
# width of the middle half, shaded) describe the times without being pulled by outliers. From here on
# every time comes with its IQR.

# %% [markdown]
# ## 3. Compare two versions: alternate them
#
# ultralytics PR #25315 replaced its EMA update, a Python loop of three ops per tensor (the
# *before-code*), with one `torch._foreach_lerp_` over all tensors (the *after-code*). To compare them,
# run them in alternating *rounds*, so that a disturbance hits both, then divide the medians.
# `ema_lab.bench.seed` holds both, verbatim:

# %% tags=["nbval-ignore-output"]
from copy import deepcopy

from ema_lab.bench.seed import seed_after, seed_before

args = {"e": deepcopy(model).eval(), "m": model, "d": 0.9999}
timers = {
    name: Timer("f(e, m, d)", globals={"f": fn, **args}, num_threads=1)
    for name, fn in (("PR before", seed_before), ("PR after", seed_after))
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
# The speed-up is your machine's counterpart of the 2.2x the PR reported on an Apple M-series Mac;
# the per-round range shows how far one round alone could mislead. `ema_lab.bench.timing.time_candidates`
# is this loop, packaged: warm-up, measurements of about 20 ms each, a rotating order, the thread count
# recorded.

# %% [markdown]
# ## 4. Threads: which ops can use a second core?
#
# `torch.set_num_threads(n)` lets one op split its elements over n threads. ATen (PyTorch's C++ library
# of tensor operations) splits an element-wise op only above 32,768 elements (its *grain size*). Time a
# `_foreach_lerp_` over 2,000 tensors of 136 elements (like the zoo's `tiny_tensors`) and one `lerp_`
# over 2.6M elements (as many as yolo) at 1 and 2 threads:

# %% tags=["nbval-ignore-output"]
small = {"e": [torch.rand(136) for _ in range(2000)], "m": [torch.rand(136) for _ in range(2000)]}
big = {"e": torch.rand(2_600_144), "m": torch.rand(2_600_144)}
stmts = {
    "2,000 x 136 elements": ("torch._foreach_lerp_(e, m, 1e-4)", small),
    "1 x 2.6M elements": ("e.lerp_(m, 1e-4)", big),
}
timers = {(op, n): Timer(stmt, globals=g, num_threads=n) for op, (stmt, g) in stmts.items() for n in (1, 2)}
times = {key: [] for key in timers}
for _ in range(9):
    for key, t in timers.items():  # one round: both ops at both thread counts
        times[key].append(1e3 * t.timeit(10).mean)
for op in stmts:
    (lo1, m1, hi1), (lo2, m2, hi2) = (statistics.quantiles(times[op, n], n=4) for n in (1, 2))
    verdict = "faster" if hi2 < lo1 else "slower" if lo2 > hi1 else "within the spread"
    print(f"{op:<21} 1 thread {m1:6.3f} ms, 2 threads {m2:6.3f} ms: {m1 / m2:.2f}x, {verdict}")

# %% [markdown]
# Only the large `lerp_` has elements to split, and it gains only if the second core is free. The small
# tensors run one at a time on one thread whatever you set, so a ratio away from 1 for them is noise or
# a wait for a busy core, even when it lies outside the spread. Ask first what an op *can* split, then
# read the spread.

# %% [markdown]
# ## 5. The benchmark on every device
#
# `python -m ema_lab bench --device all` does all of this for every EMA strategy on several zoo models, on
# every device present, and writes a results file. `run_bench` is the same call in Python. Here it runs small:
# one model, three rounds, the PR's code and `ModelEMA(strategy="foreach")`.

# %% tags=["nbval-ignore-output"]
from ema_lab.bench import run_bench

print("timing five candidates on tiny_tensors, on every device present ...", flush=True)
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
# Each row is a median over interleaved rounds, and its speed-up over `seed_before` (the PR's
# before-code). Two reference rows are always run: `floor`, one `lerp_` over two contiguous buffers
# holding all the model's floats (the fastest an update can be), and `copy`, one `copy_` of the same
# bytes.
#
# A missing CUDA or MPS device is reported as skipped, with the reason. CUDA and MPS figures come from
# readers' runs (section 7); section 6 lists the saved ones.

# %% [markdown]
# ## 6. Compare with another machine
#
# A results file keeps what a run measured and how. The reference run,
# `results/linux-amd-epyc-2c_2026-12-02.json`, is a full run on a 2-core AMD EPYC virtual machine with
# torch 2.13. `load` reads and checks it; `results_dir()` finds the folder:

# %% tags=["nbval-ignore-output"]
from ema_lab.bench.results import load, results_dir

reference = load(results_dir() / "linux-amd-epyc-2c_2026-12-02.json")


def settings(rec: dict) -> dict:
    """What changes a timing, besides the hardware."""
    return {
        "torch": rec["environment"]["torch"],
        **{k: rec["settings"][k] for k in ("threads", "rounds", "quick")},
    }


for key, value in settings(reference).items():
    print(f"{key:<8} reference {value!s:<12} yours {settings(record)[key]}")

# %% tags=["nbval-ignore-output"]
from ema_lab.bench.results import bench_files

for f in bench_files(results_dir()):
    measured = [d for d, s in load(f)["devices"].items() if s["status"] == "measured"]
    if measured != ["cpu"]:
        print("a saved run on", "+".join(measured), "->", f.relative_to(results_dir()))

# %% [markdown]
# Both saved GPU runs come from one `python3 dev.py gpu-check` on an NVIDIA H200 (torch 2.11, CUDA
# 13.0). Milliseconds depend on the machine and its load; a speed-up measured within one run cancels
# part of that. Compare speed-ups, then, read with the settings above:

# %% tags=["nbval-ignore-output"]
gpu_folder = results_dir() / "gpu-linux-intel-xeon-16c-nvidia-h200"
h200 = load(gpu_folder / "linux-intel-xeon-16c-nvidia-h200_2026-12-04T154528Z_full_t1_cuda.json")
runs = [("CPU reference", reference, "cpu"), ("H200", h200, "cuda")]
runs += [(f"your run, {d}", record, d) for d, s in record["devices"].items() if s["status"] == "measured"]
names = {"seed_after": "PR after-code", "foreach": 'ModelEMA "foreach"'}
fig, ax = plt.subplots(figsize=(7, 1 + 0.5 * len(runs)))
height = 0.8 / len(runs)
for i, cand in enumerate(names):
    for j, (run, rec, device) in enumerate(runs):
        row = next(
            r
            for r in rec["results"]
            if (r["model"], r["candidate"], r["device"]) == ("tiny_tensors", cand, device)
        )
        x, y = row["speedup_vs_seed_before"], i - 0.4 + height * (j + 0.5)
        ax.barh(y, x, height=0.95 * height, color=f"C{j}")
        ax.text(x, y, f" {x:.1f}x {run}", va="center", fontsize=9)
ax.set_yticks(range(len(names)), list(names.values()))
ax.set(xlabel="speed-up over the PR's before-code", title="tiny_tensors, 1 thread")
ax.set_xlim(0, 1.5 * ax.get_xlim()[1])
ax.invert_yaxis()  # top to bottom in the order above
plt.show()

# %% [markdown]
# On the H200 both speed-ups are several times the CPU's: a GPU does the arithmetic of 2,000 tiny
# tensors almost for free, so the per-op cost the PR removes (Python, the dispatcher, a launch) is
# nearly the whole update. Between two CPUs, different bars mean different per-op or memory costs,
# different settings, or a disturbed run: rerun to tell which.

# %% [markdown]
# <details><summary>On CUDA: what one <code>_foreach_lerp_</code> launch carries (from PyTorch's source)</summary>
#
# On CUDA, `_foreach_lerp_` packs many tensors into one kernel launch, but only when every tensor of the
# lists has the same device, dtype and layout; otherwise it silently runs one kernel per tensor. A
# launch carries at most 64 tensors and 320 chunks of 65,536 elements (448 and 2,240 when built with
# CUDA 12.1 or later on a driver with large kernel arguments). yolo26n's 594 tensors take about 10
# launches, or 2.
# </details>

# %% [markdown]
# ## 7. Add your own machine
#
# 1. Run `python -m ema_lab bench --device all` (add `--quick` for a first look, `--threads 1 2` to
#    measure two thread counts). It prints the table and writes a JSON file and plots to `results/`,
#    named after the machine, date and time; no run replaces another.
# 2. Run `python -m ema_lab compare results/*.json` to put runs side by side, with the settings in
#    which they differ.
# 3. Share the JSON file, above all a CUDA or MPS run.

# %% [markdown]
# ## Summary
#
# - Warm up first; on a GPU, synchronise before reading the clock (`Timer` does).
# - One run's times spread: report the median and IQR, at a fixed, recorded thread count.
# - Compare versions in alternating rounds, and by the ratio of their medians.
# - A second thread helps only ops with elements to split; a "gain" on tiny tensors is noise.

# %% [markdown]
# ## Exercises
#
# 1. How many calls does `ModelEMA` need before its time settles? Time the first five updates of a
#    fresh `ModelEMA` on `models.build("tiny_tensors")`, printing `rebuilds` after each.
# 2. Which zoo models (`yolo`, `resnet50`, `gpt2`, `tiny_tensors`) hold most of their elements in
#    tensors large enough to split over threads?
# 3. In the reference run, on which model does `foreach` gain most over the PR's before-code, and why?

# %% [markdown]
# ## Solutions (click to expand)

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["nbval-ignore-output"]
# 1. One: the first call builds the update (rebuilds stays 1) and costs many times more; later calls
#    differ from each other far less.
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
