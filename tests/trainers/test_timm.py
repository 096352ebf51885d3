"""ema_lab.trainers.timm.ModelEmaV3 inside timm's own training pieces, beside timm's ModelEmaV3.

Both train.py flows: timm <= 1.0.2x's (``model_ema = ModelEmaV3(model, ...)``,
``CheckpointSaver(model_ema=)``, ``resume_checkpoint``,
``load_checkpoint(model_ema.module, ..., use_ema=True)``) and the task flow of timm 1.0.31
(``task.setup_ema`` makes the EMA from the ``ModelEmaV3`` that timm/task/task.py imports, the one import
swapped here). Each run is compared with timm's class on the same model and batches: bitwise equal.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("timm", reason="timm is not installed: the test-only extra trainers (nox -s trainers)")

import timm.task.task
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.models import create_model, load_checkpoint, resume_checkpoint
from timm.optim import create_optimizer_v2
from timm.task import ClassificationTask, load_task_ema_checkpoint, resume_task_checkpoint
from timm.utils import CheckpointSaver, distribute_bn, unwrap_model
from timm.utils.model_ema import ModelEmaV3 as TimmEmaV3

from ema_lab.trainers.timm import ModelEmaV3

STEPS = 6
BATCHES = [
    (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 4, (4,), generator=g))
    for g in [torch.Generator().manual_seed(0)]
    for _ in range(2 * STEPS)
]


def tiny_model() -> torch.nn.Module:
    """timm's test_resnet (convolutions and BatchNorm, 373k weights), the same weights every call."""
    torch.manual_seed(0)
    return create_model("test_resnet", num_classes=4)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> None:
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def assert_same(a: dict, b: dict) -> None:
    """Equal keys and bitwise equal tensors."""
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} of {len(a)} entries differ: {different[:5]}"


@pytest.mark.parametrize(
    "kwargs, with_step",
    [
        ({"decay": 0.9}, True),
        ({"decay": 0.9}, False),  # no step: the constant decay from the first update
        ({"decay": 0.99, "use_warmup": True, "warmup_gamma": 2.0, "warmup_power": 0.75}, True),
        ({"decay": 0.9, "use_warmup": True, "min_decay": 0.5, "update_after_step": 2}, True),
        ({"decay": 0.9, "foreach": False}, True),
        ({"decay": 0.9, "exclude_buffers": True}, True),
    ],
)
def test_equal_to_timm(kwargs: dict, with_step: bool) -> None:
    """Side by side on one model, updated after each step: the same decays and bitwise the same EMA."""
    model = tiny_model()
    optimizer = create_optimizer_v2(model, "sgd", lr=0.05)
    ours, theirs = ModelEmaV3(model, **kwargs), TimmEmaV3(model, **kwargs)
    for n, batch in enumerate(BATCHES[:STEPS], 1):
        train_step(model, optimizer, batch)
        step = n if with_step else None
        assert ours.get_decay(step) == theirs.get_decay(step)
        ours.update(model, step=step)
        theirs.update(model, step=step)
    assert_same(ours.state_dict(), theirs.state_dict())
    assert any(k.endswith("running_mean") for k in ours.state_dict())  # the buffers were compared too


def test_checkpoints_go_both_ways() -> None:
    """The same state_dict keys as timm's class: each loads the other's, strictly."""
    model = tiny_model()
    ours, theirs = ModelEmaV3(model, decay=0.9), TimmEmaV3(model, decay=0.9)
    optimizer = create_optimizer_v2(model, "sgd", lr=0.05)
    train_step(model, optimizer, BATCHES[0])
    theirs.update(model, step=1)
    ours.load_state_dict(theirs.state_dict())
    assert_same(ours.state_dict(), theirs.state_dict())
    train_step(model, optimizer, BATCHES[1])
    ours.update(model, step=2)
    theirs.load_state_dict(ours.state_dict())
    assert_same(ours.state_dict(), theirs.state_dict())


