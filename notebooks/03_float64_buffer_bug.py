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
# # 03 · The float64 buffer bug
#
# - Profiling a model with `thop` 0.1.1 leaves float64 tensors in it, and a shared activation spreads them.
# - A validator casts the EMA copy; then `torch._foreach_lerp_` fails halfway, after updating some.
# - Fix the cause (profile a deep copy) and the update (check every pair before touching any).

# %% [markdown]
# ![Course map](figures/course_map_03.svg)
#
# Notebook 02 built the EMA step; here a profiler breaks it, and you fix both the cause and the update.

# %% tags=["nbval-ignore-output"]
import math
import platform
import warnings
from copy import deepcopy
from importlib.metadata import version

import matplotlib.pyplot as plt
import torch
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # thop 0.1.1 imports a deprecated module
    import thop

torch.set_num_threads(1)  # one thread: the values printed below are the same on every run
print(f"torch {torch.__version__}, thop {version('thop')}, Python {platform.python_version()}")

# %% [markdown]
# PR #25315 also changed `_profile_one_layer`, where ultralytics profiles a layer with `thop`, a library
# that counts a model's operations. A puzzle: profiling should only *read* a model.

# %%
net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.SiLU())
print("state_dict entries before:", list(net.state_dict()))
thop.profile(net, inputs=(torch.randn(1, 3, 32, 32),), verbose=False)
print("after:", list(net.state_dict()))

# %% [markdown]
# Two new entries appeared in the [`state_dict()`](../docs/glossary.md#state_dict) (the dict of
# parameters and buffers that a checkpoint saves and the EMA update walks). Their path, in one picture:
#
# ![thop's buffers travel from an in-place profile to the EMA update; a deep copy stops them](figures/03_thop_path.svg)

# %% [markdown]
# ## 1. What `thop.profile` leaves behind
#
# `thop` counts multiply-accumulates (MACs: a multiply plus an add) with forward hooks (functions
# PyTorch calls after a module's forward). It stores the counts in two float64 **buffers** (tensors a
# module owns but does not train), `total_ops` and `total_params`, on *every* module, and afterwards
# removes them only from module types it has a counting rule for.
#
# Here is ultralytics' `Conv` block, written out. `default_act` is a **class attribute**: every `Conv`
# ever built holds the *same* `nn.SiLU` object.


# %%
class Conv(nn.Module):
    """Conv2d + BatchNorm2d + SiLU, as in ultralytics: the activation is shared at class level."""

    default_act = nn.SiLU()  # one object for every Conv

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = self.default_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


torch.manual_seed(0)
block = Conv(3, 16, 3)
macs, params = thop.profile(block, inputs=(torch.randn(1, 3, 32, 32),), verbose=False)
print(f"thop.profile -> {macs:,.0f} MACs, {params:,.0f} parameters")
for k, v in block.state_dict().items():
    print(f"  {k:<22} {v.dtype}")

# %% [markdown]
# Four new float64 entries. Which modules kept them, here and in the first cell's `net`?


# %%
def leaked_keys(model):  # thop's entries in a state_dict
    return [k for k in model.state_dict() if k.endswith(("total_ops", "total_params"))]


# thop's private rule table (module type -> counting rule), read from the module that defines profile
rules = set(thop.profile.__globals__["register_hooks"])
for label, root in (("block", block), ("net", net)):
    for name, m in root.named_modules():
        kept = "total_ops" in m._buffers
        path = f"{label}.{name}" if name else label
        print(f"{path:<10} {type(m).__name__:<12} rule: {type(m) in rules!s:<5}  kept: {kept}")
print("leaked keys:", leaked_keys(block))

# %% [markdown]
# Modules with a rule were cleaned: `Conv2d`, `BatchNorm2d` and `nn.Sequential`. The block and `SiLU`
# have no rule in thop 0.1.1 and kept theirs. The count follows thop's rules: 16 × 32 × 32 outputs ×
# 3 × 3 × 3 MACs each (a 3 × 3 kernel over 3 channels) for the convolution, plus the 4 per output
# element thop charges BatchNorm, make 507,904 (SiLU adds nothing).
#
# thop has no `try/finally` either. When the profiled forward raises (a 1-channel input into a
# 3-channel convolution), the buffers stay on every module, the hooks stay registered, and the block
# is left in eval mode:

# %%
broken = Conv(3, 16, 3).train()
try:
    thop.profile(broken, inputs=(torch.randn(1, 1, 32, 32),), verbose=False)
except RuntimeError as e:
    print("RuntimeError:", str(e).splitlines()[0][:60], "...")
