"""The demo job: every strategy runs, matches the float64 reference, and is reported."""

import pytest

pytest.importorskip(
    "numpy", reason="numpy is not installed (the bench extra; the demo runs ema_lab.bench.sweep)"
)

from ema_lab.__main__ import main
from ema_lab.ema import STRATEGIES


def test_demo_runs_every_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", "tiny_cnn", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "32 state_dict entries, 27 float tensors, 11,266 float elements" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and "e-" in line]
    assert [r[0] for r in rows] == list(STRATEGIES)
    assert all(float(r[2]) <= 1e-5 for r in rows)  # max |ema - float64 reference|
