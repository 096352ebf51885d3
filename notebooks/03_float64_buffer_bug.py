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
# # 03 · The float64 buffer bug: how profiling a layer broke the batched EMA update
#
# ultralytics PR #25315 replaced the EMA's per-tensor Python loop with one `torch._foreach_lerp_`
# call. The same PR had to change a second, unrelated-looking line: the layer profiler now runs
# `thop.profile` on a **deep copy** of each layer. This notebook reproduces why, in its own cells,
# with the real PyPI `thop` 0.1.1.post2209072238 that the project pins.
#
# **Take-aways**
# - `thop.profile` (0.1.1) leaves float64 `total_ops`/`total_params` buffers on every module it has no
#   counting rule for, and an activation shared at class level carries them into models built later.
# - Once the EMA copy is cast with `.float()`, one (EMA, model) pair disagrees in dtype and
#   `_foreach_lerp_` raises *after* updating the pairs before it: a failed call is not atomic.
# - Profiling a deep copy fixes the cause; validating every pair before touching any (or grouping
#   pairs by dtype) makes the update itself safe.
#
# **Time** on this machine (2-core AMD EPYC, torch 2.13 CPU, shared with other jobs), measured with
# `time python3 dev.py notebooks notebooks/03_float64_buffer_bug.py`: 10 s in full mode, 11 s in
# quick mode (`EMA_LAB_QUICK=1`); nothing here is timed, so both modes run the same cells.

# %%
# NBVAL_IGNORE_OUTPUT
from copy import deepcopy

import matplotlib.pyplot as plt
import torch
from torch import nn

from ema_lab import ModelEMA, foreach_update
from ema_lab.bench.environment import format_environment, quick_mode
from ema_lab.lessons.float64_bug import leaked_keys, shared_act_leak, train_step
from ema_lab.lessons.models import build, yolo
from ema_lab.lessons.profiling import dtype_table, import_thop, profile_flops, remove_thop_buffers

torch.set_num_threads(1)  # the numbers below come from one seeded training step: keep them bit-stable
thop = import_thop()  # `import thop`, with its distutils DeprecationWarning silenced
print(format_environment())
print("quick mode:", quick_mode(), "(nothing here is timed: both modes print the same)")

# %% [markdown]
# The cell above records the versions and hardware the outputs below come from.
#
# ## 1. What `thop.profile` leaves behind
#
# `thop.profile(model, inputs)` counts multiply-accumulates (MACs) with forward hooks. To store the
# counts it calls `model.apply(add_hooks)`, which registers two **float64 buffers**, `total_ops` and
# `total_params`, on *every* module. Only modules with a counting rule (`Conv2d`, `BatchNorm2d`,
# `Linear`, `Sequential`, ...) get a hook, and at the end thop removes the buffers from exactly those.
# Everything else keeps them, and buffers are part of `state_dict()`.
#
# The block below is ultralytics' `Conv` (Conv2d + BatchNorm2d + SiLU), written out. Note
# `default_act`: a **class attribute**, so every `Conv` ever built holds the *same* `nn.SiLU` object.


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
print("before:", len(block.state_dict()), "entries")
macs, params = thop.profile(block, inputs=(torch.randn(1, 3, 32, 32),), verbose=False)
print(f"thop.profile -> {macs:,.0f} MACs, {params:,.0f} parameters")
print("after:", len(block.state_dict()), "entries")
print(dtype_table(block))

# %% [markdown]
# Four new entries, all `float64`. Which modules kept them, and which did thop clean?

# %%
rules = set(thop.profile.__globals__["register_hooks"])  # thop's table: module type -> counting rule
for name, m in block.named_modules():
    kept = "total_ops" in m._buffers
    print(f"{name or '<root>':<7} {type(m).__name__:<12} rule: {type(m) in rules!s:<5}  kept buffers: {kept}")
print("leaked keys:", leaked_keys(block))
conv_macs, bn_macs = 16 * 32 * 32 * 3 * 3 * 3, 4 * 16 * 32 * 32
print(
    f"by hand: conv {conv_macs:,} + BatchNorm {bn_macs:,} = {conv_macs + bn_macs:,} MACs; {16 * 27 + 2 * 16} parameters"
)