print("leaked keys:", len(leaked_keys(broken)))
print("forward hooks left:", sum(len(m._forward_hooks) for m in broken.modules()))
print("still in training mode:", broken.training)

# %% [markdown]
# Eight keys, two on each module; four hooks, two (its rule and a parameter counter) on each module
# with a rule, `conv` and `bn`.
#
# ## 2. A shared activation carries the leak into models built later
#
# `Conv.default_act` now carries thop's buffers, and every `Conv` holds it. So a model built *after*
# the profile, never profiled itself, has them too:

# %%
later = nn.Sequential(Conv(3, 8, 3), Conv(8, 16, 3, 2), Conv(16, 16, 3))
print("one shared SiLU:", later[0].act is later[2].act is Conv.default_act)
print(len(later.state_dict()), "entries, of which thop's:", leaked_keys(later))

# %% [markdown]
# The same on a YOLO-sized network from ema_lab's model zoo (`models.build("yolo")`), which has its own `Conv`
# with a shared `SiLU`. Profile one zoo `Conv` in place, build two more networks, profile one of them:

# %%
from collections import Counter

from ema_lab.bench import models

clean = models.build("yolo")  # built before the leak
sizes = {"built before, clean": (len(clean.state_dict()), len(leaked_keys(clean)))}
thop.profile(models.Conv(3, 16, 3), inputs=(torch.randn(1, 3, 32, 32),), verbose=False)  # the leak
fresh = models.build("yolo")  # built after it; never profiled itself
profiled = models.build("yolo")
thop.profile(profiled, inputs=(torch.randn(1, 3, 64, 64),), verbose=False)
for label, m in (("built before, now", clean), ("built after", fresh), ("profiled in place", profiled)):
    sizes[label] = (len(m.state_dict()), len(leaked_keys(m)))
for label, (entries, stray) in sizes.items():
    print(f"yolo {label:<19}: {entries} entries, {stray} of them thop's")
print("Conv modules in yolo:", sum(type(m).__name__ == "Conv" for m in fresh.modules()))
owners = Counter(type(profiled.get_submodule(k.rpartition(".")[0])).__name__ for k in leaked_keys(profiled))
print("profiled in place, thop's keys by module type:", dict(owners.most_common()))
del models.Conv.default_act.total_ops, models.Conv.default_act.total_params  # clean the shared SiLU

# %%
labels = [label.replace(", ", ",\n") for label in sizes]
own = [sizes["built before, clean"][0]] * len(sizes)
stray = [n for _, n in sizes.values()]
fig, ax = plt.subplots(figsize=(7, 3.2))
ax.bar(labels, own, color="tab:blue")
ax.bar(labels, stray, bottom=own, color="tab:red")
for i, n in enumerate(stray):
    ax.text(i, own[i] + n + 15, f"+{n} thop", ha="center", color="tab:red")
ax.text(0, own[0] / 2, "the model's\nown entries", ha="center", color="white")
ax.set(ylabel="state_dict entries", title="yolo: thop's float64 entries, profiled or not")
ax.set_ylim(0, (own[0] + max(stray)) * 1.15)
plt.show()

# %% [markdown]
# Nobody profiled the middle two models, yet each carries 228 stray entries: two for each of its 114
# `Conv` modules, whose `act` is the shared `SiLU`; even the one built *before* the profile. Profiled in
# place, yolo adds two on each module without a rule: each `Conv` and other custom block, each
# `nn.ModuleList`.
#
# ## 3. A cast EMA copy makes `_foreach_lerp_` fail halfway
#
# The EMA starts as `deepcopy(model)`, float64 buffers and all. ultralytics' [validator](../docs/glossary.md#validator)
# (`BaseValidator`, the code that scores the model during training) [casts](../docs/glossary.md#cast) it
# at the start of every validation: `.half()` on a GPU with mixed precision, `.float()` otherwise, and
# `.float()` again when it returns. thop's buffers in the EMA become float32 (or float16); the training
# model keeps them in float64. So the first update after the first validation meets pairs that disagree.
# The CPU's cast, then one training step:


# %%
def train_step(model, seed=0):  # one SGD step on random images: weights and BatchNorm statistics move
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    model.train().zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


torch.manual_seed(0)
model = nn.Sequential(
    Conv(3, 8, 3), Conv(8, 16, 3, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)
)
ema = deepcopy(model).eval().float()  # what a validation does to the EMA on a CPU
train_step(model)

