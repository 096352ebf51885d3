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
# # 01 · Kernel-launch overhead: why a Python loop over 600 small tensors is slow
#
# Before ultralytics PR #25315 the EMA update ran three tiny tensor ops for every floating-point
# tensor of the model, one after another from Python. After it, one `torch._foreach_lerp_` call does
# the whole model. This notebook measures *why* that matters: every op dispatched from Python has a
# fixed cost before it touches a single byte, and an EMA update of a detector is hundreds of such ops
# on tensors that are mostly tiny.
#
# **You will learn**
# - how to count the ATen ops a piece of code dispatches (`ema_lab.count_ops`), and what is and is
#   not counted;
# - the op counts of the seed's before-code, its after-code and the other strategies on the model zoo;
# - what one dispatched op costs on this device, measured, and how the update time grows with the
#   number of tensors at a fixed total size;
# - the per-launch cost model `time = overhead_per_op × ops + bytes / bandwidth`, fitted here,
#   and the "roofline" of a single copy kernel;
# - how to count real CUDA kernel launches with `torch.profiler` where a GPU is present.

# %%
# NBVAL_IGNORE_OUTPUT
# %matplotlib inline
import torch

from ema_lab.bench import count_candidate_ops
from ema_lab.bench.costmodel import run_cost_model
from ema_lab.bench.counting import count_ops, kernel_launches_or_reason, without_views
from ema_lab.bench.environment import available_devices, format_environment, quick_mode
from ema_lab.bench.plots import plot_cost_model
from ema_lab.bench.timing import time_candidates
from ema_lab.lessons import models

torch.set_num_threads(1)  # every timing below is single-threaded; op counts do not depend on it
print(format_environment())
print("quick mode:", quick_mode())

# %% [markdown]
# ## 1. Counting dispatched ops
#
# `count_ops(fn, *args)` runs `fn` once under a `TorchDispatchMode` and returns a `Counter` of every
# ATen op that reached the dispatcher, keyed by overload name. It is deterministic, so the counts
# below are checked strictly every time the notebook is tested. Here is the seed's before-code for
# one tensor pair, `v *= d; v += (1 - d) * m.detach()`, next to one `lerp_`:

# %%
v, m, d = torch.zeros(8), torch.ones(8), 0.9999


def before_one_tensor():
    v.mul_(d)  # v *= d
    v.add_((1 - d) * m.detach())  # v += (1 - d) * m.detach()


print("before, one tensor:", dict(count_ops(before_one_tensor)))
print("compute ops only:  ", dict(without_views(count_ops(before_one_tensor))))
print("one lerp_:         ", dict(count_ops(v.lerp_, m, 1 - d)))
ema_list, model_list = [torch.zeros(8) for _ in range(600)], [torch.ones(8) for _ in range(600)]
print(
    "one _foreach_lerp_ over 600 tensors:", dict(count_ops(torch._foreach_lerp_, ema_list, model_list, 1 - d))
)

# %% [markdown]
# Three compute ops per tensor (`mul_`, `mul` which allocates a temporary, `add_`) plus a `detach`,
# which is a *view*: it dispatches but moves no data (`without_views` drops it). The foreach call is
# **one** dispatched op no matter how many tensors it holds.
#
# What is *not* counted: ops that run inside another op's kernel. On CPU `_foreach_lerp_` loops over
# its 600 tensors in C++ without going back through the dispatcher, so that loop is invisible here
# (it still costs time, which section 3 measures). Python work that dispatches nothing, such as
# walking `state_dict()` and building lists, is not counted either, although `state_dict()` does
# dispatch one `detach` per entry.
#
# ## 2. Op counts on the model zoo
#
# The zoo (`ema_lab.lessons.models`) has models sized like the real ones. For each, one steady-state update
# of each candidate: `seed_before`/`seed_after` are the seed's code verbatim (walking `state_dict()`
# on every call), `loop`/`foreach`/`gated` are `ema_lab.ModelEMA` strategies with cached tensor
# lists, and `floor` is one `lerp_` over two contiguous buffers with the same number of floats.

