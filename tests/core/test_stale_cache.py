"""A tensor-list cache built once goes stale (ultralytics 8.4.190); ModelEMA's cache notices and rebuilds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ema_lab import ModelEMA, PostHocEMA, flatten_model
from ema_lab.bench import models
from ema_lab.flat_step import CAT_MAX_NUMEL, MIN_LIVE_RUN
from ema_lab.pairs import collect_pairs
from ema_lab.step import Watch

from ..helpers import CONVERSIONS, CachedListEMA, float_entries, follows_after


def _watch(ema: nn.Module, model: nn.Module) -> Watch:
    """The per-slot check over every entry of both modules, as a rebuilt step records it."""
    pairs = collect_pairs([ema], model)
    return Watch(model, pairs.slots(), pairs.modules)


def _ema(model: nn.Module, strategy: str) -> ModelEMA:
    """``"flatten_model"``: the model flattened first, then the default EMA. ``"cuda_graph"``: the model
    moved to CUDA, an EMA with ``cuda_graph=True``, and its graph recorded (decay 1 keeps the EMA as it is),
    so the test's own updates are replays."""
    graph = strategy.endswith("cuda_graph")
    if graph:
        model.cuda()
    if strategy.startswith("flatten_model"):
        flatten_model(model)
    ema = ModelEMA(model, strategy=strategy if strategy in EAGER else "auto", cuda_graph=graph)
    for _ in range(2 if graph else 0):
        ema.update(model, decay=1.0)
    return ema


def _shift(model: nn.Module, by: float) -> None:
    """Stand-in for an optimizer step that moves every float entry."""
    with torch.no_grad():
        for v in float_entries(model).values():
            v.add_(by)


def _snapshot(ema: ModelEMA) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in float_entries(ema.ema).items()}


def _moved(before: dict[str, torch.Tensor], ema: ModelEMA) -> bool:
    return any(not torch.equal(before[k], v) for k, v in float_entries(ema.ema).items())


@pytest.mark.parametrize("cls", [CachedListEMA, ModelEMA])
def test_both_move_while_nothing_is_converted(cls: type[ModelEMA]) -> None:
    model = models.build("tiny_cnn")
    ema = cls(model, decay=0.9, tau=1)
    for _ in range(3):
        before = _snapshot(ema)
        _shift(model, 0.5)
        ema.update(model)
        assert _moved(before, ema)


def test_cached_lists_stop_moving_after_ema_half() -> None:
    model = models.build("tiny_cnn")
    ema = CachedListEMA(model, decay=0.9, tau=1)
    ema.update(model)  # builds the cache
    ema.ema.half()  # new storage for every EMA parameter and buffer
    before = _snapshot(ema)
    for _ in range(3):
        _shift(model, 0.5)
        ema.update(model)
    assert not _moved(before, ema), "the cached update should only touch the dead float32 tensors"
    assert ema.updates == 4  # and it still counts updates: nothing says it is broken


def test_model_ema_keeps_moving_after_ema_half() -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model, decay=0.9, tau=1)
    ema.update(model)
    watch = _watch(ema.ema, model)
    ema.ema.half()
    assert not watch.current(model)
    before = _snapshot(ema)
    _shift(model, 0.5)
    ema.update(model)
    assert _moved(before, ema)
    assert all(v.dtype == torch.float16 for v in float_entries(ema.ema).values())


def _after_double(cls: type[ModelEMA], shift_after: float) -> tuple[nn.Module, ModelEMA]:
    model = models.build("tiny_cnn")
    ema = cls(model, decay=0.5, tau=0.01)  # decay ~0.5 from the first update: the EMA follows quickly
    ema.update(model)
    model.double()
    _shift(model, shift_after)
    for _ in range(20):
        ema.update(model)
    return model, ema


def test_cached_lists_ignore_the_model_after_model_double() -> None:
    # Same history, except that the model moves by 10 after .double() in one run: the cached EMA cannot tell.
    _, still = _after_double(CachedListEMA, 0.0)
    moved_model, moved = _after_double(CachedListEMA, 10.0)
    for k, v in float_entries(moved.ema).items():
        assert torch.equal(v, float_entries(still.ema)[k]), k
    gap = max(
        (v.double() - float_entries(moved_model)[k]).abs().max().item()
        for k, v in float_entries(moved.ema).items()
    )
    assert gap > 9.0