esd, msd = ema.state_dict(), model.state_dict()
floats = [k for k, v in esd.items() if v.dtype.is_floating_point]  # the pairs the PR's code averages
bad = [k for k in floats if esd[k].dtype != msd[k].dtype]
print(f"{len(bad)} of {len(floats)} float pairs disagree in dtype:")
for k in bad:
    print(f"  {k:<18} EMA {esd[k].dtype}  model {msd[k].dtype}")

# %% [markdown]
# Only thop's keys disagree. The PR's after-code calls `torch._foreach_lerp_(ema_tensors,
# model_tensors, 1 - d)` once, with `d` the [decay](../docs/glossary.md#decay-and-weight) (the share of
# the old EMA each step keeps); `lerp_` needs both tensors of a pair in one dtype. `d = 0.9` makes one
# step show in four decimals:

# %%
d = 0.9
before = {k: esd[k].clone() for k in floats}
try:
    with torch.no_grad():
        torch._foreach_lerp_([esd[k] for k in floats], [msd[k] for k in floats], 1 - d)
except RuntimeError as e:
    print("RuntimeError:", e)
updated = [k for k in floats if not torch.equal(esd[k], before[k])]
print(f"first bad pair: #{floats.index(bad[0])} {bad[0]!r}")
print("already updated:", updated)

# %% [markdown]
# `end` is the model's float64 ("double") tensor. On a CPU the call works through the pairs in order,
# so the five tensors before the bad pair were already moved: a failed `_foreach_lerp_` is **not
# atomic**.
#
# A tempting repair, not the PR's: catch the error, run the old per-tensor loop. It
# promotes to float64 and casts back, so it succeeds, and moves those five tensors again:

# %%
with torch.no_grad():  # a hypothetical `except RuntimeError:` branch: the PR's before-code loop
    for k in floats:
        v = esd[k]
        v *= d
        v += (1 - d) * msd[k].detach()


def applied_weight(k: str) -> float | None:
    """w in ``after = before + w * (model - before)``, at the element with the largest gap."""
    gap = (msd[k].double() - before[k].double()).flatten()
    if gap.abs().max() == 0:
        return None  # nothing to measure (thop's buffers hold the same value on both sides)
    i = int(gap.abs().argmax())
    return ((esd[k].double().flatten()[i] - before[k].double().flatten()[i]) / gap[i]).item()


weights = {k: applied_weight(k) for k in floats}
for k in (updated[0], floats[-1]):
    print(f"{k:<14} weight given to the model: {weights[k]:.4f}")
print(f"one step: 1 - d = {1 - d:.4f}; two steps: 1 - d² = {1 - d * d:.4f}")

# %%
shown = [k for k, w in weights.items() if w is not None]
fig, ax = plt.subplots(figsize=(7, 3.4))
ax.bar(
    range(len(shown)),
    [weights[k] for k in shown],
    color=["tab:red" if k in updated else "tab:blue" for k in shown],
)
ax.axhline(1 - d, ls="--", c="k", lw=1)
ax.axhline(1 - d * d, ls=":", c="tab:red", lw=1)
ax.text(len(shown) - 0.5, 1 - d + 0.005, "one step", ha="right")
ax.text(len(shown) - 0.5, 1 - d * d + 0.005, "two steps", ha="right", color="tab:red")
ax.set(
    ylabel="weight given to the model",
    ylim=(0, 0.24),
    title="failed _foreach_lerp_, then a fallback loop (d = 0.9)",
)
ax.set_xticks(range(len(shown)), shown, rotation=90, fontsize=8)
plt.show()

# %% [markdown]
# Red: moved twice, by 1 − d² = 0.19 (to float32 rounding) instead of 0.1. The mismatch stays, so
# this would happen at *every* step, silently halving those tensors' averaging window (about 1 / (1 − d) steps).
#
# ## 4. Two fixes: check every pair first, profile a deep copy
#
# The update's fix: look at all pairs first, and refuse before anything moves. A few lines:


# %%
def checked_foreach_lerp(ema_t, model_t, d, names):
    bad = [n for n, e, m in zip(names, ema_t, model_t) if e.dtype != m.dtype or e.shape != m.shape]
    if bad:
        raise ValueError(f"{len(bad)} pairs disagree, first {bad[0]!r}: nothing was updated")
    torch._foreach_lerp_(ema_t, model_t, 1 - d)


ema = deepcopy(model).eval().float()  # a fresh cast EMA, as in section 3
esd = ema.state_dict()
start = {k: v.clone() for k, v in esd.items()}
try:
    checked_foreach_lerp([esd[k] for k in floats], [msd[k] for k in floats], d, floats)
