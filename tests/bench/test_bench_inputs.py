"""Bad ``--out`` folders and ``--plot`` files fail in one line with exit code 2 before any work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the bench extra is not installed")

from ema_lab.bench import cli, sweep

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "results" / "linux-amd-epyc-2c_2026-12-03T083304Z_quick_t1_cpu.json"
linux = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux's /proc and /sys")


def _never(*args, **kwargs):
    raise AssertionError("the work started before --out was checked")


@pytest.mark.parametrize(
    "cmd, out, message",
    [
        ("bench", "{tmp}/a_file", "--out '{tmp}/a_file' exists and is not a folder"),
        (
            "bench",
            "{tmp}/a_file/sub",
            "cannot create --out '{tmp}/a_file/sub': {tmp}/a_file is a file, not a folder",
        ),
        pytest.param(
            "bench",
            "/proc/forbidden",
            "cannot create --out '/proc/forbidden': /proc takes no new folders (No such file or directory)",
            marks=linux,
        ),
        # A folder that exists but takes no files, even for root (permission denied, or a read-only mount).
        pytest.param(
            "bench", "/sys", "cannot write to --out '/sys': the folder takes no new files (", marks=linux
        ),
    ],
)
def test_an_unwritable_out_is_one_line_and_exit_2_before_any_work(
    cmd, out, message, tmp_path, monkeypatch, capsys
) -> None:
    (tmp_path / "a_file").write_text("a file, not a folder")
    monkeypatch.setattr(sweep, "run_bench", _never)
    monkeypatch.setattr(sweep, "compare", _never)
    files = [str(RUN)] if cmd == "compare" else ["--models", "tiny_cnn"]
    assert cli.main([cmd, *files, "--out", out.format(tmp=tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{cmd}: error: {message.format(tmp=tmp_path)}" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "plot, message",
    [
        ("{tmp}/runs.txt", "--plot '{tmp}/runs.txt': the file name must end in one of .png, .svg, .pdf"),
        ("{tmp}/a_folder.png", "--plot '{tmp}/a_folder.png' is a folder; name the file to write"),
        ("{tmp}/a_file/runs.png", "the folder of --plot '{tmp}/a_file/runs.png' exists and is not a folder"),
        pytest.param(
            "/proc/forbidden/runs.png",
            "cannot create the folder of --plot '/proc/forbidden/runs.png': "
            "/proc takes no new folders (No such file or directory)",
            marks=linux,
        ),
    ],
)
def test_a_bad_plot_file_is_one_line_and_exit_2_before_any_work(
    plot, message, tmp_path, monkeypatch, capsys
) -> None:
    (tmp_path / "a_file").write_text("a file, not a folder")
    (tmp_path / "a_folder.png").mkdir()
    monkeypatch.setattr(sweep, "compare", _never)
    assert cli.main(["compare", str(RUN), "--plot", plot.format(tmp=tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"compare: error: {message.format(tmp=tmp_path)}" in err and err.count("\n") == 1, err


def test_compare_with_no_runs_says_what_it_takes(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sweep, "compare", _never)
    assert cli.main(["compare"]) == 2
    err = capsys.readouterr().err
    assert "compare: error: name the runs to compare: result files or folders, e.g. `compare results`" in err
    assert err.count("\n") == 1, err


def test_a_new_out_is_created_and_left_empty(tmp_path) -> None:
    out = tmp_path / "new" / "deeper"
    assert cli.writable_folder(str(out)) == out
    assert out.is_dir() and list(out.iterdir()) == []  # the scratch file is gone


def test_an_os_error_while_writing_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys) -> None:
    def disk_full(record, out):
        raise OSError(28, "No space left on device", str(Path(out) / "run.json"))

    monkeypatch.setattr(sweep, "run_bench", lambda *a, **k: {})
    monkeypatch.setattr(sweep, "write_results", disk_full)
    assert cli.main(["bench", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f" bench: error: No space left on device: {tmp_path / 'run.json'}\n"), err
    assert err.count("\n") == 1
