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
# `thop.profile` on a **deep copy** of each layer. This notebook reproduces why, step by step, with
# the real PyPI `thop` 0.1.1.post2209072238 that the project pins.
#
# **You will learn**
# - what `thop.profile` leaves on a model (float64 `total_ops`/`total_params` buffers), and where;
# - how an activation shared at class level (`Conv.default_act`) carries that leak into new models;
# - why one (EMA, model) pair that disagrees in dtype makes `_foreach_lerp_` raise
#   ``expected dtype float for `end` but got dtype double``, while the old loop silently promoted;
# - why a failed `_foreach_lerp_` is **not atomic**, and how a naive `try/except` fallback then applies
#   the decay twice;
# - the fixes: validate before touching anything (`ema_lab.foreach_update`), group by dtype
#   (`gated_update`, `ModelEMA`), and profile a deep copy (`ema_lab.profile_flops`);
# - how thop's FLOP count compares with torch's own `FlopCounterMode`, and why a float64 model cannot
#   move to Apple's MPS.
#
# Every step is a function in `ema_lab.lessons.float64_bug` that returns what it observed; the tests in
# `tests/test_float64_bug.py` assert the same observations, and `run_all()` prints them in one go.

# %%
# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt
import torch

from ema_lab.bench.environment import format_environment, quick_mode
from ema_lab.lessons import float64_bug as bug
from ema_lab.lessons.models import Conv, build
from ema_lab.lessons.profiling import dtype_table

torch.set_num_threads(1)  # the numbers below come from one seeded training step: keep them bit-stable
print(format_environment())
print("quick mode:", quick_mode(), "(nothing here is timed: both modes print the same)")

# %% [markdown]
# ## 1. What `thop.profile` leaves behind
#
# `thop.profile(model, inputs)` counts multiply-accumulates (MACs) with forward hooks. To store the
# counts it calls `model.apply(add_hooks)`, which registers two **float64 buffers**, `total_ops` and
# `total_params`, on *every* module. Only modules with a counting rule (`Conv2d`, `BatchNorm2d`,
# `Linear`, `Sequential`, ...) get a hook, and at the end thop removes the buffers from exactly those.
# Everything else (a custom block like ultralytics' `Conv`, the `nn.SiLU` inside it, a `ModuleList`,
# the root) keeps them, and buffers are part of `state_dict()`.
#
# Here is one `Conv` block (Conv2d + BatchNorm2d + SiLU) before and after an in-place profile.
# `shared_act_leak()` profiles a fresh block in place and, on exit, removes what it left on the shared
# activation, so the rest of this notebook starts clean.

# %%
print("before thop.profile:")
print(dtype_table(Conv(3, 16, 3)))
with bug.shared_act_leak() as block:
    print("\nafter thop.profile(block, ...):")
    print(dtype_table(block))

# %% [markdown]
# Four new entries, all `float64`: the block's own pair and the pair on its activation (`act.`).
# `conv` and `bn` are clean because thop has rules for them. The step function records the same
# thing, plus what happens when the profiled forward **fails**: thop has no `try/finally`, so the
# buffers stay on all four modules, the counting hooks stay registered, and the block is left in
# eval mode.

# %%
s1 = bug.step1_profile_in_place()
print(s1)

# %% [markdown]
# The MACs are easy to check by hand: the convolution produces 16 × 32 × 32 outputs of 3 × 3 × 3
# multiply-adds each (442,368), and thop charges the affine BatchNorm 4 per element (65,536);
# SiLU has no rule and counts 0. The tests assert this formula.
#
# ## 2. A class-level activation spreads the leak
#
# ultralytics' `Conv` stores its activation as a **class attribute**, `default_act = nn.SiLU()`, and
# every instance does `self.act = self.default_act`. So every `Conv` ever built holds the *same*
# `SiLU` object, and the buffers thop registered on it appear in every model built afterwards,
# under every path that reaches it (`state_dict()` does not de-duplicate shared modules).
# `ema_lab.lessons.models.Conv` copies that design. The YOLO-sized model of the zoo shows the effect:

# %%
s2 = bug.step2_shared_activation()
print(s2)