# %%
CANDIDATES = ["seed_before", "seed_after", "loop", "foreach", "gated", "floor"]
print(f"{'model':<14}{'float tensors':>14}" + "".join(f"{c:>13}" for c in CANDIDATES))
for name in ["yolo", "resnet50", "gpt2", "tiny_tensors"]:
    counts = count_candidate_ops(name, CANDIDATES)
    tensors = models.describe(models.build(name)).float_tensors
    print(
        f"{name:<14}{tensors:>14}"
        + "".join(f"{sum(without_views(counts[c]).values()):>13}" for c in CANDIDATES)
    )
print("\nseed_before on yolo, every op:", dict(count_candidate_ops("yolo", ["seed_before"])["seed_before"]))

# %% [markdown]
# The before-code dispatches 3 compute ops per float tensor: 1782 on the YOLO-sized net (594 float
# tensors), 6000 on the 1000 × `Linear(16, 16)` model. Every foreach strategy dispatches one
# `_foreach_lerp_` (plus, where the model has BatchNorm, one `_foreach_copy_` for the integer
# `num_batches_tracked` counters, which `ModelEMA` copies instead of skipping). The `detach`
# views (2 per state_dict entry from walking both modules, plus one per tensor) are listed in the
# last line: `seed_after` still pays for those on every call.
#
# ## 3. What one dispatched op costs, measured
#
# Time an op that has (almost) no work: `lerp_` on a one-element tensor. Then the same op on a
# million elements, a Python loop of 600 small `lerp_`, and one `_foreach_lerp_` over the same 600. `time_candidates` interleaves the candidates in rounds and reports the median
# and the interquartile range (IQR) per call.

# %%
# NBVAL_IGNORE_OUTPUT
tiny, tiny_m, big, big_m = torch.zeros(1), torch.ones(1), torch.zeros(1 << 20), torch.ones(1 << 20)
ops = {
    "lerp_ on 1 element": lambda: tiny.lerp_(tiny_m, 0.1),
    "lerp_ on 1M elements": lambda: big.lerp_(big_m, 0.1),
    "600 x lerp_ on 8 elements (Python loop)": lambda: [
        e.lerp_(m, 0.1) for e, m in zip(ema_list, model_list)
    ],
    "_foreach_lerp_ over 600 tensors": lambda: torch._foreach_lerp_(ema_list, model_list, 0.1),
}
results = time_candidates(ops, rounds=5 if quick_mode() else 15, threads=1)
for name, r in results.items():
    print(f"{name:<40} {1e6 * r.median_s:9.2f} us  (IQR {1e6 * r.iqr_s:.2f} us)")

# %% [markdown]
# The one-element `lerp_` costs microseconds although it updates a single float: that is the fixed
# price of going from Python through the dispatcher to a kernel. The million-element `lerp_` shows
# what the bytes cost. A Python loop of 600 tiny ops pays the fixed price 600 times; one foreach op
# pays it once (on CPU it still visits each tensor in a C++ loop, which costs less per tensor than a
# trip from Python, but not nothing: section 4 fits that cost too).
#
# ## 4. Update time vs tensor count at fixed total size: the cost model
#
# `run_cost_model` sweeps synthetic (EMA, model) lists: the same total of 1M float32 elements split
# into 1 … 1024 tensors, and 64 tensors holding a growing total. For the per-tensor `loop` it fits
# `time = overhead_per_op × dispatched ops + bytes / bandwidth`; for one `_foreach_lerp_` the unit
# is a tensor inside the call. A single `copy_` kernel over the same sizes is the roofline.

# %%
# NBVAL_IGNORE_OUTPUT
cost = run_cost_model("cpu", quick=quick_mode(), threads=1)
for name, fit in cost.fits.items():
    per = f"{fit.overhead_per_op_us:6.2f} us per {fit.unit:<34}"
    print(f"{name:<8} {per} {fit.bandwidth_gbps:7.1f} GB/s  (R^2 {fit.r2:.2f})")
print(
    "roofline fraction (bandwidth / single-kernel copy bandwidth):",
    {k: round(v, 2) for k, v in cost.roofline_fraction.items()},
)
plot_cost_model(cost.as_dict())

# %% [markdown]
# Left: at a fixed total size, the loop's time grows linearly with the number of tensors once there
# are more than a few dozen: it is **launch-bound**, and the slope is the fitted overhead per
# dispatched op. One `_foreach_lerp_` grows far more slowly (its per-tensor cost is the C++ loop
# inside the op). Right: at a fixed count, time grows with bytes (**bandwidth-bound**) and the
# single `lerp_`/`copy_` kernels mark the floor. A roofline fraction near 1 means the strategy streams
# memory about as fast as a copy does; it can exceed 1 on a CPU because a copy's destination is
# read into cache before it is written, which the byte counts here do not include.
#
# ## 5. Why the before-code on a detector is launch-bound
#
# Plug the YOLO-sized net into the fitted model: how much of its update is the fixed per-op cost,
# and how much is moving bytes?