except ValueError as e:
    print("ValueError:", e)
print("EMA unchanged:", all(torch.equal(esd[k], start[k]) for k in esd))

# %% [markdown]
# `ema_lab.foreach_update` is this check, packaged with the call (it also compares devices, and names
# the dtypes):

# %%
from ema_lab import foreach_update

try:
    foreach_update([esd[k] for k in floats], [msd[k] for k in floats], d, floats)
except ValueError as e:
    print("ValueError:", e)
print("EMA unchanged:", all(torch.equal(esd[k], start[k]) for k in esd))

# %% [markdown]
# `ema_lab.ModelEMA`'s default strategy accepts mixed pairs: it groups tensors by dtype and casts the
# model's float64 values first (notebook 05 builds such groups). Check it against the PR's before-code
# loop over ten training steps, both with notebook 02's ramp (decay 0.9, tau 3: each step moves the EMA
# at least a tenth of the way):

# %% tags=["nbval-ignore-output"]
from ema_lab import ModelEMA

auto = ModelEMA(model, decay=0.9, tau=3)
auto.ema.float()  # the validator's cast
ref = deepcopy(auto.ema)  # the reference, updated by the loop
start = deepcopy(ref.state_dict())
for n in range(1, 11):
    train_step(model, seed=n)
    auto.update(model)
    d_n = 0.9 * (1 - math.exp(-n / 3))
    with torch.no_grad():
        for k, v in ref.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d_n
                v += (1 - d_n) * model.state_dict()[k]
got, want, msd = auto.ema.state_dict(), ref.state_dict(), model.state_dict()


def gap(a: dict, b: dict) -> float:
    """The largest absolute difference over the float entries."""
    return max((a[k].double() - b[k].double()).abs().max().item() for k in floats)


print(f"ModelEMA vs the loop:   {gap(got, want):.1e}")
print(f"ModelEMA vs the model:  {gap(got, msd):.1e}")
print(f"ModelEMA vs its start:  {gap(got, start):.1e}")
torch.testing.assert_close({k: got[k] for k in floats}, {k: want[k] for k in floats}, rtol=1e-5, atol=1e-6)

# %% [markdown]
# The EMA agrees with the loop to float32 rounding, yet is far from the model and from its start: an
# EMA that skipped steps, or copied the model, would show a near-zero gap.

# %% [markdown]
# **The fix in the PR (`_profile_one_layer`): profile a deep copy.** `deepcopy(block)` gets its own
# `SiLU` (deepcopy copies the module the instance points to), so thop can touch neither the block nor the shared activation.
# Clean section 1's leak first:

# %%
del Conv.default_act.total_ops, Conv.default_act.total_params
block = Conv(3, 16, 3)
x = torch.randn(1, 3, 32, 32)
macs, params = thop.profile(deepcopy(block), inputs=(x,), verbose=False)  # the PR's fix
print(f"thop on a deep copy -> {macs:,.0f} MACs; leaked on the block: {leaked_keys(block)}")
print("Conv.default_act's state_dict:", dict(Conv.default_act.state_dict()))

# %% [markdown]
# `ema_lab.lessons.profiling.profile_flops` is this fix, packaged. It deep-copies the inputs too (a
# forward that writes into its input must not change yours) and returns (GFLOPs, parameters) as
# ultralytics reports them: GFLOPs = 2 × MACs / 10⁹. With no float64 buffer left, the PR's one call
# runs on a cast EMA:

# %%
from ema_lab.lessons.profiling import profile_flops

