"""``ModelEMA``: a drop-in for ultralytics' class that keeps one cached step and nothing strategy-specific."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import is_dataclass
from functools import partial
from itertools import zip_longest

import torch
from torch import Tensor, nn

from .checks import check_decay, check_int, weight_of
from .flat_step import CAT_MAX_NUMEL, FlatStep
from .graph_step import GraphStep
from .pairs import Pairs, check_materialized, collect_pairs, module_entries
from .ranks import RankDuties, is_fully_sharded
from .schedules import Schedule, decay_over, ramp
from .step import Step, StepOptions
from .updates import LIST_STRATEGIES, ListStep

__all__ = ["ModelEMA", "BaseEMA", "STRATEGIES", "unwrap_model"]

STEPS: dict[str, type[Step]] = {**dict.fromkeys(LIST_STRATEGIES, ListStep), "flat": FlatStep}
STRATEGIES = (*STEPS, "auto")


def resolve_strategy(strategy: str, tensors: Sequence[Tensor], in_place: bool = False) -> str:
    """``"auto"``: "flat", or "gated" where a tensor is not strided or must stay ``in_place``."""
    if strategy != "auto":
        return strategy
    movable = all(t.layout == torch.strided and t.device.type != "meta" for t in tensors)
    return "flat" if movable and not in_place else "gated"


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside DataParallel/DistributedDataParallel and ``torch.compile`` wrappers."""
    while True:
        # torch.compile's wrapper holds the module as "_orig_mod"; a dict lookup, as getattr of a missing
        # name goes through Module.__getattr__ and builds an AttributeError on every update.
        wrapped = isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))
        inner = model.module if wrapped else model._modules.get("_orig_mod")
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _name(schedule: Schedule) -> str:
    """A schedule as a checkpoint names it, or a ValueError naming the fix (a lambda has no name)."""
    if is_dataclass(schedule):
        return repr(schedule)
    if isinstance(schedule, partial):
        values = (*schedule.args, *schedule.keywords.values())
        if all(isinstance(v, (int, float, str, type(None))) for v in values):  # reprs that name the value
            args = [*map(repr, schedule.args), *(f"{k}={v!r}" for k, v in schedule.keywords.items())]
            return f"{_name(schedule.func)}({', '.join(args)})"
    elif (inspect.isfunction(schedule) or inspect.isbuiltin(schedule)) and "<" not in schedule.__qualname__:
        return schedule.__qualname__  # "<lambda>", "f.<locals>.g": shared by every lambda, every closure
    raise ValueError(
        f"the schedule {schedule!r} has no name a checkpoint can tell from another's: use a schedule of "
        "ema_lab.schedules, a function defined at module level, a dataclass, or a partial of one of these"
    )


def _unfit(saved: object, mine: Tensor) -> str | None:
    """Why a checkpoint's entry (of ``mine``'s shape) cannot be copied into ``mine``, or None."""
    if not isinstance(saved, Tensor):
        return f"a {type(saved).__name__}, not a tensor"
    if saved.layout != torch.strided:
        return f"a {saved.layout} tensor, not a dense one"
    if saved.is_meta:
        return "on the meta device: it holds no values (saved before the weights were materialized)"
    if not torch.can_cast(saved.dtype, mine.dtype):  # complex to real, float to int: values of another kind
        return f"{saved.dtype}, which does not cast to this EMA's {mine.dtype}"
    return None


