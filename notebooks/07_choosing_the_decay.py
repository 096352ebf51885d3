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
# # 07 · Choosing the decay: what the EMA buys
#
# - In a run of noisy SGD steps, the EMA of the weights scores better on new data than the weights do.
# - Its window is about `1 / (1 - d)` steps; a warm-up keeps it from remembering the initial weights.
# - Post-hoc EMA: train once, keep snapshots, and choose the EMA's length afterwards.

# %% [markdown]
# A small network learns a curve from noisy samples, with plain SGD at a large step size. Here is the
# curve, and some of the samples it learns from:

# %%
# %matplotlib inline
import math
import os

import matplotlib.pyplot as plt
import torch
from torch import nn

torch.set_num_threads(1)  # one thread: results that do not depend on how many cores you have
QUICK = os.environ.get("EMA_LAB_QUICK", "0") not in ("", "0")  # a shorter run: fewer seeds and points
STEPS, BATCH, LR = 3000, 16, 0.1


def curve(x):
    return torch.sin(3 * x) + 0.5 * torch.sin(6 * x)


gen = torch.Generator().manual_seed(0)
x_train = 4 * torch.rand(STEPS * BATCH, 1, generator=gen) - 2  # x in [-2, 2]
y_train = curve(x_train) + 0.5 * torch.randn(STEPS * BATCH, 1, generator=gen)  # noisy labels
x_test = torch.linspace(-2, 2, 401).unsqueeze(1)
y_test = curve(x_test)  # noise-free: the test loss measures the model, not the noise

fig, ax = plt.subplots(figsize=(6.5, 3.2))
ax.plot(x_train[:400], y_train[:400], ".", color="0.6", label="400 training samples")
ax.plot(x_test, y_test, color="k", label="the curve (test targets)")
ax.legend(loc="lower left", ncols=2, bbox_to_anchor=(0, 1))
ax.set(xlabel="x", ylabel="y")
plt.show()
print(f"{STEPS} SGD steps of {BATCH} samples; the test set is {len(x_test)} points on the curve")

# %% [markdown]
# ## 1. What the EMA buys
#
# The model, and an [EMA](../docs/glossary.md#ema) of its weights: after each SGD step, each averaged
# tensor moves a fraction `1 - d` of the way to the model's (one `lerp_`). The decay `d` may change with
# the update number `n`:

# %%
from copy import deepcopy


def make_model():
    return nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


class HandEMA:
    def __init__(self, model, schedule):  # schedule: update number n (1, 2, ...) -> decay d
        self.ema, self.schedule, self.n = deepcopy(model), schedule, 0

    @torch.no_grad()
    def update(self, model):
        self.n += 1
        torch._foreach_lerp_(list(self.ema.parameters()), list(model.parameters()), 1 - self.schedule(self.n))


# %% [markdown]
# The training loop takes any number of EMAs (each as a function that builds it from the model),
# updates them after every step, and scores the model and each EMA's `.ema` every 50 steps:


# %%
@torch.no_grad()
def test_loss(model):
    return nn.functional.mse_loss(model(x_test), y_test).item()


def train(*make_emas, steps=STEPS, lr=LR, seed=0, every=50):
    torch.manual_seed(seed)  # the initial weights
    model = make_model()
    emas = [make(model) for make in make_emas]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = {"raw": [], **{i: [] for i, e in enumerate(emas) if hasattr(e, "ema")}}
    for i in range(steps):
        opt.zero_grad()
        batch = slice(BATCH * i, BATCH * (i + 1))
        nn.functional.mse_loss(model(x_train[batch]), y_train[batch]).backward()
        opt.step()
        for ema in emas:
            ema.update(model)
        if (i + 1) % every == 0:
            for key in losses:
                losses[key].append(test_loss(model if key == "raw" else emas[key].ema))
    return model, emas, losses


# %% [markdown]
# One run, with ultralytics' decay `d(n) = decay * (1 - exp(-n / tau))`, which rises to 0.995 here
# (section 2 says why it rises):


# %% tags=["nbval-ignore-output"]
def ramp(n, decay=0.9999, tau=2000):  # ultralytics; ema_lab's ModelEMA default
    return decay * (1 - math.exp(-n / tau))


