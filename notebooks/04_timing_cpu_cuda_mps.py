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
# # 04 · Timing on CPU, CUDA and MPS, and comparing machines
#
# A speed-up is only as good as its timing. GPUs run asynchronously, the first call of anything is
# slow, other processes steal cores, and thread counts change results. This notebook runs ema_lab's
# benchmark on every device this machine has, explains what the timer does about each of those
# traps, and puts saved results from several machines side by side.
#
# **You will learn**
# - why a GPU timing needs a synchronisation, and what you measure without one;
# - why warm-up matters (caches, lazy initialisation) and how `ema_lab.bench.timing` handles it;
# - how to run the benchmark (`python -m ema_lab bench`) and read its table: median, IQR, speed-up
#   against the seed's before-code, roofline fraction;
# - how to load `results/*.json` from other machines, plot them together, and add your own.

# %%
# NBVAL_IGNORE_OUTPUT
# %matplotlib inline
from functools import partial
from pathlib import Path

import torch
from IPython.display import display

from ema_lab import ModelEMA
from ema_lab.bench import run_bench
from ema_lab.bench.environment import available_devices, format_environment, quick_mode
from ema_lab.bench.plots import plot_compare, plot_cost_model, plot_times
from ema_lab.bench.results import ResultError, format_table, load_many, validate
from ema_lab.bench.timing import cold_vs_warm, unsynced_vs_synced
from ema_lab.lessons import models

torch.set_num_threads(1)
print(format_environment())
print("quick mode:", quick_mode())

# %% [markdown]
# ## 1. Synchronisation: what the clock sees
#
# On CUDA and MPS a call such as `torch._foreach_lerp_` only *queues* kernels and returns; the GPU
# runs them later. Reading the clock right after the call measures the queueing, not the work.
# `torch.utils.benchmark.Timer` (which `ema_lab.bench.timing` builds on) synchronises the accelerator before
# it reads the clock (torch 2.13 calls `torch.accelerator.synchronize()`). Below, the same EMA update
# timed both ways on every accelerator present. On a CPU there is nothing to wait for: the call
# returns when the work is done.

# %%
# NBVAL_IGNORE_OUTPUT
for device, reason in available_devices().items():
    if reason is not None:
        print(f"{device}: {reason}")
        continue
    model = models.build("yolo").to(device)
    ema = ModelEMA(model, strategy="foreach")
    unsynced, synced = unsynced_vs_synced(partial(ema.update, model), device)
    print(f"{device}: clock read without sync {1e3 * unsynced:.3f} ms, with sync {1e3 * synced:.3f} ms")

# %% [markdown]
# On a GPU the unsynchronised number is the launch cost alone, often much smaller than the real one;
# on a CPU both agree up to noise. A missing `skipped: ...` line names each device this machine lacks.
#
# ## 2. Warm-up: the first call is different
#
# The first `ModelEMA.update` collects and validates the (EMA, model) tensor pairs; the first CUDA
# call initialises the context and the caching allocator; the first pass over a buffer brings it
# into cache. `cold_vs_warm` times the first call alone and the median of the next ones.

# %%
# NBVAL_IGNORE_OUTPUT
for device, reason in available_devices().items():
    if reason is not None:
        print(f"{device}: {reason}")
        continue
    model = models.build("yolo").to(device)
    ema = ModelEMA(model)
    first, steady = cold_vs_warm(partial(ema.update, model), device)
    print(f"{device}: first update {1e3 * first:.2f} ms, then {1e3 * steady:.3f} ms (median) per update")

# %% [markdown]
# So every candidate gets warm-up calls before it is measured. `ema_lab.bench.timing.time_candidates` also
# fixes the intra-op thread count (1 by default: on a shared 2-core machine a second busy process makes
# 2-thread ops stall) and records it, sizes each measurement to about 20 ms, and visits the candidates
# in *rounds* in a rotating order, so that a noisy neighbour slows all candidates alike. It reports the
# median and the interquartile range (IQR) over the rounds, never the mean of a single run.
#
# ## 3. The benchmark on every available device
#
# This is what `python -m ema_lab bench --device all` runs, here on two models of the zoo and five
# candidates so that the notebook stays fast (the command line default covers yolo, resnet50, gpt2
# and tiny_tensors and every strategy). Devices that are missing are listed as skipped with the
# reason, never as zero.

# %%
# NBVAL_IGNORE_OUTPUT
record = run_bench(
    "all",
    models=["tiny_cnn", "yolo"] if quick_mode() else ["yolo", "tiny_tensors"],
    strategies=["seed_after", "loop", "foreach", "gated", "floor"],
    threads=1,
    quick=quick_mode(),
    progress=False,
)
print(format_table(record))