def classic_run(ema_class: type, folder: Path, stop_at: int | None = None, resume: str = "") -> Any:
    """timm <= 1.0.2x's train.py, its EMA calls in its order: the EMA after 2 * STEPS steps, or, with
    ``stop_at``, the path of the checkpoint saved after that epoch."""
    folder.mkdir()
    model = tiny_model() if not resume else create_model("test_resnet", num_classes=4)  # resumed: any weights
    optimizer = create_optimizer_v2(model, "sgd", lr=0.05)
    start = 0
    if resume:
        start = resume_checkpoint(model, resume, optimizer=optimizer)
    model_ema = ema_class(model, decay=0.99, use_warmup=True)
    if resume:
        load_checkpoint(model_ema.module, resume, use_ema=True)
    args = argparse.Namespace(model="test_resnet")
    saver = CheckpointSaver(
        model, optimizer, args=args, model_ema=model_ema, checkpoint_dir=str(folder), recovery_dir=str(folder)
    )
    num_updates = start * STEPS
    for epoch in range(start, 2):
        for batch in BATCHES[epoch * STEPS : (epoch + 1) * STEPS]:
            model.train()
            train_step(model, optimizer, batch)
            num_updates += 1
            model_ema.update(model, step=num_updates)
        distribute_bn(model_ema, 1, True)  # train.py's dist_bn='reduce', run by a one-rank gloo group
        model_ema.eval()  # train.py's validate()
        with torch.no_grad():
            assert torch.equal(model_ema(BATCHES[0][0]), unwrap_model(model_ema)(BATCHES[0][0]))
        saver.save_checkpoint(epoch, metric=float(epoch))
        if stop_at == epoch:
            return saver.checkpoint_files[0][0]
    return unwrap_model(model_ema).state_dict()


@pytest.fixture
def one_rank_group() -> None:
    """A one-process gloo group: distribute_bn calls torch.distributed as train.py does."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_classic_train_py_saves_and_resumes(tmp_path, one_rank_group) -> None:
    """CheckpointSaver, resume_checkpoint and load_checkpoint(model_ema.module, use_ema=True) carry the EMA:
    the resumed run ends bitwise where the uninterrupted one does, and where timm's class does."""
    ours = classic_run(ModelEmaV3, tmp_path / "a")
    assert_same(ours, classic_run(TimmEmaV3, tmp_path / "b"))
    checkpoint = classic_run(ModelEmaV3, tmp_path / "c", stop_at=0)
    assert_same(ours, classic_run(ModelEmaV3, tmp_path / "d", resume=checkpoint))


def task_run(folder: Path, monkeypatch, ema_class: type, stop_at: int | None = None, resume: str = "") -> Any:
    """timm 1.0.31's train.py with the task: its EMA calls in its order (see classic_run)."""
    folder.mkdir()
    monkeypatch.setattr(timm.task.task, "ModelEmaV3", ema_class)  # the one import, swapped
    task = ClassificationTask(tiny_model(), verbose=False)
    optimizer = create_optimizer_v2(task.get_trainable_module(), "sgd", lr=0.05)
    start = resume_task_checkpoint(task, resume, optimizer=optimizer, log_info=False) if resume else 0
    task.setup_ema(decay=0.99, use_warmup=True)
    assert type(task.get_trainable_module(ema=True)) is ema_class
    if resume:
        load_task_ema_checkpoint(task, resume)
    saver = CheckpointSaver(
        task.get_trainable_module(),
        optimizer,
        task=task,
        checkpoint_dir=str(folder),
        recovery_dir=str(folder),
    )
    num_updates = start * STEPS
    for epoch in range(start, 2):
        task.train()
        for x, y in BATCHES[epoch * STEPS : (epoch + 1) * STEPS]:
            task(x, y)["loss"].backward()
            optimizer.step()
            num_updates += 1
            optimizer.zero_grad()
            task.update_ema(step=num_updates)
        eval_model = task.get_eval_model(ema=True)
        eval_model.eval()
        with torch.no_grad():
            eval_model(BATCHES[0][0])
        saver.save_checkpoint(epoch, metric=float(epoch))
        if stop_at == epoch:
            return saver.checkpoint_files[0][0]
    return unwrap_model(task.get_trainable_module(ema=True)).state_dict()


