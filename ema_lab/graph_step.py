"""``ModelEMA(..., cuda_graph=True)``: the flat step recorded once in a CUDA graph, one ``replay()`` per
update (costs: docs/beyond_foreach_details.md); a float16 or bfloat16 EMA reads the weight in its dtype."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from .flat_step import FlatStep
from .pairs import Pairs
from .step import StepOptions

__all__ = ["GraphStep"]


def _record(body: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """Record ``body``'s kernels in a CUDA graph (nothing runs); return the graph's ``replay``."""
    # Not torch.cuda.graph(): it syncs the device and empties the caching allocator the training loop reuses.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream(device)):
        graph.capture_begin(capture_error_mode="thread_local")  # a pin-memory thread may allocate meanwhile
        try:
            body()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # ends the broken capture; body's error is the one to see
                graph.capture_end()
            raise
        graph.capture_end()
    return graph.replay


class GraphStep(FlatStep):
    """The flat step without gathers, run eagerly once, then recorded in a CUDA graph and replayed."""

    recordable = False  # already a recording
    gathers = False  # the graph reads the model itself

    @staticmethod
    def check_devices(tensors: Iterable[Tensor]) -> torch.device:
        """The one CUDA device every EMA tensor is on, else a ValueError naming the devices found."""
        devices = {t.device for t in tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            found = ", ".join(sorted(map(str, devices))) or "no tensors"
            raise ValueError(f"cuda_graph=True needs every EMA tensor on one CUDA device, found {found}")
        return devices.pop()

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None:
        # Before the flat step moves any EMA tensor; counters too: a host copy would run once, at recording.
        device = self.check_devices([t for e in (*pairs.floats, *pairs.counters) for t in e.emas])
        super().__init__(pairs, model, replace(options, cat_max_numel=0))
        self.weights = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(pairs.count)]
        self.replay: Callable[[], None] | None = None  # set when the graph is recorded
        self.warm = False  # True once an update ran eagerly: the next one records

    def apply(self, decays: Sequence[float | Tensor], weights: Sequence[float | Tensor]) -> None:
        """Write each weight where the graph reads it, then replay it (recorded at the second update)."""
        self.check_weights(weights)
        if self.replay is None and self.warm:
            self.replay = _record(self._update, self.weights[0].device)
        for into, w in zip(self.weights, weights):
            into.fill_(w)  # a 0-dim tensor on this device (checked) is copied: no host sync
        (self.replay or self._update)()  # eagerly until recorded
        self.warm = True

    def _update(self) -> None:
        for g in self.groups:  # with no gathers, every read is a copy between fixed tensors
            g.read()
        FlatStep.apply(self, self.weights, self.weights)
