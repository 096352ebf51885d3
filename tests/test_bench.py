"""`python -m ema_lab bench --quick` writes a valid JSON and PNGs; compare; the CLI's error paths."""

from __future__ import annotations

import copy
import json

import pytest

from ema_lab.__main__ import main
from ema_lab.bench.environment import available_devices
from ema_lab.bench.results import SCHEMA_VERSION, ResultError, load, validate
from ema_lab.bench.sweep import BASELINE, REFERENCES, candidate_names
from ema_lab.ema import STRATEGIES
from ema_lab.lessons import models

MODELS = ("tiny_cnn", "tiny_transformer")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    rc = main(["bench", "--quick", "--models", ",".join(MODELS), "--out", str(out), "--no-progress"])
    return rc, out


def test_quick_bench_writes_valid_json_and_pngs(quick_run, capsys):
    rc, out = quick_run
    assert rc == 0
    (path,) = out.glob("*.json")
    record = load(path)  # validates
    assert record["schema_version"] == SCHEMA_VERSION
    assert path.name == f"{record['machine']}_{record['created'][:10]}.json"
    assert sorted(p.name for p in out.glob("*.png")) == sorted(
        f"{path.stem}_cpu_{kind}.png" for kind in ("costmodel", "times")
    )
    assert record["settings"]["threads"] == 1 and record["environment"]["threads"] == 1
    assert record["settings"]["candidates"] == candidate_names()
    assert set(STRATEGIES) <= set(record["settings"]["candidates"])
    rows = record["results"]
    assert [(r["model"], r["candidate"]) for r in rows] == [(m, c) for m in MODELS for c in candidate_names()]
    for row in rows:
        stats = models.describe(models.build(row["model"]))
        assert row["stats"]["float_tensors"] == stats.float_tensors
        if row["candidate"] == BASELINE:
            assert row["speedup_vs_seed_before"] == 1.0
            assert row["ops_compute"] == 3 * stats.float_tensors
        if row["candidate"] in {"seed_after", *REFERENCES}:
            assert row["ops_compute"] == 1
        assert row["kernel_launches"] is None and row["kernel_launches_note"].startswith("not available: ")
    for dev, reason in available_devices().items():
        status = record["devices"][dev]["status"]
        expected = "measured" if dev == "cpu" else reason or "skipped: not requested (--device cpu)"
        assert status == expected
    fits = record["cost_model"]["cpu"]["fits"]
    assert set(fits) == {"loop", "foreach", "floor", "copy"}
    assert fits["loop"]["unit"] == "dispatched op"


def test_skipped_devices_are_reported_in_the_table(quick_run, tmp_path, capsys):
    missing = [d for d, reason in available_devices().items() if reason is not None]
    rc = main(
        ["bench", "--quick", "--device", "all", "--models", "tiny_cnn", "--strategies", "foreach"]
        + ["--out", str(tmp_path), "--no-progress"]
    )
    assert rc == 0
    table = capsys.readouterr().out
    for dev in missing:
        assert f"{dev}: skipped: " in table
    record = load(next(tmp_path.glob("*.json")))
    assert {r["candidate"] for r in record["results"]} == {BASELINE, "foreach", "copy"}


def test_compare_plots_result_files_and_skips_other_tools_json(quick_run, tmp_path, capsys):
    _, out = quick_run
    files = [str(p) for p in out.glob("*.json")]
    foreign = tmp_path / "peers-2026-01-01.json"  # results/ may hold another tool's JSON
    foreign.write_text(json.dumps({"rows": []}))
    assert main(["compare", *files, files[0], str(foreign), "--out", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("compare_*.png"))) == 1
    printed = capsys.readouterr().out
    assert f"skipped '{foreign}': not an ema_lab.bench result" in printed and "seed_before" in printed


def test_validate_names_the_bad_field(quick_run):
    _, out = quick_run
    good = json.loads(next(out.glob("*.json")).read_text())
    cases = [
        (lambda r: r.pop("environment"), "missing field 'environment'"),
        (lambda r: r.update(schema_version=99), "schema_version"),
        (lambda r: r["results"][0].update(q1_ms=1e9), "q1_ms <= median_ms"),
        (lambda r: r["results"][0].update(median_ms="fast"), r"results\[0\].median_ms: expected int/float"),
        (lambda r: r["results"][0].update(device="tpu"), "not a measured device"),
        (lambda r: r["devices"]["cpu"].update(status="zero"), "'measured' or 'skipped: <reason>'"),
        (lambda r: r["settings"].update(quick="yes"), "settings.quick: expected bool"),
    ]
    for breaks, message in cases:
        bad = copy.deepcopy(good)
        breaks(bad)
        with pytest.raises(ResultError, match=message):
            validate(bad)


def _absent_device() -> str | None:
    return next((d for d, reason in available_devices().items() if reason is not None), None)


def _exit_code(argv: list[str]) -> int:
    """main()'s return value, or the code of the SystemExit argparse raises."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--models", "alexnet"], "unknown model 'alexnet'"),
        (["bench", "--models", "tiny_cnn", "--strategies", "fastest"], "unknown strategy 'fastest'"),
        (["bench", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["bench", "--threads", "0", "--models", "tiny_cnn"], "--threads must be >= 1"),
        (["bench", "--threads", "two"], "invalid int value: 'two'"),
        (["compare", "missing.json"], "cannot read result file 'missing.json'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys, tmp_path):
    out = ["--out", str(tmp_path)] if argv[0] in {"bench", "compare"} else []
    assert _exit_code([*argv, *out]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_absent_device_and_bad_result_files_exit_2(tmp_path, capsys):
    device = _absent_device()
    if device is not None:  # on a machine with both CUDA and MPS there is nothing absent to ask for
        assert main(["bench", "--device", device, "--out", str(tmp_path)]) == 2
        assert f"device {device!r} is not available (skipped: " in capsys.readouterr().err
    not_json = tmp_path / "notes.json"
    not_json.write_text("this is not JSON")
    other_json = tmp_path / "other.json"
    other_json.write_text(json.dumps({"schema": "something else"}))
    broken_bench = tmp_path / "broken.json"
    broken_bench.write_text(json.dumps({"schema": "ema_lab.bench"}))
    (tmp_path / "out").write_text("a file, not a folder")
    for argv, message in (
        (["compare", str(not_json)], "is not a JSON result file"),
        (
            ["compare", str(other_json)],
            "no ema_lab.bench result among",
        ),
        (
            ["compare", str(broken_bench)],
            "is not a valid ema_lab result: result: missing field 'schema_version'",
        ),
        (["bench", "--out", str(tmp_path / "out")], "exists and is not a folder"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
