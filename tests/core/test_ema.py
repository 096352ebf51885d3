"""ModelEMA: the ultralytics-compatible surface, drop-in equivalence, caching and its invalidation."""

from __future__ import annotations

import math
from copy import deepcopy

import pytest
import torch
from torch import nn

from ema_lab import ModelEMA
from ema_lab.bench import models
from ema_lab.bench.seed import seed_before
from ema_lab.ema import STRATEGIES

from ..helpers import float_entries

EXPLICIT = [s for s in STRATEGIES if s != "auto"]


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    x = torch.randn(8, 3, 16, 16, generator=gen)
    y = torch.randint(0, 10, (8,), generator=gen)
    model.train()
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_defaults_and_ramp() -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    assert (ema.schedule.decay, ema.schedule.tau, ema.updates, ema.strategy, ema.enabled) == (
        0.9999,
        2000.0,
        0,
        "auto",
        True,
    )
    assert ema.decay(0) == 0.0
    assert ema.decay(2000) == pytest.approx(0.9999 * (1 - math.exp(-1)))
    assert ema.decay(10**7) == pytest.approx(0.9999)
    assert not ema.ema.training and ema.ema is not model
    assert all(not p.requires_grad for p in ema.ema.parameters())
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decay": 1.5}, r"decay must be a finite number in \[0, 1\], got 1.5"),
        ({"decay": -0.1}, r"decay must be a finite number in \[0, 1\], got -0.1"),
        ({"decay": float("nan")}, r"decay must be a finite number in \[0, 1\], got nan"),
        ({"decay": "0.9"}, r"decay must be a finite number in \[0, 1\], got '0.9'"),
        ({"decay": True}, r"decay must be a finite number in \[0, 1\], got True"),
        ({"tau": 0}, "tau must be a positive number, got 0"),
        ({"tau": -5.0}, "tau must be a positive number"),
        ({"updates": -1}, "updates must be an int >= 0"),
        ({"strategy": "fastest"}, "unknown strategy 'fastest'"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelEMA(models.build("tiny_cnn"), **kwargs)


@pytest.mark.parametrize("decay", [0, 1.0])
def test_the_constructor_and_update_share_one_decay_rule(decay: float) -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model, decay=decay, tau=1e-9)  # the ramp is flat: every update uses ``decay`` itself
    before = {k: v.clone() for k, v in float_entries(ema.ema).items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    now = float_entries(ema.ema)
    target = before if decay == 1.0 else float_entries(model)  # 1 keeps the EMA, 0 copies the model
    assert all(torch.equal(now[k], target[k]) for k in now)
    ema.update(model, decay=decay)  # the same bounds per step
    with pytest.raises(ValueError, match=r"decay must be a finite number in \[0, 1\]"):
        ema.update(model, decay=1.01)


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        ModelEMA({})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_drop_in_for_the_seed_over_a_training_run(strategy: str) -> None:
    """Same EMA as ultralytics' pre-change ModelEMA.update (reproduced by seed_before) over real SGD steps."""
    torch.manual_seed(0)
    model = models.build("tiny_cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ours = ModelEMA(model, decay=0.99, tau=5, strategy=strategy)
    seed_ema = deepcopy(model).eval()
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 16):
        _train_step(model, opt, gen)
        ours.update(model)
        seed_before(seed_ema, model, ours.decay(n))
    assert ours.updates == 15
    theirs = float_entries(seed_ema)
    for k, v in float_entries(ours.ema).items():
        torch.testing.assert_close(v, theirs[k], rtol=1e-5, atol=1e-6)
    # ultralytics leaves num_batches_tracked at the copy's value; ema_lab copies non-float entries.
    assert ours.ema.state_dict()["0.bn.num_batches_tracked"].item() == 15
    assert seed_ema.state_dict()["0.bn.num_batches_tracked"].item() == 0


def test_update_does_not_walk_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    ema.update(model)
    monkeypatch.setattr(nn.Module, "state_dict", lambda *a, **k: pytest.fail("state_dict walked per update"))
    for _ in range(3):
        ema.update(model)
    assert ema.rebuilds == 1 and ema.updates == 4


def _moves(ema: ModelEMA, model: nn.Module) -> bool:
    before = {k: v.double().clone() for k, v in float_entries(ema.ema).items()}
    ema.update(model)
    after = float_entries(ema.ema)
    return any(not torch.equal(before[k], after[k].double()) for k in before)


def _perturb(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


@pytest.mark.parametrize(
    "change",
    ["model.double()", "model.half()", "model.to(float64)", "ema.half()", "new parameter", "load_state_dict"],
)
def test_cache_follows_replaced_tensors(change: str) -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model, decay=0.5, tau=1e-9)
    ema.update(model)
    if change == "model.double()":
        model.double()
    elif change == "model.half()":
        model.half()
    elif change == "model.to(float64)":
        model.to(torch.float64)
    elif change == "ema.half()":
        ema.ema.half()
    elif change == "new parameter":
        model[6].weight = nn.Parameter(torch.full_like(model[6].weight, 3.0))
    else:
        model.load_state_dict(models.build("tiny_cnn", seed=5).state_dict())
    _perturb(model)
    target = {k: v.detach().double() for k, v in float_entries(model).items()}
    for _ in range(40):  # decay 0.5: the EMA converges to the (now fixed) model within dtype precision
        ema.update(model)
    for k, v in float_entries(ema.ema).items():
        tol = 1e-2 if v.dtype == torch.float16 or change == "model.half()" else 1e-5
        assert (v.double() - target[k]).abs().max().item() <= tol * (1 + target[k].abs().max().item()), k


def test_stale_cache_is_rebuilt_not_reused() -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    ema.update(model)
    assert (ema.rebuilds, ema.modes) == (1, ["cat+foreach"])
    ema.update(model)
    assert ema.rebuilds == 1
    model.double()
    ema.update(model)
    assert (ema.rebuilds, ema.modes) == (2, ["cast"])  # rebuilt over the float64 model tensors
    assert all(v.dtype == torch.float32 for v in float_entries(ema.ema).values())


def test_foreach_strategy_refuses_mixed_dtypes_atomically() -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model, strategy="foreach")
    ema.update(model)
    model.double()
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    with pytest.raises(ValueError, match=r"entry 0 \('0.conv.weight'\).*torch.float32.*torch.float64"):
        ema.update(model)
    assert ema.updates == 1
    assert all(torch.equal(v, before[k]) for k, v in ema.ema.state_dict().items())


