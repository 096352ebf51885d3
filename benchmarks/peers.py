"""ema_lab's EMA update against the peers' (not project dependencies), run from a throwaway environment.

    python -m venv /tmp/peers && /tmp/peers/bin/pip install torch==2.13.0
    /tmp/peers/bin/pip install --no-deps timm ema-pytorch ultralytics opencv-python-headless
    /tmp/peers/bin/pip install numpy pyyaml huggingface_hub safetensors psutil pillow requests tqdm
    PYTHONPATH=/work/main /tmp/peers/bin/python benchmarks/peers.py [--models yolo ...] [--out results]

timm's ModelEmaV3 is loaded from its own source file (``timm/utils/model_ema.py`` imports only
torch), because ``import timm`` needs torchvision and no CPU torchvision build for torch 2.13 is on
PyPI. Everything is timed in one process, interleaved, at one intra-op thread, medians of rounds,
with :func:`ema_lab.bench.timing.time_candidates`. Each candidate gets its own copy of the model.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import sys
from collections.abc import Callable
from copy import deepcopy
from datetime import datetime, timezone
from pathlib import Path

import torch

from ema_lab import ModelEMA
from ema_lab.bench.environment import environment
from ema_lab.bench.timing import time_candidates
from ema_lab.lessons import models

DECAY = 0.9999
MODELS = ("yolo", "resnet50", "gpt2", "tiny_tensors")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _timm_model_ema_v3() -> type | None:
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "model_ema.py"
    mod_spec = importlib.util.spec_from_file_location("timm_model_ema", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.ModelEmaV3


def peer_candidates(name: str) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """Zero-argument update functions per candidate (each on its own model copy), and skip reasons."""
    fns: dict[str, Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    base = models.build(name)
    n = models.describe(base).float_elements
    a, b = torch.randn(n), torch.randn(n)
    fns["floor (one lerp_)"] = lambda: a.lerp_(b, 1 - DECAY)

    def ours(strategy: str) -> Callable[[], object]:
        model = deepcopy(base)
        ema = ModelEMA(model) if strategy == "default" else ModelEMA(model, strategy=strategy)
        ema.updates = 10_000
        return lambda: ema.update(model)

    fns["ema_lab ModelEMA() default"] = ours("default")
    fns["ema_lab flat_model"] = ours("flat_model")
    fns["ema_lab gated"] = ours("gated")

    try:
        from ultralytics.utils.torch_utils import ModelEMA as UltralyticsEMA

        m_u = deepcopy(base)
        u = UltralyticsEMA(m_u)
        u.updates = 10_000
        fns[f"ultralytics {_version('ultralytics')} ModelEMA"] = lambda: u.update(m_u)
    except ImportError as exc:
        skipped["ultralytics"] = f"skipped: {exc}"

    v3 = _timm_model_ema_v3()
    if v3 is None:
        skipped["timm"] = "skipped: timm not installed"
    else:
        m_t = deepcopy(base)
        t = v3(m_t, decay=DECAY, foreach=True)
        fns[f"timm {_version('timm')} ModelEmaV3"] = lambda: t.update(m_t)

    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    m_a = deepcopy(base)
    avg = AveragedModel(m_a, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    avg.update_parameters(m_a)  # the first call copies; the timed calls average
    fns["torch AveragedModel + get_ema_multi_avg_fn"] = lambda: avg.update_parameters(m_a)

    try:
        from ema_pytorch import EMA

        m_e = deepcopy(base)
        e = EMA(m_e, beta=DECAY, update_after_step=0, update_every=1, use_foreach=True)
        e.update()  # initialises the EMA copy
        fns[f"ema-pytorch {_version('ema-pytorch')} (use_foreach)"] = e.update
    except ImportError as exc:
        skipped["ema-pytorch"] = f"skipped: {exc}"
    return fns, skipped


def run(names: tuple[str, ...], rounds: int, target_s: float) -> dict:
    """Time every candidate on every model; return a JSON-able record."""
    torch.set_grad_enabled(True)
    rows = []
    skipped: dict[str, str] = {}
    for name in names:
        fns, skip = peer_candidates(name)
        skipped.update(skip)
        timed = time_candidates(fns, "cpu", rounds=rounds, target_s=target_s, threads=1)
        floor = timed["floor (one lerp_)"].median_s
        for k, t in timed.items():
            rows.append(
                {
                    "model": name,
                    "candidate": k,
                    "median_ms": 1e3 * t.median_s,
                    "q1_ms": 1e3 * t.q1_s,
                    "q3_ms": 1e3 * t.q3_s,
                    "x_floor": t.median_s / floor,
                    "threads": t.threads,
                    "rounds": t.rounds,
                }
            )
        print(format_table([r for r in rows if r["model"] == name]), flush=True)
    env = environment("cpu")
    env["threads"] = 1
    env["peers"] = {d: _version(d) for d in ("ultralytics", "timm", "ema-pytorch", "torch")}
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": env,
        "skipped": skipped,
        "rows": rows,
    }


def format_table(rows: list[dict]) -> str:
    """A Markdown table: model, candidate, median ms (IQR), times the floor."""
    lines = ["| model | candidate | median ms (q1-q3) | x floor |", "|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['candidate']} | {r['median_ms']:.3f} ({r['q1_ms']:.3f}-{r['q3_ms']:.3f}) "
            f"| {r['x_floor']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, write results/peers-<date>.json and .md."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(models.ZOO))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--target-s", type=float, default=0.02)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results"))
    args = parser.parse_args(argv)
    record = run(tuple(args.models), args.rounds, args.target_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"peers-{record['created'][:10]}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    env = record["environment"]
    header = (
        f"# EMA update vs peers\n\n{env['cpu']} ({env['cpu_count']} cores), 1 intra-op thread, torch "
        f"{env['torch']}, peers {env['peers']}, {record['created']}\n\n"
        f"Skipped: {record['skipped'] or 'none'}\n\n"
    )
    stem.with_suffix(".md").write_text(header + format_table(record["rows"]) + "\n")
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
