"""EMA under torch.distributed: DDP and FSDP2 in real gloo processes, and ShardedModelEMA in-process.

The multi-process tests spawn real gloo ranks on 127.0.0.1 (``ema_lab.lessons.distributed.launch``)
and compare with one process training the same model in float64 on the whole batch. The in-process
tests run FSDP2 over a one-rank gloo group inside pytest (fast, and the only way to reach the error
paths and a model with BatchNorm buffers, whose DDP/FSDP statistics differ from a single process's).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

# torch.distributed.tensor.debug (CommDebugMode, used by every FSDP2 run here) imports numpy.
pytest.importorskip(
    "numpy", reason="numpy is not installed (the bench extra); torch's CommDebugMode needs it"
)

from ema_lab import ModelEMA, ShardedModelEMA
from ema_lab.bench.counting import count_ops
from ema_lab.bench.models import build
from ema_lab.lessons import distributed as dist_demo
from ema_lab.schedules import power, warmup

from ..helpers import one_rank_group

ROOT = Path(__file__).resolve().parents[2]
SKIP = dist_demo.skip_reason()
needs_distributed = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
CFG = dist_demo.Config(world_size=2)
FULL_BYTES = 19_712 * 4  # tiny_transformer: 19,712 distinct float elements (the tied head once)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """float32 ranks vs the float64 one-process reference: rounding only."""
    torch.testing.assert_close(a, {k: v.to(a[k].dtype) for k, v in b.items()}, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def two_ranks() -> tuple[list[dict], dict, dict, int]:
    """Two real gloo ranks (DDP then FSDP2) and the float64 one-process reference, run once."""
    if SKIP:
        pytest.skip(SKIP)
    ranks = dist_demo.launch(dist_demo.rank_run, CFG.world_size, CFG)
    return (ranks, *dist_demo.reference(CFG))


# --- DDP ---------------------------------------------------------------------------------------------------


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
def test_reference_moved_far_from_the_initial_weights(two_ranks) -> None:
    _, ref, init, full = two_ranks
    assert dist_demo.max_abs_diff(ref, init) > 0.1  # so matching it is not a trivial match
    assert full == FULL_BYTES


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
def test_ddp_ema_is_bit_identical_on_every_rank_and_equals_one_process(two_ranks) -> None:
    ranks, ref, _, _ = two_ranks
    torch.testing.assert_close(ranks[1]["ddp_state"], ranks[0]["ddp_state"], rtol=0, atol=0)
    _close(ranks[0]["ddp_state"], ref)
    assert [r["ddp_bytes"] for r in ranks] == [FULL_BYTES, FULL_BYTES]


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
def test_ddp_rank0_only_ema_lives_on_rank_0_and_equals_the_others(two_ranks) -> None:
    ranks, _, _, _ = two_ranks
    torch.testing.assert_close(ranks[0]["rank0_only_state"], ranks[0]["ddp_state"], rtol=0, atol=0)
    assert ranks[1]["rank0_only_state"] is None
    assert [r["rank0_only_bytes"] for r in ranks] == [FULL_BYTES, 0]


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
def test_ddp_update_is_local_and_alike_on_every_rank(two_ranks) -> None:
    ranks, _, _, _ = two_ranks
    assert all(c == 0 for r in ranks for c in r["ddp_collectives"])  # CommDebugMode around every update
    ops = [c for r in ranks for c in r["ddp_ops"][1:]]  # the first update also builds the cache
    assert all(c == ops[0] for c in ops) and not any(k.startswith("c10d") for k in ops[0])


# --- FSDP2 -------------------------------------------------------------------------------------------------


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
def test_fsdp_gathered_ema_equals_one_process_and_copy_to_gives_the_same(two_ranks) -> None:
    ranks, ref, _, _ = two_ranks
    _close(ranks[0]["fsdp_state"], ref)
    torch.testing.assert_close(ranks[0]["fsdp_via_model_state"], ranks[0]["fsdp_state"], rtol=0, atol=0)
    assert ranks[1]["fsdp_state"] == {}  # cpu_offload: the full state_dict lands on rank 0 only


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
def test_fsdp_update_is_one_foreach_lerp_and_no_collective(two_ranks) -> None:
    ranks, _, _, _ = two_ranks
    assert all(c == 0 for r in ranks for c in r["fsdp_collectives"])
    assert all(c == {"aten._foreach_lerp_.Scalar": 1} for r in ranks for c in r["fsdp_ops"][1:])
    assert [r["fsdp_rebuilds"] for r in ranks] == [1, 1]  # FSDP2 keeps its sharded tensors


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
def test_fsdp_shards_add_up_to_one_full_ema(two_ranks) -> None:
    ranks, _, _, _ = two_ranks
    # Every tensor of tiny_transformer has an even first dimension: each rank holds exactly half.
    assert [r["fsdp_bytes"] for r in ranks] == [FULL_BYTES // 2, FULL_BYTES // 2]
    assert ranks[0]["fsdp_rows"]["embed.weight"] == ranks[1]["fsdp_rows"]["embed.weight"] == 32


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
def test_model_ema_refuses_an_fsdp2_model(two_ranks) -> None:
    ranks, _, _, _ = two_ranks
    msg = ranks[0]["modelema_refused"]
    assert msg.startswith("TypeError: model is sharded with FSDP2 (fully_shard)") and "ShardedModelEMA" in msg
    assert all(r["gloo_interface"] == dist_demo.loopback_interface() for r in ranks)


# --- uneven shards: 4 ranks, first dimensions 5 and 3 ---------------------------------------------------

UNEVEN_STEPS, UNEVEN_BATCH = 4, 2


def _uneven_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _uneven_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def _train_uneven(model: nn.Module, ema: ModelEMA | ShardedModelEMA, part: slice, n: int, dtype) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(UNEVEN_STEPS):
        x, y = _uneven_batch(step, n)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[part].to(dtype)), y[part].to(dtype)).backward()
        opt.step()
        ema.update(model)


def uneven_rank(rank: int, world: int) -> dict[str, object]:
    """FSDP2 + ShardedModelEMA on the uneven model: each rank's shard rows and the gathered EMA."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _uneven_model()
    dist_demo.shard_model(model, init_device_mesh("cpu", (world,)), groups=(model[0], model[2]))
    ema = ShardedModelEMA(model, decay=0.9, tau=2)
    part = slice(rank * UNEVEN_BATCH, (rank + 1) * UNEVEN_BATCH)
    _train_uneven(model, ema, part, UNEVEN_BATCH * world, torch.float32)
    rows = {k: tuple(t.shape) for k, t in ema.local_tensors().items()}
    return {"rows": rows, "full": ema.full_state_dict(cpu_offload=True)}


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
@needs_distributed
def test_uneven_shards_over_four_ranks_match_a_float64_single_process_ema() -> None:
    ranks = dist_demo.launch(uneven_rank, 4)
    rows = [r["rows"] for r in ranks]
    # FSDP2 shards dim 0 like torch.chunk: ceil(rows / world) per rank, the last ranks get less or nothing.
    assert [r["0.weight"] for r in rows] == [(2, 4), (2, 4), (1, 4), (0, 4)]
    assert [r["0.bias"] for r in rows] == [(2,), (2,), (1,), (0,)]
    assert [r["2.weight"] for r in rows] == [(1, 5), (1, 5), (1, 5), (0, 5)]
    assert [r["2.bias"] for r in rows] == [(1,), (1,), (1,), (0,)]
    ref_model = _uneven_model().double()
    ref = ModelEMA(ref_model, decay=0.9, tau=2)
    _train_uneven(ref_model, ref, slice(None), UNEVEN_BATCH * 4, torch.float64)
    want = ref.ema.state_dict()
    assert max((want[k] - _uneven_model().state_dict()[k].double()).abs().max() for k in want) > 0.01
    _close(ranks[0]["full"], want)
    assert all(r["full"] == {} for r in ranks[1:])