def test_auto_handles_float64_buffers_like_the_loop() -> None:
    model = models.build("tiny_cnn")
    model[0].register_buffer("total_ops", torch.zeros(1, dtype=torch.float64))
    ema, loop = ModelEMA(model), ModelEMA(model, strategy="loop")
    ema.ema.float()  # the validator casts the EMA: one pair now disagrees in dtype
    loop.ema.float()
    model[0].total_ops += 10
    ema.update(model)
    loop.update(model)
    assert ema.ema[0].total_ops.dtype == torch.float32 and ema.ema[0].total_ops.item() > 0
    for k, v in ema.ema.state_dict().items():
        torch.testing.assert_close(v, loop.ema.state_dict()[k])


def test_tied_weights_are_averaged_once() -> None:
    model = models.build("tiny_transformer")
    ema = ModelEMA(model, decay=0.5, tau=1e-9)
    start = ema.ema.embed.weight.detach().clone()
    with torch.no_grad():
        model.embed.weight.zero_()
    ema.update(model)
    assert ema.ema.head.weight is ema.ema.embed.weight
    torch.testing.assert_close(ema.ema.embed.weight, 0.5 * start)  # seed_before would give 0.25 * start


def test_wrapped_models_are_unwrapped() -> None:
    model = models.build("tiny_cnn")
    wrapped = nn.DataParallel(model)  # on a CPU-only machine DataParallel just calls the module
    ema = ModelEMA(wrapped, decay=0.5, tau=1e-9)
    assert not isinstance(ema.ema, nn.DataParallel)
    _perturb(model)
    ema.update(wrapped)
    torch.testing.assert_close(ema.ema[6].bias, model[6].bias - 0.5)
    ema.update(model)  # the same module, wrapped or not: no rebuild
    assert ema.rebuilds == 1


def test_mismatched_model_is_refused() -> None:
    ema = ModelEMA(models.build("tiny_cnn"))
    before = deepcopy(ema.ema.state_dict())
    with pytest.raises(ValueError, match="EMA and model do not hold the same entries"):
        ema.update(models.build("tiny_transformer"))
    assert ema.updates == 0
    assert all(torch.equal(v, before[k]) for k, v in ema.ema.state_dict().items())


def test_disabled_does_nothing() -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    ema.enabled = False
    _perturb(model)
    ema.update(model)
    ema.update_attr(model)
    assert ema.updates == 0


def test_update_attr() -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    model.names, model.stride, model._private, model.reducer = ["cat"], 32, 1, object()
    ema.update_attr(model)
    assert ema.ema.names == ["cat"] and ema.ema.stride == 32
    assert not hasattr(ema.ema, "_private") and not hasattr(ema.ema, "reducer")
    model.stride = 16
    ema.update_attr(model, include=("names",))
    assert ema.ema.stride == 32