# %%
# NBVAL_IGNORE_OUTPUT
stats = models.describe(models.build("yolo"))
loop = cost.fits["loop"]
ops_before = 4 * stats.float_tensors  # mul_, mul, add_ and the detach view, per float tensor
launch_ms = 1e3 * loop.overhead_per_op_us * 1e-6 * ops_before
bytes_ms = 1e3 * 7 * stats.float_bytes / (loop.bandwidth_gbps * 1e9)
print(f"yolo: {stats.float_tensors} float tensors, {stats.float_bytes / 2**20:.1f} MiB of float32")
print(f"predicted per-op part: {launch_ms:.2f} ms, predicted bytes part: {bytes_ms:.2f} ms")

# %% [markdown]
# The per-op term dominates: the detector's tensors are small (about 4,400 elements on average), so
# each op finishes its bytes long before the next one can be dispatched. That is the gap PR #25315
# closed, and what the benchmark (`python -m ema_lab bench`, notebook 04) measures on real updates.
# (The seed's before-code also walks `state_dict()` twice per call, which this model leaves out.)
#
# ## 6. Kernel launches on CUDA (and what MPS can say)
#
# On a GPU, "one op" and "one kernel launch" are not the same thing: `_foreach_lerp_` launches a few
# multi-tensor kernels (chunks of tensors per launch), the loop launches one kernel per op. ema_lab
# counts them with `torch.profiler`; where that is impossible it says why instead of printing a number.

# %%
# NBVAL_IGNORE_OUTPUT
for device, reason in available_devices().items():
    if device == "cpu":
        continue
    if reason is not None:
        print(f"{device}: {reason}")
        continue
    e = [torch.zeros(100, device=device) for _ in range(600)]
    m = [torch.ones(100, device=device) for _ in range(600)]
    fused = kernel_launches_or_reason(torch._foreach_lerp_, e, m, 0.1, device=device)
    looped = kernel_launches_or_reason(
        lambda e=e, m=m: [a.lerp_(b, 0.1) for a, b in zip(e, m)], device=device
    )
    for label, k in (("one _foreach_lerp_", fused), ("600 x lerp_", looped)):
        print(f"{device}: {label}: " + (k if isinstance(k, str) else f"{sum(k.values())} kernel launches"))
print("cpu:", kernel_launches_or_reason(torch._foreach_lerp_, ema_list, model_list, 0.1, device="cpu"))

# %% [markdown]
# On a CPU-only machine this prints the reasons: there is no CUDA device, MPS kernels are invisible to
# `torch.profiler`, and CPU ops are function calls rather than kernel launches (use `count_ops`).
#
# ## Try it yourself
#
# 1. Count the ops of `count_candidate_ops("tiny_transformer")`. Its output head shares the embedding
#    matrix: how many times does `seed_before` decay that tensor, and how many times does `loop`?
# 2. Re-run section 3 with `threads=2`. Which of the four numbers changes, and why not the others?
# 3. Change the fixed total in the cost model (`ema_lab.bench.costmodel.FIXED_ELEMENTS = 1 << 16`) and
#    re-run section 4. Does the fitted per-op overhead stay put while the bandwidth changes?
# 4. On a GPU, compare the kernel counts in section 6 for 6,000 tensors instead of 600.
#
# ## Summary
#
# - Every op dispatched from Python has a fixed cost of microseconds, independent of its size.
# - The seed's before-code dispatches 3 compute ops per float tensor (1782 for the YOLO-sized net);
#   one `_foreach_lerp_` replaces them all with one dispatched op.
# - At a fixed total size, the loop's update time grows linearly with the number of tensors: the
#   fitted slope is the per-op overhead printed in section 4; the foreach call's per-tensor cost is
#   several times smaller; a single `lerp_` over contiguous buffers is the floor.
# - `count_ops` is exact and deterministic (tests assert it); kernel launches are a device question,
#   answered by `torch.profiler` on CUDA and reported as "not available" elsewhere.
