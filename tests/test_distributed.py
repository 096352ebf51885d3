"""EMA under torch.distributed: the 2-process DDP/FSDP2 demo end to end, and ShardedModelEMA in-process.

The end-to-end test spawns real gloo processes on 127.0.0.1 through the command line. The others
run FSDP2 over a one-rank gloo group inside pytest (fast, and the only way to reach the error paths
and a model with BatchNorm buffers, whose DDP/FSDP statistics differ from a single process's).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ema_lab import ModelEMA, ShardedModelEMA
from ema_lab.bench.counting import count_ops
from ema_lab.lessons import distributed as dist_demo
from ema_lab.lessons.models import build

MISSING = dist_demo.missing_apis()
needs_distributed = pytest.mark.skipif(bool(MISSING), reason=f"skipped: torch lacks {', '.join(MISSING)}")


@needs_distributed
def test_two_process_demo_passes_every_check() -> None:
    rc, output, summary = dist_demo.run_cli(world_size=2)
    assert rc == 0, output
    assert "result: OK" in output
    assert summary["ok"] and not summary["failures"]
    assert len(summary["checks"]) == 14 and all(summary["checks"].values())
    fig = summary["figures"]
    full = fig["full_ema_bytes_reference"]
    assert full == 19_712 * 4  # tiny_transformer: 19,712 distinct float elements (the tied head once)
    ranks = fig["per_rank"]
    assert [r["ddp_ema_bytes"] for r in ranks] == [full, full]
    assert [r["ddp_rank0_only_bytes"] for r in ranks] == [full, 0]
    # Every tensor of tiny_transformer has an even first dimension: each rank holds exactly half.
    assert [r["fsdp_ema_bytes"] for r in ranks] == [full // 2, full // 2]
    assert [r["fsdp_cache_builds"] for r in ranks] == [1, 1]  # FSDP2 keeps its sharded tensors
    assert all(r["gloo_interface"] == dist_demo.loopback_interface() for r in ranks)
    assert fig["fsdp_modelema_error"].startswith("TypeError: model is sharded with FSDP2 (fully_shard)")
    assert "ShardedModelEMA" in fig["fsdp_modelema_error"]


def test_timeout_reports_failure_and_leaves_no_worker() -> None:
    cfg = dist_demo.Config(timeout_s=0.3)  # far less than a rank needs to import torch
    report = dist_demo.run(cfg)
    assert not report.ok and report.failures == ["timed out after 0.3 s"]
    assert multiprocessing.active_children() == []
    assert "result: FAILED" in dist_demo.format_report(report)


def test_missing_api_is_a_named_skip(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(dist_demo, "REQUIRED_APIS", (*dist_demo.REQUIRED_APIS, ("torch", "no_such_api")))
    assert dist_demo.missing_apis() == ["torch.no_such_api"]
    assert dist_demo.main(["--world-size", "2"]) == 0
    assert f"skipped: this torch ({torch.__version__}) lacks torch.no_such_api" in capsys.readouterr().out


def test_bad_command_line_is_rejected() -> None:
    with pytest.raises(SystemExit) as e:
        dist_demo.main(["--world-size", "1"])
    assert e.value.code == 2


# --- in-process FSDP2 over a one-rank gloo group ----------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    if MISSING:
        pytest.skip(f"skipped: torch lacks {', '.join(MISSING)}")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("skipped: a default process group already exists in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _step(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3, 16, 16, generator=g)).square().mean().backward()
    opt.step()


def test_sharded_ema_matches_model_ema_with_buffers(mesh: object) -> None:
    plain, sharded = build("tiny_cnn"), dist_demo.shard_model(build("tiny_cnn"), mesh)
    ref, ema = ModelEMA(plain, decay=0.9, tau=2), ShardedModelEMA(sharded, decay=0.9, tau=2)
    for i in range(3):
        _step(plain, i)
        _step(sharded, i)
        ref.update(plain)
        ema.update(sharded)
    full = ema.full_state_dict()
    expected = ref.ema.state_dict()
    assert full.keys() == expected.keys()
    for k, v in expected.items():  # BatchNorm running stats averaged, num_batches_tracked copied
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert full["1.bn.num_batches_tracked"].item() == 3
    assert ema.updates == 3 and ema.rebuilds == 1


def test_sharded_ema_update_is_one_foreach_call(mesh: object) -> None:
    model = dist_demo.shard_model(build("tiny_transformer"), mesh)
    ema = ShardedModelEMA(model)
    ema.update(model)  # builds the cache
    assert count_ops(ema.update, model) == {"aten._foreach_lerp_.Scalar": 1}
    local = ema.local_tensors()
    assert len(local) == 28 and "head.weight" not in local  # tied to embed.weight: averaged once
    assert ema.local_bytes() == 19_712 * 4


def test_sharded_ema_refuses_unsharded_parameters_and_changes_nothing(mesh: object) -> None:
    model = dist_demo.shard_model(build("tiny_transformer"), mesh)
    ema = ShardedModelEMA(model, decay=0.5, tau=1)
    before = {k: v.clone() for k, v in ema.local_tensors().items()}
    model(torch.zeros(2, 8, dtype=torch.long)).sum()  # after forward the root keeps unsharded tensors
    with pytest.raises(ValueError, match=r"entry '\w+': the EMA holds a DTensor.*after optimizer.step\(\)"):
        ema.update(model)
    assert ema.updates == 0
    assert all(torch.equal(before[k], v) for k, v in ema.local_tensors().items())
    with pytest.raises(ValueError, match="does not hold the EMA's entries"):
        ema.update(dist_demo.shard_model(build("tiny_cnn"), mesh))


def test_checks_catch_a_wrong_ema(mesh: object) -> None:
    """The comparison is not vacuous: a 1e-3 error in one element of either EMA fails exactly its checks."""
    cfg = dist_demo.Config(world_size=1, steps=3, timing_repeats=1)
    rank = {"ddp": dist_demo.ddp_demo(cfg, 0), "fsdp": dist_demo.fsdp_demo(cfg, 0), "gloo_interface": None}
    ref = dist_demo.reference(cfg)
    clean = dist_demo.Report(cfg, ranks=[rank])
    dist_demo.summarise(clean, *ref)
    rank["ddp"]["state"]["embed.weight"][0, 0] += 1e-3
    rank["fsdp"]["state"]["blocks.layers.1.linear2.bias"][0] += 1e-3
    bad = dist_demo.Report(cfg, ranks=[rank])
    dist_demo.summarise(bad, *ref)
    flipped = {k for k in clean.checks if clean.checks[k] and not bad.checks[k]}
    assert flipped == {
        "DDP: EMA equals the single-process reference",
        "DDP: rank-0-only EMA equals the per-rank EMA",
        "FSDP2: gathered EMA equals the single-process reference",
        "FSDP2: copy_to + get_model_state_dict gives the same EMA",
    }
    assert not bad.ok and "result: FAILED" in dist_demo.format_report(bad)
    # One rank holds the whole EMA at world size 1: the only check that fails on the clean run.
    assert [k for k, v in clean.checks.items() if not v] == [
        "FSDP2: shards add up to one full EMA, no rank holds it all"
    ]


def test_sharded_ema_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ShardedModelEMA(object())
    with pytest.raises(ValueError, match="decay must be in"):
        ShardedModelEMA(nn.Linear(2, 2), decay=1.5)
    with pytest.raises(ValueError, match="unknown strategy"):
        ShardedModelEMA(nn.Linear(2, 2), strategy="fast")