# %%
# NBVAL_IGNORE_OUTPUT
labels = ["built before\nthe leak", "built after profiling\none Conv block", "profiled\nin place"]
real = [s2.clean_entries] * 3
stray = [0, s2.fresh_stray, s2.profiled_stray]
fig, ax = plt.subplots(figsize=(7, 3.4))
ax.bar(labels, real, label="the model's own entries")
ax.bar(labels, stray, bottom=real, label="thop's float64 total_ops / total_params")
for i, n in enumerate(stray):
    ax.text(i, real[i] + n + 15, f"+{n}", ha="center")
ax.set(ylabel="state_dict entries (count)", title="yolo(): state_dict size before and after thop")
ax.set_ylim(0, (s2.clean_entries + s2.profiled_stray) * 1.15)
ax.legend(loc="upper left")
plt.show()

# %% [markdown]
# The middle bar is the surprising one: a model nobody profiled carries 228 stray float64 entries,
# two for each of its 114 `Conv` modules, because they all reach the one shared `SiLU`. (The issue
# report quotes 152 on a fresh YOLO11n and 410 on a profiled one; our YOLO-sized net has a
# different module count, same mechanism.)
#
# ## 3. The EMA copy is cast; the model is not
#
# The EMA starts as `deepcopy(model)`, so at first both carry the same float64 buffers. Then the
# validator runs on the EMA and casts it: `model.half() if half else model.float()`, and `.float()`
# again afterwards. `.float()` turns *every* floating tensor into float32, including thop's buffers.
# The training model keeps them in float64, so those (EMA, model) pairs now disagree in dtype:

# %%
s3 = bug.step3_cast_ema()
print(s3)

# %% [markdown]
# Only the stray keys disagree after `.float()`. After `.half()` every pair does, which breaks the
# batched update just as well (a bf16/fp16 model into an fp32 EMA is the same failure).
#
# ## 4. `_foreach_lerp_` raises, after a partial update
#
# The post-change update (`ema_lab.lessons.seed.seed_after`, the PR's code verbatim) collects every float
# entry and calls `torch._foreach_lerp_(ema_tensors, model_tensors, 1 - d)` once. `lerp_` requires
# both tensors of a pair to have the same dtype, and on CPU the foreach kernel checks each pair as it
# reaches it. So the call updates the pairs *before* the first bad one, then raises. We use
# `d = 0.9` so the effect is visible in six decimals:

# %%
s4 = bug.step4_foreach_fails()
print(s4)

# %% [markdown]
# The error text comes from lerp's meta check: `end` is the model tensor, float64 ("double"), while
# the EMA tensor is float32 ("float"). The five tensors of the first block were already moved by
# the failed call. A fallback that catches the error and re-runs the loop moves them a second time:
# the model's weight becomes 1 − d² = 0.19 instead of 1 − d = 0.1, and since the mismatch never goes
# away, that happens at *every* step, silently halving the averaging window of those tensors.
# The plot shows the weight each pair actually received:

# %%
# NBVAL_IGNORE_OUTPUT
keys = [k for k, w in s4.weights if w is not None]
ws = [w for _, w in s4.weights if w is not None]
twice = 1 - bug.DECAY**2
fig, ax = plt.subplots(figsize=(8, 3.6))
ax.bar(range(len(ws)), ws, color=["tab:red" if w > 0.15 else "tab:blue" for w in ws])
ax.axhline(s4.model_weight, ls="--", c="k", lw=1, label=f"1 - d = {s4.model_weight:.2f} (one step)")
ax.axhline(twice, ls=":", c="tab:red", lw=1, label=f"1 - d² = {twice:.2f} (two steps)")
ax.set(
    xlabel="float state_dict entry of the EMA (thop buffers left out)",
    ylabel="weight given to the model (fraction)",
    ylim=(0, 0.24),
    title="failed _foreach_lerp_ + try/except loop: weight applied per tensor (d = 0.9)",
)
ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
ax.legend(loc="upper right")
plt.show()