class BaseEMA(RankDuties):
    """What the EMAs share: an EMA per schedule (``.emas``), all moved by one cached step."""

    sharded = False  # ShardedModelEMA: the EMA stays in DTensor shards, so its step must update in place

    def __init__(
        self,
        model: nn.Module,
        decay: float | Schedule | Sequence[Schedule] = 0.9999,
        tau: float = 2000,
        updates: int = 0,
        strategy: str = "auto",
        *,
        every: int = 1,
        cat_max_numel: int = CAT_MAX_NUMEL,
        cuda_graph: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        schedules = list(decay) if isinstance(decay, (list, tuple)) else [decay]
        schedules = [s if callable(s) else ramp(check_decay(s), tau) for s in schedules]
        check_int("updates", updates, 0)
        check_int("every", every, 1)
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
        if self.sharded and strategy != "auto" and not STEPS[strategy].in_place:
            use = ["auto", *(s for s, step in STEPS.items() if step.in_place)]
            why = "moves the EMA into new buffers; a sharded EMA keeps its DTensor shards in place"
            raise ValueError(f"strategy {strategy!r} {why}: use one of {use}")
        if cuda_graph and self.sharded:
            raise ValueError("cuda_graph=True records one device's update; a sharded EMA cannot use it")
        check_materialized(module_entries(unwrap_model(model)))
        with torch.inference_mode(False):  # built under inference_mode, the EMA would be read-only outside
            ema = self._average_of(unwrap_model(model))
            self.emas: list[nn.Module] = [ema, *(deepcopy(ema) for _ in schedules[1:])]
        floats = [t for t in (*ema.parameters(), *ema.buffers()) if t.is_floating_point()]
        self.resolved_strategy = resolve_strategy(strategy, floats, in_place=self.sharded)
        self._step_type: type[Step] = STEPS[self.resolved_strategy]
        if cuda_graph:
            if not self._step_type.recordable:
                why = f"strategy {strategy!r} runs {self.resolved_strategy!r} for this model"
                raise ValueError(f"cuda_graph=True records the 'flat' step; {why}")
            GraphStep.check_devices([*ema.parameters(), *ema.buffers()])
            self._step_type = GraphStep
        self._options = StepOptions(self.resolved_strategy, cat_max_numel)
        self._step: Step | None = None
        self.schedules: list[Schedule] = schedules
        self.updates, self.every, self.strategy, self.cuda_graph = updates, every, strategy, cuda_graph
        self.enabled = True
        self.rebuilds = 0  # how many times the cached step was (re)built

    @property
    def ema(self) -> nn.Module:
        """The (first) EMA module."""
        return self.emas[0]

    @ema.setter
    def ema(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ema must be a torch.nn.Module, got {type(module).__name__}")
        self.emas[0] = module
        self._step = None  # the cached step moves the old module: the next update() builds one over this one

    # The name torch's AveragedModel and timm's EMAs give it: timm's unwrap_model and CheckpointSaver read it.
    module = ema

    @property
    def schedule(self) -> Schedule:
        """The (first) EMA's decay schedule: :func:`ema_lab.schedules.ramp` for a number."""
        return self.schedules[0]

    def decay(self, n: int, schedule: Schedule | None = None) -> float:
        """The decay of update number ``n`` by ``schedule`` (default: the first EMA's), checked."""
        schedule = self.schedule if schedule is None else schedule
        d = schedule(n)
        try:
            return check_decay(d)
        except (TypeError, ValueError):
            why = f"gave decay {d!r} at update {n}, not a number in [0, 1]"
            raise ValueError(f"the schedule {schedule!r} {why}") from None

    @property
    def modes(self) -> list[str]:
        """Each flat group's mode: ``fused``, ``cast``, ``cat``, ``foreach`` or ``cat+foreach``."""
        return [] if self._step is None else self._step.modes

    def _collect(self, model: nn.Module) -> Pairs:
        return collect_pairs(self.emas, model)

    def _rebuild(self, model: nn.Module) -> Step:
        """A new step over ``model`` and the EMAs, checked and gathered like a cached one."""
        self._step = None  # a failed rebuild must not leave the stale step behind
        with torch.inference_mode(False):  # its buffers must stay writable outside inference_mode too
            step = self._step_type(self._collect(model), model, self._options)
        if not step.ready(model):  # only a model changed meanwhile fails here
            raise RuntimeError("the model changed while its EMA step was being built")
        self._step = step
        self.rebuilds += 1
        return step

    def update(self, model: nn.Module, decay: float | Tensor | None = None) -> None:
        """Move every EMA one step towards ``model`` (wrappers unwrapped), with ``every=k`` every k-th call by
        the product of the k decays; ``decay`` overrides the schedules ("flat": a 0-dim tensor too)."""
        if not self.enabled:
            return
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if decay is not None:
            decay = check_decay(decay, self._step_type.tensor_decay)
        n = self.updates + 1
        if n % self.every:
            self.updates = n
            return
        decays, weights = [], []
        for schedule in self.schedules:  # a loop, not a comprehension: no frame of its own before 3.12
            if decay is not None:
                d = decay
            elif self.every == 1:  # the default
                d = self.decay(n, schedule)
            else:
                d = decay_over(partial(self.decay, schedule=schedule), n, self.every)
            decays.append(d)
            weights.append(weight_of(d))  # 1 - decay, once
        model = unwrap_model(model)
        if not self.ranks_checked:  # once: buffers that the ranks compute apart need sync_buffers()
            self._warn_unsynced(model)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad(), minus its three Python objects (7 us a call)
        try:
            step = self._step
            if step is None or not step.ready(model):  # stale, or a live read no longer fits: rebuilt
                step = self._rebuild(model)
            step.apply(decays, weights)
        finally:
            torch._C._set_grad_enabled(grad)
        self.updates = n

    def state_dict(self) -> dict:
        """What a resumed run needs to continue bit for bit: the EMAs, the count, the schedules, ``every``."""
        schedules = [_name(s) for s in self.schedules]
        emas = [e.state_dict() for e in self.emas]
        return {"emas": emas, "updates": self.updates, "schedules": schedules, "every": self.every}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` in place; one that does not fit is refused before anything changes."""
        self._check_state(state)
        for ema, saved in zip(self.emas, state["emas"]):
            ema.load_state_dict(saved)  # in place: the cached step keeps its tensors
        self.updates = state["updates"]

    def _check_state(self, state: dict) -> None:
        own = self.state_dict()
        if not isinstance(state, dict) or state.keys() != own.keys():
            raise ValueError(f"not a {type(self).__name__} state_dict: expected a dict of {sorted(own)}")
        for key in ("schedules", "every"):  # one schedule per EMA: their number is checked too
            if state[key] != own[key]:
                raise ValueError(f"the checkpoint's {key} is {state[key]!r}, this EMA's {own[key]!r}")
        check_int("updates", state["updates"], 0)
        emas = state["emas"] if isinstance(state["emas"], list) else []
        for saved, mine in zip_longest(emas, own["emas"], fillvalue={}):  # one more or fewer: all differ
            saved = saved if isinstance(saved, dict) else {}
            shape = {k: getattr(v, "shape", None) for k, v in saved.items()}  # a non-tensor: None
            diff = [k for k in {**shape, **mine} if shape.get(k) != getattr(mine.get(k), "shape", None)]
            if diff:
                why = f"entries {diff[:3]} differ in name or shape"
                raise ValueError(f"the checkpoint is another model's: {why}")
            for key, value in saved.items():  # torch would copy the entries before it, then raise
                if why := _unfit(value, mine[key]):
                    raise ValueError(f"the checkpoint's entry {key!r} is {why}: nothing was loaded")

    def __getstate__(self) -> dict:
        # The cached step holds weak references and module dicts: dropped, the next update() rebuilds it.
        return {**self.__dict__, "_step": None}

    def __repr__(self) -> str:
        args = f"decay={self.schedule!r}, updates={self.updates}, every={self.every}"
        return f"{type(self).__name__}({args}, strategy={self.strategy!r}, cuda_graph={self.cuda_graph})"


class ModelEMA(BaseEMA):
    """Exponential moving average of a model's weights, with the ramp ``decay * (1 - exp(-n / tau))``.

    A drop-in for ultralytics' ``ModelEMA`` (docs/api.md) that collects the pairs once into a cached step;
    ``cat_max_numel``: smaller model tensors are gathered by ``torch.cat``. Not thread-safe."""

    def _average_of(self, model: nn.Module) -> nn.Module:
        if is_fully_sharded(model):
            raise TypeError(
                "model is sharded with FSDP2 (fully_shard): a deep copy of it is not possible; "
                "use ema_lab.ShardedModelEMA, which keeps the EMA of the local shards"
            )
        # Pruning's (or the old weight_norm's) computed weight, a non-leaf that deepcopy refuses: detached.
        held = (t for m in model.modules() for t in vars(m).values() if isinstance(t, Tensor))
        ema = deepcopy(model, {id(t): t.detach().clone() for t in held if t.grad_fn}).eval()
        for p in ema.parameters():
            p.requires_grad_(False)
        return ema

    def update_attr(
        self, model: nn.Module, include: tuple = (), exclude: tuple = ("process_group", "reducer")
    ) -> None:
        """Copy the model's plain attributes (not starting with ``_``) to the EMA, as ultralytics does."""
        if self.enabled:
            for k, v in unwrap_model(model).__dict__.items():
                if not ((include and k not in include) or k.startswith("_") or k in exclude):
                    setattr(self.ema, k, v)
