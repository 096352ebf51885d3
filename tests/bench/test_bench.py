"""`python -m ema_lab bench --quick` writes a valid JSON and PNGs; compare; the CLI's error paths."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("numpy", reason="numpy is not installed (the bench extra; ema_lab.bench.sweep needs it)")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (the bench extra)")

from ema_lab.__main__ import main
from ema_lab.bench import models, sweep
from ema_lab.bench.environment import available_devices
from ema_lab.bench.plots import plot_compare, plot_cost_model
from ema_lab.bench.results import (
    SCHEMA_VERSION,
    ResultError,
    bench_files,
    cost_model_line,
    format_table,
    load,
    load_many,
    result_stem,
    settings_differences,
    validate,
)
from ema_lab.bench.sweep import BASELINE, REFERENCES, candidate_names, floor_fraction, write_results
from ema_lab.ema import STRATEGIES

MODELS = ("tiny_cnn", "tiny_transformer")
THREADS = (1, 2)
RESULTS = Path(__file__).resolve().parents[2] / "results"
COMMITTED = RESULTS / "linux-amd-epyc-2c_2026-12-02.json"  # written as version 1, migrated to version 3


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    rc = main(
        [
            "bench",
            "--quick",
            "--models",
            ",".join(MODELS),
            "--threads",
            "1,2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    return rc, out


def _record(out: Path) -> dict:
    (path,) = out.glob("*.json")
    return load(path)


def test_quick_bench_writes_valid_json_and_pngs(quick_run, capsys):
    rc, out = quick_run
    assert rc == 0
    (path,) = out.glob("*.json")
    record = load(path)  # validates
    assert record["schema_version"] == SCHEMA_VERSION == 3
    created = record["created"]
    stamp = f"{created[:10]}T{created[11:19].replace(':', '')}Z"
    assert path.name == f"{record['machine']}_{stamp}_quick_t1-2_cpu.json" == f"{result_stem(record)}.json"
    assert sorted(p.name for p in out.glob("*.png")) == sorted(
        f"{path.stem}_{kind}.png" for kind in ("costmodel", "times_1t", "times_2t", "threads")
    )  # the stem already ends with the one measured device
    assert record["settings"]["threads"] == list(THREADS) and record["environment"]["threads"] == 1
    assert record["cost_model"]["cpu"]["threads"] == 1
    assert record["settings"]["candidates"] == candidate_names()
    assert set(STRATEGIES) <= set(record["settings"]["candidates"])
    rows = record["results"]
    assert [(r["model"], r["threads"], r["candidate"]) for r in rows] == [
        (m, n, c) for m in MODELS for n in THREADS for c in candidate_names()
    ]
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
    assert {r["candidate"] for r in record["results"]} == {BASELINE, "foreach", "floor", "copy"}


def test_compare_plots_result_files_and_skips_other_tools_json(quick_run, tmp_path, capsys):
    _, out = quick_run
    files = [str(p) for p in out.glob("*.json")]
    foreign = [tmp_path / f"peers-2026-01-0{i}.json" for i in range(1, 6)]  # another tool's JSON
    for f in foreign:
        f.write_text(json.dumps({"rows": []}))
    assert main(["compare", *files, *map(str, foreign), "--plot", str(tmp_path / "runs.png")]) == 0
    assert (tmp_path / "runs.png").read_bytes().startswith(b"\x89PNG")
    printed = capsys.readouterr().out
    skipped = [line for line in printed.splitlines() if "not bench runs" in line]
    assert skipped == [
        'skipped 5 file(s) that are not bench runs (no "schema": "ema_lab.bench"): '
        "peers-2026-01-01.json, peers-2026-01-02.json, peers-2026-01-03.json and 2 more"
    ]
    assert "seed_before" in printed
    # bench_files() keeps other tools' JSON out by design (no note at all), broken bench files in
    assert bench_files(tmp_path) == [] and bench_files(out) == [Path(files[0])]
    machine = tmp_path / "gpu-some-machine"  # a machine's folder, one level down, is searched too
    machine.mkdir()
    (machine / "run.json").write_text(Path(files[0]).read_text())
    assert bench_files(tmp_path) == [machine / "run.json"]


def test_committed_results_load_and_stay_intact():
    """Every committed run is at the current schema version and is not rewritten by loading."""
    before = hashlib.sha256(COMMITTED.read_bytes()).hexdigest()
    record = load(COMMITTED)
    assert record["schema_version"] == SCHEMA_VERSION and record["settings"]["threads"] == [1]
    assert len(plot_compare([record]).axes) == 4  # yolo, resnet50, gpt2, tiny_tensors
    assert hashlib.sha256(COMMITTED.read_bytes()).hexdigest() == before
    records, notes = load_many(bench_files(RESULTS))
    assert any(p == COMMITTED for p, _ in records) and notes == []
    assert {rec["schema_version"] for _, rec in records} == {SCHEMA_VERSION}


def test_an_older_schema_version_is_refused_in_one_line_naming_the_file(tmp_path):
    old = json.loads(COMMITTED.read_text()) | {"schema_version": 2}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ResultError) as e:
        load(path)
    assert str(e.value) == (
        f"{str(path)!r} is not a valid ema_lab result: result.schema_version: this ema_lab reads version "
        f"{SCHEMA_VERSION} only, got 2"
    )


def _expected_floor_fraction(row: dict, rows: list[dict]) -> float | None:
    """The floor row's median over ``row``'s on the same device, model and thread count (None for copy)."""
    same = [
        r
        for r in rows
        if r["candidate"] == "floor"
        and (r["device"], r["model"], r["threads"]) == (row["device"], row["model"], row["threads"])
    ]
    return None if row["candidate"] == "copy" or not same else same[0]["median_ms"] / row["median_ms"]


def test_floor_fraction_is_the_floor_time_over_the_row_time():
    assert floor_fraction("flat", 0.3, 0.6) == 0.5 and floor_fraction("floor", 0.3, 0.3) == 1.0
    assert floor_fraction("copy", 0.3, 0.25) is None  # a copy is not an EMA update
    assert floor_fraction("flat", None, 0.6) is None  # no floor run


def test_quick_bench_rows_hold_the_floor_fraction(quick_run):
    _, out = quick_run
    rows = _record(out)["results"]
    for row in rows:
        expected = _expected_floor_fraction(row, rows)  # the file stores ms: equal up to rounding
        assert row["floor_fraction"] == (None if expected is None else pytest.approx(expected, rel=1e-12))
        assert "roofline_fraction" not in row
    assert {r["floor_fraction"] for r in rows if r["candidate"] == "floor"} == {1.0}


def test_committed_results_print_floor_fractions_never_the_word_roofline():
    for path in bench_files(RESULTS):
        record = load(path)
        table = format_table(record)
        assert "roofline" not in table.lower(), path.name
        for row in record["results"]:
            # Stored fractions were computed at run time; equal up to float rounding.
            expected = _expected_floor_fraction(row, record["results"])
            want = expected if expected is None else pytest.approx(expected, rel=1e-12)
            assert row["floor_fraction"] == want
    record = load(COMMITTED)
    table = format_table(record).splitlines()
    head = next(i for i, line in enumerate(table) if line.startswith("model"))
    assert table[head].split()[-2:] == ["floor", "frac"]
    printed = {}
    for line in table[head + 1 : head + 1 + len(record["results"])]:
        model, cand, *_, frac = line.split()
        printed[model, cand] = frac
    assert len(printed) == 40  # 4 models x 10 candidates, each row printed once
    for (model, cand), frac in printed.items():
        if cand == "copy":
            assert frac == "-"
        else:
            assert float(frac) <= 1.05, (model, cand, frac)
    line = cost_model_line(record["cost_model"]["cpu"], 1)  # a sweep that did not record its cache
    assert "no size beyond the last-level cache (not recorded: a sweep before schema 3" in line
    assert "fitted on sizes up to 16 MiB per side" in line


def test_cost_model_plot_shows_the_regimes_of_a_new_run_and_of_a_migrated_one(quick_run):
    _, out = quick_run
    new = _record(out)["cost_model"]["cpu"]
    # Whether the quick sweep reaches past the cache depends on the CPU's cache: the line says which.
    dram, line = new["fits"]["floor"]["dram_bandwidth_gbps"], cost_model_line(new, 1)
    expected = "GB/s in cache, no size beyond" if dram is None else f"{dram:.1f} GB/s beyond"
    assert expected in line
    old = load(COMMITTED)["cost_model"]["cpu"]  # no cache size recorded: split at the assumed one
    for cost in (new, old):
        left, right = plot_cost_model(cost).axes[:2]
        assert right.get_xlabel().startswith("working set") and left.get_xlabel().startswith("tensors")
        fits = [line for line in left.get_lines() if line.get_label().endswith(": fit")]
        assert len(fits) == 2  # loop and foreach, each over its count-sweep points
        largest = max(p["working_set_bytes"] for p in cost["points"]) / 2**20
        assert max(max(line.get_xdata()) for line in right.get_lines()[:4]) == largest


def _later(record: dict, seconds: int) -> dict:
    """The same record as if run ``seconds`` later the same day."""
    import datetime as dt

    rec = copy.deepcopy(record)
    t = dt.datetime.fromisoformat(rec["created"]) + dt.timedelta(seconds=seconds)
    rec["created"] = t.isoformat(timespec="seconds")
    return rec


def test_a_second_run_on_the_same_day_keeps_both_files(quick_run, tmp_path):
    _, out = quick_run
    record = _record(out)
    morning = dict(record, created="2026-12-03T09:00:00+00:00")
    first = write_results(morning, tmp_path)[0]
    second = write_results(_later(morning, 90), tmp_path)[0]  # 09:01:30, same day, same settings
    assert first != second and first.exists() and second.exists()
    assert "_2026-12-03T090000Z_" in first.name and "_2026-12-03T090130Z_" in second.name
    assert load(first)["created"] != load(second)["created"]
    record = morning
    # The very same run again (same second, same settings) is refused, and nothing is replaced.
    stamp = first.stat().st_mtime_ns
    with pytest.raises(FileExistsError, match="never replaces"):
        write_results(record, tmp_path)
    assert first.stat().st_mtime_ns == stamp


def test_a_quick_run_does_not_replace_a_full_one(quick_run, tmp_path):
    """A quick run on a machine of the committed file's kind, the same day: the full run is untouched."""
    _, out = quick_run
    (tmp_path / COMMITTED.name).write_bytes(COMMITTED.read_bytes())
    full = load(tmp_path / COMMITTED.name)
    quick = copy.deepcopy(_record(out))
    quick.update(machine=full["machine"], created=full["created"])  # same machine, same second even
    written = write_results(quick, tmp_path)
    assert (tmp_path / COMMITTED.name).read_bytes() == COMMITTED.read_bytes()
    assert all(p.name.startswith(f"{full['machine']}_") and "_quick_" in p.name for p in written)
    full_again = copy.deepcopy(quick)
    full_again["settings"]["quick"] = False
    assert write_results(full_again, tmp_path)[0].name != written[0].name


