"""Shared test helpers: an independent float64 EMA reference, and the scripts of benchmarks/ as modules."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

from ema_lab import ModelEMA
from ema_lab.bench.models import build
from ema_lab.bench.seed import lerp_float_entries


def float_entries(module: torch.nn.Module) -> dict[str, Tensor]:
    """The floating-point state_dict entries (what every EMA averages), the module's own tensors detached: a
    write into one reaches the module, also after flatten_model (whose ``state_dict()`` gives copies)."""
    return {k: v.detach() for k, v in module.state_dict(keep_vars=True).items() if v.is_floating_point()}


def reference_step(ref: list[Tensor], model: list[Tensor], d: float) -> None:
    """One EMA step in float64, written independently of ema_lab: ref = d * ref + (1 - d) * model."""
    for i, m in enumerate(model):
        ref[i] = d * ref[i] + (1 - d) * m.detach().double()


def tolerance(dtype: torch.dtype, steps: int) -> float:
    """A per-element error bound for ``steps`` EMA steps of values of order 1 in ``dtype``."""
    eps = torch.finfo(dtype).eps
    return 4 * eps * (1 + steps) if dtype in (torch.float16, torch.bfloat16) else 8 * eps * (1 + steps)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_file(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` (not in a package: a script, notebooks/execute.py) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, with ``benchmarks/`` on ``sys.path`` as when it runs (a script
    imports its sibling ``result_homes.py``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return load_file(BENCHMARKS / f"{name}.py", name)


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks")
_HOOK_DICTS += ("_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_HOOK_DICTS += ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks")
_HOOK_DICTS += ("_load_state_dict_post_hooks",)


def fingerprint(model: torch.nn.Module) -> dict[str, tuple]:
    """Everything a profiler could change on a module tree, per module path: type, training flag, hook
    ids, and each parameter and buffer (persistent or not) as (object id, a copy)."""
    out = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        tensors = {
            name: (id(t), t.detach().clone())
            for name, t in (*mod._parameters.items(), *mod._buffers.items())
            if t is not None
        }
        hooks = {d: tuple(map(id, getattr(mod, d).values())) for d in _HOOK_DICTS if getattr(mod, d, None)}
        out[path] = (type(mod).__name__, mod.training, hooks, tensors)
    return out


def _same(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and values, NaN equal to NaN."""
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What differs between two fingerprints, one line each, sorted; empty when nothing does."""
    out = [f"module added or removed: {p!r}" for p in before.keys() ^ after.keys()]
    for path in before.keys() & after.keys():
        (kind, training, hooks, tensors), (kind2, training2, hooks2, tensors2) = before[path], after[path]
        out += [f"module type changed: {path!r}"] * (kind != kind2)
        out += [f"training mode changed: {path!r}"] * (training != training2)
        out += [f"hooks changed: {path!r}"] * (hooks != hooks2)
        dot = f"{path}." if path else ""
        for name in tensors.keys() | tensors2.keys():
            if name not in tensors or name not in tensors2:
                out.append(f"tensor added or removed: {dot}{name}")
            elif tensors[name][0] != tensors2[name][0]:
                out.append(f"tensor object replaced: {dot}{name}")
            elif not _same(tensors[name][1], tensors2[name][1]):
                out.append(f"values changed: {dot}{name}")
    return sorted(out)


#: name -> what it does to (model, ema); each gives the tensors new memory behind the same module objects.
CONVERSIONS: dict[str, Callable[[torch.nn.Module, ModelEMA], object]] = {
    "model.double()": lambda model, ema: model.double(),
    "ema.ema.half()": lambda model, ema: ema.ema.half(),
}


class CachedListEMA(ModelEMA):
    """UNSAFE ON PURPOSE: ultralytics 8.4.190's update, over the ``state_dict()`` tensors it kept at first.

    ``state_dict()`` returns aliases of the parameters' memory at that moment; after ``model.double()``,
    ``.to()`` or an in-place ``ema.ema.half()`` the modules hold new memory and this EMA averages dead
    tensors, with no error. ModelEMA must not behave like this.
    """

    _cached: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None  # (ema, model), kept once

    def update(self, model: torch.nn.Module) -> None:
        """Move the kept EMA tensors one step towards the kept model tensors (the seed's after-code)."""
        if not self.enabled:
            return
        if self._cached is None:
            self._cached = (self.ema.state_dict(), model.state_dict())
        self.updates += 1
        lerp_float_entries(*self._cached, self.decay(self.updates))


def follows_after(ema_class: type[ModelEMA], conversion: str, updates: int = 20) -> tuple[bool, float]:
    """(did any EMA weight move, max |EMA - model|) after one update, ``conversion``, a shift of every model
    weight by 1.0 and ``updates`` more updates at decay ~0.5: a working EMA closes the gap to 0.5**updates."""
    model = build("tiny_cnn")
    ema = ema_class(model, decay=0.5, tau=0.01)
    ema.update(model)  # builds whatever cache the class keeps
    CONVERSIONS[conversion](model, ema)
    before = {k: v.clone() for k, v in float_entries(ema.ema).items()}
    with torch.no_grad():
        for v in float_entries(model).values():
            v.add_(1.0)
    for _ in range(updates):
        ema.update(model)
    after, target = float_entries(ema.ema), float_entries(model)
    moved = any(not torch.equal(before[k], v) for k, v in after.items())
    return moved, max((v.double() - target[k].double()).abs().max().item() for k, v in after.items())


def clear_thop_buffers(module: nn.Module) -> None:
    """Delete the buffers an in-place ``thop.profile`` left on ``module`` and its submodules."""
    for mod in module.modules():
        for name in ("total_ops", "total_params"):
            mod._buffers.pop(name, None)


def thop_buffers(module: nn.Module) -> list[str]:
    """The names of the buffers an in-place ``thop.profile`` left on ``module`` and its submodules."""
    return [
        k
        for k, _ in module.named_buffers(remove_duplicate=False)
        if k.rsplit(".", 1)[-1] in ("total_ops", "total_params")
    ]


@contextmanager
def kept_clean(shared: nn.Module) -> Iterator[None]:
    """Fail if ``shared`` (a module every instance of a class holds) leaks thop buffers in the block, or
    already had; clean it either way."""
    assert not thop_buffers(shared), f"{type(shared).__name__} already held thop buffers before this test"
    try:
        yield
        assert not thop_buffers(shared), f"this test leaked thop buffers onto {type(shared).__name__}"
    finally:
        clear_thop_buffers(shared)


@contextmanager
def one_rank_group(folder: Path) -> Iterator[None]:
    """A one-rank gloo process group in this process, its file store in ``folder`` (DDP, FSDP2 and a
    ShardedModelEMA need one); skipped where torch.distributed is missing or a group already exists."""
    import pytest
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("skipped: this torch has no torch.distributed")
    if dist.is_initialized():
        pytest.skip("skipped: a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(folder / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