print("profile_flops(block, x) ->", profile_flops(block, x))
torch.manual_seed(0)
model = nn.Sequential(Conv(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
ema = deepcopy(model).eval().float()
train_step(model)
esd, msd = ema.state_dict(), model.state_dict()
floats = [k for k, v in esd.items() if v.dtype.is_floating_point]
with torch.no_grad():
    torch._foreach_lerp_([esd[k] for k in floats], [msd[k] for k in floats], 1 - d)
print(f"_foreach_lerp_ over {len(floats)} pairs: no error; thop's keys: {leaked_keys(model)}")

# %% [markdown]
# <details><summary>Upstream, thop was fixed too</summary>
#
# The `ultralytics-thop` fork removes the buffers from every module from 2.0.21, adds `try/finally` in
# 2.0.22 and keeps plain numbers from 2.1 (its release notes; it installs the same `thop` import, so
# never install both). Or count without thop: torch's `FlopCounterMode` stores nothing on the model
# ([compared](../docs/flop_counters.md)).
# </details>
#
# <details><summary>Why a leaked model cannot move to an Apple GPU</summary>
#
# torch's MPS backend refuses float64 with a `TypeError`, and `model.to("mps")` converts one tensor at a
# time (`nn.Module._apply`): it stops halfway, the tensors before the first float64 one moved.
# </details>

# %% [markdown]
# ## Summary
#
# - `thop.profile` 0.1.1 leaves float64 buffers on modules it has no rule for; on a failing forward,
#   everything (buffers, hooks, eval mode).
# - A class-level activation spreads them to every model built afterwards.
# - A cast EMA makes `_foreach_lerp_` raise after moving the pairs before the bad one; a loop fallback
#   would then move those twice.
# - Fixes: profile a deep copy (`profile_flops`), check every pair first (`foreach_update`), or group
#   pairs by dtype (`ModelEMA`'s default).

# %% [markdown]
# ## Exercises
#
# Try each exercise in the empty cell below it before you open its solution; to run a solution,
# paste it into that cell.
#
# **Exercise 1.** Profile `resnet = models.build("resnet50")` in place: `thop.profile(resnet,
# (torch.randn(1, 3, 64, 64),), verbose=False)`. *Predict*: does it keep more or fewer of thop's keys
# than the YOLO-sized net of section 2, and why? Check with `leaked_keys(resnet)` and, for each module
# `m`, `"total_ops" in m._buffers`.

# %%
# Exercise 1: your code here

# %% [markdown]
# <details><summary>Solution 1</summary>
#
# ```python
# resnet = models.build("resnet50")
# thop.profile(resnet, (torch.randn(1, 3, 64, 64),), verbose=False)
# kept = sorted({type(m).__name__ for m in resnet.modules() if "total_ops" in m._buffers})
# print(f"resnet50: {len(leaked_keys(resnet))} of thop's keys, kept by {kept}")
# print(f"yolo profiled in place (section 2): {sizes['profiled in place'][1]}")
# ```
#
# Far fewer than yolo's 572, kept by `Flatten` and the custom `ResNetBottleneck` only; ResNet-50's
# `Conv2d`, `BatchNorm2d` and `ReLU` have thop rules, and it has no shared `SiLU`.
#
# </details>

# %% [markdown]
# **Exercise 2.** With ultralytics' `d = 0.9999`, *predict* the weight the fallback of section 3 gives
# the model per step on a mismatched tensor, and the averaging window that follows. Then compute both.

# %%
# Exercise 2: your code here

# %% [markdown]
# <details><summary>Solution 2</summary>
#
# ```python
# d = 0.9999
# print(f"weight per step: {1 - d:.6f} -> {1 - d * d:.6f}")
# print(f"averaging window: {1 / (1 - d):,.0f} steps -> {1 / (1 - d * d):,.0f} steps")
# ```
#
# Twice the weight, half the window: moved twice, the tensor keeps `d²` of the old EMA.
#
# </details>

# %% [markdown]
# **Exercise 3.** Take `nn.Sequential(nn.Conv2d(3, 4, 3), Boom())` in training mode, where `Boom` is a
# module whose forward raises `ValueError`. *Predict* what `thop.profile` and `profile_flops` each leave
# on it (thop's keys, forward hooks, training mode), then check each on a fresh one, as in section 1.

# %%
# Exercise 3: your code here

# %% [markdown]
# <details><summary>Solution 3</summary>
#
# ```python
# from contextlib import suppress
#
#
# class Boom(nn.Module):
#     def forward(self, x: torch.Tensor) -> torch.Tensor:
#         raise ValueError("boom")
#
#
# for name, profiler in (
#     ("thop.profile", lambda m, x: thop.profile(m, (x,), verbose=False)),
#     ("profile_flops", profile_flops),
# ):
#     victim = nn.Sequential(nn.Conv2d(3, 4, 3), Boom()).train()
#     with suppress(ValueError):  # Boom raises: look at what is left behind
#         profiler(victim, torch.randn(1, 3, 8, 8))
#     hooks = sum(len(m._forward_hooks) for m in victim.modules())
#     print(f"{name}: keys {len(leaked_keys(victim))}, hooks {hooks}, training {victim.training}")
# ```
#
# `thop.profile` leaves 6 keys (two on each of the three modules), 4 hooks (two on each module with a
# rule: `Sequential` and `Conv2d`) and eval mode; `profile_flops` works on a copy and leaves 0 keys,
# 0 hooks and training mode.
#
# </details>