def test_model_ema_follows_the_model_after_model_double() -> None:
    model, ema = _after_double(ModelEMA, 10.0)
    gap = max(
        (v.double() - float_entries(model)[k]).abs().max().item() for k, v in float_entries(ema.ema).items()
    )
    assert gap < 1e-4  # 20 updates at decay 0.5 leave 0.5**20 of the old distance
    assert all(v.dtype == torch.float32 for v in float_entries(ema.ema).values())  # the EMA keeps its dtype


def test_is_current_detects_conversions() -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model).ema
    watch = _watch(ema, model)
    assert watch.current(model)
    model.double()
    assert not watch.current(model)
    watch = _watch(ema, model)
    ema.half()
    assert not watch.current(model)


@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
def test_follows_after_table(conversion: str) -> None:
    stale_moved, stale_gap = follows_after(CachedListEMA, conversion)
    moved, gap = follows_after(ModelEMA, conversion)
    assert not stale_moved and stale_gap == pytest.approx(1.0, abs=1e-3)  # the whole shift, never closed
    assert moved and gap < 0.05


# --- torch's own tensor swaps: the EMA must never block them, and must follow the new tensors -------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")
EAGER = ("auto", "flat", "gated", "foreach", "loop")
GRAPHS = [pytest.param(s, marks=CUDA) for s in ("cuda_graph", "flatten_model+cuda_graph")]
STRATEGIES_ = (*EAGER, "flatten_model", *GRAPHS)


def _fill(model: nn.Module) -> None:
    # A function of its own: no alias of a model tensor outlives it (one left alive across a replacement
    # would hold the flat storage's reference count, the documented limit of a flattened model's groups).
    with torch.no_grad():
        for i, v in enumerate(float_entries(model).values()):
            v.fill_(3.0 + i % 7)


def _follows(ema: ModelEMA, model: nn.Module) -> None:
    """Decay 0: one update copies the model exactly, so the EMA reads the module's live memory."""
    _fill(model)
    ema.update(model, decay=0.0)
    live = float_entries(model)
    for k, v in float_entries(ema.ema).items():
        assert torch.equal(v, live[k].to(v.dtype)), k


@pytest.fixture
def swap_on_conversion():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.requires_torch("2.3", "torch.utils.swap_tensors")
@pytest.mark.parametrize("entry", ["0.bn.weight", "0.conv.weight"])
@pytest.mark.parametrize("strategy", [*EAGER, GRAPHS[0]])
def test_swap_tensors_on_a_model_parameter_works_and_is_followed(strategy: str, entry: str) -> None:
    model = models.build("tiny_cnn")
    ema = _ema(model, strategy)
    ema.update(model)
    p = model.get_parameter(entry)
    torch.utils.swap_tensors(p, nn.Parameter(torch.randn_like(p)))  # raised "Expected use_count" before
    _follows(ema, model)
    # The flat step reads both small tensors live from their slots (no rebuild): the BatchNorm vector as is,
    # the conv weight (a trailing shape too rare for a cat of its own) as a view(-1); the others rebuild once.
    rebuilds = 1 if strategy in ("auto", "flat") else 2
    assert ema.rebuilds == rebuilds
    _follows(ema, model)
    assert ema.rebuilds == rebuilds  # the step is cached and live


@pytest.mark.requires_torch("2.3", "torch.utils.swap_tensors")
def test_swap_tensors_on_a_flattened_model_is_followed_once_the_old_tensor_is_released() -> None:
    # A flattened model's fused groups are checked by the flat storage's reference count (O(1) per group):
    # a swap whose swapped-out tensor the caller keeps alive holds that count (ema_lab.step says so).
    model = models.build("tiny_cnn")
    ema = _ema(model, "flatten_model")
    ema.update(model)
    torch.utils.swap_tensors(model[0].conv.weight, nn.Parameter(torch.randn_like(model[0].conv.weight)))
    _follows(ema, model)
    assert ema.rebuilds == 2


@pytest.mark.requires_torch("2.3", "torch.__future__.set_swap_module_params_on_conversion")
@pytest.mark.parametrize("strategy", STRATEGIES_)
def test_swap_module_params_on_conversion_works_and_is_followed(strategy: str, swap_on_conversion) -> None:
    model = models.build("tiny_cnn")
    ema = _ema(model, strategy)
    ema.update(model)
    params = list(model.parameters())
    model.half()  # raised "_apply(): Couldn't swap Conv2d.weight" before
    model.float()
    assert list(model.parameters()) == params  # swapped in place: the same Parameter objects
    _follows(ema, model)
    ema.ema.half()  # the EMA's own tensors swapped too
    ema.ema.float()
    _follows(ema, model)