# %% [markdown]
# Red: the tensors updated by the failed call and again by the fallback. `ema_lab.foreach_update`
# avoids the trap differently: it validates every pair first and raises a `ValueError` naming the
# bad entry *before* touching any tensor (the last two lines of the step output above: EMA unchanged).
#
# ## 5. The old loop promoted silently; `gated_update` and `ModelEMA` handle it
#
# The pre-change loop did `v *= d; v += (1 - d) * m` per tensor: `(1 - d) * m` is float64, and the
# in-place `+=` into a float32 tensor computes in the promoted dtype and casts back. No error, which
# is why the leak went unnoticed for years. `ema_lab.gated_update` keeps the batched path for every
# (device, dtype) group and sends only the mismatched pairs through that promoting per-tensor path;
# `ModelEMA(strategy="auto")` uses it. With `strategy="foreach"` ModelEMA refuses up front instead:

# %%
s5 = bug.step5_loop_and_fixes()
print(s5)

# %% [markdown]
# The differences to the loop are float32 rounding (lerp and mul/add round differently), not a
# change in the result.
#
# ## 6. The fix in the PR: profile a deep copy
#
# `ema_lab.profile_flops(model, inputs)` runs thop on `deepcopy(model)` (and deep copies of the inputs)
# and reports GFLOPs as ultralytics does, `MACs / 1e9 * 2`. The caller's model, including the shared
# activation it references, is untouched even when the forward raises; `tests/test_profiling.py`
# checks that with hypothesis on random module trees (tensors, dtypes, values, hooks, training flags).

# %%
s6 = bug.step6_deepcopy_fix()
print(s6)

# %% [markdown]
# Upstream fixed thop itself: the `ultralytics-thop` fork removes the buffers from every module
# from 2.0.21, wraps the profile in `try/finally` from 2.0.22, and from 2.1 keeps plain Python ints
# instead of registering buffers, so nothing can leak. That is quoted, not run: `thop` and
# `ultralytics-thop` install the same `thop` import package, and this project pins the leaky one on
# purpose. A later ultralytics PR removed the deep copy again once it required the fixed fork.
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

with bug.shared_act_leak():
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
    with bug.shared_act_leak():
        leaky = build("tiny_cnn")
        try:
            move_to(leaky, "mps")
        except ValueError as e:
            print("refused before moving anything:", str(e)[:90], "...")
    print("clean model moved:", next(move_to(build("tiny_cnn"), "mps").parameters()).device)

# %% [markdown]
# ## Try it yourself
#
# 1. Profile `build("resnet50")` in place with `thop.profile` (inside `with bug.shared_act_leak():`)
#    and count the stray keys with `bug.leaked_keys`. Why is it fewer per module than `yolo()`?
#    (Hint: which of its module types have a thop rule?)
# 2. In step 4, change `bug.DECAY` to 0.9999 (ultralytics' value) and re-run. How large is the extra
#    update per step now, and how many steps until it matters?
# 3. Put a `Boom` module (a forward that raises) into a model and call `thop.profile` on it, then
#    `profile_flops`. Compare `ema_lab.lessons.profiling.fingerprint(model).changes(...)` after each.
# 4. Compare `compare_flop_counts` for `tiny_transformer` after
#    `torch.backends.mha.set_fastpath_enabled(False)`. Which count moves, and by how much?
#
# ## Summary
#
# - PyPI `thop` 0.1.1 registers float64 `total_ops`/`total_params` on every module and removes them only
#   where it has a rule; a failing forward leaves everything (buffers, hooks, eval mode).
# - A class-level activation (`Conv.default_act`) spreads the leak to every model built afterwards.
# - Once the EMA is cast (`.float()`/`.half()`), one disagreeing pair makes `_foreach_lerp_` raise
#   ``expected dtype float for `end` but got dtype double``, after updating the pairs before it; a naive
#   fallback then decays those twice. The old loop promoted silently.
# - Fixes: validate every pair before touching any (`foreach_update`), group by dtype (`gated_update`,
#   `ModelEMA`), profile a deep copy (`profile_flops`), and on current `ultralytics-thop` (>= 2.1)
#   nothing leaks.
# - thop and FlopCounterMode agree exactly on convolutions and linear layers; the rest of the
#   difference is BatchNorm/pooling/upsampling (thop only) and fused kernels (FlopCounterMode's
#   blind spot).
# - Run the whole reproduction with `python -c "from ema_lab.lessons.float64_bug import run_all; run_all()"`.