# %% [markdown]
# Read a row as: the candidate's dispatched compute ops per update, its CUDA kernel launches (`-`
# where the device cannot count them), the median time per update and its IQR, the speed-up against
# `seed_before` (the seed's code before PR #25315), and the roofline fraction: the EMA update's
# minimal traffic (read EMA and model, write EMA) per second, over what one `copy_` kernel of the
# same tensors achieves. `floor` (one `lerp_` over two contiguous buffers) shows the best an update
# of this model can do. The same record holds the per-op cost model of each device:

# %%
# NBVAL_IGNORE_OUTPUT
for device, status in record["devices"].items():
    if status["status"] != "measured":
        print(f"{device}: {status['status']}")
        continue
    display(plot_times(record, device))
    display(plot_cost_model(record["cost_model"][device]))

# %% [markdown]
# ## 4. What a result file holds
#
# `python -m ema_lab bench` writes the same record as JSON to `results/<machine>_<date>.json`, with
# PNG plots beside it. The record is versioned, and `ema_lab.bench.results.validate` checks it before it is
# written and whenever it is loaded. Its top-level fields and one row's fields:

# %%
print(record["schema"], "version", record["schema_version"])
print("fields:", sorted(record))
print(
    "environment:",
    sorted(
        k
        for k in record["environment"]
        if k in {"torch", "python", "os", "cpu", "threads", "ema_lab", "git_revision"}
    ),
)
print("row fields:", sorted(record["results"][0]))

# %% [markdown]
# A file that does not match is refused with the field named, rather than plotted wrongly:

# %%
broken = dict(record, results=[dict(record["results"][0], median_ms=-1.0)])
try:
    validate(broken)
except ResultError as exc:
    print("ResultError:", str(exc).split(", got")[0])

# %% [markdown]
# ## 5. Several machines side by side
#
# Every machine's results sit in `results/`, named by machine and date. `load_many` validates each
# bench file (JSON files of other tools, such as a peers benchmark, are skipped with a note);
# `plot_compare` draws each model's speed-ups against `seed_before`, one bar per machine and device.
# The same plot comes from the command line: `python -m ema_lab compare results/*.json`.

# %%
# NBVAL_IGNORE_OUTPUT
files = sorted(Path("../results").glob("*.json"))
saved, notes = load_many(files) if files else ([], [])
print(*notes, sep="\n")
for f, rec in saved:
    measured = [d for d, s in rec["devices"].items() if s["status"] == "measured"]
    env, threads = rec["environment"], rec["settings"]["threads"]
    print(f"{f.name}: {env['cpu']}, torch {env['torch']}, {threads} thread(s), measured {measured}")
if saved:
    display(plot_compare([rec for _, rec in saved], candidates=("seed_after", "foreach", "gated", "floor")))
else:
    print("no saved results yet: run `python -m ema_lab bench` from the repository root")

# %% [markdown]
# ### Add your own machine
#
# 1. From the repository root run `python3 dev.py bench` (or, in an environment with ema_lab
#    installed, `python -m ema_lab bench --device all`). On a laptop this takes a few minutes; add
#    `--quick` for a first look. It prints the table and writes `results/<machine>_<date>.json` plus
#    PNGs; the machine name comes from the OS, CPU model, core count and any GPU measured.
# 2. Keep `--threads 1` (the default) for numbers comparable with the files already here, or state
#    the thread count you chose; it is recorded in the file either way.
# 3. Re-run this notebook (or `python -m ema_lab compare results/*.json`): your machine appears next to
#    the others. Commit the JSON and PNGs to share them.
#
# ## Try it yourself
#
# 1. In section 3, pass `threads=2`. Do the medians drop? What happens to the IQR when something
#    else runs on the machine?
# 2. Time a single `ema.update(model)` on CUDA with `time.perf_counter()` and no synchronisation, then
#    with `torch.cuda.synchronize()` before reading the clock. Which matches the table?
# 3. Add `"gpt2"` to the models in section 3. Why is its speed-up the smallest of the zoo? (Hint: look
#    at its roofline fraction and its float tensors' average size.)
#
# ## Summary
#
# - GPU work is asynchronous: time it only after a synchronisation (the torch Timer does it for you).
# - The first call pays for set-up and cold caches; measure after a warm-up.
# - Interleave candidates, fix and record the thread count, and report medians with an IQR.
# - `python -m ema_lab bench` does all of that, skips missing devices with the reason, and writes a
#   validated JSON record; `compare` puts several machines side by side.
