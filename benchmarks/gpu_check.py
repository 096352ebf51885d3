"""The GPU check in one command: ``python3 benchmarks/gpu_check.py`` (from the checkout, any venv with torch).

On a CUDA machine, within 8 minutes, it writes into ``results/gpu-<machine>/`` (the gallery, ``--out``
elsewhere):

1. ``python -m ema_lab bench --device cuda --quick``: timings, op counts and kernel launches per candidate;
2. ``kernel-launches.json``: the CUDA kernels one ``ModelEMA.update`` runs, per strategy and model,
   and with ``cuda_graph=True``, and the host calls that launched them (a graph's replay is one);
3. ``cuda-tests.xml`` / ``.log``: the CUDA tests (``pytest -k "test_cuda_ or cuda_graph"``: a sync-free
   update under ``torch.cuda.set_sync_debug_mode("error")``, ``ModelEMA(cuda_graph=True)`` bit for bit with
   the eager step, sync-free and through every staleness test, an update captured in and replayed from a
   CUDA graph by the user, kernel launches of one foreach call, the peers' CUDA timer and memory);
4. ``peers.log``: the peers on CUDA (``benchmarks/peers.py --device cuda --rounds 11``: ultralytics, timm,
   torch's AveragedModel, ema-pytorch against the default and ``cuda_graph=True``; kernels per update; the
   extra device memory; the issue 29 targets, met or not), whose study
   goes where the studies live, ``docs/results/peers-<date>-cuda-<machine>.{json,md}`` (``--studies-out``
   elsewhere); skipped, with a line saying why, where ultralytics is not importable;
5. the full bench (``--device cuda``), leaving ``NOTEBOOKS_S`` of the budget to:
6. the notebooks that have CUDA cells (01's kernel counts, 04's bench on every device) executed in quick
   mode into that folder, when nbclient, jupytext and ipykernel are importable;

plus ``summary.json`` / ``summary.md``: what ran, how long it took, and what was skipped and why. A step
that cannot run (a missing package, an error, the time limit) is recorded and the others still run.
Without CUDA it prints one line saying what was skipped and why, and exits 0.

The peers are not project dependencies, and a GPU machine without network cannot install them: carry them
in. On a machine with the registry, into a folder git ignores (about 11 MB)::

    python3 -m pip install --no-deps --target build/peers-site ultralytics==8.4.190 ema-pytorch

then, on the GPU machine, with ``build/peers-site`` carried beside the checkout::

    PYTHONPATH=build/peers-site python3 benchmarks/gpu_check.py

``--no-deps`` is enough where torch, numpy, opencv, pillow and pyyaml are installed (what importing
ultralytics' ``ModelEMA`` and ``DetectionModel`` loads, checked with ultralytics 8.4.190); a missing one
makes the peers step say which.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest.mock import patch

from result_homes import GALLERY, ROOT, STUDIES, shown

# The device machine gives one command at most 10 minutes; 8 leave room to copy the results back.
BUDGET_S = 8 * 60
# Kept back from the last step (the full bench) for writing the summary.
RESERVE_S = 20
# A bench or pytest run given less than this cannot start, measure and write anything: it is skipped.
MIN_STEP_S = 30
# Left to the notebooks (two, in quick mode) after the full bench.
NOTEBOOKS_S = 150
NOTEBOOKS_WITH_CUDA = ("01_launch_overhead", "04_timing_cpu_cuda_mps")
# The peers on CUDA: six models, 11 rounds, kernel counts; estimated at 1-2 minutes on an H200.
PEERS_S = 180
PEERS_ROUNDS = 11  # as in issue 29's table
# What the peers step imports from ultralytics (its model, its EMA): the check that it can run.
PEERS_IMPORT = "import ultralytics.nn.tasks, ultralytics.utils.torch_utils"


def pythonpath() -> str:
    """This checkout first, then whatever PYTHONPATH already holds (packages carried in, say)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def no_cuda_reason() -> str | None:
    """Why the check cannot run here, or None on a usable CUDA machine."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


def bench_missing() -> str | None:
    """What the bench steps lack here (ema_lab.bench needs the bench extra), or None."""
    missing = [m for m in ("numpy", "matplotlib", "tqdm") if importlib.util.find_spec(m) is None]
    return f"skipped: {', '.join(missing)} not installed (the bench extra)" if missing else None


def machine_folder(out: Path | None) -> Path:
    """``<results>/gpu-<machine>``, named like the bench's result files (OS, CPU, cores, GPU)."""
    import torch

    if bench_missing():  # ema_lab.bench cannot be imported: the checkout's results/, the GPU's name
        gpu = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name().lower())
        return (out or GALLERY) / f"gpu-{gpu}"
    from ema_lab.bench.environment import environment
    from ema_lab.bench.results import machine_label, results_dir

    env = environment("cuda")
    return (out or results_dir()) / f"gpu-{machine_label(env, [str(env['device_name'])])}"


