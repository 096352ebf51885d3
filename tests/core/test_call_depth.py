"""How far a steady-state update is from torch: the Python frames of ema_lab below ``update()`` (a
``sys.setprofile`` trace), so that a reader follows ``ModelEMA.update`` to the arithmetic in a few hops."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ema_lab
from ema_lab import ModelEMA, graph_step
from ema_lab.bench import models
from ema_lab.graph_step import GraphStep

PACKAGE = Path(ema_lab.__file__).parent

# Every decay is a schedule: the update asks it (schedules.py) and checks what it gave (checks.py), then the
# tensors' path runs through at most three files.
DECAY_CALLS = {("schedules.py", "__call__"), ("schedules.py", "at"), ("checks.py", "check_decay")}
DECAY_CALLS |= {("checks.py", "weight_of")}


def frames_below_update(ema: ModelEMA, model: torch.nn.Module) -> list[tuple[int, str, str]]:
    """(depth below update(), file, function) of every Python call one ``ema.update(model)`` makes."""
    calls, depth = [], [0]

    def profile(frame, event, arg):  # noqa: ANN001, ANN202 (sys.setprofile's signature)
        if event == "call":
            depth[0] += 1
            calls.append((depth[0], frame.f_code.co_filename, frame.f_code.co_name))
        elif event == "return":
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        ema.update(model)
    finally:
        sys.setprofile(None)
    return [(d - 1, Path(f).name, name) for d, f, name in calls if d > 1]


def _ours(ema: ModelEMA, model: torch.nn.Module) -> list[tuple[int, str, str]]:
    for _ in range(3):  # steady state: the step is built (and recorded) and cached
        ema.update(model)
    assert ema.rebuilds == 1
    calls = [c for c in frames_below_update(ema, model) if (PACKAGE / c[1]).exists()]
    assert calls, "the trace saw no call"
    assert max(depth for depth, _, _ in calls) <= 3, calls  # deeper frames are torch's own (no_grad's)
    return calls


@pytest.mark.parametrize(
    ("strategy", "layout"),
    [("auto", "yolo"), ("flat", "flattened"), ("gated", "yolo"), ("foreach", "yolo"), ("loop", "yolo")],
)
def test_update_reaches_torch_in_three_frames_and_three_files(strategy: str, layout: str) -> None:
    model = models.build("yolo")
    if layout == "flattened":
        ema_lab.flatten_model(model)
    calls = _ours(ModelEMA(model, strategy=strategy), model)
    decay = {(file, name) for _, file, name in calls if file in ("schedules.py", "checks.py")}
    assert decay == DECAY_CALLS, calls
    assert len({"ema.py", *(file for _, file, _ in calls)} - {"schedules.py", "checks.py"}) <= 3, calls
    if strategy == "auto":  # the default: ema.py, the decay's two files, the flat step and step.py
        default = {"ema.py", "schedules.py", "checks.py", "flat_step.py", "step.py"}
        assert {file for _, file, _ in calls} <= default, calls


def test_a_graph_replay_reaches_torch_in_three_frames(monkeypatch) -> None:
    """On CPU, the replay stood in by a builtin (a CUDA replay runs no Python of ours; the arithmetic is
    tests/core/test_cuda_graph.py's): the default's files and the recording's own."""
    monkeypatch.setattr(GraphStep, "check_devices", staticmethod(lambda tensors: torch.device("cpu")))
    monkeypatch.setattr(graph_step, "_record", lambda body, device: object)
    model = models.build("yolo")
    calls = _ours(ModelEMA(model, cuda_graph=True), model)
    files = {"ema.py", "graph_step.py", "flat_step.py", "step.py", "schedules.py", "checks.py"}
    assert {file for _, file, _ in calls} == files, calls