@pytest.mark.parametrize("strategy", STRATEGIES_)
@pytest.mark.parametrize("entry", ["_parameters", "_buffers", "counter"])
def test_direct_slot_assignment_is_followed(strategy: str, entry: str) -> None:
    model = models.build("tiny_cnn")
    ema = _ema(model, strategy)
    ema.update(model)
    bn = model[0].bn
    if entry == "_parameters":  # no registration hook fires for a direct dict write
        bn._parameters["weight"] = nn.Parameter(bn.weight.detach().clone())
    elif entry == "_buffers":
        bn._buffers["running_mean"] = bn.running_mean.clone()
    else:
        bn._buffers["num_batches_tracked"] = torch.tensor(7, device=bn.weight.device)
    _follows(ema, model)
    assert ema.ema[0].bn.num_batches_tracked.item() == bn.num_batches_tracked.item()


# --- live reads: the 1-D tensors of a cat part are read through the module slots, unchecked ------------
# (these tests are about the flat step's private layout: they read ema._step)


def test_the_default_reads_small_tensors_live_and_checks_the_rest() -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    ema.update(model)
    entries = float_entries(model)
    vectors = {k for k, v in entries.items() if v.numel() < CAT_MAX_NUMEL and v.dim() == 1}
    rare = {k for k, v in entries.items() if v.numel() < CAT_MAX_NUMEL and v.dim() != 1}
    assert len(rare) == 3 < MIN_LIVE_RUN  # 2 convs' weights, the Linear's: each of a trailing shape its own
    (group,) = ema._step.groups
    (run,) = (
        group.runs
    )  # one cat: BatchNorm's vectors and the Linear's bias, then the 3 rare ones viewed flat
    assert (len(run[1]), len(run[3])) == (len(vectors), len(rare))
    # data_ptr() checked: every EMA entry, and of the model's the 3 conv weights of 2304 elements or more
    # (foreach) and the 5 counters
    large = len(entries) - len(vectors) - len(rare)
    assert large == 3
    assert len(ema._step.watch.keys) - len(ema.ema.state_dict()) == large + 5


@pytest.mark.parametrize(
    "how",
    [
        "data",
        "_parameters",
        pytest.param("swap_tensors", marks=pytest.mark.requires_torch("2.3", "torch.utils.swap_tensors")),
    ],
)
def test_a_live_slot_replaced_by_a_same_shape_tensor_is_followed_without_a_rebuild(how: str) -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    ema.update(model)
    bn = model[1].bn
    new = nn.Parameter(torch.randn_like(bn.weight))
    if how == "data":
        bn.weight.data = new.data
    elif how == "_parameters":
        bn._parameters["weight"] = new
    else:
        torch.utils.swap_tensors(bn.weight, new)
    _follows(ema, model)
    assert ema.rebuilds == 1  # the slot is read as it is now: nothing to rebuild


def _two_live_groups() -> tuple[nn.Module, ModelEMA]:
    # model[3] in float16 before the EMA is made: two groups, (fp32, fp32) and (fp16, fp16), both cat+foreach
    model = models.build("tiny_cnn")
    model[3].half()
    ema = ModelEMA(model)
    ema.update(model)
    assert [(g.emas[0].dtype, g.mode) for g in ema._step.groups] == [
        (torch.float32, "cat+foreach"),
        (torch.float16, "cat+foreach"),
    ]
    return model, ema


