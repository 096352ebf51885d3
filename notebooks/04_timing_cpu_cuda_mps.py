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
# # 04 · Timing on CPU, CUDA and MPS, and comparing runs
#
# **Take-aways**
# - A timing is only trustworthy after a synchronisation and a warm-up, at a fixed and recorded thread
#   count, as a median with its spread over interleaved rounds.
# - `python -m ema_lab bench` does that for every EMA strategy and never overwrites an earlier run;
#   `python -m ema_lab compare` puts runs side by side and says where their settings differ.
# - The per-op cost model predicts the PR's before-code well where the update is all dispatched ops,
#   and under-predicts its after-code on the YOLO-sized net (section 4 shows both, side by side).
#
# **Time to run** on the 2-core machine the committed outputs come from, measured with `time python3
# dev.py notebooks notebooks/04_timing_cpu_cuda_mps.py`: about 16 s with `EMA_LAB_QUICK=1`, and from under
# a minute to 4 minutes in full mode, whose cost model sweeps up to 4x the last-level cache (three full runs took
# 97, 241 and 68 s, at a load average of about 3 on 2 cores: the machine is shared with other jobs;
# 46 s when it was quiet). The committed outputs are from a full-mode run.
#
# A speed-up is only as good as its timing. GPUs run asynchronously, the first call of anything is
# slow, other processes steal cores, and thread counts change results. This notebook runs ema_lab's
# benchmark on every device this machine has, explains what the timer does about each of those
# traps, and puts saved runs from this and other machines side by side.
#
# **You will learn**
# - why a GPU timing needs a synchronisation, and what you measure without one;
# - why warm-up matters (caches, lazy initialisation) and how `ema_lab.bench.timing` handles it;
# - how to run the benchmark (`python -m ema_lab bench`) and read its table: median, IQR, speed-up
#   against the PR's before-code, floor fraction, and how the times change with the thread count;
# - how far the per-op cost model's prediction is from the measurement, and why;
# - what the multi-tensor CUDA kernel behind `_foreach_lerp_` packs into one launch (from PyTorch's
#   source, no GPU needed);
# - how to load every run in `results/`, compare them, and add your own.

# %%
# NBVAL_IGNORE_OUTPUT
# %matplotlib inline
import json
import math
from functools import partial
from pathlib import Path

import torch
from IPython.display import display

from ema_lab import ModelEMA
from ema_lab.bench import run_bench
from ema_lab.bench.environment import available_devices, format_environment, quick_mode
from ema_lab.bench.plots import plot_compare, plot_cost_model, plot_threads, plot_times
from ema_lab.bench.results import (
    ResultError,
    bench_files,
    format_table,
    load,
    load_many,
    run_label,
    settings_differences,
    validate,
)
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
# on a CPU both agree up to noise. A `skipped: ...` line names each device this machine lacks, with
# the reason.
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
# fixes the intra-op thread count and records it, sizes each measurement to about 20 ms, and visits
# the candidates in *rounds* in a rotating order, so that a noisy neighbour slows all candidates
# alike. It reports the median and the interquartile range (IQR) over the rounds, never the mean of a
# single run. This machine is shared with other work: IQRs of 10-50 % of the median are normal here.
#
# ## 3. The benchmark on every available device, at one and two threads
#
# This is what `python -m ema_lab bench --device all --threads 1 2` runs, here on two models of the
# zoo and a subset of the candidates so that the notebook stays fast (the command line default
# covers yolo, resnet50, gpt2 and tiny_tensors and every strategy). The candidates are the PR's
# before-code (`seed_before`, the baseline every speed-up is measured against, always run), the PR's
# after-code (`seed_after`), three `ModelEMA` strategies (`loop`, `foreach`, `gated`) and two
# reference points that are not EMA strategies: `floor`, one `lerp_` over two contiguous buffers (a
# bound: the fastest any update of these tensors can be), and `copy`, one `copy_` of the same bytes
# (what moving them costs; on a CPU a copy's store first reads its destination into the cache, a
# *write-allocate* read, so a copy is no cheaper yardstick than the floor). Both references are
# always run. Each thread count is measured in turn, with the candidates
# interleaved within it. Devices that are missing are listed as skipped with the reason, never as zero.

