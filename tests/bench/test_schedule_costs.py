"""benchmarks/schedule_costs.py runs and records every candidate (timings are measured, never asserted)."""

from __future__ import annotations

import json

from ..helpers import load_script


def test_schedule_costs_times_every_candidate_and_writes_its_record(tmp_path, capsys) -> None:
    script = load_script("schedule_costs")
    assert script.main(["--models", "tiny_cnn", "--rounds", "1", "--out", str(tmp_path)]) == 0
    (record,) = tmp_path.glob("schedule-costs-*.json")
    rows = json.loads(record.read_text())["rows"]
    assert [r["candidate"] for r in rows] == list(script.candidates("tiny_cnn", str(tmp_path)))
    assert all(r["median_ms"] > 0 and r["threads"] == 1 for r in rows)
    assert "PostHocEMA" in capsys.readouterr().out
