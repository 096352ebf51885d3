"""benchmarks/sync_costs.py runs gloo ranks and records every candidate (timings measured, never asserted)."""

from __future__ import annotations

import json
import sys

import pytest

from ema_lab.lessons import distributed as dist_demo

from ..helpers import load_script


@pytest.mark.skipif(dist_demo.skip_reason() is not None, reason=str(dist_demo.skip_reason()))
def test_sync_costs_times_update_and_sync_on_two_ranks_and_writes_its_record(
    tmp_path, capsys, monkeypatch
) -> None:
    script = load_script("sync_costs")
    monkeypatch.setitem(sys.modules, "sync_costs", script)  # the spawned ranks unpickle rank_times by name
    argv = ["--models", "tiny_cnn", "--rounds", "1", "--calls", "1", "--out", str(tmp_path)]
    assert script.main(argv) == 0
    (record,) = tmp_path.glob("sync-costs-*.json")
    rows = json.loads(record.read_text())["rows"]
    assert [r["candidate"] for r in rows] == ["update()", "sync_buffers()", "update() + sync_buffers()"]
    assert all(r["median_ms"] > 0 and r["world_size"] == 2 for r in rows)
    assert {(r["buffers"], r["buffer_bytes"]) for r in rows} == {(10, 704)}  # 5 BatchNorms: mean and var
    assert "gloo, 2 ranks" in capsys.readouterr().out
