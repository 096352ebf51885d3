"""Every way an EMA or a flattened model is saved keeps every entry (issue #62, item 3).

The "flat" EMA's tensors, and a model's after ``flatten_model``, are views of one buffer. accelerate's
``save_model``/``save_state`` key each entry by its storage (``id_tensor_storage``: device, storage pointer,
size) and keep one entry per storage; safetensors' ``save_model``/``load_model`` refuse an entry that does
not cover its storage. So each of the EMA's tensors lies on a storage of its own (a slice of the buffer's),
and a flattened model's ``state_dict()`` gives copies: checked here as those tools check (torch alone),
through ``torch.save``, and through safetensors where it is installed.
accelerate, Lightning and timm themselves: tests/trainers.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from ema_lab import ModelEMA, PostHocEMA, flatten_model, unflatten_model
from ema_lab.bench import models

from ..helpers import one_rank_group


def _trained(model: nn.Module) -> nn.Module:
    """``model`` after one forward in train mode (BatchNorm's statistics and counters move)."""
    model.train()
    model(torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0)))
    return model


def _ema_module(strategy: str, flat_model: bool = False) -> Callable[[Path], nn.Module]:
    def make(tmp_path: Path) -> nn.Module:
        model = models.build("tiny_cnn")
        if flat_model:
            flatten_model(model)
        ema = ModelEMA(model, strategy=strategy, decay=0.5, tau=0.01)
        ema.update(_trained(model))
        return ema.ema

    return make


def _flattened(tmp_path: Path) -> nn.Module:
    model = models.build("tiny_cnn")
    flatten_model(model)
    return _trained(model)


def _posthoc_second(tmp_path: Path) -> nn.Module:
    model = models.build("tiny_cnn")
    ema = PostHocEMA(model, tmp_path / "snapshots")
    ema.update(_trained(model))
    return ema.emas[1]


#: name -> a module whose state_dict() a user saves (views of one buffer; "gated": its counters only).
MODULES: dict[str, Callable[[Path], nn.Module]] = {
    "ModelEMA default (flat)": _ema_module("auto"),
    "ModelEMA gated (its counters in one buffer)": _ema_module("gated"),
    "ModelEMA of a flattened model (fused)": _ema_module("auto", flat_model=True),
    "flatten_model": _flattened,
    "PostHocEMA's second EMA": _posthoc_second,
}


def _storage_id(t: Tensor) -> tuple:
    """accelerate's ``id_tensor_storage``: ``clean_state_dict_for_safetensors`` keeps one entry of each."""
    return t.device, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def _covers_its_storage(t: Tensor) -> bool:
    """safetensors' ``_is_complete``: what its ``save_model``/``load_model`` need of an entry."""
    storage = t.untyped_storage()
    return t.data_ptr() == storage.data_ptr() and t.numel() * t.element_size() == storage.nbytes()


def _assert_whole(state: dict[str, Tensor]) -> None:
    """Every entry its own storage, covered whole: nothing for those tools to drop or refuse."""
    by_storage: dict[tuple, list[str]] = {}
    for k, v in state.items():
        by_storage.setdefault(_storage_id(v), []).append(k)
    shared = [keys for keys in by_storage.values() if len(keys) > 1]
    assert not shared, f"{sum(map(len, shared)) - len(shared)} of {len(state)} entries would be dropped"
    partial = [k for k, v in state.items() if not _covers_its_storage(v)]
    assert not partial, f"{partial[:3]} do not cover their storage"


def _assert_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k


def _zero(state: dict[str, Tensor]) -> None:
    """Zero every entry in place, through the dict's own tensors (as an EMA writes into a state_dict)."""
    with torch.no_grad():
        for v in state.values():
            v.zero_()


