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
# # 02 · EMA strategies: the step, its ramp, and a cache that goes stale
#
# - An EMA averages recent weights; a ramp widens its window from nothing.
# - In training: copy the model, step the copy, evaluate the copy.
# - Loop and foreach steps agree; tensor lists kept between steps can go stale.

# %% [markdown]
# ![Course map](figures/course_map_02.svg)
#
# Here you build the EMA: a copy of the weights that moves a fraction `w = 1 - d` towards the model after
# every optimizer step ([EMA](../docs/glossary.md#ema): exponential moving average; `d`: the
# [decay](../docs/glossary.md#decay-and-weight)). One weight:

# %%
# %matplotlib inline
import torch

torch.set_num_threads(1)  # one thread: results that do not depend on how many cores you have
torch.manual_seed(0)
weights = 1 + 0.3 * torch.randn(8)  # one weight's value at 8 steps, bouncing around 1.0
ema, d = weights[0].clone(), 0.7
for x in weights:
    ema.lerp_(x, 1 - d)  # ema = d * ema + (1 - d) * x
    print(f"weight {x:.3f}   EMA {ema:.3f}")

# %% [markdown]
# The EMA bounces much less than the weight: it averages the recent steps.
#
# ## 1. A window of past weights, and the ramp
#
# ![The EMA weights past steps by (1 - d) d^k; the warm-up ramp widens that window](figures/02_ema_window.svg)
#
# Unrolled, the EMA gives the weights of `k` steps ago the share `(1 - d) d^k`: a
# [window](../docs/glossary.md#window) of about `1 / (1 - d)` recent steps. At the start that window
# would hold the random initial weights, so ultralytics ramps the decay up: `d(n) = decay * (1 - exp(-n /
# tau))`, by default `decay = 0.9999`, `tau = 2000`.

# %%
import math


def ramp(n, decay=0.9999, tau=2000):
    return decay * (1 - math.exp(-n / tau))


for n in [1, 100, 2000, 10_000, 50_000]:
    print(f"n = {n:>6}: d = {ramp(n):.6f}, window 1/(1-d) = {1 / (1 - ramp(n)):8.1f} steps")

# %% [markdown]
# At step 1 the EMA is almost a copy of the model; the window reaches 10,000 steps only after tens of
# thousands of updates. Three values of `tau`, over 30,000 steps:

# %%
import matplotlib.pyplot as plt

updates = range(0, 30_001, 100)
fig, ax = plt.subplots(figsize=(6.5, 3.8))
for tau, color in [(500, "C0"), (2000, "C1"), (5000, "C2")]:
    window = [1 / (1 - ramp(n, tau=tau)) for n in updates]
    ax.plot(updates, window, color=color)
    at = next(i for i, w in enumerate(window) if w >= 100)  # label each curve where it is alone
    ax.annotate(
        f"tau = {tau}", (updates[at], window[at]), xytext=(8, -4), textcoords="offset points", color=color
    )
ax.set(yscale="log", xlabel="update n (optimizer steps)", ylabel="averaging window (steps)")
ax.set_title("How many recent steps the EMA averages")
ax.grid(alpha=0.3)
plt.show()
for tau in (500, 2000, 5000):
    print(f"tau = {tau}: window at n = 30,000 is {1 / (1 - ramp(30_000, tau=tau)):,.0f} steps")

# %% [markdown]
# With `tau = 500` or `2000` the window is near its full 10,000 steps by update 30,000; with
# `tau = 5000` it is still a few hundred steps. The larger `tau`, the longer the EMA stays close to
# the raw model.
#
# ## 2. An EMA in a training loop
#
# An EMA class in the shape ultralytics uses: the copy, an update counter for the ramp, and one
# `lerp_` per float entry of the `state_dict()` (weights and BatchNorm statistics):

# %%
from copy import deepcopy


class HandEMA:
    def __init__(self, model, decay=0.9999, tau=2000):
        self.ema, self.decay, self.tau, self.updates = deepcopy(model).eval(), decay, tau, 0

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d, msd = ramp(self.updates, self.decay, self.tau), model.state_dict()
        for k, e in self.ema.state_dict().items():
            if e.is_floating_point():
                e.lerp_(msd[k], 1 - d)


# %% [markdown]
# A small task: a network fits a smooth function from noisy labels, with plain SGD at a large step
# size. The test targets are noise-free, so their loss measures the model:

# %%
from torch import nn

w_true = torch.randn(8, generator=torch.Generator().manual_seed(1))


def data(n, noise, seed):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    y = torch.sin(x @ w_true / 8**0.5) + 0.5 * torch.tanh(x[:, 0] * x[:, 1])  # the smooth function
    y = y + noise * torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    return x, y.unsqueeze(1)