# %% [markdown]
# `conv` and `bn` are clean because thop has rules for them; the block itself (a custom class) and
# its `SiLU` (no rule in thop 0.1.1) keep the buffers. The MACs check by hand (last line): the
# convolution produces 16 × 32 × 32 outputs of 3 × 3 × 3 multiply-adds each (442,368), and thop charges
# the affine BatchNorm 4 per element (65,536), 507,904 in all, as thop said. Parameters: 16 × 27 conv
# weights + 2 × 16 BatchNorm affine values = 464 (SiLU has none).
#
# thop has no `try/finally` either. When the profiled forward raises (here: a 1-channel input into a
# 3-channel convolution), the buffers stay on all four modules, the counting hooks stay registered,
# and the block is left in eval mode:

# %%
broken = Conv(3, 16, 3).train()
try:
    thop.profile(broken, inputs=(torch.randn(1, 1, 32, 32),), verbose=False)
except RuntimeError as e:
    print("RuntimeError:", str(e).splitlines()[0])
print("leaked keys:", leaked_keys(broken))
print("forward hooks left:", sum(len(m._forward_hooks) for m in broken.modules()))
print("still in training mode:", broken.training)

# %% [markdown]
# ## 2. A class-level activation carries the leak into models built later
#
# Every `Conv` holds `Conv.default_act`, and that one `SiLU` now carries thop's buffers. So a model
# built *after* the profile, and never profiled itself, has them too, under every path that reaches
# the shared activation (`state_dict()` does not de-duplicate shared modules):

# %%
later = nn.Sequential(Conv(3, 8, 3), Conv(8, 16, 3, 2), Conv(16, 16, 3))
print("shared:", later[0].act is later[2].act is Conv.default_act)
print(len(later.state_dict()), "entries, of which thop's:", leaked_keys(later))

# %% [markdown]
# The same on a YOLO-sized network. `yolo()` from the model zoo is built from the zoo's own `Conv`
# (same design, its own shared `SiLU`); `shared_act_leak()` profiles one zoo `Conv` block in place,
# as above, and removes the leak from the zoo's shared activation when the `with` block ends:

# %%
clean = yolo()
sizes = {"built before, clean": (len(clean.state_dict()), len(leaked_keys(clean)))}
with shared_act_leak():
    fresh = yolo()  # built after one Conv block was profiled: never profiled itself
    profiled = yolo()
    thop.profile(profiled, inputs=(torch.randn(1, 3, 64, 64),), verbose=False)
    for label, m in (("built before, now", clean), ("built after", fresh), ("profiled in place", profiled)):
        sizes[label] = (len(m.state_dict()), len(leaked_keys(m)))
for label, (entries, stray) in sizes.items():
    print(f"yolo() {label:<19}: {entries} entries, {stray} of them thop's")
n_conv = sum(type(m).__name__ == "Conv" for m in fresh.modules())
print(f"{n_conv} Conv modules share one SiLU: 2 x {n_conv} = {2 * n_conv}")

# %%
# NBVAL_IGNORE_OUTPUT
labels = [label.replace(", ", ",\n") for label in sizes]
real = [sizes["built before, clean"][0]] * len(sizes)
stray = [n for _, n in sizes.values()]
fig, ax = plt.subplots(figsize=(8, 3.4))
ax.bar(labels, real, label="the model's own entries")
ax.bar(labels, stray, bottom=real, label="thop's float64 total_ops / total_params")
for i, n in enumerate(stray):
    ax.text(i, real[i] + n + 15, f"+{n}", ha="center")
ax.set(ylabel="state_dict entries (count)", title="yolo(): state_dict size before and after thop")
ax.set_ylim(0, (real[0] + max(stray)) * 1.15)
ax.legend(loc="upper left")
plt.show()

# %% [markdown]
# Nobody profiled the two middle models, yet each carries 228 stray float64 entries, two for each of
# its 114 `Conv` modules. Even the model built *before* the profile changed: it holds the same `SiLU`.
# A real ultralytics model has its own module count; the mechanism is the same.
#
# ## 3. The EMA copy is cast; the model is not
#
# The EMA starts as `deepcopy(model)`, so at first both carry the same float64 buffers. Then
# ultralytics' validator runs on the EMA and casts it (`model.half() if half else model.float()`).
# `.float()` turns *every* floating tensor into float32, thop's buffers included. The training model
# keeps them in float64. The model below is built while `Conv.default_act` still carries section 1's
# leak:

# %%
torch.manual_seed(0)
model = nn.Sequential(
    Conv(3, 8, 3), Conv(8, 16, 3, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)
)
ema = deepcopy(model).eval()
ema.float()  # what the validator does to the EMA
train_step(model)  # one seeded SGD step, so the model's weights move away from the EMA's

esd, msd = ema.state_dict(), model.state_dict()
floats = [k for k, v in esd.items() if v.dtype.is_floating_point]  # the PR's after-code pairs these
bad = [k for k in floats if esd[k].dtype != msd[k].dtype]
print(f"{len(bad)} of {len(floats)} float pairs disagree in dtype:")
for k in bad:
    print(f"  {k:<18} EMA {esd[k].dtype}  model {msd[k].dtype}")
half = deepcopy(model).half().state_dict()
print("with .half() instead:", sum(half[k].dtype != msd[k].dtype for k in floats), "of", len(floats))

# %% [markdown]
# Only thop's keys disagree after `.float()`. After `.half()` every pair does, which breaks the batched
# update just as well (a bf16/fp16 model into an fp32 EMA is the same failure).
#
# ## 4. `_foreach_lerp_` raises, after a partial update
#
# The PR's after-code collects every float entry of both state_dicts and calls
# `torch._foreach_lerp_(ema_tensors, model_tensors, 1 - d)` once. `lerp_` needs both tensors of a pair
# to have the same dtype, and on CPU the foreach call works through the pairs in order, checking each
# as it reaches it. We use `d = 0.9` so one step is visible in six decimals:

# %%
d = 0.9
before = {k: esd[k].clone() for k in floats}
try:
    with torch.no_grad():
        torch._foreach_lerp_([esd[k] for k in floats], [msd[k] for k in floats], 1 - d)
except RuntimeError as e:
    print("RuntimeError:", e)
updated = [k for k in floats if not torch.equal(esd[k], before[k])]
print(f"first pair that disagrees: #{floats.index(bad[0])} {bad[0]!r}")
print("pairs the failed call had already updated:", updated)

# %% [markdown]
# The message comes from lerp's check: `end` is the model tensor, float64 ("double"), while the EMA
# tensor is float32 ("float"). The five tensors of the first block (`0.conv`, `0.bn`) come before the
# first bad pair and were already moved: a failed `_foreach_lerp_` is **not atomic**.
#
# That makes the obvious repair dangerous. The PR did *not* do this; it is a hypothetical fix, shown
# because it is the first thing one tries: catch the error and run the old per-tensor loop.
# The old loop silently promotes (`(1 - d) * m` is float64, the in-place `+=` casts back), so it
# succeeds, and moves the already-updated tensors a second time:

# %%
with torch.no_grad():  # the hypothetical `except RuntimeError:` branch: the PR's before-code loop
    for k in floats:
        v = esd[k]
        v *= d
        v += (1 - d) * msd[k].detach()


def applied_weight(k: str) -> float | None:
    """w in ``after = before + w * (model - before)``, at the element with the largest gap."""
    gap = (msd[k].double() - before[k].double()).flatten()
    if gap.numel() == 0 or gap.abs().max() == 0:
        return None  # nothing to measure (thop's buffers: same value on both sides)
    i = int(gap.abs().argmax())
    return ((esd[k].double().flatten()[i] - before[k].double().flatten()[i]) / gap[i]).item()


weights = {k: applied_weight(k) for k in floats}
for k in [*updated[:2], floats[-1]]:
    print(f"{k:<16} weight given to the model: {weights[k]:.4f}")
print(f"one step: 1 - d = {1 - d:.4f}; two steps: 1 - d² = {1 - d * d:.4f}")

# %%
# NBVAL_IGNORE_OUTPUT
shown = [k for k, w in weights.items() if w is not None]
ws = [weights[k] for k in shown]
fig, ax = plt.subplots(figsize=(8, 3.6))
ax.bar(range(len(ws)), ws, color=["tab:red" if k in updated else "tab:blue" for k in shown])
ax.axhline(1 - d, ls="--", c="k", lw=1, label=f"1 - d = {1 - d:.2f} (one step)")
ax.axhline(1 - d * d, ls=":", c="tab:red", lw=1, label=f"1 - d² = {1 - d * d:.2f} (two steps)")
ax.set(
    xlabel="float state_dict entry of the EMA (thop's buffers left out)",
    ylabel="weight given to the model",
    ylim=(0, 0.24),
    title="failed _foreach_lerp_ + a hypothetical try/except loop (d = 0.9)",
)
ax.set_xticks(range(len(shown)), shown, rotation=90, fontsize=7)
ax.legend(loc="upper right")
plt.show()