class Clock:
    """The time left of the whole check's budget."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        """Seconds left before the budget runs out."""
        return self.end - time.monotonic()


def run_command(cmd: list[str], log: Path, timeout_s: float) -> str:
    """Run ``cmd`` from the checkout with its output in ``log``; "ok", or what went wrong."""
    if timeout_s < MIN_STEP_S:
        return f"skipped: {timeout_s:.0f} s left of the budget"
    env = dict(os.environ, PYTHONPATH=pythonpath())
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return f"stopped after {timeout_s:.0f} s (the budget); partial output in {log.name}"
    return "ok" if rc == 0 else f"exit code {rc}; see {log.name}"


def bench(cmd: list[str], log: Path, timeout_s: float) -> str:
    """``python -m ema_lab bench ...`` where the bench extra is installed."""
    return bench_missing() or run_command(cmd, log, timeout_s)


def kernel_launches(folder: Path) -> str:
    """CUDA kernels of one steady ``ModelEMA.update`` per strategy on the bench's quick models."""
    if bench_missing():
        return bench_missing()
    import torch

    from ema_lab import ModelEMA, flatten_model
    from ema_lab.bench import models
    from ema_lab.bench.counting import count_host_launches, kernel_launches_or_reason
    from ema_lab.bench.sweep import QUICK_MODELS
    from ema_lab.ema import STRATEGIES

    def launches(
        model: torch.nn.Module, strategy: str, cuda_graph: bool = False, decay: object = None
    ) -> object:
        ema = ModelEMA(model, strategy=strategy, cuda_graph=cuda_graph)
        for _ in range(2):  # the first update builds the cached step; with cuda_graph, the second records
            ema.update(model, decay=decay)
        counts = kernel_launches_or_reason(ema.update, model, decay=decay, device="cuda")
        if isinstance(counts, str):
            return counts
        host = count_host_launches(ema.update, model, decay=decay)  # a graph replay: one for all its kernels
        return {"total": sum(counts.values()), "host_launches": host, "kernels": counts}

    table: dict[str, dict[str, object]] = {}
    for name in QUICK_MODELS:
        model = models.build(name).cuda()
        table[name] = {strategy: launches(model, strategy) for strategy in STRATEGIES}
        table[name]["auto, tensor decay"] = launches(model, "auto", decay=torch.tensor(0.999, device="cuda"))
        table[name]["auto, cuda_graph"] = launches(model, "auto", cuda_graph=True)
        flatten_model(model)  # the floor's layout: the default EMA then runs one lerp_ per group
        table[name]["auto, flatten_model"] = launches(model, "auto")
        table[name]["auto, flatten_model, cuda_graph"] = launches(model, "auto", cuda_graph=True)
        del model
        torch.cuda.empty_cache()
    (folder / "kernel-launches.json").write_text(json.dumps(table, indent=2) + "\n")
    return "ok"


def peers_missing(timeout_s: float = 120) -> str | None:
    """Why the peers cannot run here ("skipped: ..."), or None: ultralytics must import (it is the target's
    reference); timm and ema-pytorch, where missing, are left out by peers.py and named in its results."""
    env = dict(os.environ, PYTHONPATH=pythonpath())
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PEERS_IMPORT],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"skipped: importing ultralytics took over {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return (
        f"skipped: ultralytics is not importable ({last}); the peers are carried in as wheels, see "
        "benchmarks/gpu_check.py's docstring"
    )


def peers(folder: Path, studies: Path, timeout_s: float) -> str:
    """``benchmarks/peers.py --device cuda`` into ``studies``, its output in ``folder/peers.log``."""
    missing = peers_missing()
    if missing:
        return missing
    machine = folder.name.removeprefix("gpu-")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--device", "cuda"]
    cmd += ["--rounds", str(PEERS_ROUNDS), "--out", str(studies), "--suffix", f"-{machine}"]
    outcome = run_command(cmd, folder / "peers.log", timeout_s)
    return f"ok, written to {shown(studies)}" if outcome == "ok" else outcome


