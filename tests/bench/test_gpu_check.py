"""benchmarks/gpu_check.py: one clean line without CUDA; its steps record failures instead of raising.
Also the CUDA-graph test the check runs (``-k test_cuda_``): a captured update replays like an eager one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ema_lab import ModelEMA
from ema_lab.bench import models

from ..helpers import BENCHMARKS, float_entries, load_script

ROOT = Path(__file__).resolve().parents[2]
gpu_check = load_script("gpu_check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself, not its skip")
def test_without_cuda_it_prints_one_line_writes_nothing_and_exits_0(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 1
    line = out.stdout.strip()
    skipped = "CUDA bench, kernel counts, CUDA tests, peers, notebook CUDA cells"
    assert line.startswith(f"gpu-check skipped ({skipped}): ")
    assert f"no CUDA device (torch {torch.__version__}" in line
    assert list(tmp_path.iterdir()) == []


def test_a_failing_step_is_recorded_and_the_next_still_runs() -> None:
    summary: dict[str, dict] = {}
    gpu_check.step(summary, "broken", lambda: 1 / 0)
    gpu_check.step(summary, "fine", lambda: "ok")
    assert summary["broken"]["outcome"] == "error: ZeroDivisionError: division by zero"
    assert summary["fine"]["outcome"] == "ok"


def test_a_command_is_judged_by_its_exit_code_and_stopped_at_its_time_limit(tmp_path, monkeypatch) -> None:
    log = tmp_path / "x.log"
    assert gpu_check.run_command([sys.executable, "-c", "print('hi')"], log, 60) == "ok"
    assert log.read_text() == "hi\n"
    assert gpu_check.run_command([sys.executable, "-c", "raise SystemExit(3)"], log, 60).startswith(
        "exit code 3"
    )
    assert gpu_check.run_command([sys.executable, "-c", "1"], log, 5).startswith("skipped: 5 s left")
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 0)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    assert gpu_check.run_command(sleeper, log, 1).startswith("stopped after 1 s")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")
def test_cuda_graph_replays_the_default_update_with_new_weights_and_decay() -> None:
    model = models.build("tiny_cnn").cuda()
    ema = ModelEMA(model)
    decay = torch.tensor(0.9, device="cuda")
    side = torch.cuda.Stream()  # warm-up (builds the cached step) off the capture stream, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            ema.update(model, decay=decay)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ema.update(model, decay=decay)
    before = {k: v.double() for k, v in float_entries(ema.ema).items()}
    with torch.no_grad():
        for i, v in enumerate(float_entries(model).values()):
            v.fill_(1.0 + i)
    decay.fill_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    live = float_entries(model)
    for k, v in float_entries(ema.ema).items():
        expected = 0.5 * before[k] + 0.5 * live[k].double()
        torch.testing.assert_close(v.double(), expected, rtol=1e-6, atol=1e-6, msg=k)


def test_the_peers_step_says_why_it_skips_where_ultralytics_does_not_import(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(gpu_check, "PEERS_IMPORT", "import ultralytics_is_not_here")
    outcome = gpu_check.peers(tmp_path / "gpu-x", tmp_path / "studies", 60)
    assert outcome == (
        "skipped: ultralytics is not importable (ModuleNotFoundError: No module named "
        "'ultralytics_is_not_here'); the peers are carried in as wheels, "
        "see benchmarks/gpu_check.py's docstring"
    )
    assert list(tmp_path.iterdir()) == []  # nothing run, nothing written


def test_the_peers_step_runs_peers_py_on_cuda_into_the_studies_folder(monkeypatch, tmp_path) -> None:
    calls = []
    monkeypatch.setattr(gpu_check, "peers_missing", lambda: None)
    monkeypatch.setattr(
        gpu_check, "run_command", lambda cmd, log, timeout_s: calls.append((cmd, log)) or "ok"
    )
    folder = tmp_path / "gpu-linux-h200"
    assert gpu_check.peers(folder, gpu_check.STUDIES, 100) == "ok, written to docs/results/"
    ((cmd, log),) = calls
    assert " ".join(cmd[1:]) == (
        f"{ROOT}/benchmarks/peers.py --device cuda --rounds 11 --out {ROOT}/docs/results --suffix -linux-h200"
    )
    assert log == folder / "peers.log"
