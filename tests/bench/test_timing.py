"""The timer's bookkeeping (interleaving, quartiles, threads) and the cost-model fit; no timing asserted."""

from __future__ import annotations

import math
import timeit

import pytest
import torch

pytest.importorskip(
    "numpy", reason="numpy is not installed (the bench extra; ema_lab.bench.costmodel needs it)"
)

from ema_lab.bench.costmodel import (
    BYTES_PER_ELEMENT,
    DEFAULT_LLC_BYTES,
    FIXED_ELEMENTS,
    FIXED_TENSORS,
    MEMORY_FRACTION,
    SIDE_CAP_BYTES,
    SIDES_ALIVE,
    CostModel,
    cost_seconds,
    fit_cost,
    measured_knee,
    regime,
    sweep_limit,
    sweep_plan,
)
from ema_lab.bench.environment import available_memory_bytes, device_cache_bytes, last_level_cache_bytes
from ema_lab.bench.timing import quantiles, synchronize, synchronized_clock, time_candidates


def test_quantiles_inclusive():
    assert quantiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (2.0, 3.0, 4.0)
    assert quantiles([7.0]) == (7.0, 7.0, 7.0)


def test_candidates_are_interleaved_in_a_new_order_each_round_and_threads_restored():
    calls: list[str] = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    before = torch.get_num_threads()
    res = time_candidates(fns, rounds=12, warmup=1, target_s=1e-9, threads=1)
    assert torch.get_num_threads() == before
    # target_s tiny -> one call per measurement; Timer.timeit adds 2 warm-up calls before each.
    measured = [calls[i] for i in range(len(calls)) if i >= 6 and (i - 6) % 3 == 2]
    rounds = [measured[i : i + 3] for i in range(0, len(measured), 3)]
    assert len(rounds) == 12 and all(sorted(r) == list("abc") for r in rounds)  # each candidate once a round
    # Each candidate runs after each other one in some round (a rotation gives it one predecessor only).
    assert {(r[i - 1], r[i]) for r in rounds for i in (1, 2)} == {
        (x, y) for x in "abc" for y in "abc" if x != y
    }
    for k, r in res.items():
        assert (r.name, r.device, r.threads, r.number, r.rounds, len(r.times_s)) == (k, "cpu", 1, 1, 12, 12)
        assert r.q1_s <= r.median_s <= r.q3_s and r.iqr_s == r.q3_s - r.q1_s


def test_time_candidates_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one candidate"):
        time_candidates({})
    with pytest.raises(ValueError, match="rounds and threads"):
        time_candidates({"a": lambda: None}, rounds=0)
    synchronize("cpu")  # a no-op that must not raise


def test_every_clock_reading_waits_for_mps_whatever_torch_timer_does(monkeypatch):
    # torch's Timer synchronizes MPS only since pytorch PR #157131 (July 2025); ours must on every version.
    # No MPS here: torch.mps.synchronize is replaced by a recorder, the candidate runs on the CPU.
    events: list[str] = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: events.append("sync"))
    time_candidates({"a": lambda: events.append("call")}, device="mps", rounds=3, warmup=1, target_s=1e-9)
    log = "".join("s" if e == "sync" else "c" for e in events)
    # The warm-up call, then every stretch of timed calls between two syncs: each clock reading waited.
    assert log.startswith("cs") and log.endswith("s")
    assert len([run for run in log[1:].split("s") if run]) >= 1 + 3  # the sizing call, then each round
    assert synchronized_clock("cpu") is timeit.default_timer  # nothing to wait for on a CPU


def test_fit_recovers_overhead_and_bandwidth():
    units = [4, 16, 64, 256, 1024, 256, 256]
    nbytes = [1e6, 1e6, 1e6, 1e6, 1e6, 1e5, 1e7]
    seconds = [2e-6 * u + b / 50e9 for u, b in zip(units, nbytes)]
    fit = fit_cost(units, nbytes, seconds, "loop", "dispatched op")
    assert math.isclose(fit.overhead_per_op_us, 2.0, rel_tol=1e-6)
    assert math.isclose(fit.bandwidth_gbps, 50.0, rel_tol=1e-6)
    assert math.isclose(fit.r2, 1.0, abs_tol=1e-9) and fit.points == 7


def test_fit_never_reports_a_negative_term():
    # The point with the most bytes is the fastest relative to its count: a free fit's bytes term is < 0.
    fit = fit_cost([1, 2, 3], [1e6, 2e6, 1e6], [1e-6, 1.5e-6, 3e-6], "foreach", "tensor")
    assert fit.overhead_per_op_us > 0 and fit.bandwidth_gbps == math.inf
    with pytest.raises(ValueError, match="need >= 2 points"):
        fit_cost([1], [1], [1], "loop", "op")