def test_task_train_py_saves_and_resumes(tmp_path, monkeypatch) -> None:
    """timm 1.0.31: task.setup_ema / update_ema / get_eval_model(ema=True), the CheckpointSaver of the task,
    resume_task_checkpoint and load_task_ema_checkpoint: equal to timm's class, resumed bit for bit."""
    ours = task_run(tmp_path / "a", monkeypatch, ModelEmaV3)
    assert_same(ours, task_run(tmp_path / "b", monkeypatch, TimmEmaV3))
    checkpoint = task_run(tmp_path / "c", monkeypatch, ModelEmaV3, stop_at=0)
    assert_same(ours, task_run(tmp_path / "d", monkeypatch, ModelEmaV3, resume=checkpoint))


def test_a_module_assigned_to_module_moves() -> None:
    """``model_ema.module = loaded`` (loaded elsewhere): the next update moves the new one, as timm's does."""
    model = tiny_model()
    ours, theirs = ModelEmaV3(model, decay=0.5), TimmEmaV3(model, decay=0.5)
    optimizer = create_optimizer_v2(model, "sgd", lr=0.05)
    train_step(model, optimizer, BATCHES[0])
    ours.update(model, step=5)
    theirs.update(model, step=5)
    ours.module, theirs.module = tiny_model().eval(), tiny_model().eval()
    train_step(model, optimizer, BATCHES[1])
    ours.update(model, step=6)
    theirs.update(model, step=6)
    assert_same(ours.state_dict(), theirs.state_dict())


@pytest.mark.parametrize("bad", [{"decay": 1.5}, {"decay": 0.9, "use_warmup": True, "min_decay": 0.95}])
def test_bad_decays_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="decay"):
        ModelEmaV3(tiny_model(), **bad)


def test_bfloat16_with_stochastic_rounding_is_refused() -> None:
    """timm rounds a bfloat16 EMA stochastically; ema_lab does not: refused, naming both ways out."""
    model = tiny_model().to(torch.bfloat16)
    with pytest.raises(ValueError, match="dtype=torch.float32.*stochastic_rounding=False"):
        ModelEmaV3(model)
    ema = ModelEmaV3(model, decay=0.9, dtype=torch.float32)
    ema.update(model, step=3)
    assert all(t.dtype == torch.float32 for t in ema.module.parameters())


def test_no_timm_at_import() -> None:
    """Importing ema_lab and its timm adapter leaves timm unimported."""
    code = "import sys, ema_lab.trainers.timm; assert 'timm' not in sys.modules, 'timm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_update_twice_per_step_as_timm() -> None:
    """A loop that calls update() twice with one step: both classes apply that step's decay twice."""
    model = tiny_model()
    optimizer = create_optimizer_v2(model, "sgd", lr=0.05)
    ours = ModelEmaV3(model, decay=0.99, use_warmup=True)
    theirs = TimmEmaV3(model, decay=0.99, use_warmup=True)
    for n, batch in enumerate(BATCHES[:3], 1):
        train_step(model, optimizer, batch)
        for ema in (ours, theirs, ours, theirs):
            ema.update(model, step=n)
    assert_same(ours.state_dict(), theirs.state_dict())


def test_another_device_is_refused_and_the_models_is_taken() -> None:
    """timm's --model-ema-force-cpu (an EMA on another device than the model's) is refused in one line;
    the model's own device, by any spelling, is taken."""
    model = tiny_model()
    with pytest.raises(ValueError, match="leave device unset"):
        ModelEmaV3(model, device="meta")
    for device in ("cpu", torch.device("cpu")):
        ModelEmaV3(model, decay=0.9, device=device).update(model, step=2)


def test_set_copies_the_model_as_timm() -> None:
    model = tiny_model()
    ours, theirs = ModelEmaV3(model, decay=0.9), TimmEmaV3(model, decay=0.9)
    train_step(model, create_optimizer_v2(model, "sgd", lr=0.05), BATCHES[0])
    ours.set(model)
    theirs.set(model)
    assert_same(ours.state_dict(), theirs.state_dict())
    assert_same(ours.module.state_dict(), model.state_dict())