def test_compare_keeps_runs_of_one_machine_apart(quick_run, tmp_path, capsys):
    """Two runs from one machine with different settings: distinct labels, every model, mismatch said."""
    _, out = quick_run
    full = load(COMMITTED)
    quick = copy.deepcopy(_record(out))
    quick["machine"] = full["machine"]
    path = tmp_path / "same-machine.json"
    path.write_text(json.dumps(quick))
    fig = plot_compare([full, quick])
    panels = [ax.get_title().split("\n")[0] for ax in fig.axes]  # the model, then what a run lacks
    assert panels == ["yolo", "resnet50", "gpt2", "tiny_tensors", *MODELS]  # every model of either run
    assert fig.axes[0].get_title() == "yolo\nnot measured in runs 2, 3"  # the quick run has no yolo
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(labels) == 4 and len(set(labels)) == 4  # full at 1 thread, quick at 1 and 2, floor
    assert all(full["machine"][:20] in label for label in labels[:3])
    assert any("full" in label and "1t" in label for label in labels)
    assert any("quick" in label and "2t" in label for label in labels)
    for ax in fig.axes:
        assert ax.get_yscale() == "log"
    assert "runs differ in thread counts: 1 vs 1/2" in fig._suptitle.get_text()
    assert main(["compare", str(COMMITTED), str(path)]) == 0
    printed = capsys.readouterr().out
    for line in (
        "runs differ in thread counts: 1 vs 1/2",
        "runs differ in rounds: 15 vs 3",
        "runs differ in mode (quick vs full): full vs quick",
        "run 1: ",
        "run 3: ",
    ):
        assert line in printed
    assert "run 4: " not in printed