# --- BatchNorm: buffers each rank updates from its own batch, and sync_buffers() --------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def buffer_ranks(request: pytest.FixtureRequest) -> list[dict]:
    """Real gloo ranks training :func:`batchnorm_model` with DDP, then FSDP2 (torch >= 2.9), 5 steps."""
    if SKIP:
        pytest.skip(SKIP)
    return dist_demo.launch(dist_demo.buffers_run, request.param)


def _spread(states: list[dict[str, torch.Tensor]], key: str) -> float:
    """The largest difference of entry ``key`` between rank 0 and any other rank."""
    return max((s[key].double() - states[0][key].double()).abs().max().item() for s in states)


def _check_sync(ranks: list[dict], kind: str) -> None:
    before, after = [r[f"{kind}_before"] for r in ranks], [r[f"{kind}_after"] for r in ranks]
    buffers = {"1.running_mean", "1.running_var"}
    assert all(_spread(before, k) == 0 for k in before[0].keys() - buffers)  # parameters, counters
    assert all(_spread(before, k) > 1e-3 for k in buffers)  # each rank's own batches: the EMAs differ
    for state in after:  # every entry equal on every rank, bit for bit: rank 0's
        assert state.keys() == before[0].keys()
        assert all(torch.equal(state[k], before[0][k]) for k in state)
    assert [r[f"{kind}_sync_collectives"] for r in ranks] == [1] * len(ranks)  # one dtype: one broadcast
    assert [r[f"{kind}_rebuilds"] for r in ranks] == [1] * len(ranks)  # the sync copies in place
    for r in ranks:  # the first update warned, once in 5 updates, naming the fix
        assert (
            len(r[f"{kind}_warnings"]) == 1
            and "call ema.sync_buffers() on every rank" in r[f"{kind}_warnings"][0]
        )