# %%
# NBVAL_IGNORE_OUTPUT
record = run_bench(
    "all",
    models=["tiny_cnn", "yolo"] if quick_mode() else ["yolo", "tiny_tensors"],
    strategies=["seed_after", "loop", "foreach", "gated", "floor"],
    threads=(1, 2),
    quick=quick_mode(),
    progress=False,
)
print(format_table(record))

# %% [markdown]
# The run's candidates and thread counts, as the record stores them:

# %%
candidates = record["settings"]["candidates"]
print(len(candidates), "candidates:", ", ".join(candidates))
print("thread counts:", record["settings"]["threads"])

# %% [markdown]
# So each table above has seven rows per model. Read a row as: the candidate's dispatched compute ops
# per update, its CUDA kernel launches (`-` where the device cannot count them), the median time per
# update and its IQR, the speed-up against `seed_before` (the PR's before-code), and the floor
# fraction: the floor's median time over the row's, on the same model and thread count. 1.00 means
# as fast as one `lerp_` over the same bytes; a value a little above 1 is timing noise; `copy` gets
# `-`, since a copy is not an EMA update. The figures: update times at one thread, the thread
# scaling (time against thread count, per model), and the per-op cost model of each device.

# %%
# NBVAL_IGNORE_OUTPUT
for device, status in record["devices"].items():
    if status["status"] != "measured":
        print(f"{device}: {status['status']}")
        continue
    display(plot_times(record, device, threads=1))
    display(plot_threads(record, device))
    display(plot_cost_model(record["cost_model"][device]))

# %% [markdown]
# What a second thread can do depends on the op. One op over millions of elements (`floor`, `copy`,
# the flat strategies on a large model) can split its elements between two threads; a Python loop of
# thousands of small ops (the PR's before-code) cannot dispatch any faster. And an op that uses two
# threads waits for both: when the other core is busy with other work, it waits for that core. Your
# figures above show what this machine did at the time of this run; section 6 reads two saved runs.
#
# ## 4. The cost model's prediction next to the measurement
#
# Notebook 01 fits a per-op cost model, `time = overhead per op x ops + bytes / bandwidth`, and uses
# it to predict the PR's before-code on the YOLO-sized net. Here the prediction meets the measurement,
# both from one source: the committed full run `results/linux-amd-epyc-2c_2026-12-02.json` (its cost
# model fit and its timed rows, 1 thread, 15 rounds). The ops are the ones that run counted for each
# update (views such as `detach` included, as in the fit). For the before-code every op is priced at
# the per-tensor loop's overhead and the loop's 7 element-sized transfers per element; for the
# after-code the tensors inside the one `_foreach_lerp_` are priced at the foreach overhead (3 transfers
# per element) and its other ops (the `detach` views of its two `state_dict()` walks) at the loop's.

# %%
REFERENCE_RUN = Path("../results/linux-amd-epyc-2c_2026-12-02.json")
reference = load(REFERENCE_RUN)
fits = reference["cost_model"]["cpu"]["fits"]
loop_fit, foreach_fit = fits["loop"], fits["foreach"]


def predict_ms(row: dict) -> tuple[float, float]:
    """(per-op part, bytes part) in ms of one update, from the committed cost model fits."""
    stats, ops = row["stats"], row["ops_total"]
    if row["candidate"] == "seed_before":
        per_op = loop_fit["overhead_per_op_us"] * ops
        nbytes = 7 * stats["float_bytes"] / loop_fit["bandwidth_gbps"]
    else:  # seed_after: one _foreach_lerp_ over every float tensor, plus the other (view) ops
        per_op = foreach_fit["overhead_per_op_us"] * stats["float_tensors"]
        per_op += loop_fit["overhead_per_op_us"] * (ops - 1)
        nbytes = 3 * stats["float_bytes"] / foreach_fit["bandwidth_gbps"]
    return 1e-3 * per_op, 1e-6 * nbytes  # us -> ms; bytes / (GB/s) = ns -> ms


