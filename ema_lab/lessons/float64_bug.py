"""The thop float64 buffer bug, reproduced step by step with the real ``thop`` package.

Each ``stepN_*`` function sets up what it needs, observes, cleans up and returns a small frozen
dataclass of what it saw; ``str()`` of that is what the notebook and :func:`run_all` print.

1. In-place ``thop.profile`` on a Conv+BN+SiLU block leaves float64 buffers on modules without a rule.
2. The class-level shared activation carries them into a model built afterwards.
3. Casting the EMA copy (``.float()``, as a validator does) makes (EMA, model) pairs disagree in dtype.
4. ``_foreach_lerp_`` raises, after updating the pairs before the bad one; a try/except fallback
   then decays those twice. ``ema_lab.foreach_update`` refuses up front instead.
5. The pre-change loop silently promotes; ``gated_update`` and ``ModelEMA(strategy="auto")`` handle it.
6. Profiling a deep copy (``ema_lab.profile_flops``) leaves nothing behind; current ultralytics-thop
   does not leak at all (a documented fact, not installed here).

The leak on ``Conv.default_act`` is process-wide (every ``Conv`` shares it), so every step that
creates it removes it again in a ``finally`` (:func:`shared_act_leak`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass
from importlib import metadata

import torch
from torch import nn

from ..ema import ModelEMA
from ..pairs import ModulePairs
from ..updates import foreach_update, gated_update
from .models import Conv, tiny_cnn, yolo
from .profiling import (
    THOP_BUFFERS,
    StateDictDiff,
    fingerprint,
    import_thop,
    profile_flops,
    snapshot,
    state_dict_diff,
)
from .seed import seed_after, seed_before

__all__ = [
    "DECAY",
    "ULTRALYTICS_THOP_FACT",
    "shared_act_leak",
    "leaked_keys",
    "train_step",
    "step1_profile_in_place",
    "step2_shared_activation",
    "step3_cast_ema",
    "step4_foreach_fails",
    "step5_loop_and_fixes",
    "step6_deepcopy_fix",
    "run_all",
    "STEPS",
    "Step1",
    "Step2",
    "Step3",
    "Step4",
    "Step5",
    "Step6",
]

#: A decay far from 1 so the double update of step 4 is visible in the printed digits.
DECAY = 0.9

#: Step 6's documented fact (from ultralytics-thop's release history; that package is NOT installed here).
ULTRALYTICS_THOP_FACT = (
    "ultralytics-thop >= 2.0.21 pops the buffers from every module, 2.0.22 adds try/finally, and "
    ">= 2.1 keeps plain ints instead of registering buffers, so profiling with it leaves nothing "
    "behind (documented, not run here: `thop` and `ultralytics-thop` ship the same `thop` import "
    "package, never install both)"
)

_BLOCK_INPUT = (1, 3, 32, 32)
_YOLO_INPUT = (1, 3, 64, 64)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def leaked_keys(model: nn.Module) -> list[str]:
    """The state_dict keys that are thop's buffers (``total_ops``/``total_params``)."""
    return [k for k in model.state_dict() if k.rsplit(".", 1)[-1] in THOP_BUFFERS]


@contextmanager
def _restoring_act(cls: type[Conv] = Conv) -> Iterator[nn.Module]:
    """Yield ``cls.default_act``; on exit remove any thop buffer it did not carry on entry."""
    act = cls.default_act
    had = {name for name in THOP_BUFFERS if name in act._buffers}
    try:
        yield act
    finally:
        for name in THOP_BUFFERS:
            if name not in had:
                act._buffers.pop(name, None)


@contextmanager
def shared_act_leak(cls: type[Conv] = Conv) -> Iterator[nn.Module]:
    """Profile one ``cls`` block in place (leaking onto ``cls.default_act``); remove the leak on exit."""
    thop = import_thop()
    _require_clean_act(cls)
    with _restoring_act(cls):
        block = cls(3, 16, 3)
        thop.profile(block, inputs=(torch.randn(_BLOCK_INPUT),), verbose=False)
        yield block