x_train, y_train = data(300 * 32, noise=0.5, seed=2)  # 300 batches of 32
x_test, y_test = data(1024, noise=0.0, seed=4)

# %% [markdown]
# The training loop, with the EMA's three lines numbered. It takes each of the 300 batches once and
# tests both models every 20 steps:


# %%
def train(ema_class, decay=0.99, tau=50, tests=15, steps=20, lr=0.2):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 64), nn.BatchNorm1d(64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 1)
    )
    ema = ema_class(model, decay=decay, tau=tau)  # 1. copy the model
    opt, raw, avg = torch.optim.SGD(model.parameters(), lr=lr), [], []
    for i in range(tests * steps):
        x, y = x_train[32 * i : 32 * (i + 1)], y_train[32 * i : 32 * (i + 1)]
        model.train()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ema.update(model)  # 2. step the copy after each optimizer step
        if (i + 1) % steps == 0:  # every 20 steps: 3. evaluate the copy beside the model
            with torch.no_grad():
                raw.append(nn.functional.mse_loss(model.eval()(x_test), y_test).item())
                avg.append(nn.functional.mse_loss(ema.ema(x_test), y_test).item())
    return raw, avg, ema


# %% tags=["nbval-ignore-output"]
raw, avg, hand = train(HandEMA)
tested_at = [20 * (i + 1) for i in range(len(raw))]  # the SGD step after which each test ran
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(tested_at, raw, "o-", color="C3", label="raw model")
ax.plot(tested_at, avg, "s-", color="C0", label="EMA")
ax.legend(loc="upper right")
ax.set(xlabel="SGD step (one batch of 32 each)", ylabel="test loss (MSE)", ylim=(0, None))
ax.set_title("Raw weights against their EMA (decay 0.99, tau 50)")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# At a large step size SGD bounces around the minimum: the raw loss jumps from test to test, the
# EMA's hardly does. When an EMA beats the weights it averages, and how long its window should be, is
# notebook 07's subject.
#
# `ema_lab.ModelEMA` is this class, packaged, with the same ramp and defaults. Trained with it in place
# of `HandEMA`, the run gives the same EMA:

# %%
from ema_lab import ModelEMA

raw2, avg2, packaged = train(ModelEMA)
print("same raw losses:", raw2 == raw)
print("same EMA losses, to 1e-5:", max(abs(a - b) for a, b in zip(avg, avg2)) < 1e-5)
print("same ramp:", all(packaged.decay(n) == ramp(n, 0.99, 50) for n in range(0, 5000, 7)))

# %% [markdown]
# ModelEMA also unwraps models wrapped for multi-GPU training (DDP, notebook 06) or by `torch.compile`, copies the
# integer BatchNorm counters, and applies the step in fewer ops, the subject of the next section.
#
# ## 3. Three ways to apply one step, and the gate
#
# ema_lab has the step three ways: `loop_update` (the arithmetic before ultralytics PR #25315, one
# tensor at a time), `foreach_update` (the after-code's one `torch._foreach_lerp_`) and `gated_update`
# (the same call behind the PR's gate, below, plus a fallback of ema_lab's own). Take the float
# tensors of a model shaped like the yolo26n detector:

# %%
from ema_lab import foreach_update, gated_update, loop_update
from ema_lab.bench import models

model = models.build("yolo")
model_t = [v for v in model.state_dict().values() if v.is_floating_point()]
print(len(model.state_dict()), "state_dict entries,", len(model_t), "of them float")

# %% [markdown]
# Ten random steps of the model, each followed by an update with each strategy and, as the reference,
# in float64:

# %%
emas = {f.__name__: [t.clone() for t in model_t] for f in (loop_update, foreach_update, gated_update)}
reference = [t.double() for t in model_t]
gen = torch.Generator().manual_seed(0)
for _ in range(10):
    for m in model_t:
        m.add_(torch.randn(m.shape, generator=gen), alpha=0.01)  # the "optimizer step"
    for f in (loop_update, foreach_update, gated_update):
        f(emas[f.__name__], model_t, 0.9)
    for r, m in zip(reference, model_t):
        r.mul_(0.9).add_(m.double(), alpha=0.1)
for name, ema_t in emas.items():
    err = max((e.double() - r).abs().max().item() for e, r in zip(ema_t, reference))
    print(f"{name:<15} agrees with float64 to 1e-6: {err < 1e-6}")

# %% [markdown]
# All three give the same EMA, to float32 rounding (not bit for bit: a `lerp` rounds differently
# from a multiply and an add). What differs is the number of ops they call from Python, counted
# with `count_ops` from notebook 01:

# %%
from ema_lab.bench.counting import count_ops