largest = max(p["elements"] for p in reference["cost_model"]["cpu"]["points"])
print(
    f"cost model: {loop_fit['overhead_per_op_us']:.2f} us per op in the loop, "
    f"{foreach_fit['overhead_per_op_us']:.2f} us per tensor inside _foreach_lerp_; "
    f"one bandwidth per strategy, fitted on sizes up to {4 * largest / 2**20:.0f} MiB per side"
)
print(
    f"{'model':<14}{'code':<12}{'ops':>6}{'per-op ms':>11}{'bytes ms':>10}{'predicted':>11}{'measured':>10}"
)
for row in reference["results"]:
    if row["candidate"] in ("seed_before", "seed_after"):
        per_op, nbytes = predict_ms(row)
        code = "PR before" if row["candidate"] == "seed_before" else "PR after"
        print(
            f"{row['model']:<14}{code:<12}{row['ops_total']:>6}{per_op:>11.2f}{nbytes:>10.2f}"
            f"{per_op + nbytes:>11.2f}{row['median_ms']:>10.2f}   measured/predicted "
            f"{row['median_ms'] / (per_op + nbytes):.2f}"
        )

# %% [markdown]
# Where the update is nothing but dispatched ops on small tensors (`tiny_tensors`, 2,000 of them),
# the model lands within about 15 % of the measurement for both the before-code and the after-code.
# On the YOLO-sized net it predicts the before-code about a fifth low and the after-code about half
# low: besides its ops, each PR update walks `state_dict()` twice, and on a net with hundreds of
# nested modules that Python walk (visiting every module, building two ordered dicts of 708 entries)
# costs milliseconds that no per-op or per-byte term sees. For the large models (resnet50, gpt2) the
# bytes part dominates, and the measurement is 1.8 to 2.9 times the prediction: this file's cost
# model was fitted before the sweep went beyond the last-level cache, with one bandwidth on sizes up
# to 16 MiB per side (printed above), while these updates move 100-340 MB per side from main memory
# (exercise 3 works out the bandwidth that would match).
#
# ## 5. What a result file holds
#
# `python -m ema_lab bench` writes the same record as JSON to `results/<stem>.json`, with PNG plots
# beside it. The stem is unique per run: machine, date and time of day (UTC, to the second), quick or
# full, thread counts and measured devices, e.g. `linux-amd-epyc-2c_2026-12-03T083304Z_quick_t1_cpu`;
# a run never replaces an earlier file (if the name exists it stops with a one-line error). The record
# is versioned (version 3 adds each row's floor fraction and the cost model's cache and DRAM
# bandwidths; version 2 stored the list of thread counts; files of versions 1 and 2 still load), and `ema_lab.bench.results.validate` checks it before it is written and whenever it is
# loaded. Its top-level fields and one row's fields:

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
# ## 6. Every saved run side by side
#
# `bench_files` lists every bench run in `results/` (files whose `"schema"` is `ema_lab.bench`), and
# `load_many` validates each. `results/` also holds `peers-*.json` and `trainer-*.json`, written by
# `benchmarks/peers.py` (other projects' EMA classes) and `benchmarks/trainer.py` (a short training
# run) in their own formats; `bench_files` leaves them out by design, and their tables are in the
# `.md` file beside each and in the README. Each run is labelled by machine, device, date and time,
# thread count, quick or full mode, and torch version, so that runs from one machine stay apart.

# %%
# NBVAL_IGNORE_OUTPUT
saved, _ = load_many(bench_files("../results"))
for f, rec in saved:
    for device, status in rec["devices"].items():
        if status["status"] == "measured":
            for n in rec["settings"]["threads"]:
                print(f"{f.name}\n    {run_label(rec, device, n)}")
print(*settings_differences([rec for _, rec in saved]), sep="\n")

# %% [markdown]
# `plot_compare` draws each model's speed-up against `seed_before` (log scale), one bar per run,
# with `floor` as a dashed line in the run's colour (it is a bound, not a strategy). A panel exists for
# every model that any run measured; a run that did not measure a model has no bars there. The
# settings in which the runs differ are written above the figure: read differences between such runs
# as differences of settings too, not of code or hardware alone. The same plot and table come from the
# command line: `python -m ema_lab compare results/*.json`.

# %%
# NBVAL_IGNORE_OUTPUT
display(
    plot_compare([rec for _, rec in saved], candidates=("seed_after", "foreach", "gated", "flat", "auto"))
)