class _MaxNormConv(nn.Conv2d):
    """braindecode's and EEGNet's max-norm constraint: the forward reassigns ``weight.data``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.data = torch.renorm(self.weight.data, p=2, dim=0, maxnorm=1.0)
        return super().forward(x)


def test_a_small_weight_reassigned_by_every_forward_costs_no_rebuild() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 8, (1, 4), bias=False), _MaxNormConv(8, 16, (3, 1), groups=8, bias=False)
    )
    ema = ModelEMA(model)
    for _ in range(5):
        model(torch.randn(2, 1, 3, 8))
        ema.update(model, decay=0.0)
    assert ema.rebuilds == 1  # both weights are of a rare trailing shape: read live, as views
    assert all(torch.equal(v, float_entries(model)[k]) for k, v in float_entries(ema.ema).items())


def test_a_small_weight_narrowed_in_place_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(6, 5))
    ema = ModelEMA(model)
    ema.update(model)
    before = {k: v.clone() for k, v in float_entries(ema.ema).items()}
    model[1].weight.data = model[1].weight.data[:2]  # the same data_ptr(), fewer elements
    with pytest.raises(ValueError, match=r"^entry \d+ \('1.weight'\).*does not match model shape \(2, 6\)"):
        ema.update(model)
    assert all(torch.equal(v, before[k]) for k, v in float_entries(ema.ema).items())


def test_a_model_of_small_tensors_can_be_flattened_after_its_emas_first_update() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(6, 5))
    ema = ModelEMA(model)
    ema.update(model)
    flatten_model(model)  # the step holds no alias of a small tensor: nothing refuses the move
    ema.update(model, decay=0.0)  # the live reads follow the tensors to their new memory
    assert all(torch.equal(v, float_entries(model)[k]) for k, v in float_entries(ema.ema).items())


@pytest.mark.parametrize(
    "breakage, error",
    [
        ("size", "does not match model shape"),
        ("None", "EMA and model do not hold the same entries"),
        ("del", "EMA and model do not hold the same entries"),
        ("meta", "does not match model shape"),
    ],
)
def test_a_live_slot_that_no_longer_fits_fails_before_any_group_is_written(breakage: str, error: str) -> None:
    model, ema = _two_live_groups()
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    bn = model[3].bn  # a live slot of the second group: the first group must stay untouched as well
    if breakage == "size":
        bn._parameters["weight"] = nn.Parameter(torch.ones(33, dtype=torch.float16))
    elif breakage == "None":
        bn._parameters["weight"] = None
    elif breakage == "del":  # a live slot's key gone: a clear error, not the gather's KeyError
        del bn.weight
    else:
        bn._parameters["weight"] = nn.Parameter(torch.empty(32, dtype=torch.float16, device="meta"))
    with pytest.raises(ValueError, match=error):
        ema.update(model)
    for k, v in ema.ema.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert ema.updates == 1


def test_a_live_slot_that_changes_dtype_is_followed_after_a_rebuild() -> None:
    model, ema = _two_live_groups()
    bn = model[3].bn
    bn.weight.data = bn.weight.data.float()  # fp16 -> fp32: the gather of its group no longer fits
    _follows(ema, model)
    assert ema.rebuilds == 2


def _reviewed_in_place(strategy: str, which: str) -> tuple[nn.Module, ModelEMA, dict, str]:
    """A model whose ``entry`` was re-viewed in place (``p.data = p.view(new_shape)``) after one update."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Conv2d(4, 4, 3), nn.Linear(64, 64))  # 4096, 144 elements
    ema = _ema(model, strategy)
    ema.update(model)
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    _shift(model, 1.0)  # every pair would move: a partial update could not hide
    entry = "2.weight" if which.startswith("large") else "1.weight"
    p = model.get_parameter(entry)
    p.data = p.data.view(32, 128) if which.startswith("large") else p.data.view(8, 2, 3, 3)  # same data_ptr()
    return model, ema, before, entry


WHICH = ["large (foreach)", "small N-D (cat alias)"]


@pytest.mark.parametrize("strategy", [*EAGER, GRAPHS[0]])
@pytest.mark.parametrize("which", WHICH)
def test_a_tensor_reviewed_in_place_is_averaged_as_its_memory_by_every_strategy(
    strategy: str, which: str
) -> None:
    """Every step reads the model through aliases shaped like the EMA: all pairs move, none halfway."""
    model, ema, before, _ = _reviewed_in_place(strategy, which)
    ema.update(model, decay=0.5)
    now = model.state_dict()
    for k, v in ema.ema.state_dict().items():
        if v.is_floating_point():  # every pair moved, towards the model's memory as it lies
            assert torch.equal(v, before[k].lerp(now[k].reshape(v.shape), 0.5)), k


@pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch build has no torch.distributed")
def test_sharded_ema_also_averages_a_tensor_reshaped_in_place_as_its_memory() -> None:
    from ema_lab.sharded import ShardedModelEMA

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))  # plain tensors: averaged whole, one process
    ema = ShardedModelEMA(model, decay=0.5, tau=1e-9)
    ema.update(model)
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    _shift(model, 1.0)
    model[1].weight.data = model[1].weight.data.view(32, 128)
    ema.update(model)
    now = model.state_dict()
    for k, v in ema.ema.state_dict().items():
        assert torch.equal(v, before[k].lerp(now[k].reshape(v.shape), 0.5)), k
    assert ema.rebuilds == 1