model, (ema,), losses = train(lambda m: HandEMA(m, lambda n: ramp(n, 0.995, tau=100)))
steps = range(50, STEPS + 1, 50)
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(steps, losses["raw"], color="C3", label="raw weights")
ax.plot(steps, losses[0], color="C0", lw=2, label="their EMA")
ax.legend(loc="upper right")
ax.set(xlabel="SGD step", ylabel="test loss (MSE)", yscale="log")
ax.set_yticks([0.02, 0.05, 0.1, 0.2, 0.5], ["0.02", "0.05", "0.1", "0.2", "0.5"], minor=False)
ax.minorticks_off()
ax.grid(alpha=0.3)
plt.show()
print(f"after {STEPS} steps: raw {losses['raw'][-1]:.4f}, EMA {losses[0][-1]:.4f}")
print(f"the raw weights' best test loss at any of the {len(steps)} checkpoints: {min(losses['raw']):.4f}")

# %% [markdown]
# At this step size each SGD step jolts the weights: the raw loss jumps from checkpoint to
# checkpoint. The EMA averages the bounces away, and ends below the best the raw weights ever reached.
# Is that the luck of one seed? Other initial weights:

# %% tags=["nbval-ignore-output"]
for seed in range(1, 2 if QUICK else 6):
    _, _, seed_losses = train(lambda m: HandEMA(m, lambda n: ramp(n, 0.995, tau=100)), seed=seed)
    raw, avg = seed_losses["raw"], seed_losses[0]
    print(f"seed {seed}: final raw {raw[-1]:.4f}, best raw {min(raw):.4f}, final EMA {avg[-1]:.4f}")

# %% [markdown]
# Every seed ends the same way: the EMA below the best checkpoint of the raw weights.
#
# ## 2. The window, and what an EMA remembers of the start
#
# Unrolled, the EMA gives the weights of `k` steps ago the share `(1 - d) d^k`: a
# [window](../docs/glossary.md#window) of about `1 / (1 - d)` recent steps. The share it does not give to
# any step stays on the weights it started from:
#
# ![After 10 updates, an EMA with a constant decay of 0.999 is still 99 % the initial weights; a warm-up has let them go](figures/07_start_bias.svg)

# %% [markdown]
# With a constant `d = 0.999` the initial weights keep `0.999^n`: 99 % after 10 steps, 90 % after 100,
# 5 % after 3000. A warm-up starts with a small decay and raises it. Two more schedules, beside the ramp:


# %%
def warmup(n, decay=0.9999, gamma=1.0, power=2 / 3):  # timm, diffusers, ema-pytorch
    return min(decay, 1 - (1 + (n - 1) / gamma) ** -power)


def power_ema(n, gamma=6.94):  # Karras et al. 2024: the power function
    return (1 - 1 / n) ** (gamma + 1)


# %% [markdown]
# Ten steps of our run, with a constant decay and with the warm-up, both capped at 0.999:

# %% tags=["nbval-ignore-output"]
torch.manual_seed(0)
print(f"initial weights:            test loss {test_loss(make_model()):.3f}")
model, (const, warm), _ = train(
    lambda m: HandEMA(m, lambda n: 0.999), lambda m: HandEMA(m, lambda n: warmup(n, 0.999)), steps=10
)
print(f"raw weights after 10 steps: test loss {test_loss(model):.3f}")
print(f"EMA, constant d = 0.999:    test loss {test_loss(const.ema):.3f}")
print(f"EMA, warm-up:               test loss {test_loss(warm.ema):.3f}")

# %% [markdown]
# The constant-decay EMA still scores about what the untrained model scores; the warm-up's follows the
# training. The windows `1 / (1 - d)` as the run goes on: the ramp and the warm-up capped at 0.999, the
# power function with `gamma = 6.94`, beside the constant:

# %%
by_hand = {
    "constant": lambda n: 0.999,
    "ramp (tau = 100)": lambda n: ramp(n, 0.999, tau=100),
    "warm-up": lambda n: warmup(n, 0.999),
    "power function": power_ema,
}
colors = {"constant": "0.5", "ramp (tau = 100)": "C0", "warm-up": "C1", "power function": "C2"}
ns = [round(10 ** (k / 20)) for k in range(0, 101)]  # 1 to 100,000, evenly on a log scale
fig, ax = plt.subplots(figsize=(6.5, 3.8))
labels = {
    "constant": (2, 4, 4),
    "ramp (tau = 100)": (48, 8, -4),
    "warm-up": (30, -6, 6),
    "power function": (80, -6, 8),
}
for name, schedule in by_hand.items():
    window = [1 / (1 - schedule(n)) for n in ns]
    ax.plot(ns, window, color=colors[name])
    at, dx, dy = labels[name]  # where the name sits beside its curve
    ax.annotate(
        name, (ns[at], window[at]), xytext=(dx, dy), textcoords="offset points", ha="right" if dx < 0 else "left",
        color=colors[name],
    )  # fmt: skip
