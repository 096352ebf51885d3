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
# # 07 · Choosing the decay: what the EMA buys
#
# - With noisy SGD steps, an EMA of the right length scores better on new data than the weights.
# - Its window is about `1 / (1 - d)` steps; a warm-up lets go of the initial weights.
# - [Post-hoc EMA](../docs/glossary.md#post-hoc-ema): keep snapshots, choose the length after training.

# %% [markdown]
# ![Course map](figures/course_map_07.svg)
#
# What is the EMA for, and how long should it be? A small network learns a curve from noisy samples,
# with plain SGD at a large step size:

# %%
# %matplotlib inline
import math
import os

import matplotlib.pyplot as plt
import torch
from torch import nn

torch.set_num_threads(1)  # one thread: results that do not depend on how many cores you have
QUICK = os.environ.get("EMA_LAB_QUICK", "0") not in ("", "0")  # EMA_LAB_QUICK=1: one seed, not five, below
STEPS, BATCH, LR = 3000, 16, 0.1


def curve(x):
    return torch.sin(3 * x) + 0.5 * torch.sin(6 * x)


gen = torch.Generator().manual_seed(0)
x_train = 4 * torch.rand(STEPS * BATCH, 1, generator=gen) - 2  # x in [-2, 2]
y_train = curve(x_train) + 0.5 * torch.randn(STEPS * BATCH, 1, generator=gen)  # noisy labels
x_val = 4 * torch.rand(2000, 1, generator=gen) - 2  # the validation split: noisy samples never trained on
y_val = curve(x_val) + 0.5 * torch.randn(2000, 1, generator=gen)
x_test = torch.linspace(-2, 2, 401).unsqueeze(1)
y_test = curve(x_test)  # noise-free: the test loss measures the model, not the noise

fig, ax = plt.subplots(figsize=(6.5, 3.2))
ax.plot(x_train[:400], y_train[:400], ".", color="0.6", label="400 training samples")
ax.plot(x_test, y_test, color="k", label="the curve (test targets)")
ax.legend(loc="lower left", ncols=2, bbox_to_anchor=(0, 1))
ax.set(xlabel="x", ylabel="y")
plt.show()
print(f"{STEPS} SGD steps of {BATCH} samples; {len(x_val)} validation samples; {len(x_test)} test points")

# %% [markdown]
# ## 1. What the EMA buys
#
# An [EMA](../docs/glossary.md#ema) moves each averaged tensor a fraction `1 - d` of the way to the
# model's after each SGD step (one `lerp_`); the decay `d` may change with the update number `n`. The
# loop updates any number of EMAs and scores the model and each `.ema` every 50 steps:

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


@torch.no_grad()
def test_loss(model):
    return nn.functional.mse_loss(model(x_test), y_test).item()


def train(*make_emas, steps=STEPS, lr=LR, seed=0, every=50, anneal=False):
    torch.manual_seed(seed)  # the initial weights
    model = make_model()
    emas = [make(model) for make in make_emas]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / steps if anneal else 1)
    losses = {"raw": [], **{i: [] for i, e in enumerate(emas) if hasattr(e, "ema")}}
    for i in range(steps):
        opt.zero_grad()
        batch = slice(BATCH * i, BATCH * (i + 1))
        nn.functional.mse_loss(model(x_train[batch]), y_train[batch]).backward()
        opt.step()
        lr_schedule.step()
        for ema in emas:
            ema.update(model)
        if (i + 1) % every == 0:
            for key in losses:
                losses[key].append(test_loss(model if key == "raw" else emas[key].ema))
    return model, emas, losses


# %% [markdown]
# One run, with ultralytics' decay `d(n) = decay * (1 - exp(-n / tau))` rising to 0.995 within about
# 1000 steps (`tau = 100`): a [window](../docs/glossary.md#window) of
# `1 / (1 - 0.995)` = 200 steps, a fifteenth of the run.


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
print(f"the EMA's window once ramped: 1 / (1 - 0.995) = {1 / (1 - 0.995):.0f} steps")

# %% [markdown]
# Each SGD step jolts the weights: the raw loss jumps from checkpoint to checkpoint. The EMA averages the
# bounces away, and ends below even the raw weights' best checkpoint (picked with hindsight, on the test
# set). Luck? Five other seeds (one in quick mode):