# %% [markdown]
# The two quick runs from 2026-12-03 were made on this machine one after the other, one at 1 thread
# and one at 2 (`python3 dev.py bench --quick --threads 1`, then `--threads 2`), while other jobs
# loaded it; the full run from 2026-12-02 is at 1 thread with 15 rounds instead of 3. The comparison
# of the two quick runs alone is saved as `results/compare_1-vs-2-threads_2026-12-03.png` (made with
# `python3 dev.py compare` on the two files). Their medians of the single-op references and of the
# PR's code, read from the two files:

# %%
pair = [
    load(f"../results/linux-amd-epyc-2c_2026-12-03T{t}_cpu.json")
    for t in ("083304Z_quick_t1", "083322Z_quick_t2")
]
for model in pair[0]["settings"]["models"]:
    for cand in ("seed_before", "seed_after", "loop", "flat_model", "floor", "copy"):
        ms = [
            next(r for r in rec["results"] if r["model"] == model and r["candidate"] == cand) for rec in pair
        ]
        print(
            f"{model:<13}{cand:<12} 1 thread {ms[0]['median_ms']:7.3f} ms [IQR {ms[0]['q3_ms'] - ms[0]['q1_ms']:6.3f}]"
            f"   2 threads {ms[1]['median_ms']:7.3f} ms [IQR {ms[1]['q3_ms'] - ms[1]['q1_ms']:6.3f}]"
        )

# %% [markdown]
# On yolo (2.6M elements) the single `lerp_` and `copy_` ran about 2.6 times faster at two threads
# (0.81 -> 0.31 ms), and `flat_model` about twice as fast: a big single op splits well. On
# tiny_tensors (272,000 elements in all) the same single ops went from 0.04 ms to about 8 ms at two
# threads, with an IQR near zero: every call waited about 8 ms, the signature of the second thread
# waiting for a core that another process held, not of the work. The PR's code barely moved on
# tiny_tensors (about 49 and 24 ms at both counts), and the per-tensor `loop` on yolo became erratic
# at two threads (median 43 ms, IQR 26 ms). So on a shared 2-core machine one thread is the honest
# default; a second thread pays off only for large single ops, and only when the core is free. The
# 1-thread medians of 2026-12-03 are also about 25-60 % above the 2026-12-02 run (for example the
# before-code on yolo: 20.8 vs 14.0 ms). Load from other jobs is part of it, but not all: the full
# run of 09:30 that day, started with the machine idle, measured 20.9 ms too. Runs on a shared
# machine differ from day to day by that much, which is why runs are compared within one session and
# their settings are printed.
#
# Runs from a GPU: the code paths for CUDA and MPS are written (synchronised timing, kernel-launch
# counts), but this machine has neither. The cell below looks for a run in `results/` that measured
# one, and says so when there is none.

# %%
# NBVAL_IGNORE_OUTPUT
gpu_runs = [
    (f, rec, d)
    for f, rec in saved
    for d, status in rec["devices"].items()
    if d != "cpu" and status["status"] == "measured"
]
for f, rec, device in gpu_runs:
    print(f.name)
    display(plot_times(rec, device))
if not gpu_runs:
    print(f"no run in results/ measured a CUDA or MPS device ({len(saved)} bench runs, all on CPU)")

# %% [markdown]
# ## 7. On CUDA: what one `_foreach_lerp_` launch carries (facts from PyTorch's source)
#
# Without a GPU here, these are facts read in PyTorch's CUDA code
# (`aten/src/ATen/native/cuda/MultiTensorApply.cuh` and the foreach kernels that use it), not
# measurements:
#
# - **The fast route needs uniform lists.** `_foreach_lerp_` on CUDA takes the multi-tensor-apply
#   route only when every tensor of the lists is on the same device, with the same dtype and a
#   compatible (dense, non-overlapping) layout. Otherwise it falls back, silently, to one ordinary
#   kernel per tensor. A typical cause: a bf16 or fp16 model averaged into an fp32 EMA.
# - **One launch carries a bounded batch.** For depth 2 (an in-place lerp reads and writes the EMA
#   list and reads the model list) one launch carries at most 64 tensors and 320 chunks of 65,536
#   elements, within the 4 KB kernel-argument limit. Built with CUDA >= 12.1 on a driver that supports
#   large kernel arguments, the limits are 448 tensors and 2,240 chunks. A launch is issued when the
#   tensor slots or the chunk slots are full, or at the last chunk of the last tensor; a tensor cut
#   by a full chunk list continues in the next launch.
# - **"Launch-bound" is host time.** Each launch costs CPU time to prepare and enqueue. The GPU shows
#   idle gaps only when it drains the queue faster than the host fills it; while the queue stays
#   ahead, launch cost is hidden from a GPU trace but still spent on the CPU.
#
# The packing rule as a small function, applied to the zoo's YOLO-sized net (the same 594 float
# tensors and 2.6M elements as yolo26n):