def _require_clean_act(cls: type[Conv] = Conv) -> None:
    leaked = [n for n in THOP_BUFFERS if n in cls.default_act._buffers]
    if leaked:
        raise RuntimeError(
            f"{cls.__name__}.default_act already carries thop buffers {leaked} from an earlier in-place "
            f"profile: remove them (ema_lab.remove_thop_buffers({cls.__name__}.default_act)) first"
        )


def train_step(model: nn.Module, seed: int = 0) -> None:
    """One deterministic SGD step on random data, so the model's weights and BN statistics move."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 32, 32, generator=gen)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _leaky_setup(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A fresh ``tiny_cnn``, its EMA cast with ``.float()`` (as a validator does), one train step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tiny_cnn()
    ema = deepcopy(model).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    ema.float()  # BaseValidator: model.half() if half else model.float(), then .float() again after val
    train_step(model, seed)
    return model, ema


# --- Step 1 --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step1:
    """In-place ``thop.profile`` of one Conv block, once normally and once with a forward that fails."""

    macs: float
    params: float
    added: StateDictDiff  # normal run: keys thop left behind
    kept_on: tuple[tuple[str, str], ...]  # (module path, type) that kept the buffers: no thop rule
    cleaned: tuple[tuple[str, str], ...]  # modules with a rule: buffers popped
    failed_error: str  # the failing forward's exception
    failed_added: StateDictDiff  # what the failing run left
    failed_hooks_left: int  # forward hooks thop never removed
    failed_training: tuple[bool, bool]  # block.training before, after the failed profile

    def __str__(self) -> str:
        kept = ", ".join(f"{p or '<root>'} ({t})" for p, t in self.kept_on)
        clean = ", ".join(f"{p} ({t})" for p, t in self.cleaned)
        return (
            f"thop.profile(Conv(3, 16, 3), 1x3x32x32) -> MACs {self.macs:,.0f}, params {self.params:,.0f}\n"
            f"keys added to the block's state_dict:\n{_indent(self.added)}\n"
            f"kept by (no thop rule): {kept}\ncleaned (thop rule): {clean}\n"
            f"with a failing forward ({self.failed_error}):\n{_indent(self.failed_added)}\n"
            f"  forward hooks left: {self.failed_hooks_left}, "
            f"training before/after: {self.failed_training[0]}/{self.failed_training[1]}"
        )


def _indent(obj: object) -> str:
    return "\n".join(f"  {line}" for line in str(obj).splitlines())


def step1_profile_in_place() -> Step1:
    """Profile a fresh Conv+BN+SiLU block in place with thop and record what stays behind."""
    thop = import_thop()
    rules = _thop_rules()
    _require_clean_act()
    with _restoring_act() as act:
        block = Conv(3, 16, 3)
        before = snapshot(block)
        macs, params = thop.profile(block, inputs=(torch.randn(_BLOCK_INPUT),), verbose=False)
        added = state_dict_diff(before, block)
        mods = list(block.named_modules())
        kept = tuple((p, type(m).__name__) for p, m in mods if "total_ops" in m._buffers)
        cleaned = tuple((p, type(m).__name__) for p, m in mods if type(m) in rules)
        _strip(act)

        block = Conv(3, 16, 3).train()
        before, was_training = snapshot(block), block.training
        try:  # 1 input channel for a 3-channel conv: the forward raises inside thop.profile
            thop.profile(block, inputs=(torch.randn(1, 1, 32, 32),), verbose=False)
            raise AssertionError("the forward with a wrong channel count was expected to fail")
        except RuntimeError as e:
            error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        failed = state_dict_diff(before, block)
        hooks = sum(len(m._forward_hooks) for m in block.modules())
        return Step1(macs, params, added, kept, cleaned, error, failed, hooks, (was_training, block.training))


def _thop_rules() -> set[type]:
    """The module types installed thop has a counting rule for (the ones it cleans up after)."""
    import_thop()
    return set(importlib.import_module("thop.profile").register_hooks)


def _strip(module: nn.Module) -> None:
    for name in THOP_BUFFERS:
        module._buffers.pop(name, None)


# --- Step 2 --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step2:
    """State_dict sizes of YOLO-sized nets built before, after, and profiled in place during a leak."""

    clean_entries: int  # yolo() with no leak
    fresh_entries: int  # yolo() built after one Conv block was profiled in place
    fresh_stray: int
    fresh_example: tuple[tuple[str, str], ...]  # first few stray keys and dtypes
    conv_refs: int  # Conv modules in the net: each carries the shared act's two buffers
    profiled_entries: int  # yolo() profiled in place itself
    profiled_stray: int

    def __str__(self) -> str:
        ex = ", ".join(f"{k} ({d})" for k, d in self.fresh_example)
        return (
            f"yolo() before any profiling: {self.clean_entries} state_dict entries, 0 stray\n"
            f"yolo() built after profiling one Conv block: {self.fresh_entries} entries, "
            f"{self.fresh_stray} stray float64 keys = 2 x {self.conv_refs} Conv modules sharing one SiLU\n"
            f"  e.g. {ex}\n"
            f"yolo() profiled in place: {self.profiled_entries} entries, {self.profiled_stray} stray keys"
        )


def step2_shared_activation() -> Step2:
    """Show the class-level ``Conv.default_act`` carrying the leak into a model that was never profiled."""
    thop = import_thop()
    clean = yolo()
    clean_entries = len(clean.state_dict())
    with shared_act_leak():
        fresh = yolo()
        sd = fresh.state_dict()
        stray = leaked_keys(fresh)
        conv_refs = sum(isinstance(m, Conv) for m in fresh.modules())
        profiled = yolo()
        thop.profile(profiled, inputs=(torch.randn(_YOLO_INPUT),), verbose=False)
        profiled_entries = len(profiled.state_dict())
        profiled_stray = len(leaked_keys(profiled))
    return Step2(
        clean_entries=clean_entries,
        fresh_entries=len(sd),
        fresh_stray=len(stray),
        fresh_example=tuple((k, _dt(sd[k].dtype)) for k in stray[:2]),
        conv_refs=conv_refs,
        profiled_entries=profiled_entries,
        profiled_stray=profiled_stray,
    )


# --- Step 3 --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step3:
    """Which (EMA, model) pairs disagree in dtype once the EMA copy is cast."""

    float_pairs: int
    mismatched_after_float: tuple[tuple[str, str, str], ...]  # (key, EMA dtype, model dtype)
    mismatched_after_half: int  # after ema.half() instead: every float pair

    def __str__(self) -> str:
        w = max((len(k) for k, _, _ in self.mismatched_after_float), default=0)
        rows = "\n".join(f"  {k:<{w}}  EMA {e:<8} model {m}" for k, e, m in self.mismatched_after_float)
        n = len(self.mismatched_after_float)
        return (
            f"tiny_cnn built during the leak, EMA = deepcopy(model).float(): "
            f"{n} of {self.float_pairs} float pairs disagree in dtype\n{rows}\n"
            f"with ema.half() instead: {self.mismatched_after_half} of {self.float_pairs} pairs disagree"
        )


def _mismatches(ema: nn.Module, model: nn.Module) -> tuple[int, tuple[tuple[str, str, str], ...]]:
    esd, msd = ema.state_dict(), model.state_dict()
    floats = [k for k, v in esd.items() if v.is_floating_point()]
    bad = tuple((k, _dt(esd[k].dtype), _dt(msd[k].dtype)) for k in floats if esd[k].dtype != msd[k].dtype)
    return len(floats), bad


def step3_cast_ema() -> Step3:
    """Cast the EMA copy as a validator does and list the pairs whose dtypes now differ."""
    with shared_act_leak():
        model, ema = _leaky_setup()
        n, bad = _mismatches(ema, model)
        _, bad_half = _mismatches(deepcopy(model).half(), model)
    return Step3(n, bad, len(bad_half))


# --- Step 4 --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step4:
    """``_foreach_lerp_`` on the mismatched pairs: the error, the partial update, the double decay."""

    error: str  # exactly what seed_after raised
    bad_index: int  # index of the first mismatched pair in the foreach lists
    bad_key: str
    updated_before_failure: tuple[str, ...]  # EMA entries the failed call had already changed
    key: str  # the entry whose numbers are shown: the largest gap among the updated pairs
    index: int  # flat index of the element shown
    ema0: float  # its first element before
    model_value: float
    one_step: float  # d * ema0 + (1 - d) * model: what one update must give
    after_failed_call: float
    after_naive_fallback: float  # try foreach, except: loop -> decayed twice
    model_weight: float  # (1 - d)
    effective_model_weight: float  # what the naive fallback applied
    weights: tuple[tuple[str, float | None], ...]  # per float pair: model weight the naive path applied
    ema_lab_error: str  # ema_lab.foreach_update's up-front ValueError
    ema_lab_unchanged: bool

    def __str__(self) -> str:
        return (
            f"seed_after (one torch._foreach_lerp_) raised: {self.error}\n"
            f"first bad pair: #{self.bad_index} {self.bad_key!r}; the {len(self.updated_before_failure)} "
            f"pairs before it were already updated: {', '.join(self.updated_before_failure)}\n"
            f"{self.key}[{self.index}] (its largest EMA-model gap) with d = {DECAY}: "
            f"EMA {self.ema0:.6f}, model {self.model_value:.6f}\n"
            f"  one correct step:          {self.one_step:.6f}\n"
            f"  after the failed call:     {self.after_failed_call:.6f}\n"
            f"  after a try/except loop:   {self.after_naive_fallback:.6f} "
            f"(model weight {self.effective_model_weight:.4f} instead of {self.model_weight:.4f}: "
            "decayed twice)\n"
            f"ema_lab.foreach_update instead raises before touching anything:\n  {self.ema_lab_error}\n"
            f"  EMA unchanged: {self.ema_lab_unchanged}"
        )


def _applied_weights(
    before: dict[str, torch.Tensor],
    model: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    keys: list[str],
) -> tuple[tuple[str, float | None], ...]:
    """Per entry, w in ``after = before + w * (model - before)`` at its largest gap (None: no gap)."""
    out = []
    for k in keys:
        b, m, a = (t.double().flatten() for t in (before[k], model[k], after[k]))
        gap = m - b
        i = int(gap.abs().argmax()) if gap.numel() else 0
        out.append((k, None if gap.numel() == 0 or gap[i] == 0 else ((a[i] - b[i]) / gap[i]).item()))
    return tuple(out)


def step4_foreach_fails() -> Step4:
    """Run the post-change update on mismatched pairs; measure the partial update and the naive fallback."""
    with shared_act_leak():
        model, ema = _leaky_setup()
        esd, msd = ema.state_dict(), model.state_dict()
        floats = [k for k, v in esd.items() if v.is_floating_point()]
        bad_index = next(i for i, k in enumerate(floats) if esd[k].dtype != msd[k].dtype)
        before = snapshot(ema)
        # Show the element that moves most, so the double decay is visible in six decimals.
        gaps = {k: (msd[k] - before[k]).abs().flatten() for k in floats[:bad_index]}
        key = max(gaps, key=lambda k: gaps[k].max().item())
        index = int(gaps[key].argmax())
        e0, m0 = before[key].flatten()[index].item(), msd[key].flatten()[index].item()

        mine = deepcopy(ema)  # ema_lab's path, from the same starting point
        pairs = ModulePairs.collect(mine, model)
        mine_before = snapshot(mine)
        try:
            foreach_update(pairs.ema, pairs.model, DECAY, pairs.names)
            raise AssertionError("foreach_update accepted mismatched dtypes")
        except ValueError as e:
            ema_lab_error = f"ValueError: {e}"
        unchanged = state_dict_diff(mine_before, mine).empty

        try:
            seed_after(ema, model, DECAY)
            raise AssertionError("seed_after was expected to raise")
        except RuntimeError as e:
            error = f"RuntimeError: {e}"
        after_failed = ema.state_dict()[key].flatten()[index].item()
        updated = state_dict_diff(before, ema).value_changed
        seed_before(ema, model, DECAY)  # the naive `except RuntimeError: loop` fallback
        after_fallback = ema.state_dict()[key].flatten()[index].item()
        weights = _applied_weights(before, msd, ema.state_dict(), floats)
    one = DECAY * e0 + (1 - DECAY) * m0
    return Step4(
        error=error,
        bad_index=bad_index,
        bad_key=floats[bad_index],
        updated_before_failure=updated,
        key=key,
        index=index,
        ema0=e0,
        model_value=m0,
        one_step=one,
        after_failed_call=after_failed,
        after_naive_fallback=after_fallback,
        model_weight=1 - DECAY,
        effective_model_weight=(after_fallback - e0) / (m0 - e0),
        weights=weights,
        ema_lab_error=ema_lab_error,
        ema_lab_unchanged=unchanged,
    )


# --- Step 5 --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step5:
    """The same mismatched pairs through the pre-change loop, ``gated_update`` and ``ModelEMA``."""

    decay: float
    loop_error: str | None  # what the pre-change loop raised: None
    loop_dtypes_kept: bool  # the float32 EMA buffers stay float32 (in-place ops cast back)
    gated_max_diff: float  # vs the loop, over every float entry
    model_ema_max_diff: float
    model_ema_foreach_error: str  # ModelEMA(strategy="foreach") refuses, naming the pair

    def __str__(self) -> str:
        return (
            f"decay {self.decay:.6g} (ModelEMA's first update)\n"
            f"pre-change loop (seed_before): error {self.loop_error}, "
            f"EMA dtypes kept: {self.loop_dtypes_kept}\n"
            f"gated_update vs loop: max |difference| {self.gated_max_diff:.3g}\n"
            f'ModelEMA(strategy="auto") vs loop: max |difference| {self.model_ema_max_diff:.3g}\n'
            f'ModelEMA(strategy="foreach") refuses: {self.model_ema_foreach_error}'
        )


def _error_of(fn: Callable[..., object], *args: object) -> str | None:
    """Run ``fn(*args)``; return "Type: message" of what it raised, or None."""
    try:
        fn(*args)
    except Exception as e:  # the point is to report whatever it raised
        return f"{type(e).__name__}: {e}"
    return None


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(
        ((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()),
        default=0.0,
    )


def step5_loop_and_fixes() -> Step5:
    """Show the pre-change loop promoting silently and ema_lab's fixes agreeing with it."""
    with shared_act_leak():
        model, ema = _leaky_setup()
        auto = ModelEMA(model, strategy="auto")
        auto.ema.load_state_dict(ema.state_dict())  # same starting values ...
        auto.ema.float()  # ... and the same cast
        d = auto.decay(auto.updates + 1)

        loop_ema, gated_ema = deepcopy(ema), deepcopy(ema)
        dtypes = {k: v.dtype for k, v in loop_ema.state_dict().items()}
        loop_error = _error_of(seed_before, loop_ema, model, d)
        loop_sd = loop_ema.state_dict()
        kept = all(loop_sd[k].dtype == dt for k, dt in dtypes.items())

        pairs = ModulePairs.collect(gated_ema, model)
        gated_update(pairs.ema, pairs.model, d, pairs.names)
        auto.update(model)

        strict = ModelEMA(model, strategy="foreach")
        strict.ema.float()
        try:
            strict.update(model)
            raise AssertionError('ModelEMA(strategy="foreach") accepted mismatched dtypes')
        except ValueError as e:
            foreach_error = f"ValueError: {e}"
        return Step5(
            decay=d,
            loop_error=loop_error,
            loop_dtypes_kept=kept,
            gated_max_diff=_max_diff(gated_ema.state_dict(), loop_sd),
            model_ema_max_diff=_max_diff(auto.ema.state_dict(), loop_sd),
            model_ema_foreach_error=foreach_error,
        )