def test_sweep_plan_varies_count_at_fixed_size_and_size_at_fixed_count():
    for quick in (False, True):
        plan = sweep_plan(quick)
        counts = [(n, e) for s, n, e in plan if s == "count"]
        sizes = [(n, e) for s, n, e in plan if s == "size"]
        assert {e for _, e in counts} == {FIXED_ELEMENTS} and len(counts) >= 4
        assert {n for n, _ in sizes} == {FIXED_TENSORS} and len(sizes) >= 2
    # a copy also reads its destination (write-allocate): 3 accesses per element, like a lerp
    assert BYTES_PER_ELEMENT == {"loop": 7, "foreach": 3, "floor": 3, "copy": 3}


def _largest_side(llc: int | None, available: int | None) -> int:
    return 4 * max(e for s, _, e in sweep_plan(False, llc, available) if s == "size")


def test_full_sweep_reaches_four_times_the_reported_cache_when_it_is_small_and_quick_stays_small():
    llc = 32 << 20
    assert _largest_side(llc, 64 << 30) == 4 * llc  # float32 bytes per side: 4x LLC, not more
    assert max(e for _, _, e in sweep_plan(True, llc)) * 4 * 2 <= llc  # quick: inside the cache
    assert len(sweep_plan(True, llc)) == 6


@pytest.mark.parametrize(
    "llc, available, largest, bound",
    [
        (480 << 20, 20 << 30, SIDE_CAP_BYTES, "the cap"),  # a VM that reports a 480 MiB L3
        (1 << 30, 8 << 30, SIDE_CAP_BYTES, "the cap"),  # a 1 GiB L3 and 8 GiB free
        (1 << 30, 2 << 30, 128 << 20, "available memory"),  # a 1 GiB L3 and 2 GiB free
        (None, None, 128 << 20, "reported last-level cache"),  # nothing known: 4x the assumed 32 MiB
    ],
)
def test_full_sweep_is_bounded_by_the_cap_and_the_available_memory_not_by_the_reported_cache(
    llc, available, largest, bound
):
    limit, why = sweep_limit(llc, available)
    assert bound in why and _largest_side(llc, available) == largest <= limit
    if available is not None:  # the buffers of one size fit in the memory share
        assert SIDES_ALIVE * largest <= MEMORY_FRACTION * available


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8000000 kB\n")
    assert available_memory_bytes(meminfo) == (8_000_000 * 1024, f"{meminfo} MemAvailable")
    size, source = available_memory_bytes(tmp_path / "absent")
    assert "sysconf" in source or size is None


def test_knee_is_where_the_floor_bandwidth_steps_down_and_none_without_a_step():
    sides = [1 << k for k in range(20, 29)]  # 1 MiB .. 256 MiB per side
    ws = [2 * s for s in sides]
    stepped = [60.0 if w <= (32 << 20) else 12.0 for w in ws]
    assert measured_knee(ws, stepped) == 64 << 20
    assert measured_knee(ws, [30.0] * len(ws)) is None  # all in cache (or all in DRAM)
    assert measured_knee(ws[-3:], stepped[-3:]) is None  # too few points for two plateaus
    # a private L2 plateau below KNEE_MIN_WORKING_SET is not taken for the cache-to-DRAM knee
    l2 = [200.0 if w < (4 << 20) else v for w, v in zip(ws, stepped)]
    assert measured_knee(ws, l2) == 64 << 20


def test_regimes_split_at_half_and_twice_the_cache():
    llc = 32 << 20
    assert [regime(ws, llc) for ws in (16 << 20, 17 << 20, 63 << 20, 64 << 20)] == [
        "cache",
        "transition",
        "transition",
        "dram",
    ]


