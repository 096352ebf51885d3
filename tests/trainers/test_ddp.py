"""docs/trainers.md's plain DDP recipe (torch alone): 2 processes on gloo with BatchNorm, saved by rank 0,
resumed bitwise on both ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from ..processes import leftovers, marked_env
from .ddp_run import SAVE_AT

ROOT = Path(__file__).resolve().parents[2]


def test_resumed_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    env, mark = marked_env({**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    script = str(Path(__file__).with_name("ddp_run.py"))
    run = subprocess.run(
        [*command, script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert not leftovers(mark), "torchrun left processes behind"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    final = torch.load(tmp_path / "uninterrupted-rank0.pt", weights_only=True)
    assert "1.running_var" in final
    for name in ("uninterrupted-rank1.pt", "resumed-rank0.pt", "resumed-rank1.pt"):
        other = torch.load(tmp_path / name, weights_only=True)
        assert [k for k in final if not torch.equal(final[k], other[k])] == [], name
    assert torch.load(tmp_path / "state.pt", weights_only=True)["ema"]["updates"] == SAVE_AT