ax.set(xscale="log", yscale="log", xlabel="update n", ylabel="window 1 / (1 - d) (steps)")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The ramp stays near a copy of the model for its first `tau` updates or so, and reaches its full window
# after about `10 tau`. The warm-up widens its window as `n^(2/3)`. The power function's grows in
# proportion to `n`: it always covers the same fraction of the run so far, and is never capped.
#
# The window says how long; the shares say what. After `n` updates, step `k` keeps `(1 - d_k)` times
# every later decay:


# %%
def shares(schedule, n):
    """The share of the initial weights, then of each step 1..n, in the EMA after n updates."""
    out, kept = [], 1.0
    for k in range(n, 0, -1):  # newest first: step k keeps 1 - d_k, all that is older is multiplied by d_k
        out.append(kept * (1 - schedule(k)))
        kept *= schedule(k)
    return [kept, *reversed(out)]


fig, ax = plt.subplots(figsize=(6.5, 3.6))
for name, schedule in by_hand.items():
    w = shares(schedule, STEPS)
    ax.plot(range(1, STEPS + 1), w[1:], color=colors[name], label=name)
    print(f"{name:<17} the initial weights' share after {STEPS} updates: {w[0]:.3f}")
ax.set(yscale="log", ylim=(1e-5, 2e-2), xlabel=f"step k (of {STEPS})", ylabel="share of step k in the EMA")
ax.legend(loc="upper left")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The constant keeps 5 % on the initial weights. The ramp gives that 5 % to the steps it took while
# ramping (the bump near step 500), and the same shares as the constant after them. The warm-up's window
# is still short at 3000 steps; the power function spreads its shares over the later half of the run, most at the end.

# %% [markdown]
# ## 3. The schedules in ema_lab
#
# `ema_lab.schedules` packages these schedules (`constant` and `harmonic` too), each checked against its
# peer's own code ([docs/schedules.md](../docs/schedules.md)). `ModelEMA` takes one as its decay; a number still means the ramp:

# %%
from ema_lab import ModelEMA, schedules

pairs = {"warmup(0.999)": (schedules.warmup(0.999), lambda n: warmup(n, 0.999))}
pairs["power(gamma=6.94)"] = (schedules.power(gamma=6.94), power_ema)
for name, (packaged, ours) in pairs.items():
    diff = max(abs(packaged(n) - ours(n)) for n in range(1, 100_001))
    print(f"{name:<22} largest difference from ours over 100,000 updates: {diff:.1e}")
print("gamma of sigma_rel = 0.10:", round(schedules.sigma_rel_to_gamma(0.10), 2))
ramped = ModelEMA(make_model(), decay=0.999, tau=100)
print("a number is the ramp:", all(ramped.decay(n) == ramp(n, 0.999, 100) for n in range(1, 100_001)))

# %% [markdown]
# `ModelEMA` with the packaged warm-up, beside our class with our function, in one run:

# %%
_, _, both = train(
    lambda m: HandEMA(m, lambda n: warmup(n, 0.999)), lambda m: ModelEMA(m, decay=schedules.warmup(0.999))
)
gap = max(abs(a - b) for a, b in zip(both[0], both[1]))
print("same EMA test losses, to 1e-6:", gap < 1e-6)

# %% [markdown]
# ## 4. Post-hoc EMA: choose the length after training
#
# Which length is best? Karras et al. (2024) measure it with `sigma_rel`: the width (standard deviation)
# of a power-function EMA's shares, as a fraction of the run so far. `gamma = 6.94` is `sigma_rel = 0.10`.
# Their idea: keep two such EMAs, save both now and then (here every 100 steps), and afterwards build
# any other length from the snapshots.

# %% [markdown]
# After `t` updates, a power-function EMA gives step `x` a share proportional to `x^gamma`: its profile.
# The inner product of two such profiles has a closed form, so the snapshots' profiles can be fitted to
# any other one by least squares (Karras et al.'s Algorithm 3). By hand, times as fractions of the run:

# %%
import numpy as np


def sigma_rel_to_gamma(s):  # the largest root of Karras et al.'s cubic (their Algorithm 2)
    return max(np.roots([1, 7, 16 - s**-2, 12 - s**-2]).real)


def inner(t_a, g_a, t_b, g_b):  # the integral of p_a * p_b, p(x) = (g + 1) x^g / t^(g + 1) on [0, t]
    m = np.minimum(t_a, t_b)  # both are zero after the shorter one ends
    scale = (g_a + 1) * (g_b + 1) / t_a ** (g_a + 1) / t_b ** (g_b + 1)
    return scale * m ** (g_a + g_b + 1) / (g_a + g_b + 1)


