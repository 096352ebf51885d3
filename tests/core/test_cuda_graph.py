"""``ModelEMA(..., cuda_graph=True)``: what it refuses; that a replayed update is the eager flat step's, bit
for bit, recorded again after a tensor is replaced, and (on CUDA) without a host sync. Without CUDA the
step's lifecycle runs on CPU with an eager recorder. The staleness tests run it too on CUDA
(tests/core/test_stale_cache.py, ids ``cuda_graph``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ema_lab import (
    ModelEMA,
    flat_step,  # the flat step's private switches: these tests are about them
    flatten_model,
    graph_step,
)
from ema_lab.bench import models
from ema_lab.graph_step import GraphStep
from ema_lab.schedules import power

from ..helpers import CONVERSIONS, float_entries

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")


def test_cuda_graph_is_refused_off_cuda_and_for_a_step_other_than_flat() -> None:
    model = models.build("tiny_cnn")
    with pytest.raises(
        ValueError, match="^cuda_graph=True needs every EMA tensor on one CUDA device, found cpu$"
    ):
        ModelEMA(model, cuda_graph=True)
    with pytest.raises(ValueError, match="^cuda_graph=True records the 'flat' step; strategy 'gated' runs"):
        ModelEMA(model, strategy="gated", cuda_graph=True)


def test_cuda_graph_devices_are_named_when_they_differ() -> None:
    tensors = [torch.zeros(1), torch.zeros(1, device="meta")]
    with pytest.raises(ValueError, match="found cpu, meta$"):
        GraphStep.check_devices(tensors)
    with pytest.raises(ValueError, match="found no tensors$"):
        GraphStep.check_devices([])


def test_cuda_graph_checks_the_counters_device_too() -> None:
    """A counter elsewhere would be copied on the host once, while recording, and never again."""
    model = models.build("tiny_cnn")
    model.register_buffer("steps", torch.zeros((), dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="found cpu, meta$"):
        ModelEMA(model, cuda_graph=True)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=CUDA)])
def device(request, monkeypatch) -> str:
    """Where the graph step runs. On "cpu" its lifecycle runs with an eager recorder in place of the CUDA
    graph: recording runs nothing and returns the body, a replay runs it (what a CUDA replay does); and the
    CPU stands in for a device with a fused foreach (the weight as views of one buffer, the largest alone)."""
    if request.param == "cpu":
        monkeypatch.setattr(flat_step, "fused_foreach_devices", lambda: ["cpu"])
        monkeypatch.setattr(flat_step, "DENSE_WEIGHT_NUMEL", 3000)
        monkeypatch.setattr(GraphStep, "check_devices", staticmethod(lambda tensors: torch.device("cpu")))
        monkeypatch.setattr(graph_step, "_record", lambda body, device: RECORDED.append(body) or body)
    RECORDED.clear()
    return request.param


RECORDED: list = []  # the bodies the eager recorder was given


def _shift(model: nn.Module, by: float) -> None:
    with torch.no_grad():
        for v in float_entries(model).values():
            v.add_(by)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.num_batches_tracked += 1


@pytest.mark.parametrize("layout", ["plain", "flattened", "fp16 model, fp32 EMA"])
def test_cuda_graph_replays_the_eager_flat_step_bit_for_bit(layout: str, device: str) -> None:
    model = models.build("tiny_cnn").to(device)
    if layout == "flattened":
        flatten_model(model)
    graphed = ModelEMA(model, decay=0.9, tau=2, cuda_graph=True)
    eager = ModelEMA(model, decay=0.9, tau=2, cat_max_numel=0)  # the same kernels, launched one by one
    if layout == "fp16 model, fp32 EMA":
        model.half()
    for i in range(6):
        _shift(model, 0.25 * (i + 1))
        graphed.update(model)
        eager.update(model)
    # The step's private replay: this test is about the recording.
    assert graphed.rebuilds == 1 and graphed._step.replay is not None  # recorded once, replayed 5 times
    assert graphed.modes == eager.modes
    want = eager.ema.state_dict()
    for k, v in graphed.ema.state_dict().items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("every", [1, 2])
def test_cuda_graph_replays_a_schedule_bit_for_bit(every: int, device: str) -> None:
    """A schedule's float reaches the replay through the weight tensor, recorded once, as the ramp's does."""
    model = models.build("tiny_cnn").to(device)
    schedule = power(sigma_rel=0.1)
    graphed = ModelEMA(model, decay=schedule, every=every, cuda_graph=True)
    eager = ModelEMA(model, decay=schedule, every=every, cat_max_numel=0)
    for i in range(8):
        _shift(model, 0.25 * (i + 1))
        graphed.update(model)
        eager.update(model)
    assert graphed.rebuilds == 1 and graphed._step.replay is not None
    want = eager.ema.state_dict()
    for k, v in graphed.ema.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_cuda_graph_is_recorded_again_after_a_tensor_is_replaced(device: str) -> None:
    model = models.build("tiny_cnn").to(device)
    ema = ModelEMA(model, cuda_graph=True)
    for _ in range(3):
        ema.update(model)
    model[0].conv.weight.data = torch.randn_like(model[0].conv.weight)  # a replay would read the old memory
    for _ in range(3):  # rebuild and run eagerly, record, replay
        ema.update(model, decay=0.0)
    assert ema.rebuilds == 2 and torch.equal(ema.ema[0].conv.weight, model[0].conv.weight)
    assert len(RECORDED) == (2 if device == "cpu" else 0)


def test_cuda_graph_refuses_a_decay_on_another_device_and_changes_nothing(device: str) -> None:
    model = models.build("tiny_cnn").to(device)
    ema = ModelEMA(model, cuda_graph=True)
    for _ in range(2):
        ema.update(model)
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    _shift(model, 1.0)
    other = "meta" if device == "cpu" else "cpu"
    with pytest.raises(ValueError, match=f"^decay is on {other} but the EMA is on {device}"):
        ema.update(model, decay=torch.tensor(0.5, device=other))
    for k, v in ema.ema.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert ema.updates == 2


@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
def test_cuda_graph_follows_the_model_after_a_conversion(conversion: str, device: str) -> None:
    model = models.build("tiny_cnn").to(device)
    ema = ModelEMA(model, decay=0.5, tau=0.01, cuda_graph=True)
    for _ in range(3):  # run, recorded, replayed
        ema.update(model)
    CONVERSIONS[conversion](model, ema)  # new memory behind every tensor of one side
    _shift(model, 1.0)
    for _ in range(20):
        ema.update(model)
    live = float_entries(model)
    gap = max((v.double() - live[k].double()).abs().max().item() for k, v in float_entries(ema.ema).items())
    assert gap < 0.05 and ema.rebuilds == 2  # closed the gap; an fp16 EMA rounds at about 1e-3


@CUDA
def test_cuda_graph_updates_never_sync_with_the_host() -> None:
    model = models.build("tiny_cnn").cuda()
    ema = ModelEMA(model, cuda_graph=True)
    scheduled = ModelEMA(model, decay=power(sigma_rel=0.1), every=2, cuda_graph=True)
    decay = torch.tensor(0.5, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):  # build + eager, record + replay, replays; the ramp's float, then a tensor
            ema.update(model)
            scheduled.update(model)
        ema.update(model, decay=decay)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ema.rebuilds == 1 and scheduled.rebuilds == 1


@CUDA
def test_cuda_graph_recording_that_fails_raises_the_error_of_the_update() -> None:
    def body() -> None:
        torch.zeros(1, device="cuda").add_(1)
        raise ValueError("the update's own error")

    with pytest.raises(ValueError, match="the update's own error"):
        graph_step._record(body, torch.device("cuda"))  # the private recorder: this test is about it
    torch.cuda.synchronize()  # nothing left capturing
