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
# # 03 · The float64 buffer bug
#
# - Profiling a model with `thop` 0.1.1 leaves float64 tensors in it, and a shared activation spreads them.
# - A cast EMA copy then makes `torch._foreach_lerp_` fail halfway, after updating some tensors.
# - Fix the cause (profile a deep copy) and the update (check every pair before touching any).

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
# ultralytics keeps an EMA (exponential moving average) of the model's weights. PR #25315 replaced its
# per-tensor update loop with one `torch._foreach_lerp_`, and had to change how layers are profiled
# with `thop`, a library that counts a model's operations. A puzzle: profiling should only *read* a
# model.

# %%
net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.SiLU())
print("state_dict entries before:", list(net.state_dict()))
thop.profile(net, inputs=(torch.randn(1, 3, 32, 32),), verbose=False)
print("after:", list(net.state_dict()))

# %% [markdown]
# Two new entries appeared in the `state_dict()` (the dict of parameters and buffers that a checkpoint
# saves and the EMA update walks). Where they come from, and where they go, in one picture:
#
# ![thop's float64 buffers: from an in-place profile into the model and the failing EMA update; a deep copy keeps them out](figures/03_thop_path.svg)

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
# Four new float64 entries. Which modules kept them?


# %%
def leaked_keys(model):  # thop's entries in a state_dict
    return [k for k in model.state_dict() if k.endswith(("total_ops", "total_params"))]


rules = set(thop.profile.__globals__["register_hooks"])  # thop's table: module type -> counting rule
for name, m in block.named_modules():
    print(
        f"{name or '<block>':<8} {type(m).__name__:<12} rule: {type(m) in rules!s:<5}  kept: {'total_ops' in m._buffers}"
    )
print("leaked keys:", leaked_keys(block))

# %% [markdown]
# `conv` and `bn` have rules and were cleaned; the block (a custom class) and `SiLU` (no rule in thop
# 0.1.1) were not. The count follows thop's rules: 16 × 32 × 32 outputs × 27 MACs each for the
# convolution, plus the 4 per output element thop charges BatchNorm, make 507,904 (SiLU adds nothing).
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
# ## 2. A shared activation carries the leak into models built later
#
# `Conv.default_act` now carries thop's buffers, and every `Conv` holds it. So a model built *after*
# the profile, never profiled itself, has them too:

# %%
later = nn.Sequential(Conv(3, 8, 3), Conv(8, 16, 3, 2), Conv(16, 16, 3))
print("one shared SiLU:", later[0].act is later[2].act is Conv.default_act)
print(len(later.state_dict()), "entries, of which thop's:", leaked_keys(later))

# %% [markdown]
# The same on a YOLO-sized network from ema_lab's model zoo (`models.yolo()`), which has its own `Conv`
# with a shared `SiLU`. Profile one zoo `Conv` in place, build two more networks, profile one of them:

# %%
from ema_lab.bench import models

clean = models.yolo()  # built before the leak
sizes = {"built before, clean": (len(clean.state_dict()), len(leaked_keys(clean)))}
thop.profile(models.Conv(3, 16, 3), inputs=(torch.randn(1, 3, 32, 32),), verbose=False)  # the leak
fresh = models.yolo()  # built after it; never profiled itself
profiled = models.yolo()
thop.profile(profiled, inputs=(torch.randn(1, 3, 64, 64),), verbose=False)
for label, m in (("built before, now", clean), ("built after", fresh), ("profiled in place", profiled)):
    sizes[label] = (len(m.state_dict()), len(leaked_keys(m)))
for label, (entries, stray) in sizes.items():
    print(f"yolo() {label:<19}: {entries} entries, {stray} of them thop's")
print("Conv modules in yolo():", sum(type(m).__name__ == "Conv" for m in fresh.modules()))
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
ax.set(ylabel="state_dict entries", title="yolo(): thop's float64 entries, profiled or not")
ax.set_ylim(0, (own[0] + max(stray)) * 1.15)
plt.show()