# %% [markdown]
# Red: the tensors updated by the failed call and again by the fallback. They received about
# 1 − d² = 0.19 of the model (0.1902 and 0.1908 above: float32 rounding) instead of 1 − d = 0.1, and since the dtype mismatch never goes away, that would happen
# at *every* step, silently halving the averaging window of those tensors.
#
# ## 5. What `ema_lab` does with the same pairs
#
# `ema_lab.foreach_update` checks every pair before touching any, and raises a `ValueError` that names
# the bad entry; the EMA is left exactly as it was:

# %%
ema = deepcopy(model).eval().float()  # a fresh cast EMA, as in section 3
esd = ema.state_dict()
start = {k: v.clone() for k, v in esd.items()}
try:
    foreach_update([esd[k] for k in floats], [msd[k] for k in floats], d, floats)
except ValueError as e:
    print("ValueError:", e)
print("EMA unchanged:", all(torch.equal(esd[k], start[k]) for k in esd))

# %% [markdown]
# `ModelEMA` (the default, `strategy="auto"`) accepts the mixed pairs. What it really runs is visible
# from its public attributes after the first update: `resolved_strategy` is what `"auto"` chose,
# `modes` and `plan` describe each group of tensors it flattened:

# %%
auto = ModelEMA(model)
auto.ema.float()  # the same cast as the validator's
auto.ema.load_state_dict(start)  # and the same starting values as above
d1 = auto.decay(auto.updates + 1)  # ModelEMA's first, ramped decay
auto.update(model)
print("resolved_strategy:", auto.resolved_strategy)
print("modes:", auto.modes)
for g in auto.plan:
    print(
        f"  {g.mode:<12} EMA {g.ema_dtype}, model {g.model_dtype}: {g.tensors} tensors, {g.elements} elements"
    )

# %% [markdown]
# `"auto"` resolved to `flat`: the EMA's float tensors live in one flat buffer per
# (device, EMA dtype, model dtype) group. Here the float32/float32 pairs are all small, so that group is
# `cat`: one `torch.cat` gathers the model's tensors, one `lerp_` averages them. thop's buffers, float32
# in the EMA and float64 in the model, form a `cast` group: one `_foreach_copy_` casts the model's values
# into a float32 scratch buffer, then one `lerp_`. (2 tensors, not 4: the two `Conv`s share one `SiLU`,
# and each tensor is averaged once.) No per-tensor promoting path runs. Compared with the old loop from
# the same start and the same decay, the result differs only by float32 rounding:

# %%
loop = deepcopy(ema)
with torch.no_grad():  # the PR's before-code loop, at ModelEMA's first decay
    for k, v in loop.state_dict().items():
        if v.dtype.is_floating_point:
            v *= d1
            v += (1 - d1) * msd[k].detach()
torch.testing.assert_close(auto.ema.state_dict(), loop.state_dict(), rtol=1e-6, atol=1e-6)
print(f"decay {d1:.3g}: ModelEMA equals the promoting loop within 1e-6")

strict = ModelEMA(model, strategy="foreach")
strict.ema.float()
try:
    strict.update(model)
except ValueError as e:
    print('ModelEMA(strategy="foreach") refuses:', e)

# %% [markdown]
# ## 6. The fix in the PR: profile a deep copy
#
# The PR changed the layer profiler to run thop on `deepcopy(layer)`. The copy gets its own `SiLU`
# (deepcopy copies the submodule the instance points to, not the class attribute), so neither the
# block nor the class-level activation is touched. First, remove section 1's leak from our `Conv`:

# %%
print("removed:", remove_thop_buffers(Conv.default_act))
block = Conv(3, 16, 3)
x = torch.randn(1, 3, 32, 32)
macs, params = thop.profile(deepcopy(block), inputs=(x,), verbose=False)  # the PR's fix
print(f"thop on a deep copy -> {macs:,.0f} MACs; leaked on the block: {leaked_keys(block)}")
print("Conv.default_act's state_dict:", dict(Conv.default_act.state_dict()))
print("profile_flops(block, x) ->", profile_flops(block, x), "(GFLOPs = MACs / 1e9 * 2, parameters)")