@needs_distributed
def test_ddp_batchnorm_ema_differs_by_rank_until_sync_buffers(buffer_ranks: list[dict]) -> None:
    _check_sync(buffer_ranks, "ddp")


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
@needs_distributed
def test_fsdp_batchnorm_ema_differs_by_rank_until_sync_buffers(buffer_ranks: list[dict]) -> None:
    _check_sync(buffer_ranks, "fsdp")


def test_sync_buffers_outside_a_process_group_changes_nothing_and_silences_the_warning() -> None:
    import warnings

    model = dist_demo.batchnorm_model()
    model(torch.randn(4, 8))
    ema = ModelEMA(model)
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    ema.sync_buffers()
    assert all(torch.equal(v, before[k]) for k, v in ema.ema.state_dict().items())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one process: nothing to warn about
        ema.update(model)
        ModelEMA(model).update(model)
    with pytest.raises(ValueError, match=r"^src must be a rank of the group, 0 to 0, got 1$"):
        ema.sync_buffers(src=1)


def test_the_warning_leaves_out_syncbatchnorm_whose_buffers_are_equal_on_every_rank(monkeypatch) -> None:
    import warnings

    class Wrapped(nn.parallel.DistributedDataParallel):  # isinstance DDP, no process group needed
        def __init__(self, module: nn.Module) -> None:
            nn.Module.__init__(self)
            self.module = module

    for norm, warns in ((nn.SyncBatchNorm(4), False), (nn.BatchNorm1d(4), True)):
        model = nn.Sequential(nn.Linear(3, 4), norm)
        ema = ModelEMA(model)
        model(torch.randn(8, 3))  # a forward moves the statistics (SyncBatchNorm's alike on every rank)
        # Then a two-rank run, as torch says (patched after the forward: SyncBatchNorm would sync on a GPU).
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ema.update(Wrapped(model))
        assert len(caught) == warns, (norm, [str(w.message) for w in caught])
        monkeypatch.undo()


# --- the command line, failures, skips -------------------------------------------------------------------