def _roundtrip(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("name", MODULES)
def test_every_entry_is_its_own_storage_and_round_trips(name: str, tmp_path: Path) -> None:
    module = MODULES[name](tmp_path)
    state = module.state_dict()
    _assert_whole(state)
    loaded = _roundtrip(state)
    _assert_equal(loaded, state)
    fresh = models.build("tiny_cnn")
    fresh.load_state_dict(loaded)  # strict: every entry there
    _assert_equal(fresh.state_dict(), state)


EMAS = [name for name in MODULES if name != "flatten_model"]


@pytest.mark.parametrize("name", EMAS)
def test_an_emas_tensors_own_their_storages_through_a_deep_copy_or_pickle(name: str, tmp_path: Path) -> None:
    module = MODULES[name](tmp_path)
    for other in (deepcopy(module), _roundtrip(module), pickle.loads(pickle.dumps(module))):
        _assert_whole(other.state_dict())
        _assert_equal(other.state_dict(), module.state_dict())


@pytest.mark.parametrize("name", EMAS)
def test_an_emas_state_dict_is_views_writes_into_it_land(name: str, tmp_path: Path) -> None:
    """No copies: ``v.copy_()`` into ``ema.ema.state_dict()`` (Lightning's, ultralytics' idiom) moves it."""
    module = MODULES[name](tmp_path)
    _zero(module.state_dict())
    assert all(not t.any() for t in (*module.parameters(), *module.buffers()))


def test_a_flattened_models_state_dict_is_copies_and_keep_vars_its_own_tensors(tmp_path: Path) -> None:
    model = _flattened(tmp_path)
    own = model.state_dict(keep_vars=True)
    assert all(own[k] is p for k, p in model.named_parameters())
    _zero(own)
    assert all(not v.any() for v in model.state_dict().values())  # keep_vars: writes land
    model.state_dict()["0.conv.weight"].fill_(1.0)  # a copy: the model is untouched
    assert not model[0].conv.weight.any()


def test_a_copy_of_a_flattened_model_gives_views_until_flattened_itself(tmp_path: Path) -> None:
    """An EMA that deep-copies the model and writes into the copy's ``state_dict()`` (ultralytics', timm's
    ModelEmaV3) still moves; ``flatten_model`` of the copy makes it save whole."""
    model = _flattened(tmp_path)
    for copy in (deepcopy(model), _roundtrip(model), pickle.loads(pickle.dumps(model))):
        _assert_equal(copy.state_dict(), model.state_dict())
        _zero(copy.state_dict())
        assert all(not t.any() for t in (*copy.parameters(), *copy.buffers()))
        flatten_model(copy)
        _assert_whole(copy.state_dict())


def test_one_entry_saved_alone_is_its_own_size_not_the_buffer(tmp_path: Path) -> None:
    module = _ema_module("auto")(tmp_path)
    floats = {k: v for k, v in module.state_dict().items() if v.is_floating_point()}
    key, value = min(floats.items(), key=lambda item: item[1].numel())
    buffer = io.BytesIO()
    torch.save({key: value}, buffer)
    assert buffer.tell() < 4096 + value.numel() * value.element_size(), buffer.tell()


def test_tied_weights_are_saved_under_both_names() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    flatten_model(model)
    state = model.state_dict()
    _assert_whole(state)
    assert torch.equal(state["0.weight"], state["1.weight"])
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fresh.load_state_dict(_roundtrip(state))
    _assert_equal(fresh.state_dict(), state)


def test_a_submodule_of_a_flattened_model_saves_whole_too(tmp_path: Path) -> None:
    model = _flattened(tmp_path)
    _assert_whole(model[0].state_dict())  # saved on its own (a backbone, an unwrapped model)
    _assert_equal(model[0].state_dict(), {k[2:]: v for k, v in model.state_dict().items() if k[:2] == "0."})


def test_unflatten_removes_the_hook_and_a_second_flatten_adds_none() -> None:
    model = models.build("tiny_cnn")
    flatten_model(model)
    flatten_model(model)
    assert all(len(m._state_dict_hooks) == 1 for m in model.modules())
    unflatten_model(model)
    assert not any(m._state_dict_hooks for m in model.modules())
    _assert_whole(model.state_dict())  # its own memory again


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_ddp_wrapped_flattened_model_saves_whole_wrapped_or_not(tmp_path_factory, when: str) -> None:
    with one_rank_group(tmp_path_factory.mktemp("pg")):
        model = models.build("tiny_cnn")
        if when == "before":
            flatten_model(model)
        wrapped = nn.parallel.DistributedDataParallel(model)
        if when == "after":
            flatten_model(wrapped)
        state = wrapped.state_dict()  # accelerate's save_state
        assert all(k.startswith("module.") for k in state)
        _assert_whole(state)
        _assert_whole(model.state_dict())  # accelerate's save_model unwraps it
        ema = ModelEMA(wrapped)
        ema.update(wrapped)
        _assert_whole(ema.ema.state_dict())


def test_a_submodule_saved_inside_its_parent_is_whole_under_its_prefix(tmp_path: Path) -> None:
    ema = _ema_module("auto")(tmp_path)
    holder = nn.Module()
    holder.module = ema  # timm's ModelEmaV3 holds the EMA so: state_dict keys "module.<key>"
    state = holder.state_dict()
    _assert_whole(state)
    _assert_equal({k.removeprefix("module."): v for k, v in state.items()}, ema.state_dict())


@pytest.mark.parametrize("name", MODULES)
def test_safetensors_save_file_save_model_and_load_model_keep_every_entry(name: str, tmp_path: Path) -> None:
    st = pytest.importorskip(
        "safetensors.torch", reason="safetensors is not installed (tests/trainers has it)"
    )
    module = MODULES[name](tmp_path)
    want = {k: v.clone() for k, v in module.state_dict().items()}
    st.save_file(module.state_dict(), tmp_path / "file.safetensors")
    _assert_equal(st.load_file(tmp_path / "file.safetensors"), want)
    st.save_model(module, tmp_path / "model.safetensors")
    with torch.no_grad():
        for v in module.state_dict(keep_vars=True).values():
            v.zero_()
    missing, unexpected = st.load_model(module, tmp_path / "model.safetensors")
    assert not missing and not unexpected
    _assert_equal(module.state_dict(), want)


@pytest.mark.skipif(
    not hasattr(torch.UntypedStorage, "resizable"),
    reason=f"torch {torch.__version__} has no UntypedStorage.resizable(): a storage slice cannot be told",
)
def test_unflatten_gives_an_emas_tensors_memory_apart_from_its_steps_buffer(tmp_path: Path) -> None:
    model = models.build("tiny_cnn")
    ema = ModelEMA(model)
    ema.update(model)
    before = {k: (v.data_ptr(), v.clone()) for k, v in ema.ema.state_dict().items()}
    unflatten_model(ema.ema)  # each on a slice of the step's buffer: moved all the same
    for k, v in ema.ema.state_dict().items():
        assert v.data_ptr() != before[k][0] and torch.equal(v, before[k][1]), k
    ema.update(model)
    assert ema.rebuilds == 2
