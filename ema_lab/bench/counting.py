"""Count what an EMA update launches: ATen ops via ``TorchDispatchMode``, CUDA kernels via ``torch.profiler``.

What :func:`count_ops` counts, and what it does not:

- Counted: every ATen op that reaches the Python dispatch key while ``fn`` runs, keyed by its
  overload name (``aten._foreach_lerp_.Scalar``, ``aten.mul_.Tensor``), views included
  (``state_dict()`` and ``.detach()`` each dispatch ``aten.detach.default``). Each of these is one
  trip through the dispatcher; each non-view op is at least one kernel on the device.
- Not counted: ops that run *inside* another op's kernel (the per-tensor loop inside a CPU
  ``_foreach_lerp_``, the dtype casts inside ``add_``), Python-side work that dispatches nothing
  (``data_ptr()``, walking modules, building lists) and composite ops that decompose before the
  Python key (their pieces are counted instead).
- Deterministic: the same call gives the same Counter on every run, so tests assert on it.

The number of device kernels is a different question (one ``_foreach_lerp_`` is one kernel per
chunk of tensors on CUDA, but one lerp per tensor on CPU): :func:`count_kernel_launches` asks the
profiler, and says "not available: <reason>" where the device or profiler cannot answer. The kernels
that ran are not always the launches the host paid for: a CUDA graph's replay runs all of its kernels
from one host call. :func:`count_host_launches` counts those calls.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_ops", "without_views", "kernel_launches_or_reason", "count_host_launches"]


class _OpCounter(TorchDispatchMode):
    """Counts each ATen overload dispatched while active; runs every op unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.counts[str(func)] += 1
        # The mode is off while func runs, so ops called from inside its kernel are not seen.
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Counter[str]:
    """Run ``fn(*args, **kwargs)`` once and return the ATen ops it dispatched, keyed by overload name."""
    mode = _OpCounter()
    with mode:
        fn(*args, **kwargs)
    return mode.counts


def is_view_op(name: str) -> bool:
    """True when the overload ``name`` (e.g. ``aten.detach.default``) returns a view: no data moves."""
    namespace, op, overload = name.split(".", 2) if name.count(".") >= 2 else (*name.split("."), "default")
    packet = getattr(getattr(torch.ops, namespace), op)
    return bool(getattr(packet, overload).is_view)


def without_views(counts: Counter[str]) -> Counter[str]:
    """The ops of ``counts`` that compute (views and aliases such as ``detach`` dropped)."""
    return Counter({k: v for k, v in counts.items() if not is_view_op(k)})


class KernelCountUnavailable(RuntimeError):
    """The device or profiler cannot count kernel launches; the message starts with "not available:"."""


def _unavailable_reason(device: str) -> str | None:
    if device == "cpu":
        return "not available: CPU ops run as function calls, not device kernel launches (use count_ops)"
    if device == "mps":
        # torch.mps.profiler only emits OS signposts for Instruments; torch.profiler has no MPS activity.
        return "not available: torch.profiler cannot see Metal kernels on MPS (use count_ops)"
    if device != "cuda":
        return f"not available: no kernel counter for device {device!r}"
    if not torch.cuda.is_available():
        return "not available: no CUDA device (torch.cuda.is_available() is False)"
    if torch.profiler.ProfilerActivity.CUDA not in torch.profiler.supported_activities():
        return "not available: this torch build's profiler has no CUDA activity (CUPTI missing)"
    return None


#: Name prefixes of the CUDA runtime and driver calls by which the host queues work on a stream (kernels,
#: cooperative kernels, graphs, copies, sets), as the profiler reports them.
HOST_LAUNCH_CALLS = ("cudaLaunch", "__cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaMemset")


def _profile_cuda(fn: Callable[..., Any], args: tuple, kwargs: dict, device: str) -> list:
    """The profiler's events (host and device) of one call of ``fn``; raise if the device has none."""
    reason = _unavailable_reason(device)
    if reason is not None:
        raise KernelCountUnavailable(reason)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        # Newer torch warns that events do not accumulate across profiling cycles; this is one cycle.
        warnings.filterwarnings("ignore", message=r".*Profiler clears events", category=UserWarning)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(*args, **kwargs)
            torch.cuda.synchronize()
    return list(prof.events())


def count_kernel_launches(
    fn: Callable[..., Any], *args: Any, device: str = "cuda", **kwargs: Any
) -> Counter[str]:
    """Run ``fn`` once under ``torch.profiler`` and count CUDA kernels by name; raise if impossible.

    Raises :class:`KernelCountUnavailable` ("not available: <reason>") on CPU, MPS, or a CUDA
    device without profiler support. Memcpy/memset activity is counted under its own name.
    """
    from torch.autograd import DeviceType

    events = _profile_cuda(fn, args, kwargs, device)
    return Counter(evt.name for evt in events if evt.device_type == DeviceType.CUDA)


def count_host_launches(fn: Callable[..., Any], *args: Any, device: str = "cuda", **kwargs: Any) -> int:
    """Run ``fn`` once under ``torch.profiler`` and count the host's calls in :data:`HOST_LAUNCH_CALLS`."""
    return sum(evt.name.startswith(HOST_LAUNCH_CALLS) for evt in _profile_cuda(fn, args, kwargs, device))


def kernel_launches_or_reason(
    fn: Callable[..., Any], *args: Any, device: str = "cuda", **kwargs: Any
) -> Counter[str] | str:
    """Like :func:`count_kernel_launches`, but return the "not available: ..." text instead of raising."""
    try:
        return count_kernel_launches(fn, *args, device=device, **kwargs)
    except KernelCountUnavailable as exc:
        return str(exc)