# %% [markdown]
# Nobody profiled the middle two models, yet each carries 228 stray float64 entries: two for each of
# its 114 `Conv` modules. Even the model built *before* the profile changed, since it holds the same
# `SiLU`.
#
# ## 3. A cast EMA copy makes `_foreach_lerp_` fail halfway
#
# The EMA starts as `deepcopy(model)`. ultralytics' validator then casts it with `.float()` (or
# `.half()`), which converts every floating tensor, thop's buffers included. The training model keeps
# them in float64. One training step moves the model away from its EMA:


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
ema = deepcopy(model).eval().float()  # what the validator does to the EMA
train_step(model)

esd, msd = ema.state_dict(), model.state_dict()
floats = [k for k, v in esd.items() if v.dtype.is_floating_point]  # the pairs the PR's code averages
bad = [k for k in floats if esd[k].dtype != msd[k].dtype]
print(f"{len(bad)} of {len(floats)} float pairs disagree in dtype:")
for k in bad:
    print(f"  {k:<18} EMA {esd[k].dtype}  model {msd[k].dtype}")

# %% [markdown]
# Only thop's keys disagree (after `.half()` every pair would). The PR's after-code calls
# `torch._foreach_lerp_(ema_tensors, model_tensors, 1 - d)` once, with `d` the decay (the share of the
# old EMA that each step keeps). `lerp_` needs both tensors of a pair in the same dtype. We use
# `d = 0.9` so that one step shows in four decimals:

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
# so the five tensors before the first bad pair were already moved: a failed `_foreach_lerp_` is **not
# atomic**.
#
# The obvious repair, which the PR did *not* make, is to catch the error and run the old per-tensor
# loop. That loop promotes to float64 and casts back, so it succeeds, and moves those five tensors a
# second time:

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
# Red: moved by the failed call and again by the fallback, by about 1 − d² = 0.19 instead of 0.1. The
# mismatch never goes away, so that would happen at *every* step, halving those tensors' averaging
# window (about 1 / (1 − d) steps) without a word.
#
# ## 4. Check every pair before touching any
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
# model's float64 values first. Check it against the PR's before-code loop over ten training steps,
# both with the ramp `d_n = decay × (1 − exp(−n / tau))`; decay 0.9 and tau 3 make every step count:

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


print("modes:", auto.modes)
print(f"ModelEMA vs the loop:   {gap(got, want):.1e}")
print(f"ModelEMA vs the model:  {gap(got, msd):.1e}")
print(f"ModelEMA vs its start:  {gap(got, start):.1e}")
torch.testing.assert_close({k: got[k] for k in floats}, {k: want[k] for k in floats}, rtol=1e-5, atol=1e-6)

# %% [markdown]
# `modes` lists how each group of tensors is updated: `cat` gathers the float32 pairs (notebook 05),
# `cast` converts thop's float64 ones. The EMA agrees with the loop to float32 rounding, yet is far
# from the model and from its start: an EMA that skipped steps, or copied the model, would fail the
# last line. (`ModelEMA(model, strategy="foreach")` asks for exactly the PR's single call, and refuses
# the mixed pairs up front, like `foreach_update`.)

# %% [markdown]
# ## 5. The fix in the PR: profile a deep copy
#
# `deepcopy(block)` gets its own `SiLU` (deepcopy copies the module the instance points to), so thop
# can touch neither the block nor the shared activation. Clean section 1's leak first:

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
# 2.0.22, and keeps plain Python numbers instead of buffers from 2.1. (Quoted from its release notes,
# not run here: `thop` and `ultralytics-thop` install the same `thop` import, so never install both.)
# A later ultralytics PR dropped the deep copy once it required the fixed fork.
# </details>
#
# <details><summary>A second opinion on the count: torch's FlopCounterMode</summary>
#
# `torch.utils.flop_counter.FlopCounterMode` counts FLOPs (one MAC is two) at the dispatcher and stores
# nothing on the model, so it cannot leak. It agrees with thop on convolutions and linear layers and differs elsewhere (BatchNorm,
# attention, fused kernels); `docs/flop_counters.md` in the repository compares the two on
# three models.
# </details>
#
# <details><summary>Why a leaked model cannot move to an Apple GPU</summary>
#
# Apple's MPS backend has no float64, so thop's buffers cannot move there, and `model.to("mps")`
# converts tensor by tensor, leaving a half-moved model when it fails.
# `ema_lab.lessons.profiling.check_movable(model, "mps")` looks first and names the float64 entries.
# </details>