@pytest.mark.requires_torch("2.9", "FSDP2 training on CPU over gloo (2.6 and 2.8 fail)")
@needs_distributed
def test_command_line_runs_two_ranks_and_says_ok() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "ema_lab.lessons.distributed", "--world-size", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "result: OK"
    assert f"full EMA: {FULL_BYTES:,} bytes" in proc.stdout
    assert any(line.split()[:3] == ["1", f"{FULL_BYTES:,}", f"{FULL_BYTES // 2:,}"] for line in lines)


def _sleep_rank(rank: int, world: int) -> None:
    time.sleep(60)


@needs_distributed
def test_timeout_raises_and_leaves_no_worker() -> None:
    with pytest.raises(TimeoutError, match="timed out after 0.3 s"):
        dist_demo.launch(_sleep_rank, 2, timeout_s=0.3)
    assert multiprocessing.active_children() == []


def _failing_rank(rank: int, world: int) -> None:
    raise ValueError(f"rank {rank} fails")


@needs_distributed
def test_a_failing_rank_is_reported_with_its_error() -> None:
    error_files = set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*"))  # torch's, for tracebacks
    with pytest.raises(RuntimeError, match=r"(?s)a worker failed: .*ValueError: rank \d fails"):
        dist_demo.launch(_failing_rank, 2)
    assert multiprocessing.active_children() == []
    assert set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*")) <= error_files


def _ddp_rank_with_an_exit_mark(rank: int, world: int, folder: str) -> None:
    """DDP leaves references to the group inside torch; an atexit mark shows whether Python's shutdown ran."""
    import atexit

    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel(nn.Linear(2, 2))
    atexit.register(Path(folder, f"shutdown_rank{rank}").touch)