def _untracked(folder: Path) -> list[str]:
    """The files git does not track under ``folder`` (every file where ``folder`` is not in a checkout)."""
    out = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "."], cwd=folder, capture_output=True, text=True
    )
    return sorted(out.stdout.splitlines()) if out.returncode == 0 else sorted(map(str, folder.rglob("*")))


def test_compare_writes_a_file_only_where_asked(quick_run, tmp_path, monkeypatch, capsys):
    """Three compares of the README's kind leave no new file; --plot FILE writes (and rewrites) that one."""
    _, out = quick_run
    monkeypatch.chdir(tmp_path)
    before = {folder: _untracked(folder) for folder in (RESULTS, out, tmp_path)}
    for _ in range(3):
        assert main(["compare", str(RESULTS), str(out)]) == 0
    assert {folder: _untracked(folder) for folder in before} == before
    assert capsys.readouterr().out.count("add --plot FILE.png to draw these runs side by side") == 3
    for _ in range(2):
        assert main(["compare", str(out), "--plot", "runs.svg"]) == 0
        assert capsys.readouterr().out.endswith("wrote runs.svg\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.svg"]


def test_compare_names_each_machine_whole_in_its_plot():
    h200 = next(RESULTS.glob("gpu-*/*_full_t1_cuda.json"))
    fig = plot_compare([load(COMMITTED), load(h200)])
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[0].startswith("linux-amd-epyc-2c cpu 2026-12-02 12:36 1t full")
    assert labels[1].startswith("linux-intel-xeon-16c-nvidia-h200 cuda 2026-12-04 15:45 1t full")


