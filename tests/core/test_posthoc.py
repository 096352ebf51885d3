"""ema_lab.posthoc: post-hoc EMA synthesis against EMAs tracked directly, bad input (the snapshot files:
tests/core/test_snapshots.py).

ema-pytorch's PostHocEMA is compared by benchmarks/peer_schedules.py (docs/results/peer-schedules.json).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ema_lab import ModelEMA, PostHocEMA, flatten_model
from ema_lab.bench import models
from ema_lab.posthoc import power_inner_products, solve_weights, synthesize
from ema_lab.schedules import power
from ema_lab.snapshots import check_folder, list_snapshots, read_snapshot, save_step

from ..helpers import float_entries


def track(
    xs: torch.Tensor, sigma_rels: tuple[float, ...], folder: Path | None, every: int
) -> list[torch.Tensor]:
    """Power EMAs of the rows of xs (float32, as a model's), snapshots of the first two every ``every``."""
    schedules = [power(sigma_rel=s) for s in sigma_rels]
    emas = [xs[0].clone() for _ in schedules]
    if folder is not None:
        check_folder(folder)
    for n in range(1, len(xs) + 1):
        for e, s in zip(emas, schedules):
            e.lerp_(xs[n - 1], 1 - s(n))
        if folder is not None and n % every == 0:
            save_step(
                folder, n, {s.gamma: {"w": e, "count": torch.tensor(n)} for e, s in zip(emas, schedules[:2])}
            )
    return emas


def trajectories(steps: int, dim: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(steps, dim, generator=g)
    t = torch.arange(1, steps + 1, dtype=torch.float32)[:, None]
    return {"random walk": noise.cumsum(0), "t-linear plus noise": t + noise}


@pytest.mark.parametrize("name", ["random walk", "t-linear plus noise"])
def test_synthesis_matches_the_ema_tracked_directly(tmp_path, name):
    # 4,000 steps, snapshots of sigma_rel 0.05 and 0.10 every 200; synthesize 0.075 (between) and 0.15
    # (beyond), compare with the EMAs of those lengths tracked alongside. Tolerance: 1 % of the distance from
    # the tracked EMA to the nearest snapshot EMA (what taking that snapshot instead would cost). Measured
    # (float32): walk 0.085 % at 0.075, 0.13 % at 0.15; line 0.027 % and 0.13 %.
    xs = trajectories(4000, 512)[name]
    ema05, ema10, ema075, ema15 = track(xs, (0.05, 0.10, 0.075, 0.15), tmp_path, every=200)
    assert len(list_snapshots(tmp_path)) == 40
    for sr, tracked, nearest in ((0.075, ema075, ema10), (0.15, ema15, ema10)):
        out = synthesize(tmp_path, sr)
        err = (out["w"] - tracked).abs().max().item()
        gap = (nearest - tracked).abs().max().item()
        assert err < 0.01 * gap, (sr, err, gap)
        assert out["count"].item() == 4000  # integer entries: the last snapshot's


def test_synthesis_at_an_earlier_step_uses_the_snapshots_up_to_it(tmp_path):
    xs = trajectories(2000, 64)["random walk"]
    track(xs, (0.05, 0.10), tmp_path, every=100)
    early = tmp_path / "early"
    ema05, ema10, ema075 = track(xs[:1000], (0.05, 0.10, 0.075), early, every=100)
    a, b = synthesize(tmp_path, 0.075, step=1000), synthesize(early, 0.075)
    torch.testing.assert_close(a["w"], b["w"], rtol=0, atol=0)
    assert (a["w"] - ema075).abs().max() < 0.01 * (ema10 - ema075).abs().max()


def test_a_snapshot_of_the_target_length_gets_all_the_weight():
    w = solve_weights([6.94, 16.97, 6.94, 16.97], [500, 500, 1000, 1000], 1000, target_gamma=16.97)
    torch.testing.assert_close(w, torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64), atol=1e-9, rtol=0)
    assert w.dtype == torch.float64 and w.sum().item() == pytest.approx(1.0, abs=1e-15)


def test_inner_products_match_numerical_integration():
    # The profiles (g + 1) / t (x / t) ** g on [0, t], integrated by a midpoint sum, not the closed form.
    m = 400_000
    for ta, ga, tb, gb in ((1000.0, 6.94, 700.0, 16.97), (300.0, 0.0, 900.0, 3.5), (500.0, 2.0, 500.0, 2.0)):
        x = (torch.arange(m, dtype=torch.float64) + 0.5) * (min(ta, tb) / m)
        pa, pb = (ga + 1) / ta * (x / ta) ** ga, (gb + 1) / tb * (x / tb) ** gb
        numeric = (pa * pb).sum().item() * min(ta, tb) / m
        f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        closed = power_inner_products(f64(ta), f64(ga), f64(tb), f64(gb)).item()
        assert closed == pytest.approx(numeric, rel=1e-6)


def test_a_saved_twice_snapshot_does_not_break_the_solve():
    w = solve_weights([6.94, 6.94, 16.97], [1000, 1000, 1000], 1000, target_sigma_rel=0.075)
    assert torch.isfinite(w).all() and w[0].item() == pytest.approx(w[1].item())


BAD_SOLVE = [
    ({"snapshot_gammas": [1.0], "snapshot_steps": [10], "target_step": 10}, "give one of target_gamma"),
    (
        {"snapshot_gammas": [1.0, 2.0], "snapshot_steps": [10], "target_step": 10, "target_gamma": 1.0},
        "as many",
    ),
    ({"snapshot_gammas": [], "snapshot_steps": [], "target_step": 10, "target_gamma": 1.0}, "at least one"),
    (
        {"snapshot_gammas": [-2.0], "snapshot_steps": [10], "target_step": 10, "target_gamma": 1.0},
        "gamma must",
    ),
    ({"snapshot_gammas": [1.0], "snapshot_steps": [0], "target_step": 10, "target_gamma": 1.0}, "step must"),
    (
        {"snapshot_gammas": [1.0], "snapshot_steps": [10], "target_step": 1.5, "target_gamma": 1.0},
        "target_step",
    ),
    (
        {"snapshot_gammas": [1.0], "snapshot_steps": [10], "target_step": 10, "target_sigma_rel": 0.5},
        "sigma_rel",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_SOLVE, ids=[m for _, m in BAD_SOLVE])
def test_solve_weights_bad_input_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        solve_weights(**kwargs)
    assert "\n" not in str(info.value)


def test_synthesize_bad_input_one_line(tmp_path):
    save_step(tmp_path, 10, {1.0: {"w": torch.ones(2)}})
    cases = [
        (lambda: synthesize(tmp_path / "missing", 0.1), "no snapshot folder"),
        (lambda: synthesize(tmp_path, 0.1, step=5), "step must be one of the snapshots' steps"),
        (lambda: synthesize(tmp_path), "give one of sigma_rel and gamma"),
        (lambda: synthesize(tmp_path, 0.1, gamma=1.0), "give one of sigma_rel and gamma"),
        (lambda: synthesize(tmp_path, 0.1, dtype=torch.float16), "dtype must be"),
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((lambda: synthesize(empty, 0.1), "no snapshots in"))
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


# --- PostHocEMA: every profile from one read, snapshots, resume --------------------------------


def _train_step(model: torch.nn.Module, step: int) -> None:
    """A deterministic drift plus noise, and the BatchNorm counters moving, as training would."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for v in float_entries(model).values():
            v.add_(torch.randn(v.shape, generator=g) * 0.01 + 0.001)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.num_batches_tracked += 1


@pytest.mark.parametrize(
    "sigma_rels", [(0.05, 0.2), (0.05, 0.1, 0.15, 0.2)], ids=["2 profiles", "4 profiles"]
)
@pytest.mark.parametrize("layout", ["plain", "flattened", "half model"])
def test_every_ema_equals_its_own_model_ema_bit_for_bit(layout: str, sigma_rels: tuple, tmp_path) -> None:
    model = models.build("tiny_cnn")
    if layout == "flattened":
        flatten_model(model)
    posthoc = PostHocEMA(model, tmp_path, sigma_rels=sigma_rels, snapshot_every=4)
    direct = [ModelEMA(model, decay=power(sigma_rel=s), strategy="flat") for s in sigma_rels]
    for step in range(1, 11):
        _train_step(model, step)
        if layout == "half model" and step == 5:
            model.half()  # a conversion mid-run: both EMAs follow the rebuilt step
        posthoc.update(model)
        for ema in direct:
            ema.update(model)
    assert len(posthoc.emas) == len(direct) and posthoc.ema is posthoc.emas[0]
    for ours, theirs in zip(posthoc.emas, direct):
        mine, other = ours.state_dict(), theirs.ema.state_dict()
        assert mine.keys() == other.keys()
        for k in mine:
            assert torch.equal(mine[k], other[k]), k
    assert posthoc.rebuilds == (2 if layout == "half model" else 1)
    assert [s.step for s in list_snapshots(tmp_path)] == [4] * len(sigma_rels) + [8] * len(sigma_rels)


def test_synthesis_between_the_two_lengths_is_close_to_the_ema_tracked_directly(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    posthoc = PostHocEMA(model, tmp_path, sigma_rels=(0.05, 0.10), snapshot_every=100)
    direct = ModelEMA(model, decay=power(sigma_rel=0.075))
    start = model.weight.detach().clone()
    for step in range(1, 2001):
        with torch.no_grad():  # a drifting weight: the EMA's length shows in how far it lags
            model.weight.copy_(start + step / 2000 + 0.05 * torch.randn_like(start))
        posthoc.update(model)
        direct.update(model)
    synthesized = posthoc.synthesize(0.075)["weight"]
    tracked, nearest = direct.ema.weight, posthoc.ema.weight
    gap = (tracked - synthesized).abs().max().item()
    assert gap < 0.05 * (tracked - nearest).abs().max().item()  # 5 % of the distance to a snapshot's EMA


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sigma_rels": ()}, "sigma_rels must be a non-empty sequence of lengths"),
        ({"sigma_rels": 0.05}, "sigma_rels must be a non-empty sequence of lengths"),
        ({"sigma_rels": "0.05"}, "sigma_rels must be a non-empty sequence of lengths"),
        ({"sigma_rels": torch.tensor(0.05)}, "sigma_rels must be a non-empty sequence of lengths"),
        ({"sigma_rels": (0.05, 0.05)}, "sigma_rels must be distinct profiles"),
        ({"sigma_rels": (0.05, 0.5)}, "sigma_rel must be in"),
        ({"snapshot_every": 0}, "snapshot_every must be an int >= 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs: dict, message: str, tmp_path) -> None:
    with pytest.raises(ValueError, match=message) as info:
        PostHocEMA(torch.nn.Linear(2, 2), tmp_path / "run", **kwargs)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_sigma_rels_may_be_any_run_of_numbers(tmp_path) -> None:
    """A NumPy array or a generator of lengths gives the same profiles as the tuple."""
    np = pytest.importorskip("numpy")
    want = [s.gamma for s in PostHocEMA(torch.nn.Linear(2, 2), tmp_path / "a", (0.05, 0.1)).schedules]
    for lengths in (np.array([0.05, 0.1]), (s for s in (0.05, 0.1))):
        got = PostHocEMA(torch.nn.Linear(2, 2), tmp_path / "b", lengths).schedules
        assert [s.gamma for s in got] == want and all(type(s.gamma) is float for s in got)


def test_the_second_ema_follows_its_own_tensors_being_replaced(tmp_path) -> None:
    """A further EMA's tensors moved by the user (new memory, another dtype) are laid out again."""
    model = models.build("tiny_cnn")
    posthoc = PostHocEMA(model, tmp_path, sigma_rels=(0.05, 0.2), snapshot_every=100)
    direct = ModelEMA(model, decay=power(sigma_rel=0.2), strategy="flat")
    for step in range(1, 9):
        _train_step(model, step)
        if step == 3:
            posthoc.emas[1][0].conv.weight.data = posthoc.emas[1][0].conv.weight.data.clone()
        if step == 5:
            posthoc.emas[1].double()  # laid out again in the first EMA's dtype
        posthoc.update(model)
        direct.update(model)
    want = direct.ema.state_dict()
    for k, v in posthoc.emas[1].state_dict().items():
        assert torch.equal(v, want[k]), k


def _run(runs: tuple[tuple[torch.nn.Module, PostHocEMA], ...], steps: range) -> None:
    """Each step: train every model, then update its EMA."""
    for step in steps:
        for model, ema in runs:
            _train_step(model, step)
            ema.update(model)


def _assert_same_emas(mine: PostHocEMA, other: PostHocEMA) -> None:
    """Every profile's EMA bitwise equal to the other run's."""
    for a, b in zip(mine.emas, other.emas, strict=True):
        want = b.state_dict()
        for k, v in a.state_dict().items():
            assert torch.equal(v, want[k]), k


def test_a_run_resumed_from_its_snapshots_equals_one_that_never_stopped(tmp_path) -> None:
    model, again = models.build("tiny_cnn"), models.build("tiny_cnn")
    whole = PostHocEMA(model, tmp_path / "whole", snapshot_every=4)
    first = PostHocEMA(again, tmp_path / "resumed", snapshot_every=4)
    _run(((model, whole), (again, first)), range(1, 9))
    with pytest.raises(ValueError, match="holds snapshots up to update 8: resume with updates="):
        PostHocEMA(again, tmp_path / "resumed", snapshot_every=4)
    resumed = PostHocEMA(again, tmp_path / "resumed", snapshot_every=4, updates=8)
    _run(((model, whole), (again, resumed)), range(9, 13))
    assert resumed.updates == whole.updates == 12
    _assert_same_emas(resumed, whole)


def test_an_update_whose_save_fails_is_undone_and_a_retry_applies_it_once(tmp_path, monkeypatch) -> None:
    model, twin = models.build("tiny_cnn"), models.build("tiny_cnn")
    failing = PostHocEMA(model, tmp_path / "failing", snapshot_every=2)
    whole = PostHocEMA(twin, tmp_path / "whole", snapshot_every=2)
    for step in (1, 2):
        for m, ema in ((model, failing), (twin, whole)):
            _train_step(m, step)
            ema.update(m)
    before = [{k: v.clone() for k, v in ema.state_dict().items()} for ema in failing.emas]
    for m in (model, twin):
        _train_step(m, 3)
    failing.update(model)
    whole.update(twin)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr("ema_lab.posthoc.save_step", disk_full)
        _train_step(model, 4)
        with pytest.raises(OSError, match="No space left"):
            failing.update(model)
    assert failing.updates == 3
    for ema, old in zip(failing.emas, before):
        assert any(not torch.equal(v, old[k]) for k, v in ema.state_dict().items())  # update 3 stayed
    failing.update(model)  # the retry, once space is back
    _train_step(twin, 4)
    whole.update(twin)
    assert failing.updates == whole.updates == 4 and failing.rebuilds == 1
    for mine, other in zip(failing.emas, whole.emas):
        want = other.state_dict()
        for k, v in mine.state_dict().items():
            assert torch.equal(v, want[k]), k


class _StandInDDP(torch.nn.parallel.DistributedDataParallel):
    """Only what the unsynced warning reads of a DDP model (a real one refuses SyncBatchNorm off the GPU)."""

    def __init__(self, module: torch.nn.Module) -> None:
        torch.nn.Module.__init__(self)
        self.module = module


def test_sync_batchnorm_warns_for_no_ema_of_a_posthoc_ema(tmp_path: Path, monkeypatch, recwarn) -> None:
    # SyncBatchNorm's buffers are equal on every rank: only the first EMA's counted as such, so the second
    # EMA's (a deepcopy, other tensors) made PostHocEMA ask for a sync_buffers() that is not needed.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # a two-rank run, as torch says
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4))
    ema = PostHocEMA(model, tmp_path)
    ema.update(_StandInDDP(model))
    assert not [w for w in recwarn if "sync_buffers" in str(w.message)]


# --- a run's identity and checkpoints (issue #55) ----------------------------------------------------------


def test_a_resumed_run_from_its_state_dict_equals_one_that_never_stopped_bit_for_bit(tmp_path) -> None:
    """Checkpointed at update 10 (snapshots at 4 and 8), resumed in a new object from the snapshots of 8 and
    the checkpoint through torch.save/torch.load(weights_only=True): every EMA, the count and the later
    snapshots equal an uninterrupted run's."""
    model, again = models.build("tiny_cnn"), models.build("tiny_cnn")
    whole = PostHocEMA(model, tmp_path / "whole", snapshot_every=4)
    first = PostHocEMA(again, tmp_path / "resumed", snapshot_every=4)
    for step in range(1, 11):
        for m, ema in ((model, whole), (again, first)):
            _train_step(m, step)
            ema.update(m)
    torch.save({"ema": first.state_dict(), "model": again.state_dict()}, tmp_path / "checkpoint.pt")
    del first
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    again = models.build("tiny_cnn")
    again.load_state_dict(checkpoint["model"])
    resumed = PostHocEMA(again, tmp_path / "resumed", snapshot_every=4, updates=8)
    resumed.load_state_dict(checkpoint["ema"])
    for step in range(11, 15):
        for m, ema in ((model, whole), (again, resumed)):
            _train_step(m, step)
            ema.update(m)
    assert resumed.updates == whole.updates == 14
    for mine, other in zip(resumed.emas, whole.emas):
        want = other.state_dict()
        for k, v in mine.state_dict().items():
            assert torch.equal(v, want[k]), k
    for a, b in zip(list_snapshots(tmp_path / "whole"), list_snapshots(tmp_path / "resumed")):
        assert (a.step, a.gamma) == (b.step, b.gamma)
    assert all(torch.equal(v, whole.synthesize(0.075)[k]) for k, v in resumed.synthesize(0.075).items())


def test_a_run_resumed_from_a_checkpoint_older_than_its_last_snapshot_continues_bit_for_bit(tmp_path) -> None:
    """Checkpointed at update 5 (last saved: 3), snapshot 6 written, then the run stops: resumed from the
    snapshots of 6 and the checkpoint of 5, it replaces step 6 when it saves it again, and every EMA, every
    snapshot and the synthesis equal an uninterrupted run's (issue #62, item 7)."""
    model, again = models.build("tiny_cnn"), models.build("tiny_cnn")
    whole = PostHocEMA(model, tmp_path / "whole", snapshot_every=3)
    first = PostHocEMA(again, tmp_path / "resumed", snapshot_every=3)
    _run(((model, whole), (again, first)), range(1, 6))
    saved = {"ema": first.state_dict(), "model": {k: v.clone() for k, v in again.state_dict().items()}}
    torch.save(saved, tmp_path / "checkpoint.pt")
    _run(((model, whole), (again, first)), range(6, 7))
    del first  # the run stops after its save of update 6
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    again = models.build("tiny_cnn")
    again.load_state_dict(checkpoint["model"])
    with pytest.raises(ValueError, match="holds snapshots up to update 6: resume with updates=6 ") as info:
        PostHocEMA(again, tmp_path / "resumed", snapshot_every=3, updates=3)
    assert "\n" not in str(info.value)
    resumed = PostHocEMA(again, tmp_path / "resumed", snapshot_every=3, updates=6)
    resumed.load_state_dict(checkpoint["ema"])
    for step in range(6, 10):
        _train_step(again, step)  # whole trained up to 6 already: it goes on from 7
        if step > 6:
            _train_step(model, step)
            whole.update(model)
        resumed.update(again)
    assert resumed.updates == whole.updates == 9
    _assert_same_emas(resumed, whole)
    pairs = list(zip(list_snapshots(tmp_path / "whole"), list_snapshots(tmp_path / "resumed"), strict=True))
    for a, b in pairs:
        assert (a.step, a.gamma) == (b.step, b.gamma)
        ta, tb = read_snapshot(a)["tensors"], read_snapshot(b)["tensors"]
        assert all(torch.equal(v, tb[k]) for k, v in ta.items()), (a.step, a.gamma)
    assert all(torch.equal(v, whole.synthesize(0.075)[k]) for k, v in resumed.synthesize(0.075).items())
    assert checkpoint["ema"]["saved"] == 3 and resumed.state_dict()["saved"] == whole.saved == 9


def test_a_checkpoint_older_than_another_runs_snapshot_is_still_refused_at_its_save(tmp_path) -> None:
    """Only the run's own later steps are replaced: a step of another run in the folder stops the save."""
    model = models.build("tiny_cnn")
    ema = PostHocEMA(model, tmp_path, snapshot_every=2)
    ema.update(model)
    state = ema.state_dict()  # saved 0
    ema.update(model)  # saves 2
    save_step(tmp_path, 3, {1.0: {"w": torch.ones(2)}}, run="another")
    ema.load_state_dict(state)
    with pytest.raises(ValueError, match="holds update 3, after run .* last save .0.: another run") as info:
        ema.update(model)
    assert "\n" not in str(info.value) and ema.updates == 1
    assert {s.step for s in list_snapshots(tmp_path)} == {2, 3}  # nothing removed


def test_a_state_without_saved_loads_as_before_and_a_bad_one_is_refused(tmp_path) -> None:
    model = models.build("tiny_cnn")
    ema = PostHocEMA(model, tmp_path, snapshot_every=2)
    for _ in range(3):
        ema.update(model)
    state = ema.state_dict()
    older = {k: v for k, v in state.items() if k != "saved"}  # saved before the state recorded it
    resumed = PostHocEMA(model, tmp_path, snapshot_every=2, updates=2)
    resumed.load_state_dict(older)
    assert resumed.updates == 3 and resumed.saved == 2
    for bad in (-1, 4, "2", None):
        with pytest.raises(ValueError, match=r"^the state's saved is .*: need an int in \[0, 3\]$"):
            resumed.load_state_dict({**state, "saved": bad})


def test_a_state_dict_of_other_profiles_or_another_run_is_refused_before_anything_changes(tmp_path) -> None:
    model = models.build("tiny_cnn")
    ema = PostHocEMA(model, tmp_path / "a", snapshot_every=2)
    for step in range(1, 4):
        _train_step(model, step)
        ema.update(model)
    other = {**PostHocEMA(model, tmp_path / "b", sigma_rels=(0.05, 0.15)).state_dict(), "run": ema.run}
    resumed = PostHocEMA(model, tmp_path / "a", snapshot_every=2, updates=2)
    before = [{k: v.clone() for k, v in e.state_dict().items()} for e in resumed.emas]
    stranger = {**ema.state_dict(), "run": "another"}
    for state, message in (
        (other, "schedules"),
        (stranger, "of run 'another'"),
        ({"emas": []}, "not a PostHocEMA"),
    ):
        with pytest.raises(ValueError, match=message) as info:
            resumed.load_state_dict(state)
        assert "\n" not in str(info.value)
    assert resumed.updates == 2
    for e, old in zip(resumed.emas, before):
        assert all(torch.equal(v, old[k]) for k, v in e.state_dict().items())
    resumed.load_state_dict(ema.state_dict())  # its own run's: accepted
    assert resumed.updates == 3 and resumed.run == ema.run


def test_each_snapshot_names_its_run_and_a_second_run_in_the_folder_is_refused(tmp_path) -> None:
    """Two runs started on one empty folder: the second to save finds a step it did not save, and stops with
    one line (its update undone); synthesize refuses snapshots of two runs."""
    model = models.build("tiny_cnn")
    a = PostHocEMA(model, tmp_path, snapshot_every=2)
    b = PostHocEMA(model, tmp_path, snapshot_every=3)
    assert a.run != b.run
    for _ in range(2):
        a.update(model)
    b.update(model)
    b.update(model)
    with pytest.raises(ValueError, match="holds update 2, after run .* last save .0.: another run") as info:
        b.update(model)
    assert "\n" not in str(info.value) and b.updates == 2
    assert {s.step for s in list_snapshots(tmp_path)} == {2}
    resumed = PostHocEMA(model, tmp_path, snapshot_every=2, updates=2)  # the caller resumes that run
    assert resumed.run == a.run
    save_step(tmp_path, 3, {1.0: {"w": torch.ones(2)}}, run="another")
    save_step(tmp_path, 4, {2.0: {"w": torch.ones(2)}}, run="another")
    with pytest.raises(ValueError, match="of run 'another'.*holds the snapshots of one run"):
        synthesize(tmp_path, 0.1)


def test_the_temporaries_of_killed_saves_are_removed_but_never_a_live_writers(tmp_path) -> None:
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    host = socket.gethostname()
    killed = tmp_path / f".step-000000000004.{host}.{int(dead.stdout)}.0a1b2c3d.tmp"
    live = tmp_path / f".step-000000000004.{host}.{os.getpid()}.0a1b2c3d.tmp"
    elsewhere = tmp_path / f".step-000000000004.another-host.{int(dead.stdout)}.0a1b2c3d.tmp"
    for folder in (killed, live, elsewhere):
        folder.mkdir()
        (folder / "g6.94.pt").write_bytes(b"half a file")
    check_folder(tmp_path)  # as PostHocEMA does when a run starts or resumes
    assert not killed.exists() and live.exists() and elsewhere.exists()
    model = models.build("tiny_cnn")
    PostHocEMA(model, tmp_path, snapshot_every=1).update(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, elsewhere.name, "step-000000000001"]
    )


def test_a_temporary_named_with_a_pid_no_process_can_have_is_a_dead_writers(tmp_path) -> None:
    """os.kill refuses a pid past the C int with OverflowError: no writer is alive under it."""
    import socket

    huge = tmp_path / f".step-000000000004.{socket.gethostname()}.{10**30}.0a1b2c3d.tmp"
    huge.mkdir()
    assert check_folder(tmp_path) == tmp_path and not huge.exists()