def test_a_forward_that_reassigns_a_non_persistent_buffer_does_not_rebuild_the_step() -> None:
    """A rotary or mask cache reassigned every forward is no entry of the EMA: no rebuild per update."""

    class WithCache(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.register_buffer("cache", torch.zeros(4), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.cache = x.detach().mean(0)  # a new tensor each call
            return super().forward(x)

    model = WithCache()
    ema = ModelEMA(model)
    for _ in range(5):
        model(torch.randn(2, 4))
        ema.update(model)
    assert ema.rebuilds == 1


def test_an_ema_unpickled_where_no_ema_was_made_still_sees_a_replaced_module(monkeypatch) -> None:
    """The registration hooks come with the first watch, not only with the first constructor."""
    import pickle

    from ema_lab import step

    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    ema = ModelEMA(model)
    ema.update(model)
    blob = pickle.dumps(ema)
    for handle in step._hooks:  # as in a fresh process (the private hook list: this test is about it)
        handle.remove()
    monkeypatch.setattr(step, "_hooks", [])
    fresh = pickle.loads(blob)
    fresh.update(model)
    model[0] = nn.Linear(3, 3)  # a registration, seen only through the hooks
    fresh.update(model, decay=0.0)
    assert torch.equal(fresh.ema[0].weight, model[0].weight) and fresh.rebuilds == 3  # pickled after 1


def _each_kind_of_ema(model: nn.Module, tmp_path) -> dict[str, ModelEMA]:
    emas: dict[str, ModelEMA] = {s: ModelEMA(model, strategy=s) for s in ("flat", "gated", "foreach", "loop")}
    emas["posthoc"] = PostHocEMA(model, tmp_path, sigma_rels=(0.05, 0.1, 0.15), snapshot_every=1000)
    return emas


def test_modules_built_in_the_training_loop_cost_no_rebuild(tmp_path) -> None:
    """A loss with a weight, a metric with buffers, a layer made each step: none is the EMA's model."""
    model = models.build("tiny_cnn")
    emas = _each_kind_of_ema(model, tmp_path)
    for step in range(5):
        nn.BCEWithLogitsLoss(pos_weight=torch.ones(3))  # registers a buffer
        nn.CrossEntropyLoss(weight=torch.ones(3))
        nn.Linear(2, 2)
        metric = nn.BatchNorm1d(4)
        metric.running_mean = torch.zeros(4)  # a buffer replaced, on a module no EMA watches
        _shift(model, 0.1 * step)
        for ema in emas.values():
            ema.update(model)
    assert {name: ema.rebuilds for name, ema in emas.items()} == dict.fromkeys(emas, 1)


def test_modules_built_in_another_thread_and_another_models_changes_cost_no_rebuild(tmp_path) -> None:
    import threading

    model, other = models.build("tiny_cnn"), models.build("tiny_cnn")
    emas, other_ema = _each_kind_of_ema(model, tmp_path), ModelEMA(other)
    for ema in (*emas.values(), other_ema):
        ema.update(model if ema is not other_ema else other)

    def build() -> None:
        for _ in range(20):
            nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3))

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    other[0].conv = nn.Conv2d(
        3, 8, 3, 2, 1, bias=False
    )  # the other model's layer replaced: only its EMA rebuilds
    other_ema.update(other)
    for ema in emas.values():
        ema.update(model)
    assert {name: ema.rebuilds for name, ema in emas.items()} == dict.fromkeys(emas, 1)
    assert other_ema.rebuilds == 2


@pytest.mark.parametrize("strategy", ["auto", "gated"])
def test_a_registration_on_the_model_or_the_ema_still_rebuilds(strategy: str) -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model, strategy=strategy)
    ema.update(model)
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    bn.num_batches_tracked = torch.zeros((), dtype=torch.long)  # a buffer replaced in the model
    ema.update(model)
    assert ema.rebuilds == 2
    ema_bn = next(m for m in ema.ema.modules() if isinstance(m, nn.BatchNorm2d))
    ema_bn.num_batches_tracked = torch.zeros((), dtype=torch.long)  # and in the EMA
    ema.update(model)
    assert ema.rebuilds == 3