print(f"torch {torch.__version__}")
for f in (loop_update, foreach_update, gated_update):
    print(f"{f.__name__:<15}", dict(count_ops(f, emas[f.__name__], model_t, 0.9)))

# %% [markdown]
# The loop calls four ops per tensor: `mul_`, `mul`, `add_` and `detach` (the before-code's
# `m.detach()`: no arithmetic, yet it passes the dispatcher). The other two call one `_foreach_lerp_`
# per list, so they pay an op's fixed price (notebook 01) once.
#
# **The gate.** `_foreach_lerp_` does not exist before torch 2.0, and the PR calls it on Apple GPUs
# (MPS) only from torch 2.4 (its comment: "`_foreach_lerp_` needs torch>=2.0 and, on MPS, torch>=2.4").
# Otherwise it runs the loop. `ema_lab.foreach_lerp_supported` is that check:

# %%
from ema_lab import foreach_lerp_supported

devices = ["cpu", "cuda", "mps", "npu"]
print(f"{'torch':<7}" + "".join(f"{d:>9}" for d in devices))
for version in ["1.13", "2.0", "2.3", "2.4", "2.13"]:
    row = ["foreach" if foreach_lerp_supported(version, d) else "loop" for d in devices]
    print(f"{version:<7}" + "".join(f"{r:>9}" for r in row))

# %% [markdown]
# Ascend NPUs (`npu`) are excluded by a later version of the gate. `gated_update` applies the gate,
# then adds a fallback the PR does not have: where the dtypes of a pair differ, the PR's call raises,
# and `gated_update` updates that pair alone with `mul_` and `add_`. Your torch, on a CPU:

# %%
print(f"torch {torch.__version__}, cpu:", "foreach" if foreach_lerp_supported(None, "cpu") else "loop")

# %% [markdown]
# ## 4. Lists collected once, and how they go stale
#
# The PR's code walks `state_dict()` twice per update to find the tensors, which notebook 01 found
# costly. ultralytics 8.4.190 collects the two lists once and reuses them. In a few lines:


# %%
class CachedListEMA:  # ultralytics 8.4.190's idea: collect the lists once, reuse them forever
    def __init__(self, model, d):
        self.ema, self.d, self.lists = deepcopy(model), d, None

    def update(self, model):
        if self.lists is None:
            msd = model.state_dict()
            self.lists = [(v, msd[k]) for k, v in self.ema.state_dict().items() if v.is_floating_point()]
        foreach_update([e for e, _ in self.lists], [m for _, m in self.lists], self.d)


# %% [markdown]
# The catch: `state_dict()` returns tensors that share memory with the parameters at that moment.
# `model.double()` gives every parameter new memory, behind the same `Parameter` object:

# %%
model = models.build("tiny_cnn")
held = model.state_dict()["0.conv.weight"]  # what a cached list holds
param = model[0].conv.weight
print("before: shares memory with the parameter:", held.data_ptr() == param.data_ptr())
model.double()
print("after model.double(): same Parameter object:", param is model[0].conv.weight)
print("                      shares memory:", held.data_ptr() == param.data_ptr())

# %% [markdown]
# So after the conversion the cached EMA averages tensors nobody writes any more. Update once, convert,
# move every model weight by +1, then update 20 times at `d = 0.5`: a working EMA closes the gap.


# %%
def gap_after_conversion(ema, model):
    ema.update(model)
    model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the model moves on
    for _ in range(20):
        ema.update(model)
    return max((e.double() - p).abs().max().item() for e, p in zip(ema.ema.parameters(), model.parameters()))


model = models.build("tiny_cnn")
print(f"CachedListEMA: largest |EMA - model| = {gap_after_conversion(CachedListEMA(model, 0.5), model):.3f}")

# %% [markdown]
# The gap stays at about 1: the EMA stopped following, and nothing raised an error. `ema_lab.ModelEMA`
# caches its lists too, but checks on every update that the tensors are still the model's, and
# rebuilds them when they are not (`ema.rebuilds` counts that). `tau` near 0 makes its decay a flat 0.5:

# %%
model = models.build("tiny_cnn")
ema = ModelEMA(model, decay=0.5, tau=1e-9)
print(
    f"ModelEMA:      largest |EMA - model| = {gap_after_conversion(ema, model):.3f}, rebuilds: {ema.rebuilds}"
)

# %% [markdown]
# It follows the model (`rebuilds` counts every build of its lists: the first, then one after the
# conversion). Casting the EMA copy
# itself, `ema.ema.half()`, breaks cached lists the same way; a [validator](../docs/glossary.md#validator)
# (the code that scores the model on held-out data during training) may cast the copy like that.