# %%
CHUNK = 65_536  # elements per chunk (kChunkSize)
LIMITS = {  # depth 2: (tensors, chunks) per launch
    "4 KB kernel arguments": (64, 320),
    "CUDA >= 12.1 large kernel arguments": (448, 2_240),
}


def mta_launches(numels: list[int], max_tensors: int, max_chunks: int, chunk: int = CHUNK) -> int:
    """Launches multi_tensor_apply issues for tensors of these sizes (empty tensors skipped)."""
    numels = [n for n in numels if n > 0]
    launches = tensors = chunks = 0
    for i, n in enumerate(numels):
        tensors += 1
        n_chunks = math.ceil(n / chunk)
        for c in range(n_chunks):
            chunks += 1
            last_of_tensor = c == n_chunks - 1
            if (
                (tensors == max_tensors and last_of_tensor)
                or chunks == max_chunks
                or (i == len(numels) - 1 and last_of_tensor)
            ):
                launches += 1
                chunks = 0
                tensors = 0 if last_of_tensor else 1  # a cut tensor carries on in the next launch
    return launches


yolo = models.build("yolo")
numels = [v.numel() for v in yolo.state_dict().values() if v.is_floating_point()]
print(
    f"yolo: {len(numels)} float tensors, {sum(numels):,} elements, {sum(math.ceil(n / CHUNK) for n in numels)} chunks"
)
for name, (max_t, max_c) in LIMITS.items():
    print(f"  {name}: {mta_launches(numels, max_t, max_c)} launches of _foreach_lerp_ per EMA update")
print(f"  the PR's before-code: {3 * len(numels)} kernels (mul_, mul, add_ per tensor)")

# %% [markdown]
# So on a GPU the PR's after-code replaces 1,782 kernel launches with about 10, or 2 with large kernel
# arguments, as long as the lists are uniform. The `flat` strategies go further: one tensor per group,
# so the launch count depends only on the chunk limit.
#
# ## 8. Add your own machine
#
# 1. From the repository root run `python3 dev.py bench` (or, in an environment with ema_lab
#    installed, `python -m ema_lab bench --device all`). On a laptop this takes a few minutes; add
#    `--quick` for a first look. It prints the table and writes `results/<stem>.json` plus PNGs, where
#    the stem names the machine (OS, CPU model, core count, any GPU measured), the date and time,
#    quick or full, thread counts and devices. Run it as often as you like: no run replaces another.
# 2. Keep `--threads 1` (the default) for numbers comparable with the files already here; add more
#    counts (`--threads 1 2 4`) to measure the scaling in the same run. The counts are recorded in
#    the file and printed by `compare`.
# 3. Compare: `python3 dev.py compare results/*.json` (or re-run this notebook, which picks up every
#    run in `results/`). Commit the JSON and PNGs to share them.
#
# ## Try it yourself
#
# 1. From the record of section 3, compute each candidate's 2-thread speed-up over its own 1-thread
#    time on the last model. Which candidates gain, and why those?
# 2. With `mta_launches`, how many launches does one `_foreach_lerp_` take for `tiny_tensors` (2,000
#    tensors of 136 elements), and for one flat buffer holding all of yolo's 2.6M elements?
# 3. The prediction for the PR's after-code on `gpt2` is far too low. Which bandwidth would make it
#    match the measurement, keeping the per-op part? Compare it with the fitted one.
#
# ## Solutions
#
# **1.** Divide each candidate's 1-thread median by its 2-thread median (above 1: faster at two threads):

