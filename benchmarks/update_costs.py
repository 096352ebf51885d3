"""Where the default ``ModelEMA.update()`` spends its time, part by part, as a training loop sees it.

    PYTHONPATH=. /tmp/peers/bin/python benchmarks/update_costs.py [--model yolo26n] [--out results]

Run it from the throwaway peers venv for the real yolo26n (see ``benchmarks/peers.py``); ``yolo_like``
and the zoo models run in the project venv too. Before every timed call one full EMA step streams the
whole EMA and model through the caches, as the forward/backward pass of a training step would, so each
part is timed with the cache state it meets in training (the module objects and dicts the validity check
reads are no longer in L1/L2). One thread unless ``--threads`` says otherwise; the candidates alternate
call by call, medians of ``--rounds``.

Parts: the validity check (read every model slot that is not a flat view, ``data_ptr()`` of those not read
live unchecked), the prepared step given what the slots hold, and inside it the cat part's gather and
``lerp_`` and the foreach part, the integer-counter copy, the whole ``update()``; references: one
``lerp_`` over two flat buffers (the floor) and one ``torch._foreach_lerp_`` over all pairs (what
ultralytics 8.4.190's cached update runs). Alternatives that were considered are
measured here so the choices stay checkable: the check followed by the step reading every tensor through
the detached aliases it was built from (the cat parts' 1-D tensors included); the check plus the shape and
dtype of every float tensor read whole (what reading the foreach parts from the module slots would need,
so that ``p.data = p.view(new_shape)`` could not stop a foreach halfway; the step reads them through
aliases shaped like the EMA instead); and the cat/foreach split (``CAT_MAX_NUMEL``) over a few values.
The "bound" rows are what any check must spend that reads each watched model slot once per update (a
direct ``module._parameters[k] = t`` is seen by nothing else), and that plus the step and the counter copy
without any ``data_ptr()``: unsafe, timed only as the floor of every design that keeps these guarantees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from copy import deepcopy
from datetime import datetime, timezone
from operator import getitem
from pathlib import Path

import torch

import ema_lab.flat as flat
from ema_lab import ModelEMA
from ema_lab.bench.environment import environment
from ema_lab.flat import picker
from ema_lab.pairs import shape_and_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import build  # noqa: E402 - the benchmark models live in the sibling script

DECAY = 0.9999


def _ema(model: torch.nn.Module) -> ModelEMA:
    ema = ModelEMA(model)
    ema.updates = 10_000
    ema.update(model)
    return ema


def candidates(name: str, splits: tuple[int, ...]) -> tuple[dict[str, Callable[[], object]], dict]:
    """Zero-argument functions per part/alternative, and facts about the model's plan."""
    base = build(name)
    flush = _ema(deepcopy(base)).prepared_step
    # Every EMA made registers new tensors, which invalidates every cache (a rebuild on its next update):
    # make all of them before the one whose parts are timed, and take its parts after its last rebuild.
    splits_fns: dict[str, Callable[[], object]] = {}
    saved = flat.CAT_MAX_NUMEL
    try:
        for split in splits:
            flat.CAT_MAX_NUMEL = split
            m = deepcopy(base)
            e = _ema(m)
            plan = e.plan[0]
            label = f"split {split}: step ({plan.cat} cat, {plan.foreach} foreach)"
            splits_fns[label] = lambda s=e._state.step: s(DECAY)
    finally:
        flat.CAT_MAX_NUMEL = saved
    model = deepcopy(base)
    ema = _ema(model)
    state = ema._state
    step, copy_counters = state.step, state.copy_other
    floats = [v for v in deepcopy(base).state_dict().values() if v.is_floating_point()]
    model_floats = [v for v in model.state_dict().values() if v.is_floating_point()]
    n = sum(v.numel() for v in floats)
    a, b = (flat.empty_flat(n, torch.float32).normal_() for _ in range(2))  # as ema_lab's own buffers
    # The float tensors the step reads whole (foreach parts, N-D cat tensors): what a per-update shape and
    # dtype check would cover (considered; the step reads them through aliases of the EMA's shapes instead).
    float_pos = [i for i, fused in enumerate(step.fused_pairs) if not fused]
    whole = picker([k for k, i in enumerate(float_pos) if i not in step.live_pairs])
    live_ext = [*state.live(model), *step.ext]  # what the step's gather reads (slots of this moment)
    cat_runs = [r for g in step.groups for r in g.cat_parts()]
    fns: dict[str, Callable[[], object]] = {
        "floor: one lerp_ over flat buffers": lambda: a.lerp_(b, 1 - DECAY),
        "one _foreach_lerp_ over all pairs": lambda: torch._foreach_lerp_(floats, model_floats, 1 - DECAY),
        "default update()": lambda: ema.update(model),
        "  validity check": lambda: state.live(model),
        "  prepared step, live": lambda: step(DECAY, state.live(model)),
        "  counter copy": copy_counters,
        "  cat part: gather the live tensors (torch.cat)": lambda: [g.gather(live_ext) for g in step.groups],
        "  cat part: lerp_": lambda: [r.ema.lerp_(r.scratch, 1 - DECAY) for r in cat_runs],
        "  foreach part: _foreach_lerp_ over the aliases": lambda: [
            torch._foreach_lerp_(g.ema_views, g.model, 1 - DECAY) for g in step.groups if g.model
        ],
        "alt: check + step through the built aliases": lambda: (state.live(model), step(DECAY)),
        "alt: check + shape and dtype of the float tensors read whole": lambda: list(
            map(shape_and_dtype, whole(state.live(model)))
        ),
        "bound: read the slots (no data_ptr())": lambda: list(map(getitem, *state.watch)),
        "bound: read the slots + step, live + counter copy": lambda: (
            step(DECAY, list(map(getitem, *state.watch))),
            copy_counters(),
        ),
    }
    # The live step's own time is "prepared step, live" minus "validity check" (it needs the slots read).
    info = {
        "plan": [str(g) for g in ema.plan],
        "read_slots": len(state.watch[1]),
        "checked_slots": len(state.check_ptrs),
        "ema": ema,
    }
    fns.update(splits_fns)
    fns["flush"] = lambda: flush(DECAY)
    return fns, info