# %% [markdown]
# ## Summary
#
# - The EMA step is `ema.lerp_(model, 1 - d)` per float tensor, with `d(n) = decay * (1 - exp(-n / tau))`:
#   a window of about `1 / (1 - d)` recent steps; the ramp keeps the early window short.
# - In training: copy the model, update the copy after each optimizer step, evaluate the copy.
# - Loop, foreach and gated updates give the same EMA; foreach calls one op per list.
# - The gate allows `_foreach_lerp_` from torch 2.0, on MPS from 2.4.
# - Cached tensor lists go stale when the model gets new memory; check them, or the EMA freezes.

# %% [markdown]
# ## Exercises
#
# Try each exercise in the empty cell below it before you open its solution; to run a solution,
# paste it into that cell.
#
# **Exercise 1.** Train with `tau=5` instead of 50: `train(HandEMA, tau=5)`. *Predict* after which
# steps the EMA's test loss is worse than the raw model's, and why; then compare its two lists of losses.
# Hint: the weights of steps 1-20 keep the product of every later decay.

# %%
# Exercise 1: your code here

# %% [markdown]
# <details><summary>Solution 1</summary>
#
# ```python
# def early_share_below(tau, limit=0.1):  # the step at which steps 1-20 hold under 10 % of the EMA
#     share, n = 1.0, 20
#     while share > limit:
#         n += 1
#         share *= ramp(n, 0.99, tau)
#     return n
#
#
# for tau in (5, 50):
#     raw_t, avg_t, _ = train(HandEMA, tau=tau)
#     worse = [step for step, r, a in zip(tested_at, raw_t, avg_t) if a > r]
#     print(f"tau = {tau:>2}: EMA worse than raw after steps {worse}")
#     print(f"          the EMA of steps 1-20 keeps over 10 % of it until step {early_share_below(tau)}")
# ```
#
# With `tau=5` the EMA is worse than the raw model at many more of the first tests than with `tau=50`
# (the exact steps depend on your torch's random numbers). With `tau=5` the decay is near 0.99 within a
# few updates, so the weights of the first 20 steps, far from the minimum, keep over 10 % of the EMA
# until step 241: the EMA drags them along while the model improves. With `tau=50` the decay is still
# small after step 20, and their share falls below 10 % at step 23.
#
# </details>

# %% [markdown]
# **Exercise 2.** Section 4 converted the model with `model.double()`. *Predict*: after
# `model.bfloat16()` instead, does `CachedListEMA` follow the model? Does `ModelEMA`? Check: copy
# `gap_after_conversion` with `model.bfloat16()` in place of `model.double()`, and run it on both as
# section 4 did.

# %%
# Exercise 2: your code here

# %% [markdown]
# <details><summary>Solution 2</summary>
#
# ```python
# def gap_after_bfloat16(ema, model):
#     ema.update(model)
#     model.bfloat16()
#     with torch.no_grad():
#         for p in model.parameters():
#             p.add_(1.0)
#     for _ in range(20):
#         ema.update(model)
#     return max((e.double() - p).abs().max().item() for e, p in zip(ema.ema.parameters(), model.parameters()))
#
#
# model = models.build("tiny_cnn")
# print(f"CachedListEMA: gap {gap_after_bfloat16(CachedListEMA(model, 0.5), model):.3f}")
# model = models.build("tiny_cnn")
# print(f"ModelEMA:      gap {gap_after_bfloat16(ModelEMA(model, decay=0.5, tau=1e-9), model):.3f}")
# ```
#
# A gap near 1 for `CachedListEMA` and near 0 for `ModelEMA`: any conversion to another dtype gives
# the parameters new memory, so the cached lists freeze again; `ModelEMA` notices and rebuilds them.
#
# </details>

# %% [markdown]
# **Exercise 3.** Make one of yolo's model tensors float64: `mixed = list(model_t); mixed[5] =
# mixed[5].double()` (`model_t` of section 3). *Predict* how many ops `gated_update` dispatches on it,
# and what `foreach_update` does; then try both, counting with `count_ops`.

# %%
# Exercise 3: your code here

# %% [markdown]
# <details><summary>Solution 3</summary>
#
# ```python
# mixed = list(model_t)
# mixed[5] = mixed[5].double()
# ema_t = [t.clone() for t in model_t]
# print("gated_update:", dict(count_ops(gated_update, ema_t, mixed, 0.9)))
# try:
#     foreach_update(ema_t, mixed, 0.9)
# except ValueError as e:
#     print("foreach_update: ValueError:", e)
# ```
#
# `gated_update` dispatches 3 ops: one `_foreach_lerp_` for all the matching pairs, then `mul_` and
# `add_` for the mixed one. `foreach_update` checks every pair first and raises a `ValueError` naming
# entry 5 and both dtypes, before it updates anything.
#
# </details>