def test_last_level_cache_is_the_highest_data_level_in_sysfs(tmp_path):
    for i, (level, kind, size) in enumerate(
        [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"), (3, "Unified", "32768K")]
    ):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    size, source = last_level_cache_bytes(tmp_path)
    assert size == 32 << 20 and "(L3)" in source


def test_cuda_l2_or_the_cpus_last_level_cache_is_the_cache_before_memory():
    assert device_cache_bytes("cpu") == last_level_cache_bytes()
    assert device_cache_bytes("mps") == (None, "unknown for mps")
    if torch.cuda.is_available():
        size, source = device_cache_bytes("cuda")
        assert (
            size == torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
            and "L2_cache_size" in source
        )


def test_two_regime_fit_recovers_each_bandwidth_and_fractions_are_time_ratios_to_the_floor():
    units = [1, 1, 1, 1, 1, 1]
    nbytes = [1e5, 1e6, 1e7, 1e8, 2e8, 4e8]
    far = [False, False, False, True, True, True]
    seconds = [1e-6 + b / (30e9 if f else 90e9) for b, f in zip(nbytes, far)]
    fit = fit_cost(units, nbytes, seconds, "floor", "call", beyond_llc=far)
    assert math.isclose(fit.bandwidth_gbps, 90.0, rel_tol=1e-6)
    assert math.isclose(fit.dram_bandwidth_gbps, 30.0, rel_tol=1e-6)
    predicted = cost_seconds(fit.overhead_per_op_us, fit.dram_bandwidth_gbps, 1, 4e8)
    assert math.isclose(predicted, seconds[-1], rel_tol=1e-9)
    assert cost_seconds(2.0, float("inf"), 3, 1e9) == cost_seconds(2.0, None, 3, 1e9) == pytest.approx(6e-6)
    # fractions are time ratios to the floor at the largest size of each regime
    fits = {k: fit for k in ("loop", "foreach", "floor", "copy")}
    pts = []
    for e, where in ((1 << 10, "cache"), (1 << 20, "cache"), (1 << 25, "dram")):
        for strategy, n, t in (("loop", 64, 7.0), ("foreach", 64, 3.5), ("floor", 1, 3.0), ("copy", 1, 3.0)):
            pts.append(
                {"strategy": strategy, "tensors": n, "elements": e, "regime": where, "median_s": t * e}
            )
    cm = CostModel("cpu", 1, fits, pts)
    assert cm.floor_fraction("cache") == pytest.approx({"loop": 3 / 7, "foreach": 3 / 3.5})
    assert cm.floor_fraction("dram") == pytest.approx({"loop": 3 / 7, "foreach": 3 / 3.5})
    stored = cm.as_dict()
    assert stored["floor_fraction"] == cm.floor_fraction("cache") and "roofline_fraction" not in stored
    assert stored["fits"]["floor"]["dram_bandwidth_gbps"] == pytest.approx(30.0)
    quick = CostModel("cpu", 1, fits, [p for p in pts if p["regime"] == "cache"])
    assert quick.floor_fraction("dram") == {"loop": None, "foreach": None}


def test_regime_plot_draws_both_panels_and_the_cache_marks():
    matplotlib = pytest.importorskip("matplotlib", reason="matplotlib is not installed (the bench extra)")

    matplotlib.use("Agg")
    from ema_lab.bench.plots import plot_cost_model

    fits = {
        k: {"overhead_per_op_us": 1.0, "bandwidth_gbps": 90.0, "dram_bandwidth_gbps": 30.0}
        for k in BYTES_PER_ELEMENT
    }
    pts = []
    for strategy in BYTES_PER_ELEMENT:
        for sweep, n, e in sweep_plan(False, 32 << 20):
            pts.append(
                {
                    "sweep": sweep,
                    "strategy": strategy,
                    "tensors": n,
                    "elements": e,
                    "units": n,
                    "bytes": 12 * e,
                }
                | {"working_set_bytes": 8 * e, "median_s": 1e-3}
            )
    cost = {"points": pts, "fits": fits, "fixed_elements": FIXED_ELEMENTS, "fixed_tensors": FIXED_TENSORS}
    fig = plot_cost_model(cost | {"llc_bytes": 480 << 20, "knee_bytes": 64 << 20, "split_bytes": 64 << 20})
    left, right = fig.axes
    assert left.get_xscale() == "log" and right.get_xlabel().startswith("working set")
    labels = [line.get_label() for line in right.get_lines()]
    assert {"last-level cache as reported by the OS: 480 MiB", "measured knee 64 MiB"} <= set(labels)
    assert {t.get_text() for t in right.texts} == {"floor fit, cache: 90 GB/s", "floor fit, DRAM: 30 GB/s"}


def test_costmodel_main_writes_the_quick_sweep_with_the_reported_cache_and_the_load(tmp_path, capsys):
    import json

    from ema_lab.bench.costmodel import main

    out = tmp_path / "cm.json"
    assert main(["--quick", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    cm = record["cost_model"]
    assert record["quick"] is True and set(cm["fits"]) == {"loop", "foreach", "floor", "copy"}
    # Quick mode stays under its size limit; whether that is beyond the cache depends on the CPU's cache
    # (an 8 MiB L3 is): each point's regime follows from its working set and the reported cache.
    split = cm["llc_bytes"] or DEFAULT_LLC_BYTES  # no knee in quick mode (asserted below)
    for p in cm["points"]:
        assert p["regime"] == regime(p["working_set_bytes"], split), p
    assert cm["llc_bytes"] == last_level_cache_bytes()[0] and "load_average_1_5_15min" in record
    assert cm["knee_bytes"] is None and cm["size_limit"].startswith("quick mode")
    printed, llc = capsys.readouterr().out, cm["llc_bytes"]
    assert (f"{llc / 2**20:.0f} MiB as reported" if llc else cm["llc_source"]) in printed
    assert "the sweep was bounded by quick mode" in printed