# %% [markdown]
# `ema_lab.lessons.profiling.profile_flops` is that fix as a function: it deep-copies the model *and*
# the inputs (a forward that writes into its input must not change the caller's), and reports GFLOPs
# as ultralytics does. `tests/test_profiling.py` checks with hypothesis on random module trees that
# the caller's model never changes, even when the forward raises.
#
# With no float64 buffers anywhere, the PR's after-code runs on a cast EMA:

# %%
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
# Upstream fixed thop itself: the `ultralytics-thop` fork removes the buffers from every module
# from 2.0.21, wraps the profile in `try/finally` from 2.0.22, and from 2.1 keeps plain Python ints
# instead of registering buffers, so nothing can leak. That is quoted from its release history, not
# run: `thop` and `ultralytics-thop` install the same `thop` import package, and this project pins
# the leaky one on purpose. A later ultralytics PR removed the deep copy again once it required the
# fixed fork.
#
# ## 7. Cross-check: thop vs torch's `FlopCounterMode`
#
# `torch.utils.flop_counter.FlopCounterMode` counts FLOPs at the ATen level with a dispatch mode:
# no hooks on the model, no buffers. `compare_flop_counts` runs both on deep copies and splits thop's
# count by module type:

# %%
from ema_lab.lessons.profiling import compare_flop_counts

for name, x in [("tiny_cnn", torch.randn(1, 3, 32, 32)), ("yolo", torch.randn(1, 3, 64, 64))]:
    print(f"--- {name}, input {tuple(x.shape)}")
    print(compare_flop_counts(build(name), x).explain())

# %% [markdown]
# For convolutions and linear layers the two counters agree *exactly* (thop's MACs × 2 =
# FlopCounterMode's FLOPs). The whole difference is what thop counts and FlopCounterMode has no
# formula for: BatchNorm (thop charges 4 per element, though deployed models usually fuse it into
# the convolution), adaptive average pooling and upsampling. The two can also disagree on the
# matmuls themselves, each for its own reason:

# %%
print(compare_flop_counts(build("tiny_transformer"), torch.randint(0, 64, (1, 16))).explain())

# %% [markdown]
# thop has no rule for `nn.MultiheadAttention` or `nn.Embedding` (and matches rule types exactly, so
# attention's `NonDynamicallyQuantizableLinear` projection counts 0); it sees only the feed-forward
# `Linear` layers. FlopCounterMode sees only the output head: in eval mode under `no_grad`,
# `nn.TransformerEncoderLayer` runs the fused `aten::_transformer_encoder_layer_fwd` kernel, which has
# no FLOP formula. Neither number is "the" FLOP count; say which counter you used.
#
# ## 8. MPS has no float64
#
# Apple's MPS backend has no float64 dtype, so a model that still carries thop's float64 buffers
# cannot be moved there. Worse, `Module.to()` converts tensor by tensor (`Module._apply`), so a
# conversion that fails on the first float64 buffer leaves the tensors before it already moved.
# `ema_lab.lessons.profiling.check_movable` (and `move_to`) looks first and names the entries. The check
# only *names* the device, so it runs anywhere:

# %%
from ema_lab.lessons.profiling import check_movable, move_to

with shared_act_leak():
    leaky = build("tiny_cnn")  # built during the leak: 10 float64 entries
    try:
        check_movable(leaky, "mps")
    except ValueError as e:
        print("ValueError:", e)
check_movable(build("tiny_cnn"), "mps")
print("a clean model: no objection")

# %%
from ema_lab.bench.environment import available_devices

reason = available_devices()["mps"]
if reason is not None:
    print(reason)
else:
    with shared_act_leak():
        leaky = build("tiny_cnn")
        try:
            move_to(leaky, "mps")
        except ValueError as e:
            print("refused before moving anything:", str(e)[:90], "...")
    print("clean model moved:", next(move_to(build("tiny_cnn"), "mps").parameters()).device)

# %% [markdown]
# ## Try it yourself
#
# 1. Profile `build("resnet50")` in place with `thop.profile` (inside `with shared_act_leak():`) and
#    count its stray keys. Why are there fewer per module than on `yolo()`? (Hint: which of its
#    module types have a thop rule?)
# 2. With ultralytics' decay `d = 0.9999`, how much weight does the hypothetical try/except fallback
#    give the model per step, and what does that do to the averaging window (about 1 / (1 − d) steps)?
# 3. Put a module whose forward raises into a model, call `thop.profile` on it in place, then
#    `profile_flops` on a fresh copy. What does `fingerprint(model).changes(...)` report after each?
# 4. Compare `compare_flop_counts` for `tiny_transformer` after
#    `torch.backends.mha.set_fastpath_enabled(False)`. Which count moves, and by how much?
#
# ## Solutions
#
# **1.** Count the modules that kept buffers, by type, on both networks:

# %%
with shared_act_leak():
    resnet = build("resnet50")
    thop.profile(resnet, inputs=(torch.randn(1, 3, 64, 64),), verbose=False)
    for name, net in (("resnet50", resnet), ("yolo", profiled)):
        mods = list(net.modules())  # each module once (the shared SiLU counts once here)
        kept = sorted({type(m).__name__ for m in mods if "total_ops" in m._buffers})
        print(f"{name}: {len(leaked_keys(net))} stray keys; {len(mods)} distinct modules; kept by: {kept}")

# %% [markdown]
# ResNet-50 is built from `Conv2d`, `BatchNorm2d`, `ReLU` and `Sequential`, which all have thop rules
# (thop 0.1.1 has one for `ReLU`, not for `SiLU`), so only its custom bottleneck blocks and a
# `Flatten` keep buffers. The YOLO-sized net adds its custom `Conv`/`C2f`-style blocks, a
# `ModuleList` and, at every one of its 114 `Conv`s, the shared `SiLU`.

# %% [markdown]
# **2.** Twice the weight: 1 − d² ≈ 2 (1 − d) when d is close to 1, so the affected tensors average over
# about half as many steps.

# %%
d = 0.9999
print(f"one step: {1 - d:.6f}; decayed twice: {1 - d * d:.6f} ({(1 - d * d) / (1 - d):.4f}x)")
print(f"averaging window: {1 / (1 - d):,.0f} steps -> {1 / (1 - d * d):,.0f} steps")

# %% [markdown]
# **3.** In place, thop leaves buffers, hooks and eval mode behind; on a copy, nothing changes.

# %%
from ema_lab.lessons.profiling import fingerprint


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


for label in ("thop.profile in place", "profile_flops"):
    victim = nn.Sequential(nn.Conv2d(3, 4, 3), Boom()).train()
    fp = fingerprint(victim)
    try:
        if label == "profile_flops":
            profile_flops(victim, torch.randn(1, 3, 8, 8))
        else:
            thop.profile(victim, inputs=(torch.randn(1, 3, 8, 8),), verbose=False)
    except ValueError as e:
        print(f"{label}: ValueError {e}")
    for change in fp.changes(fingerprint(victim)) or ["nothing changed"]:
        print("   ", change)

# %% [markdown]
# **4.** With the fast path off, `nn.TransformerEncoderLayer` runs ordinary matmuls that FlopCounterMode
# has formulas for; thop's count does not move (it never saw attention).

# %%
torch.backends.mha.set_fastpath_enabled(False)
try:
    print(compare_flop_counts(build("tiny_transformer"), torch.randint(0, 64, (1, 16))).explain())
finally:
    torch.backends.mha.set_fastpath_enabled(True)

# %% [markdown]
# ## Summary
#
# - PyPI `thop` 0.1.1 registers float64 `total_ops`/`total_params` on every module and removes them only
#   where it has a rule; a failing forward leaves everything behind (buffers, hooks, eval mode).
# - A class-level activation (`Conv.default_act`) spreads the leak to every model built afterwards.
# - Once the EMA is cast (`.float()`/`.half()`), one disagreeing pair makes `_foreach_lerp_` raise
#   ``expected dtype float for `end` but got dtype double``, after updating the pairs before it. A
#   try/except fallback to the loop (a hypothetical fix, not the PR's) would decay those twice; the old
#   loop alone promoted silently.
# - Fixes: profile a deep copy (the PR; `profile_flops`), validate every pair before touching any
#   (`foreach_update`), or group pairs by dtype (`ModelEMA`'s default resolves to `flat`, which gives
#   mismatched pairs a `cast` group). With `ultralytics-thop` >= 2.1 nothing leaks.
# - thop and FlopCounterMode agree exactly on convolutions and linear layers; the rest of the
#   difference is BatchNorm/pooling/upsampling (thop only) and fused kernels (FlopCounterMode's
#   blind spot).