@needs_distributed
def test_a_rank_that_is_done_ends_without_pythons_shutdown(tmp_path: Path) -> None:
    """The gloo threads outlive destroy_process_group(); no rank runs them into interpreter shutdown."""
    assert dist_demo.launch(_ddp_rank_with_an_exit_mark, 2, str(tmp_path)) == [None, None]
    assert list(tmp_path.iterdir()) == []
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("end", ["exit", "SIGKILL"])
def test_scratch_dir_is_removed_however_its_process_ends(tmp_path: Path, end: str) -> None:
    """Notebook 06 relies on it: a kernel that exits, restarts or is killed leaves no folder behind."""
    code = (
        "import sys, time\n"
        "from ema_lab.lessons import scratch_dir\n"
        "folder = scratch_dir('ema_lab_test_')\n"
        "(folder / 'train_ema.py').write_text('')\n"
        "print(folder, flush=True)\n"
        f"time.sleep({60 if end == 'SIGKILL' else 0})\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    folder = Path(proc.stdout.readline().strip())
    assert folder.name.startswith("ema_lab_test_") and (folder / "train_ema.py").exists()
    if end == "SIGKILL":
        proc.kill()
    proc.wait(timeout=60)
    proc.stdout.close()
    deadline = time.monotonic() + 30  # the watcher is a fresh Python process: slow on a loaded machine
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not folder.exists()


def test_missing_api_is_a_named_skip(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(dist_demo, "REQUIRED_APIS", (*dist_demo.REQUIRED_APIS, ("torch", "no_such_api")))
    assert dist_demo.main(["--world-size", "2"]) == 0
    assert f"skipped: this torch ({torch.__version__}) lacks torch.no_such_api" in capsys.readouterr().out


def test_the_lesson_needs_torch_alone() -> None:
    """The lesson (run by torchrun, maybe where only torch is installed) imports no bench extra."""
    code = (
        "import sys; sys.modules.update(dict.fromkeys(['numpy', 'matplotlib', 'tqdm']))\n"
        "import ema_lab.lessons.distributed"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_bad_command_line_is_rejected() -> None:
    with pytest.raises(SystemExit) as e:
        dist_demo.main(["--world-size", "1"])
    assert e.value.code == 2


# --- in-process FSDP2 over a one-rank gloo group ----------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    if SKIP:
        pytest.skip(SKIP)
    from torch.distributed.device_mesh import init_device_mesh

    with one_rank_group(tmp_path_factory.mktemp("pg")):
        yield init_device_mesh("cpu", (1,))


def _step(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3, 16, 16, generator=g)).square().mean().backward()
    opt.step()


@pytest.mark.parametrize(
    "kwargs",
    [{"decay": 0.9, "tau": 2}, {"decay": warmup(0.9, after=1)}, {"decay": power(gamma=2.0), "every": 2}],
    ids=["ramp", "warmup", "power every 2"],
)
def test_sharded_ema_matches_model_ema_with_buffers(mesh: object, kwargs: dict) -> None:
    """The one constructor: the same decay, schedule and every=k as ModelEMA's, on the local shards."""
    plain, sharded = build("tiny_cnn"), dist_demo.shard_model(build("tiny_cnn"), mesh)
    ref, ema = ModelEMA(plain, **kwargs), ShardedModelEMA(sharded, **kwargs)
    for i in range(4):
        _step(plain, i)
        _step(sharded, i)
        ref.update(plain)
        ema.update(sharded)
    full = ema.full_state_dict()
    expected = ref.ema.state_dict()
    assert full.keys() == expected.keys()
    for k, v in expected.items():  # BatchNorm running stats averaged, num_batches_tracked copied
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert full["1.bn.num_batches_tracked"].item() == 4
    assert ema.updates == 4 and ema.rebuilds == 1


def test_sharded_ema_update_is_one_foreach_call(mesh: object) -> None:
    model = dist_demo.shard_model(build("tiny_transformer"), mesh)
    ema = ShardedModelEMA(model)
    ema.update(model)  # builds the cache
    assert count_ops(ema.update, model) == {"aten._foreach_lerp_.Scalar": 1}
    local = ema.local_tensors()
    assert len(local) == 28 and "head.weight" not in local  # tied to embed.weight: averaged once
    assert ema.local_bytes() == FULL_BYTES


def test_sharded_ema_refuses_unsharded_parameters_and_changes_nothing(mesh: object) -> None:
    model = dist_demo.shard_model(build("tiny_transformer"), mesh)
    ema = ShardedModelEMA(model, decay=0.5, tau=1)
    before = {k: v.clone() for k, v in ema.local_tensors().items()}
    model(torch.zeros(2, 8, dtype=torch.long)).sum()  # after forward the root keeps unsharded tensors
    with pytest.raises(ValueError, match=r"entry '\w+': the EMA holds a DTensor.*after optimizer.step\(\)"):
        ema.update(model)
    assert ema.updates == 0
    assert all(torch.equal(before[k], v) for k, v in ema.local_tensors().items())
    with pytest.raises(ValueError, match="EMA and model do not hold the same entries"):
        ema.update(dist_demo.shard_model(build("tiny_cnn"), mesh))


def test_sharded_ema_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ShardedModelEMA(object())
    with pytest.raises(ValueError, match=r"decay must be a finite number in \[0, 1\]"):
        ShardedModelEMA(nn.Linear(2, 2), decay=1.5)
    with pytest.raises(ValueError, match="unknown strategy"):
        ShardedModelEMA(nn.Linear(2, 2), strategy="fast")
    with pytest.raises(
        ValueError, match="^strategy 'flat' moves the EMA into new buffers; a sharded EMA keeps"
    ):
        ShardedModelEMA(nn.Linear(2, 2), strategy="flat")
    with pytest.raises(ValueError, match="^cuda_graph=True records one device's update"):
        ShardedModelEMA(nn.Linear(2, 2), cuda_graph=True)


def test_sync_buffers_on_one_rank_issues_no_collective(mesh: object) -> None:
    """A sharded EMA holds buffers as parameters: those, and no DTensor shard, are what sync broadcasts."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = dist_demo.shard_model(build("tiny_cnn"), mesh)
    ema = ShardedModelEMA(model)
    _step(model, 0)
    ema.update(model)
    float_buffers = [b for b in build("tiny_cnn").buffers() if b.is_floating_point()]
    assert len(ema.rank_local_tensors()) == len(float_buffers) > 0
    with CommDebugMode() as comm:
        ema.sync_buffers()
    assert comm.get_total_counts() == 0