# %%
# NBVAL_IGNORE_OUTPUT
last = record["settings"]["models"][-1]
by = {(r["candidate"], r["threads"]): r["median_ms"] for r in record["results"] if r["model"] == last}
for c in record["settings"]["candidates"]:
    print(f"{last:<13}{c:<12} {by[c, 1]:8.3f} ms -> {by[c, 2]:8.3f} ms, speed-up {by[c, 1] / by[c, 2]:.3g}x")

# %% [markdown]
# Only ops with many elements can split them over two threads (on yolo: `floor`, `copy`, the flat
# strategies); the per-op dispatch of the loops and of the PR's code stays single-threaded Python and
# C++ work, so it does not gain. On tiny_tensors even the single ops are too small to gain, and when
# the second core is busy a 2-thread op can wait for it, milliseconds per call (the waits of about
# 8 ms seen in section 6), so a "speed-up" far below 1 is possible.
#
# **2.** The chunk limit never binds for `tiny_tensors`; the tensor limit does. One flat buffer is one
# tensor of 40 chunks:

# %%
for name, (max_t, max_c) in LIMITS.items():
    tiny = mta_launches([136] * 2000, max_t, max_c)
    flat = mta_launches([sum(numels)], max_t, max_c)
    print(f"{name}: tiny_tensors {tiny} launches, one flat buffer of yolo {flat} launch(es)")

# %% [markdown]
# **3.** Solve `measured = per-op part + 3 x bytes / bandwidth` for the bandwidth:

# %%
row = next(r for r in reference["results"] if r["model"] == "gpt2" and r["candidate"] == "seed_after")
per_op, _ = predict_ms(row)
needed_gbps = 3 * row["stats"]["float_bytes"] / (1e6 * (row["median_ms"] - per_op))
print(f"gpt2, PR after-code: measured {row['median_ms']:.1f} ms, per-op part {per_op:.2f} ms")
print(f"bandwidth that matches: {needed_gbps:.0f} GB/s; fitted: {foreach_fit['bandwidth_gbps']:.0f} GB/s")
newer = json.loads(Path("../results/costmodel-linux-amd-epyc-2c_2026-12-03.json").read_text())["cost_model"]
print(
    f"the newer two-regime sweep (to {4 * max(p['elements'] for p in newer['points']) / 2**20:.0f} MiB "
    f"per side, {newer['threads']} thread): foreach {newer['fits']['foreach']['bandwidth_gbps']:.0f} GB/s "
    f"in cache, {newer['fits']['foreach']['dram_bandwidth_gbps']:.0f} GB/s beyond the last-level cache "
    f"({newer['llc_bytes'] / 2**20:.0f} MiB)"
)

# %% [markdown]
# About a third of the fitted bandwidth. The committed 2026-12-02 file's fit predates the sweep to 4x
# the last-level cache: its sizes stop at 16 MiB per side (a 32 MiB working set, as large as this
# machine's 32 MiB L3), while gpt2's update moves three times 340 MB, which streams from main memory
# rather than from cache. The newer sweep, `results/costmodel-linux-amd-epyc-2c_2026-12-03.json`,
# fits a bandwidth per regime, and beyond the cache it is of that order (tens of GB/s, not a hundred);
# it is lower still than the one that matches here, but it comes from another day, with the machine
# more loaded (a load average of about 3 on 2 cores, recorded in the file), so compare regimes, not
# the exact figures.
#
# ## Summary
#
# - GPU work is asynchronous: time it only after a synchronisation (the torch Timer does it for you).
# - The first call pays for set-up and cold caches; measure after a warm-up.
# - Interleave candidates, fix and record the thread count, and report medians with an IQR.
# - `python -m ema_lab bench` does all of that, skips missing devices with the reason, measures
#   several thread counts in one run, and writes a validated JSON record under a name no later run
#   reuses; `compare` labels every run and says where their settings differ.
# - The per-op cost model explains the before-code on many small tensors; the `state_dict()` walks and
#   main-memory bandwidth are what it leaves out.
# - On CUDA one `_foreach_lerp_` packs up to 64 (or 448) tensors per launch, but only for uniform lists.