def notebooks(folder: Path, clock: Clock) -> str:
    """Execute the notebooks with CUDA sections (quick mode) into ``folder``; never the committed ones."""
    missing = [m for m in ("nbclient", "jupytext", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:
        return f"skipped: {', '.join(missing)} not installed (notebooks need the notebooks extra)"
    import jupytext
    import nbformat

    sys.path.insert(0, str(ROOT / "notebooks"))
    import execute  # notebooks/execute.py: its kernel runs in this interpreter

    (folder / "notebooks").mkdir(exist_ok=True)
    outcomes = []
    with patch.dict(os.environ, EMA_LAB_QUICK="1", PYTHONPATH=pythonpath()):  # what the kernels inherit
        for stem in NOTEBOOKS_WITH_CUDA:
            if clock.left() < 2 * MIN_STEP_S:
                outcomes.append(f"{stem} skipped (the budget)")
                continue
            nb = jupytext.read(ROOT / "notebooks" / f"{stem}.py")
            try:  # cwd notebooks/, as when a reader runs it; the executed copy goes to folder/notebooks/
                execute.run(nb, ROOT / "notebooks", int(clock.left()))
                outcomes.append(f"{stem} ok")
            except Exception as exc:  # a failing notebook is reported; the next one still runs
                outcomes.append(f"{stem} error: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
            nbformat.write(nb, folder / "notebooks" / f"{stem}.ipynb")
    return "ok" if all(o.endswith(" ok") for o in outcomes) else "; ".join(outcomes)


def step(summary: dict[str, dict], name: str, fn: Callable[[], str]) -> None:
    """Run one step, recording its outcome and duration; an exception is recorded, not raised."""
    t0 = time.monotonic()
    try:
        outcome = fn()
    except Exception as exc:  # one broken step must not cost the others their device time
        outcome = f"error: {type(exc).__name__}: {exc}"
    summary[name] = {"outcome": outcome, "seconds": round(time.monotonic() - t0, 1)}
    print(f"[gpu-check] {name}: {outcome} ({summary[name]['seconds']} s)", flush=True)


def write_summary(folder: Path, summary: dict[str, dict]) -> None:
    """summary.json and a short summary.md next to the results."""
    import torch

    header = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (folder / "summary.json").write_text(json.dumps({**header, "steps": summary}, indent=2) + "\n")
    lines = [f"# GPU check: {header['gpu']}", "", ", ".join(f"{k} {v}" for k, v in header.items()), ""]
    lines += [f"- {name}: {s['outcome']} ({s['seconds']} s)" for name, s in summary.items()]
    (folder / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run every step that this machine allows; 0 unless a step failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=f"results folder (default: {shown(GALLERY)})")
    parser.add_argument(
        "--studies-out", type=Path, default=STUDIES, help=f"the peers' study (default: {shown(STUDIES)})"
    )
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help=f"seconds for all steps (default: {BUDGET_S})"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # this checkout's ema_lab, also when run as a plain script
    reason = no_cuda_reason()
    if reason:
        skipped = "CUDA bench, kernel counts, CUDA tests, peers, notebook CUDA cells"
        print(f"gpu-check skipped ({skipped}): {reason}")
        return 0
    clock = Clock(args.budget_s)
    folder = machine_folder(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[gpu-check] writing to {folder}", flush=True)
    py = sys.executable
    cmd = [py, "-m", "ema_lab", "bench", "--device", "cuda", "--no-progress", "--out", f"{folder}"]

    def upto(seconds: float) -> float:
        return min(seconds, clock.left() - RESERVE_S)

    # The CUDA tests are named test_cuda_* or carry the id cuda_graph (the staleness tests); a bare "cuda"
    # would also pick notebook 04's file checks.
    tests = [py, "-m", "pytest", "tests", "-k", "test_cuda_ or cuda_graph", "-rs"]
    tests += ["--junitxml", f"{folder}/cuda-tests.xml"]
    summary: dict[str, dict] = {}
    step(summary, "bench quick", lambda: bench([*cmd, "--quick"], folder / "bench-quick.log", upto(150)))
    step(summary, "kernel launches", lambda: kernel_launches(folder))
    step(summary, "CUDA tests", lambda: run_command(tests, folder / "cuda-tests.log", upto(120)))
    step(summary, "peers", lambda: peers(folder, args.studies_out, upto(PEERS_S)))
    step(
        summary, "bench full", lambda: bench(cmd, folder / "bench-full.log", upto(clock.left() - NOTEBOOKS_S))
    )
    step(summary, "notebooks", lambda: notebooks(folder, clock))
    write_summary(folder, summary)
    failed = [n for n, s in summary.items() if not s["outcome"].startswith(("ok", "skipped"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