def test_settings_mismatch_is_reported(quick_run):
    _, out = quick_run
    a = _record(out)
    assert settings_differences([a, _later(a, 60)]) == []  # same settings, later time: nothing to say
    b = copy.deepcopy(a)
    b["environment"]["torch"] = "2.14.1"
    b["settings"]["rounds"] = 15
    assert settings_differences([a, b]) == [
        "runs differ in rounds: 3 vs 15",
        f"runs differ in torch version: {a['environment']['torch']} vs 2.14.1",
    ]


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
        (lambda r: r["settings"].update(threads=[1, 1]), "a thread count is listed twice"),
        (lambda r: r["settings"].update(threads=[]), "non-empty list of ints"),
        (lambda r: r["results"][0].update(threads=8), r"results\[0\].threads: 8 is not in settings.threads"),
        (lambda r: r["results"][0].pop("floor_fraction"), r"results\[0\]: missing field 'floor_fraction'"),
        (lambda r: r["cost_model"]["cpu"]["fits"]["floor"].pop("dram_bandwidth_gbps"), "dram_bandwidth_gbps"),
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
        (["bench", "--threads", "1,1", "--models", "tiny_cnn"], "lists a thread count twice"),
        (["bench", "--threads", "1", "0", "--models", "tiny_cnn"], "--threads must be >= 1, got 0"),
        (["compare", "missing.json"], "cannot read result file 'missing.json'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys, tmp_path):
    out = {"bench": ["--out", str(tmp_path)], "compare": ["--plot", str(tmp_path / "runs.png")]}.get(
        argv[0], []
    )
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


def test_a_run_that_would_replace_a_file_exits_2(quick_run, monkeypatch, tmp_path, capsys):
    _, out = quick_run
    record = _record(out)
    write_results(record, tmp_path)
    monkeypatch.setattr(sweep, "run_bench", lambda *a, **k: record)  # the same run again, same second
    assert main(["bench", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "exists already; a run never replaces another" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "env, argv0, name",
    [
        ("python3 dev.py", "/x/python3", "python3 dev.py"),  # dev.py says how it was started
        (None, "/usr/local/bin/ema-lab", "ema-lab"),  # the installed script
        (None, "/x/ema_lab/__main__.py", "python -m ema_lab"),
    ],
)
def test_errors_name_the_command_the_user_ran(env, argv0, name, monkeypatch, capsys):
    from ema_lab.bench.cli import command_name

    if env is None:
        monkeypatch.delenv("EMA_LAB_PROG", raising=False)
    else:
        monkeypatch.setenv("EMA_LAB_PROG", env)
    monkeypatch.setattr("sys.argv", [argv0])
    assert command_name() == name
    assert _exit_code(["bench", "--models", "alexnet"]) == 2
    assert capsys.readouterr().err.startswith(f"{name} bench: error: unknown model 'alexnet'")