# --- Step 6 --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step6:
    """``profile_flops`` (thop on a deep copy): nothing leaks, and the post-change update runs."""

    gflops: float
    params: int
    block_changes: tuple[str, ...]  # fingerprint differences of the profiled block: none
    shared_act_keys: tuple[str, ...]  # state_dict of Conv.default_act afterwards: empty
    new_model_stray: int  # stray keys on a model built afterwards
    seed_after_error: str | None  # what the post-change foreach update on a cast EMA raised: None
    thop_version: str
    fact: str

    def __str__(self) -> str:
        return (
            f"profile_flops(Conv(3, 16, 3), 1x3x32x32) -> {self.gflops:.6f} GFLOPs, {self.params} params\n"
            f"block changed: {list(self.block_changes) or 'nothing'}; Conv.default_act state_dict: "
            f"{list(self.shared_act_keys) or 'empty'}; stray keys on a model built afterwards: "
            f"{self.new_model_stray}\n"
            f"seed_after on a .float() EMA afterwards: error {self.seed_after_error}\n"
            f"installed: thop {self.thop_version}\nfact: {self.fact}"
        )


def _installed_thop() -> str:
    """The installed thop's version, PEP 440-normalised where ``packaging`` is available."""
    raw = metadata.version("thop")
    try:
        from packaging.version import Version
    except ImportError:
        return raw
    return str(Version(raw))