snap_t = np.repeat(np.arange(100, STEPS + 1, 100) / STEPS, 2)  # every 100 steps, both EMAs
snap_g = np.tile([sigma_rel_to_gamma(0.05), sigma_rel_to_gamma(0.10)], STEPS // 100)
target_g = sigma_rel_to_gamma(0.03)  # a length no EMA tracked
gram = inner(snap_t[:, None], snap_g[:, None], snap_t[None], snap_g[None])
weights = np.linalg.lstsq(gram, inner(snap_t, snap_g, 1.0, target_g), rcond=None)[0]

# %% [markdown]
# The weighted sum of the 60 snapshots' profiles, against the profile wanted:

# %%
x = np.linspace(0.7, 1, 301)
profiles = (snap_g[:, None] + 1) * x ** snap_g[:, None] / snap_t[:, None] ** (snap_g[:, None] + 1)
profiles[x > snap_t[:, None]] = 0  # a snapshot knows nothing of the steps after it
fig, ax = plt.subplots(figsize=(6.5, 3.4))
wanted = (target_g + 1) * x**target_g / STEPS
ax.plot(STEPS * x, wanted, color="k", lw=4, alpha=0.3, label="sigma_rel = 0.03, wanted")
ax.plot(STEPS * x, weights @ profiles / STEPS, color="C2", label="sum of the snapshots' profiles")
for g, s, style in zip(snap_g[-2:], [0.05, 0.10], [":", "--"]):  # the two tracked EMAs at the end
    ax.plot(STEPS * x, (g + 1) * x**g / STEPS, "k", ls=style, lw=1, label=f"tracked, sigma_rel = {s}")
ax.legend(loc="upper left")
ax.set(xlabel="step", ylabel="share of each step")
ax.grid(alpha=0.3)
plt.show()
print(
    f"{len(weights)} snapshots, weights from {weights.min():.2f} to {weights.max():.2f}, sum {weights.sum():.4f}"
)

# %% [markdown]
# The sum draws the profile of an EMA that was never tracked, narrower than both that were: some weights
# are negative, taking older snapshots away. `ema_lab.PostHocEMA` packages all of it:
# two power-function EMAs updated in one step, snapshots written to a folder, and `synthesize(sigma_rel)`,
# which returns a `state_dict`. One run, with two more EMAs tracked directly, to check the synthesis:

# %% tags=["nbval-ignore-output"]
from ema_lab import PostHocEMA
from ema_lab.lessons import scratch_dir

folder = scratch_dir("ema_lab_07_")  # a temporary folder, removed when the kernel stops
tracked = [0.03, 0.15]
model, (posthoc, *direct), losses = train(
    lambda m: PostHocEMA(m, sigma_rels=(0.05, 0.10), snapshot_every=100, folder=folder),
    *[lambda m, s=s: ModelEMA(m, decay=schedules.power(sigma_rel=s)) for s in tracked],
)
evaluate = make_model()


def synthesized_loss(sigma_rel):
    evaluate.load_state_dict(posthoc.synthesize(sigma_rel))
    return test_loss(evaluate)


for s, ema in zip(tracked, direct):
    a, b = test_loss(ema.ema), synthesized_loss(s)
    print(f"sigma_rel {s}: tracked {a:.5f}, synthesized {b:.5f} ({100 * abs(b - a) / a:.2f} % apart)")

# %% [markdown]
# The synthesized EMAs score what the tracked ones score, to about a hundredth of a percent. Now any
# length, after training:

# %% tags=["nbval-ignore-output"]
sigma_rels = [0.01, 0.015, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.25]
if QUICK:
    sigma_rels = sigma_rels[::3]
synthesized = [synthesized_loss(s) for s in sigma_rels]
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(sigma_rels, synthesized, "o-", color="C2", label="synthesized from the snapshots")
tracked_losses = [test_loss(e.ema) for e in direct]
ax.plot(tracked, tracked_losses, "s", ms=12, mfc="none", color="k", label="tracked directly")
ax.legend(loc="upper left")
ax.set(xscale="log", xlabel="sigma_rel (length of the EMA)", ylabel="test loss after 3000 steps")
ax.grid(alpha=0.3)
plt.show()
best_loss, best = min(zip(synthesized, sigma_rels))
print(
    f"best sigma_rel of those tried: {best} (test loss {best_loss:.4f}; raw weights {losses['raw'][-1]:.4f})"
)

# %% [markdown]
# Too short an EMA keeps some of the raw weights' noise; too long a one reaches back to the worse
# weights of early training. The best length lies between, and the run did not need to know it in
# advance.

# %% [markdown]
# ## Summary
#
# - With noisy SGD steps, the EMA of the weights scores better on held-out data than the weights
#   themselves: here below the best the raw weights reached at any checkpoint.
# - An EMA's window is about `1 / (1 - d)` steps; with a constant decay it starts biased towards the
#   initial weights (`d^n` of them remain). Warm-ups start small: the ramp, the warm-up, the power function.
# - The power function's window is a fixed fraction of the run (`sigma_rel`). Two of them and snapshots
#   are enough to build any `sigma_rel` after training, and pick the best.
# - `ema_lab.schedules` and `ModelEMA(decay=schedule)` package the schedules; `ema_lab.PostHocEMA` the
#   post-hoc EMA.

# %% [markdown]
# ## Exercises
#
# Try each one before you open its solution.
#
# 1. Predict: which of the four schedules of section 2 (all capped at 0.999) gives the lowest test loss
#    after 3000 steps, and which the highest? Then train once with a `HandEMA` for each and compare.
#
# <details><summary>Solution 1</summary>
#
# The warm-up and the power function come first, close together: at step 3000 their windows are about
# 200 and 400 steps of late, good weights. The ramp and the constant average about 1000 steps, reaching
# back into worse weights, and the constant still holds 5 % of the untrained start: it comes last.
#
# ```python
# _, _, four = train(*[lambda m, s=s: HandEMA(m, s) for s in by_hand.values()])
# for key, name in enumerate(by_hand):
#     print(f"{name:<17} {four[key][-1]:.4f}")
# ```
# </details>
#
# 2. `ModelEMA`'s defaults (`decay=0.9999, tau=2000`) are made for long runs: its window reaches 10,000
#    steps after tens of thousands of updates. Predict: after our 3000 steps, is its EMA's test loss
#    nearer section 1's EMA or the raw weights'? Then run it.
#
# <details><summary>Solution 2</summary>
#
# At update 3000 its decay is `0.9999 * (1 - exp(-1.5)) = 0.78`: a window of under 5 steps. Even that
# removes most of the single steps' bounce: its loss lies nearer section 1's EMA, though above it.
#
# ```python
# _, _, default = train(lambda m: ModelEMA(m))
# print(f"raw {default['raw'][-1]:.4f}, default ModelEMA {default[0][-1]:.4f}")
# ```
# </details>
#
# 3. Predict: with snapshots every 500 steps instead of 100 (12 instead of 60), is `sigma_rel = 0.03`
#    still synthesized as well? Then measure it against an EMA of that length tracked directly.
#
# <details><summary>Solution 3</summary>
#
# As well: the profiles are smooth, and 12 of them fit the one wanted about as closely as 60 do.
#
# ```python
# folder = scratch_dir("ema_lab_07_")
# _, (sparse, tracked_03), _ = train(
#     lambda m: PostHocEMA(m, sigma_rels=(0.05, 0.10), snapshot_every=500, folder=folder),
#     lambda m: ModelEMA(m, decay=schedules.power(sigma_rel=0.03)),
# )
# evaluate.load_state_dict(sparse.synthesize(0.03))
# print(f"tracked {test_loss(tracked_03.ema):.5f}, synthesized from 12 snapshots {test_loss(evaluate):.5f}")
# ```
# </details>
#
# The three cells below run the solutions (folded in JupyterLab: click to expand).

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "nbval-ignore-output"]
# Solution 1
_, _, four = train(*[lambda m, s=s: HandEMA(m, s) for s in by_hand.values()])
for key, name in enumerate(by_hand):
    print(f"{name:<17} {four[key][-1]:.4f}")

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "nbval-ignore-output"]
# Solution 2
_, _, default = train(lambda m: ModelEMA(m))
print(f"raw {default['raw'][-1]:.4f}, default ModelEMA {default[0][-1]:.4f}")

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "nbval-ignore-output"]
# Solution 3
folder = scratch_dir("ema_lab_07_")
_, (sparse, tracked_03), _ = train(
    lambda m: PostHocEMA(m, sigma_rels=(0.05, 0.10), snapshot_every=500, folder=folder),
    lambda m: ModelEMA(m, decay=schedules.power(sigma_rel=0.03)),
)
evaluate.load_state_dict(sparse.synthesize(0.03))
print(f"tracked {test_loss(tracked_03.ema):.5f}, synthesized from 12 snapshots {test_loss(evaluate):.5f}")