def test_update_attr_unwraps_data_parallel() -> None:
    """As ultralytics 8.4.190 does: the wrapper's own attributes (device_ids, ...) never reach the EMA."""
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    model.names = ["cat"]
    ema.update_attr(nn.DataParallel(model))
    assert ema.ema.names == ["cat"] and not hasattr(ema.ema, "device_ids")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pickle_and_deepcopy_drop_the_cache_and_keep_averaging(strategy: str) -> None:
    import io
    import pickle

    model = models.build("tiny_cnn")
    ema = ModelEMA(model, decay=0.5, tau=1e-9, strategy=strategy)
    ema.update(model)
    buf = io.BytesIO()
    torch.save(ema, buf)  # trainers checkpoint the whole object
    clones = [pickle.loads(pickle.dumps(ema)), deepcopy(ema)]
    buf.seek(0)
    clones.append(torch.load(buf, weights_only=False))
    _perturb(model)
    ema.update(model)
    for clone in clones:
        assert clone.updates == 1 and clone.modes == []  # the cached step is not copied
        clone.update(model)
        assert clone.updates == 2
        for k, v in float_entries(clone.ema).items():
            torch.testing.assert_close(v, float_entries(ema.ema)[k])


def test_import_registers_no_torch_hooks_the_first_update_does() -> None:
    import subprocess
    import sys

    code = (
        "import torch.nn.modules.module as m, ema_lab\n"
        "names = ('_global_parameter_registration_hooks', '_global_buffer_registration_hooks',"
        " '_global_module_registration_hooks')\n"
        "print([len(getattr(m, n)) for n in names])\n"
        "lin = torch.nn.Linear(2, 2); a, b = ema_lab.ModelEMA(lin), ema_lab.ModelEMA(lin)\n"
        "print([len(getattr(m, n)) for n in names])\n"
        "a.update(lin); b.update(lin)\n"
        "print([len(getattr(m, n)) for n in names])\n"
    ).replace("torch.nn.Linear", "__import__('torch').nn.Linear")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # none at import nor construction, one each after the first updates (their watches), not two
    assert out.split("\n")[:3] == ["[0, 0, 0]", "[0, 0, 0]", "[1, 1, 1]"]


def test_a_compiled_model_is_unwrapped() -> None:
    model = models.build("tiny_cnn")
    compiled = torch.compile(model)  # not called: wrapping alone, no compilation
    ema = ModelEMA(compiled)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(compiled, decay=0.0)
    for k, v in ema.ema.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


@pytest.mark.parametrize("strategy", ["auto", "gated", "loop"])
def test_an_ema_made_or_first_updated_under_inference_mode_updates_outside_it(strategy: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    with torch.inference_mode():
        made_inside = ModelEMA(model, strategy=strategy)
    first_inside = ModelEMA(model, strategy=strategy)
    with torch.inference_mode():
        first_inside.update(model)
        made_inside.update(model)
    for ema in (made_inside, first_inside):
        ema.update(model)  # raised "Inplace update to inference tensor outside InferenceMode" before
        assert ema.updates == 2
        assert not any(t.is_inference() for t in ema.ema.state_dict().values())


def test_update_refuses_what_is_not_a_module_in_one_line() -> None:
    ema = ModelEMA(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"^model must be a torch.nn.Module, got str$"):
        ema.update("model")
    assert ema.updates == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"group": "world"}, TypeError, r"^group must be a torch.distributed ProcessGroup or None, got str$"),
        ({"src": False}, ValueError, r"^src must be a rank of the group, 0 to 0, got False$"),
    ],
)
def test_sync_buffers_refuses_a_bad_group_or_src_in_one_line(kwargs: dict, error: type, message: str) -> None:
    # Outside torch.distributed as on a one-rank group: a bad group was ignored (or an AttributeError).
    ema = ModelEMA(nn.BatchNorm1d(2))
    with pytest.raises(error, match=message):
        ema.sync_buffers(**kwargs)
    assert not ema.ranks_checked  # refused before anything: the unsynced warning still comes


def test_a_list_of_schedules_keeps_one_ema_each_equal_to_its_own_model_ema() -> None:
    from ema_lab.schedules import power, warmup

    model = models.build("tiny_cnn")
    schedules = [power(sigma_rel=0.1), warmup(decay=0.99)]
    both = ModelEMA(model, decay=schedules)
    alone = [ModelEMA(model, decay=s) for s in schedules]
    for step in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (step + 1))
        for ema in (both, *alone):
            ema.update(model)
    assert both.schedules == schedules and len(both.emas) == 2 and both.ema is both.emas[0]
    for mine, other in zip(both.emas, alone):
        want = other.ema.state_dict()
        assert all(torch.equal(v, want[k]) for k, v in mine.state_dict().items())
    assert both.rebuilds == 1  # one step moves both