def step6_deepcopy_fix() -> Step6:
    """Profile with :func:`ema_lab.profile_flops` and show that neither the block nor the class leaks."""
    _require_clean_act()
    with _restoring_act() as act:
        block = Conv(3, 16, 3)
        fp = fingerprint(block)
        gflops, params = profile_flops(block, torch.randn(_BLOCK_INPUT))
        changes = tuple(fp.changes(fingerprint(block)))
        act_keys = tuple(act.state_dict())
        model = tiny_cnn()
        stray = len(leaked_keys(model))
        ema = deepcopy(model).eval().float()
        train_step(model)
        seed_after_error = _error_of(seed_after, ema, model, DECAY)
    return Step6(
        gflops=gflops,
        params=params,
        block_changes=changes,
        shared_act_keys=act_keys,
        new_model_stray=stray,
        seed_after_error=seed_after_error,
        thop_version=_installed_thop(),
        fact=ULTRALYTICS_THOP_FACT,
    )


#: (title, step) in reading order.
STEPS: tuple[tuple[str, Callable[[], object]], ...] = (
    ("in-place thop.profile leaves float64 buffers", step1_profile_in_place),
    ("a class-level shared activation carries them into new models", step2_shared_activation),
    ("casting the EMA copy makes pairs disagree in dtype", step3_cast_ema),
    ("the foreach update raises, after a partial update", step4_foreach_fails),
    ("the old loop promotes silently; gated_update and ModelEMA handle it", step5_loop_and_fixes),
    ("profiling a deep copy leaves nothing behind", step6_deepcopy_fix),
)


def run_all(verbose: bool = True) -> list[object]:
    """Run the six steps in order, print each one's observations, and return them."""
    results = []
    for i, (title, step) in enumerate(STEPS, 1):
        result = step()
        if verbose:
            print(f"== step {i}: {title}\n{result}\n")
        results.append(result)
    return results