def time_cold(fns: dict[str, Callable[[], object]], flush: Callable[[], object], rounds: int) -> dict:
    """Median and quartiles (ms) per function, each call preceded by ``flush()``; order alternates."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    with torch.no_grad():
        for k in names:  # warm-up
            fns[k]()
        for r in range(rounds):
            for k in names if r % 2 else names[::-1]:
                flush()
                t0 = time.perf_counter()
                fns[k]()
                times[k].append(time.perf_counter() - t0)
    out = {}
    for k, v in times.items():
        q1, med, q3 = statistics.quantiles(v, n=4)
        out[k] = {"median_ms": 1e3 * med, "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3}
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, time, print a table, write results/update-costs-<date><suffix>.json and .md."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--model", default="yolo26n")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--splits", type=int, nargs="*", default=[256, 1818, 8192, 65536])
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--suffix", default="")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    fns, info = candidates(args.model, tuple(args.splits))
    timed = time_cold(fns, fns.pop("flush"), args.rounds)
    ema = info.pop("ema")
    if ema.rebuilds != 1:  # the timed parts must belong to the live cache, never to a rebuilt-away one
        raise RuntimeError(f"the timed EMA rebuilt {ema.rebuilds - 1} time(s) during timing")
    floor = timed["floor: one lerp_ over flat buffers"]["median_ms"]
    lines = ["| part | median ms (q1-q3) | x floor |", "|---|---|---|"]
    for k, t in timed.items():
        iqr = f"{t['q1_ms']:.3f}-{t['q3_ms']:.3f}"
        lines.append(f"| {k} | {t['median_ms']:.3f} ({iqr}) | {t['median_ms'] / floor:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        env = environment("cpu")
        env["threads"] = torch.get_num_threads()
        record = {
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["benchmarks/update_costs.py", *(sys.argv[1:] if argv is None else argv)]),
            "model": args.model,
            "environment": env,
            "info": info,
            "note": args.note,
            "rows": timed,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"update-costs-{record['created'][:10]}{args.suffix}"
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        header = (
            f"# Where the default ModelEMA.update() spends its time: {args.model}\n\n"
            f"`PYTHONPATH=. python {record['command']}`\n\n{env['cpu']} ({env['cpu_count']} cores), "
            f"{args.threads} intra-op thread(s), torch {env['torch']}, {record['created']}, "
            f"{args.rounds} rounds, "
            "each call after one full EMA step (caches as in training)\n\n"
            f"{args.note + chr(10) + chr(10) if args.note else ''}"
            f"Plan: {info['plan']}; model slots read per step: {info['read_slots']}, of them checked by "
            f"data_ptr(): {info['checked_slots']}\n\n"
        )
        stem.with_suffix(".md").write_text(header + table + "\n")
        print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