# %% tags=["nbval-ignore-output"]
seeds, wins = range(1, 2 if QUICK else 6), 0
for seed in seeds:
    _, _, seed_losses = train(lambda m: HandEMA(m, lambda n: ramp(n, 0.995, tau=100)), seed=seed)
    raw, avg = seed_losses["raw"], seed_losses[0]
    wins += avg[-1] < min(raw)
    print(f"seed {seed}: final raw {raw[-1]:.4f}, best raw {min(raw):.4f}, final EMA {avg[-1]:.4f}")
print(f"the EMA ends below the raw weights' best checkpoint in {wins} of {len(seeds)} seeds")

# %% [markdown]
# The EMA wins in every seed. The first run again, its learning rate lowered linearly to zero
# (`anneal=True`):

# %% tags=["nbval-ignore-output"]
_, _, annealed = train(lambda m: HandEMA(m, lambda n: ramp(n, 0.995, tau=100)), anneal=True)
print(f"learning rate annealed to zero: final raw {annealed['raw'][-1]:.4f}, final EMA {annealed[0][-1]:.4f}")
print(f"the first run, not annealed:    final raw {losses['raw'][-1]:.4f}, final EMA {losses[0][-1]:.4f}")

# %% [markdown]
# Annealed to zero, the last steps are tiny: the raw weights settle where their EMA ends. But smaller
# steps also made less progress, and both end above the first run's EMA: here, averaging buys more than
# annealing.
#
# ## 2. The window, and what an EMA remembers of the start
#
# Unrolled, the EMA gives the weights of `k` steps ago the share `(1 - d) d^k`: a window of about
# `1 / (1 - d)` steps. The share it gives no step stays on the initial weights:
#
# ![A constant decay keeps the initial weights; a warm-up lets them go](figures/07_start_bias.svg)

# %% [markdown]
# With `d = 0.999` the initial weights keep `0.999^n`: 99 % after 10 steps, 5 % after 3000. A warm-up
# starts with a small decay and raises it (timm and diffusers offer it, off by default).
# So does Karras et al.'s [power function](../docs/glossary.md#power-function), `d(n) = (1 - 1/n)^(gamma
# + 1)`, whose window never stops growing (section 4 picks its `gamma`). Ten steps, constant decay
# against warm-up, both capped at 0.999:


# %% tags=["nbval-ignore-output"]
def warmup(n, decay=0.9999, gamma=1.0, power=2 / 3):  # timm, diffusers: opt-in; ema-pytorch: its default
    # gamma: timm's scale on n, not the power function's exponent below
    return min(decay, 1 - (1 + (n - 1) / gamma) ** -power)


def power_ema(n, gamma=6.94):  # Karras et al.'s power function (section 4 says why gamma = 6.94)
    return (1 - 1 / n) ** (gamma + 1)


print(f"the constant d = 0.999 keeps {0.999**10:.0%} of the initial weights after 10 steps")
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
# training. The windows over a longer run:

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
# The ramp stays near a copy of the model for about `tau` updates and reaches its full window after about
# `10 tau`. The warm-up's window grows as `n^(2/3)`; the power function's in proportion to `n`, never capped.
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
    style = {"ls": "--", "lw": 2.5, "zorder": 3} if name == "constant" else {}  # on top of the ramp's curve
    ax.plot(range(1, STEPS + 1), w[1:], color=colors[name], label=name, **style)
    print(f"{name:<17} the initial weights' share after {STEPS} updates: {w[0]:.3f}")