# %% [markdown]
# ## Summary
#
# - `thop.profile` 0.1.1 leaves float64 `total_ops`/`total_params` buffers on modules it has no rule
#   for, and everything (buffers, hooks, eval mode) when the forward fails.
# - A class-level activation spreads them to every model built afterwards.
# - A cast EMA makes `_foreach_lerp_` raise after moving the pairs before the bad one; a loop fallback
#   would then move those twice.
# - Fixes: profile a deep copy (`profile_flops`), check every pair first (`foreach_update`), or group
#   pairs by dtype (`ModelEMA`'s default).

# %% [markdown]
# ## Exercises
#
# 1. Profile `models.resnet50()` in place (inside `with shared_act_leak():` from
#    `ema_lab.lessons.float64_bug`, which puts section 2's shared-SiLU leak back and removes it on
#    exit). Why does it keep fewer stray keys than the YOLO-sized net?
# 2. With ultralytics' `d = 0.9999`, how much weight does the fallback of section 3 give the model per
#    step, and what happens to the averaging window?
# 3. Put a module whose forward raises into a model. Run `thop.profile` on it in place, and
#    `profile_flops` on a fresh one. Count what each leaves behind, as in section 1.
#
# Solutions are in the hidden cells below (click to expand).

# %% jupyter={"outputs_hidden": true, "source_hidden": true}
# 1. ResNet-50 is built from Conv2d, BatchNorm2d and ReLU, which have thop rules (SiLU has none),
#    so only its custom bottleneck blocks and Flatten keep buffers. The YOLO-sized net adds its
#    custom blocks and, under every one of its Convs, the shared SiLU.
from ema_lab.lessons.float64_bug import shared_act_leak

with shared_act_leak():
    resnet = models.resnet50()
    thop.profile(resnet, inputs=(torch.randn(1, 3, 64, 64),), verbose=False)
    for name, net in (("resnet50", resnet), ("yolo", profiled)):
        kept = sorted({type(m).__name__ for m in net.modules() if "total_ops" in m._buffers})
        print(f"{name}: {len(leaked_keys(net))} stray keys, kept by {kept}")
print(
    "types with a thop rule:",
    sorted(t.__name__ for t in (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.SiLU) if t in rules),
)

# %% jupyter={"outputs_hidden": true, "source_hidden": true}
# 2. Twice the weight per step, so half the averaging window.
d = 0.9999
print(f"weight per step: {1 - d:.6f} -> {1 - d * d:.6f}")
print(f"averaging window: {1 / (1 - d):,.0f} steps -> {1 / (1 - d * d):,.0f} steps")


# %% jupyter={"outputs_hidden": true, "source_hidden": true}
# 3. In place, thop leaves buffers, hooks and eval mode; on a copy, nothing.
class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


for label in ("thop.profile in place", "profile_flops"):
    victim = nn.Sequential(nn.Conv2d(3, 4, 3), Boom()).train()
    try:
        if label == "profile_flops":
            profile_flops(victim, torch.randn(1, 3, 8, 8))
        else:
            thop.profile(victim, inputs=(torch.randn(1, 3, 8, 8),), verbose=False)
    except ValueError as e:
        print(f"{label}: ValueError {e}")
    hooks = sum(len(m._forward_hooks) for m in victim.modules())
    print(f"    leaked keys {len(leaked_keys(victim))}, forward hooks {hooks}, training {victim.training}")
