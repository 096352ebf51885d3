"""benchmarks/peers.py without the peers: its command line, the CUDA timer (run on CPU), the issue 29 target
lines, where it writes; and on CUDA (``-k test_cuda_``) a short run that times and counts kernels."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ..helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
peers = load_script("peers")


def test_defaults_write_the_study_to_docs_results_on_cpu() -> None:
    args = peers.parse_args([])
    assert (args.device, args.out, args.rounds, args.threads) == ("cpu", ROOT / "docs" / "results", 31, [1])
    assert args.models == list(peers.MODELS)
    created = "2026-12-04T18:00:00+00:00"
    assert peers.result_stem(args.out, created, "cpu") == ROOT / "docs" / "results" / "peers-2026-12-04"
    assert peers.result_stem(Path("x"), created, "cuda", "-h200") == Path("x/peers-2026-12-04-cuda-h200")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine accepts --device cuda")
def test_device_cuda_without_cuda_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        peers.parse_args(["--device", "cuda", "--models", "yolo_like"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    reason = f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    assert err.endswith(f"error: --device cuda: {reason}")


@pytest.mark.parametrize("argv", [["--device", "mps"], ["--rounds", "0"], ["--models", "bert"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        peers.parse_args(argv)
    assert exc.value.code == 2


def test_synced_timer_measures_back_to_back_calls_interleaved_at_the_asked_threads(monkeypatch) -> None:
    clock = [0.0]  # a fake clock: each call of a candidate takes exactly its cost, so nothing is timed here
    monkeypatch.setattr(peers, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    calls: list[str] = []
    threads_seen: set[int] = set()

    def fn(name: str, cost_s: float):
        def call() -> None:
            calls.append(name)
            threads_seen.add(torch.get_num_threads())
            clock[0] += cost_s

        return call

    before = torch.get_num_threads()
    times = peers.time_synced(
        {"a": fn("a", 1.0), "b": fn("b", 4.0)}, "cpu", rounds=3, calls=4, warmup_s=0, threads=1
    )
    assert torch.get_num_threads() == before and threads_seen == {1}
    # Warm-up: each candidate `calls` times once; then rounds of `calls` back-to-back calls, order rotating.
    assert "".join(calls) == "aaaabbbb" + "aaaabbbb" + "bbbbaaaa" + "aaaabbbb"
    assert times == {"a": [1.0, 1.0, 1.0], "b": [4.0, 4.0, 4.0]}  # per call, not per measurement
    with pytest.raises(ValueError, match="at least one candidate"):
        peers.time_synced({}, "cpu", rounds=1)
    with pytest.raises(ValueError, match="must be >= 1"):
        peers.time_synced({"a": fn("a", 0)}, "cpu", rounds=1, calls=0)


def test_synced_timer_warms_up_for_the_time_asked(monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(peers, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    calls: list[int] = []
    peers.time_synced(
        {"a": lambda: (calls.append(1), clock.__setitem__(0, clock[0] + 0.1))}, "cpu", rounds=1, calls=10
    )
    # 2 s of warm-up at 1 s per pass of 10 calls: two passes, then one measured round.
    assert peers.WARMUP_S == 2.0 and len(calls) == 30


def test_kernel_counts_say_why_they_are_missing_on_cpu() -> None:
    counts, host = peers.kernels_per_update({"floor": lambda: None}, "cpu")
    assert counts["floor"].startswith("not available: ")  # the counter's own reason, passed on
    assert counts["floor"] == peers.kernel_launches_or_reason(lambda: None, device="cpu")
    assert host == {}


def _rows(model: str, ms: dict[str, float]) -> list[dict]:
    return [{"model": model, "threads": 1, "candidate": k, "median_ms": v} for k, v in ms.items()]


def test_issue_29_target_lines_compare_the_default_with_ultralytics_per_model() -> None:
    u = "ultralytics 8.4.190 ModelEMA"
    d, f, floor = peers.DEFAULT, peers.FLAT_MODEL, peers.FLOOR
    rows = _rows("yolo26n", {floor: 0.013, d: 0.385, f: 0.057, u: 0.250})  # issue 29's H200 figures
    rows += _rows("yolo_like", {floor: 0.009, d: 0.060, f: 0.020, u: 0.179})
    rows += _rows("resnet50", {floor: 0.068, d: 0.135, f: 0.075, u: 0.133})
    rows += _rows("yolo", {floor: 0.01, d: 0.1, f: 0.02, u: 0.2})
    rows += _rows("gpt2", {floor: 0.244, d: 0.331, f: 0.246})  # ultralytics missing
    assert peers.targets_cuda(rows) == [
        "- yolo26n, 1 thread(s): default 0.385 ms, ultralytics 0.250 ms: the default 1.54x slower; "
        "target >= 2x faster: NOT met",
        "- yolo26n, 1 thread(s): flat_model 0.057 ms, floor 0.013 ms: 4.38x the floor; target <= 3x: NOT met",
        "- yolo_like, 1 thread(s): default 0.060 ms, ultralytics 0.179 ms: the default 2.98x faster; "
        "target >= 2x faster: met",
        "- yolo_like, 1 thread(s): flat_model 0.020 ms, floor 0.009 ms: 2.22x the floor; target <= 3x: met",
        "- yolo, 1 thread(s): default 0.100 ms, ultralytics 0.200 ms: the default 2.00x faster; "
        "no issue 29 target for this model",
        "- yolo, 1 thread(s): flat_model 0.020 ms, floor 0.010 ms: 2.00x the floor; target <= 3x: met",
        "- resnet50, 1 thread(s): default 0.135 ms, ultralytics 0.133 ms: the default 1.02x slower; "
        "target <= 1.05x slower: met",
        "- resnet50, 1 thread(s): flat_model 0.075 ms, floor 0.068 ms: 1.10x the floor; target <= 3x: met",
        "- gpt2, 1 thread(s): default vs ultralytics: not measured (ultralytics not installed)",
        "- gpt2, 1 thread(s): flat_model 0.246 ms, floor 0.244 ms: 1.01x the floor; target <= 3x: met",
    ]
    g, fg = peers.GRAPH, peers.FLAT_GRAPH
    rows = _rows("yolo26n", {floor: 0.013, d: 0.385, f: 0.057, u: 0.250, g: 0.080, fg: 0.045})
    assert peers.targets_cuda(rows)[2:] == [
        "- yolo26n, 1 thread(s): cuda_graph 0.080 ms, ultralytics 0.250 ms: cuda_graph 3.12x faster; "
        "target >= 2x faster: met",
        "- yolo26n, 1 thread(s): flat_model+cuda_graph 0.045 ms, floor 0.013 ms: 3.46x the floor; "
        "target <= 3x: NOT met",
    ]


def test_the_extra_memory_lines_give_mib_and_the_multiple_of_the_model() -> None:
    got = {"model float bytes": 4 << 20, peers.DEFAULT: 8 << 20, peers.GRAPH: 10 << 20}
    got |= {f"{peers.DEFAULT}, held": 4 << 20, f"{peers.GRAPH}, held": 6 << 20}
    assert peers.format_memory({"yolo": got}).splitlines()[2:] == [
        f"- yolo: {peers.DEFAULT}: peak 8.0 MiB (2.00x the model), held 4.0 MiB (1.00x)",
        f"- yolo: {peers.GRAPH}: peak 10.0 MiB (2.50x the model), held 6.0 MiB (1.50x)",
    ]


def test_a_cpu_run_times_every_candidate_as_before_and_counts_no_kernels() -> None:
    pytest.importorskip("tqdm", reason="tqdm is not installed (the bench extra; time_candidates uses it)")
    record = peers.run(("tiny_cnn",), rounds=2, target_s=0.001)
    rows = {r["candidate"]: r for r in record["rows"]}
    assert {peers.FLOOR, peers.FLOOR_HUGE, peers.DEFAULT, peers.FLAT_MODEL, "ema_lab gated"} <= set(rows)
    assert "torch AveragedModel + get_ema_multi_avg_fn" in rows  # torch's own peer is always there
    assert all(r["device"] == "cpu" and r["kernels"] is None and r["rounds"] == 2 for r in rows.values())
    assert rows[peers.FLOOR]["x_floor"] == 1.0 and all(r["median_ms"] > 0 for r in rows.values())
    assert "time_candidates" in record["timing"]
    assert "| tiny_cnn | 1 | ema_lab flat_model |" in peers.format_table(record["rows"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")
def test_cuda_peers_time_synced_updates_and_count_their_kernels() -> None:
    record = peers.run(("yolo_like",), rounds=3, target_s=0.0, device="cuda")
    rows = {r["candidate"]: r for r in record["rows"]}
    assert peers.FLOOR_HUGE not in rows  # 2 MiB host pages: a CPU candidate
    assert rows[peers.FLOOR]["kernels"] == rows[peers.FLOOR]["host_launches"] == 1  # one lerp_, one buffer
    assert rows[peers.GRAPH]["host_launches"] == 2  # the weight's fill_, the graph's replay
    assert all(isinstance(r["kernels"], int) and r["kernels"] >= 1 for r in rows.values()), rows
    assert all(r["device"] == "cuda" and r["rounds"] == 3 and r["median_ms"] > 0 for r in rows.values())
    assert "torch.cuda.synchronize()" in record["timing"]
    assert peers.GRAPH in rows and peers.FLAT_GRAPH in rows
    assert len(peers.targets_cuda(record["rows"])) == 4  # per EMA: one vs ultralytics (or why not), one flat
    memory = record["memory"]["yolo_like"]
    assert memory["model float bytes"] > 0 and memory[peers.DEFAULT] > 0 and memory[peers.GRAPH] > 0
    assert 0 < memory[f"{peers.DEFAULT}, held"] <= memory[peers.DEFAULT]