print(f"the ramp's decay at step 1000: {ramp(1000, 0.999, tau=100):.5f} (the constant's: 0.999)")
ax.set(yscale="log", ylim=(1e-5, 2e-2), xlabel=f"step k (of {STEPS})", ylabel="share of step k in the EMA")
ax.legend(loc="upper left")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The constant keeps 5 % on the initial weights. The ramp gives it to the steps it took while ramping (the
# bump near step 500); from about step 1000 its decay equals the constant's, and so do the shares
# (dashed, on the ramp's). The power function spreads its shares over the later half of the run.
#
# ## 3. The schedules in ema_lab
#
# `ema_lab.schedules` packages these, and `constant` and `harmonic` (diffusers' default). Each matches
# the peer library's code ([docs/schedules.md](../docs/schedules.md)). `ModelEMA` takes one as its decay (a number
# means the ramp), here beside our class:

# %%
from ema_lab import ModelEMA, schedules

pairs = {"warmup(0.999)": (schedules.warmup(0.999), lambda n: warmup(n, 0.999))}
pairs["power(gamma=6.94)"] = (schedules.power(gamma=6.94), power_ema)
for name, (packaged, ours) in pairs.items():
    diff = max(abs(packaged(n) - ours(n)) for n in range(1, 100_001))
    print(f"{name:<22} largest difference from ours over 100,000 updates: {diff:.1e}")
ramped = ModelEMA(make_model(), decay=0.999, tau=100)
print("a number is the ramp:", all(ramped.decay(n) == ramp(n, 0.999, 100) for n in range(1, 100_001)))
_, _, both = train(
    lambda m: HandEMA(m, lambda n: warmup(n, 0.999)), lambda m: ModelEMA(m, decay=schedules.warmup(0.999))
)
print("ModelEMA(decay=schedules.warmup(0.999)) and ours, same test losses to 1e-6:",
      max(abs(a - b) for a, b in zip(both[0], both[1])) < 1e-6)  # fmt: skip

# %% [markdown]
# ## 4. Post-hoc EMA: choose the length after training
#
# Which length is best? Karras et al. ([EDM2](https://arxiv.org/abs/2312.02696), 2024) measure it with
# [`sigma_rel`](../docs/glossary.md#sigma_rel): the standard deviation of a power EMA's shares, as a
# fraction of the run so far (0.10: a tenth of the run). After `t` updates it gives step `x` a share
# proportional to `x^gamma` on `[0, t]`: its [profile](../docs/glossary.md#profile).
#
# Averaging is linear: a [snapshot](../docs/glossary.md#snapshot) (a saved EMA) sums the past weights with
# its profile's shares, so a weighted sum of snapshots is an EMA with the weighted sum of their profiles.
# A negative weight takes old steps away:

# %%
import numpy as np


def sigma_rel_to_gamma(s):  # Karras et al.'s Algorithm 2
    # The profile x^gamma on [0, 1] has variance (gamma + 1) / ((gamma + 2)^2 (gamma + 3)). Set equal to
    # s^2 and multiplied out, that is a cubic in gamma; its largest root is the gamma sought.
    return max(np.roots([1, 7, 16 - s**-2, 12 - s**-2]).real)


def profile(x, t, g):  # the share of step x in a power-function EMA (exponent g) after t updates
    return np.where(x <= t, (g + 1) * x**g / t ** (g + 1), 0.0)  # a snapshot knows no step after it


print(
    f"gamma of sigma_rel 0.10: ours {sigma_rel_to_gamma(0.10):.2f}, ema_lab's {schedules.sigma_rel_to_gamma(0.10):.2f}"
)
g = sigma_rel_to_gamma(0.05)
c = (2700 / STEPS) ** (g + 1)  # before step 2700, the later profile is c times the earlier one
x = np.linspace(2000, STEPS, 501)
fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot(x, profile(x, STEPS, g), "k--", lw=1, label=f"snapshot at step {STEPS}")
ax.plot(x, profile(x, 2700, g), "k:", lw=1, label="snapshot at step 2700")
combined = (profile(x, STEPS, g) - c * profile(x, 2700, g)) / (1 - c)
ax.plot(
    x, combined, color="C2", lw=2, label=f"{1 / (1 - c):.2f} x the first - {c / (1 - c):.2f} x the second"
)
ax.legend(loc="upper left")
ax.set(xlabel="step", ylabel="share of each step", title="sigma_rel = 0.05: two snapshots of one EMA")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# Only the steps after 2700 remain: a shorter EMA than either snapshot. Any wanted profile `p` can be
# approached so: find the weights `w` that bring `sum_i w_i p_i` closest to `p` (least squares).

# %% [markdown]
# The fit needs how much each pair of snapshot profiles overlaps, `G_ij`, the integral of `p_i p_j` (a
# table called the *Gram matrix*), and how much each overlaps the wanted one, `b_i`, the integral of
# `p_i p`. The best weights solve `G w = b`; for power profiles both integrals have a closed form
# (Karras et al.'s Algorithm 3).

# %% [markdown]
# Snapshots 100 steps apart have almost the same profile, so rows of `G` almost repeat. Its *condition
# number* bounds how many times larger the relative error in `w` can be than that in `b`.
# `np.linalg.lstsq` solves it all the same. Two EMAs saved every 100 steps, fitted to lengths neither
# tracked:


# %%
def inner(t_a, g_a, t_b, g_b):  # the integral of profile(x, t_a, g_a) * profile(x, t_b, g_b)
    m = np.minimum(t_a, t_b)  # both are zero after the shorter one ends
    scale = (g_a + 1) * (g_b + 1) / t_a ** (g_a + 1) / t_b ** (g_b + 1)
    return scale * m ** (g_a + g_b + 1) / (g_a + g_b + 1)


def snapshots(every):  # the time (a fraction of the run) and gamma of each snapshot, both EMAs
    t = np.repeat(np.arange(every, STEPS + 1, every) / STEPS, 2)
    return t, np.tile([sigma_rel_to_gamma(0.05), sigma_rel_to_gamma(0.10)], len(t) // 2)


def fit(sigma_rel, every=100):  # the snapshots' weights for that length, and the profile error
    t, g = snapshots(every)
    target = sigma_rel_to_gamma(sigma_rel)
    gram, b = inner(t[:, None], g[:, None], t, g), inner(t, g, 1.0, target)
    w = np.linalg.lstsq(gram, b, rcond=None)[0]  # G w = b
    pp = inner(1.0, target, 1.0, target)
    return w, np.sqrt(max(w @ gram @ w - 2 * w @ b + pp, 0) / pp)  # |sum_i w_i p_i - p| / |p|


weights, error = fit(0.03)
t, g = snapshots(100)
print(f"condition number of G: {np.linalg.cond(inner(t[:, None], g[:, None], t, g)):.0e}")
print(
    f"sigma_rel 0.03 from {len(weights)} snapshots: weights from {weights.min():.2f} to {weights.max():.2f}"
)
for s in [0.01, 0.02, 0.03, 0.07, 0.15, 0.2, 0.25, 0.28]:  # the error: |sum - wanted| / |wanted|
    print(f"sigma_rel {s:<4} (shares spread over ~{s * STEPS:.0f} steps)  profile error {fit(s)[1]:5.1%}")
print(
    "the longest power EMA with gamma >= 0 is gamma = 0 (the running mean):",
    f"sigma_rel 1 / sqrt(12) = {1 / math.sqrt(12):.3f}",
)

# %% [markdown]
# Large weights of both signs, as the condition number warns. The fit is close near the tracked lengths
# and fails at 0.01, whose shares spread over about 30 steps, fewer than the 100 between snapshots.
# No power EMA with `gamma >= 0` is longer than 0.289: at `gamma = 0` every step gets the same share,
# spread evenly over the run, and an even spread's standard deviation is `1 / sqrt(12)` of its width. For 0.03:

# %%
x = np.linspace(0.7, 1, 301)  # the last 30 % of the run, as a fraction of it
fig, ax = plt.subplots(figsize=(6.5, 3.4))
target_g = sigma_rel_to_gamma(0.03)
ax.plot(
    STEPS * x, profile(x, 1, target_g) / STEPS, color="k", lw=4, alpha=0.3, label="sigma_rel = 0.03, wanted"
)
summed = weights @ profile(x, t[:, None], g[:, None]) / STEPS
ax.plot(STEPS * x, summed, color="C2", label=f"sum of the {len(t)} snapshots' profiles")
for gamma, s, style in zip(g[-2:], [0.05, 0.10], [":", "--"]):  # the two tracked EMAs at the end
    ax.plot(STEPS * x, profile(x, 1, gamma) / STEPS, "k", ls=style, lw=1, label=f"tracked, sigma_rel = {s}")
ax.legend(loc="upper left")
ax.set(xlabel="step", ylabel="share of each step")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The sum draws an EMA narrower than both tracked ones. `ema_lab.PostHocEMA` packages it all: two power
# EMAs updated in one step, snapshots in a folder, `synthesize(sigma_rel)` returning a `state_dict`. One run,
# with two power EMAs tracked directly as a check:

# %% tags=["nbval-ignore-output"]
from ema_lab import PostHocEMA
from ema_lab.lessons import scratch_dir
from ema_lab.snapshots import list_snapshots

folder = scratch_dir("ema_lab_07_")  # a temporary folder, removed when the kernel stops
tracked = [0.03, 0.15]
model, (posthoc, *direct), _ = train(
    lambda m: PostHocEMA(m, sigma_rels=(0.05, 0.10), snapshot_every=100, folder=folder),
    *[lambda m, s=s: ModelEMA(m, decay=schedules.power(sigma_rel=s)) for s in tracked],
)
evaluate = make_model()


def synthesized(sigma_rel):  # the model, holding the EMA of that length built from the snapshots
    evaluate.load_state_dict(posthoc.synthesize(sigma_rel))
    return evaluate


for s, ema in zip(tracked, direct):
    a, b = test_loss(ema.ema), test_loss(synthesized(s))
    print(f"sigma_rel {s}: tracked {a:.5f}, synthesized {b:.5f} ({100 * abs(b - a) / a:.2f} % apart)")
files = [snapshot.path for snapshot in list_snapshots(folder)]  # one file per profile and saved step
print(f"{len(files)} snapshots of {sum(p.numel() for p in model.parameters()):,} float32 weights each:",
      f"{sum(f.stat().st_size for f in files) / 1e6:.1f} MB on disk")  # fmt: skip
print(
    f"a 100M-parameter model, two EMAs saved every 1000 of 100,000 steps: {100 * 2 * 100e6 * 4 / 1e9:.0f} GB"
)

# %% [markdown]
# Synthesized and tracked agree. The price is disk: two EMAs per save, so a large model saved often fills
# tens of gigabytes.
#
# Now any length the snapshots can build (profile error under 5 %), chosen on the validation split:


# %% tags=["nbval-ignore-output"]
@torch.no_grad()
def val_errors(model):  # each validation sample's squared error; noisy labels add about 0.25 to every one
    return (model(x_val) - y_val).square().flatten()


def val_loss(model):
    return val_errors(model).mean().item()


candidates = [0.01, 0.015, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.25]
sigma_rels = [s for s in candidates if fit(s)[1] < 0.05]
print("left out, the fit fails:", [s for s in candidates if s not in sigma_rels])
errors = {s: val_errors(synthesized(s)) for s in sigma_rels}
validation = [errors[s].mean().item() for s in sigma_rels]
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(sigma_rels, validation, "o-", color="C2")
ax.set(xscale="log", xlabel="sigma_rel (length of the EMA)", ylabel="validation loss (noisy labels)")
ax.set_xticks([0.02, 0.05, 0.1, 0.2], ["0.02", "0.05", "0.1", "0.2"], minor=False)
ax.minorticks_off()
ax.grid(alpha=0.3)
plt.show()
chosen = sigma_rels[validation.index(min(validation))]
print(f"chosen on validation: sigma_rel {chosen}, loss {min(validation):.5f}")
ties = []
for s in (s for s in sigma_rels if s != chosen):  # the same 2000 samples score both: a paired difference
    diff = errors[s] - errors[chosen]
    two_se = 2 * diff.std().item() / len(diff) ** 0.5  # two standard errors of the mean difference
    ties += [s] if abs(diff.mean().item()) < two_se else []
    print(f"  sigma_rel {s:<5} {diff.mean().item():+.5f} above it, noise (2 standard errors) {two_se:.5f}")
print("within the noise of the chosen length:", ", ".join(map(str, ties)))

# %% [markdown]
# A flat bottom: a difference smaller than its noise (two standard errors, over the 2000 samples) is
# none, so these samples cannot rank the lengths the last line lists; any of them will do. Against the
# raw weights on the test set:

# %% tags=["nbval-ignore-output"]
best_raw = min(losses["raw"])  # section 1's run: the same seed, the same raw weights
print(f"chosen, sigma_rel {chosen}: test loss {test_loss(synthesized(chosen)):.4f}")
print(
    f"section 1's EMA (decay ramped to 0.995): {losses[0][-1]:.4f}, or sigma_rel {1 / (1 - 0.995) / STEPS:.3f}"
)
print(f"raw weights: final {losses['raw'][-1]:.4f}, best checkpoint {best_raw:.4f} (picked on the test set)")
beat = [s for s in sigma_rels if test_loss(synthesized(s)) < best_raw]
print("lengths that beat that checkpoint on the test set:", ", ".join(map(str, beat)))

# %% [markdown]
# The chosen length beats even the raw weights' best checkpoint, and so do the lengths listed; the
# longest do not. A rule of thumb turns the choice into a constant decay: its shares' standard deviation
# is also about `1 / (1 - d)` steps, its window, so `d = 1 - 1 / (sigma_rel T)` after `T` steps. Three
# such decays, trained in one more run, against the curve:

# %% tags=["nbval-ignore-output"]
constants = [0.02, 0.05, 0.15]
_, constant_emas, _ = train(*[lambda m, s=s: HandEMA(m, lambda n: 1 - 1 / (s * STEPS)) for s in constants])
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(sigma_rels, validation, "o-", color="C2", label="synthesized from the snapshots")
ax.plot(constants, [val_loss(e.ema) for e in constant_emas], "s", ms=12, mfc="none", color="k",
        label=f"constant decay 1 - 1 / (sigma_rel x {STEPS})")  # fmt: skip
ax.legend(loc="upper left")
ax.set(xscale="log", xlabel="sigma_rel (length of the EMA)", ylabel="validation loss (noisy labels)")
ax.set_xticks([0.02, 0.05, 0.1, 0.2], ["0.02", "0.05", "0.1", "0.2"], minor=False)
ax.minorticks_off()
ax.grid(alpha=0.3)
plt.show()
for s, e in zip(constants, constant_emas):
    print(
        f"sigma_rel {s}: constant decay {val_loss(e.ema):.5f}, synthesized {validation[sigma_rels.index(s)]:.5f}"
    )

# %% [markdown]
# The constant decays land on the curve (the longest a little below it): the rule of thumb holds.
#
# ## Summary
#
# - With noisy SGD steps, an EMA of suitable length beats the weights, even their best checkpoint;
#   annealing the learning rate did not close that gap.
# - An EMA's window is about `1 / (1 - d)` steps; a warm-up keeps it off the initial weights.
# - Averaging is linear: weighted snapshots of two power EMAs build other lengths after training. Choose on
#   validation data; `d = 1 - 1 / (sigma_rel T)` turns the choice into a constant decay.
# - `ema_lab.schedules`, `ModelEMA(decay=schedule)` and `ema_lab.PostHocEMA` package it.

# %% [markdown]
# ## Exercises
#
# Try each exercise in the empty cell below it before you open its solution; to run a solution, paste it into that cell.
#
# **Exercise 1.** Train once with a `HandEMA` for each schedule in `by_hand` and print each final test loss.
# *Predict* which scores best and which worst.

# %%
# Exercise 1: your code here

# %% [markdown]
# <details><summary>Solution 1</summary>
#
# ```python
# _, _, four = train(*[lambda m, s=s: HandEMA(m, s) for s in by_hand.values()])
# for key, name in enumerate(by_hand):
#     print(f"{name:<17} {four[key][-1]:.4f}")
# ```
#
# The warm-up and the power function score best (the shortest windows late in the run); the ramp and
# the constant average about 1000 steps, reaching back into worse weights, and the constant, still 5 %
# the untrained start, is worst.
#
# </details>

# %% [markdown]
# **Exercise 2.** Train with `ModelEMA(m)`, whose defaults (`decay=0.9999, tau=2000`) suit long runs;
# print the raw weights' final and best test loss and the EMA's. *Predict*: is its final loss nearer section 1's EMA's
# or the raw weights'? Better than their best?

# %%
# Exercise 2: your code here

# %% [markdown]
# <details><summary>Solution 2</summary>
#
# ```python
# _, _, default = train(lambda m: ModelEMA(m))
# raw = default["raw"]
# print(f"raw: final {raw[-1]:.4f}, best {min(raw):.4f}; default ModelEMA: {default[0][-1]:.4f}")
# ```
#
# At update 3000 its decay is `0.9999 * (1 - exp(-1.5)) = 0.78`, a window under 5 steps. That removes much
# of the bounce: nearer section 1's EMA. But it loses to the raw weights' best: too short.
#
# </details>

# %% [markdown]
# **Exercise 3.** With snapshots every 500 steps (12, not 60), print `fit(0.03, every=500)`'s profile error
# beside `fit(0.03)`'s; then train `PostHocEMA(..., snapshot_every=500)` beside `ModelEMA` with
# `power(sigma_rel=0.03)` and compare test losses. *Predict*: as close a fit? The same loss?

# %%
# Exercise 3: your code here

# %% [markdown]
# <details><summary>Solution 3</summary>
#
# ```python
# print(f"profile error: 60 snapshots {fit(0.03)[1]:.1%}, 12 snapshots {fit(0.03, every=500)[1]:.1%}")
# folder = scratch_dir("ema_lab_07_")
# _, (sparse, tracked_03), _ = train(
#     lambda m: PostHocEMA(m, sigma_rels=(0.05, 0.10), snapshot_every=500, folder=folder),
#     lambda m: ModelEMA(m, decay=schedules.power(sigma_rel=0.03)),
# )
# evaluate.load_state_dict(sparse.synthesize(0.03))
# print(f"test loss: tracked {test_loss(tracked_03.ema):.5f}, from 12 snapshots {test_loss(evaluate):.5f}")
# ```
#
# A fit ten times worse, yet losses within about a tenth of a percent: a profile somewhat off is an EMA
# of a somewhat different length, and near the best length the loss hardly changes.
#
# </details>
