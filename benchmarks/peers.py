"""ema_lab's EMA update against the peers' (not project dependencies), run from a throwaway environment.

    python3 -m venv /tmp/peers && /tmp/peers/bin/pip install torch==2.14.1 torchvision==0.29.1
    /tmp/peers/bin/pip install ultralytics==8.4.190 timm ema-pytorch
    PYTHONPATH=. /tmp/peers/bin/python benchmarks/peers.py --threads 1 2 [--models ...] [--device cuda]

It writes ``peers-<date>[-cuda][<suffix>].json`` and ``.md`` into ``docs/results/`` (the studies,
``result_homes.STUDIES``; ``--out`` elsewhere).

``--baseline FOLDER`` adds another version's default ``ModelEMA`` as a candidate, to compare a change
with main side by side in one process: FOLDER is that version's core package under its own import name,
for example main before the core redesign::

    mkdir -p /tmp/ema_lab_main/ema_lab_main
    base=48ef05b  # main before the core redesign
    for f in $(git ls-tree --name-only $base ema_lab/ | grep 'py$'); do
        git show $base:$f > /tmp/ema_lab_main/ema_lab_main/$(basename $f); done
    PYTHONPATH=. /tmp/peers/bin/python benchmarks/peers.py --baseline /tmp/ema_lab_main/ema_lab_main

Never install these into the project's venv: ultralytics brings ultralytics-thop, which clashes with
the pinned thop. Models: ``yolo26n`` (ultralytics' ``DetectionModel("yolo26n.yaml")``, no download;
skipped where ultralytics is not installed), ``yolo_like`` (99 Conv+BN+SiLU blocks of 32 channels,
alternating 3x3 and 1x1: 495 float tensors, 0.52M elements) and the zoo's ``yolo``, ``resnet50``,
``gpt2``, ``tiny_tensors``, ``tiny_cnn``, ``tiny_transformer``. Candidates: the floor (one ``lerp_`` over
two flat buffers, as
torch allocates them, and on CPU again as ``ema_lab.flatten_tensors`` allocates ema_lab's own, 2 MiB
pages), ``ModelEMA(model)`` (the default), ``flat_model`` (the default after ``ema_lab.flatten_model``),
on CUDA both again with ``cuda_graph=True``, ultralytics' live ``ModelEMA``, timm's ModelEmaV3, torch's
AveragedModel and ema-pytorch. timm's ModelEmaV3 is loaded from its own source file
(``timm/utils/model_ema.py`` imports only torch), so a missing torchvision cannot skip it. Each
candidate gets its own copy of the model, on ``--device``.

Timing, all candidates in one process, interleaved (each round visits every candidate: in a new order on
CPU, rotating on CUDA), at each ``--threads`` count in turn (intra-op threads: a flat ``lerp_``
parallelises, a foreach over tensors under the grain size does not):

- ``--device cpu``: medians of ``--rounds`` measurements of :func:`ema_lab.bench.timing.time_candidates`
  (each measurement sized to about ``--target-s``).
- ``--device cuda``: :func:`time_synced`: the wall time of 10 back-to-back updates between two
  ``torch.cuda.synchronize()`` calls, divided by 10, once per candidate per round; the median of
  ``--rounds`` rounds, after at least 2 s of warm-up calls (an idle GPU clocks down). The kernels of one
  steady update are counted per candidate with ``torch.profiler``
  (:func:`ema_lab.bench.counting.kernel_launches_or_reason`; memcpy and memset count too), with the host
  calls that launched them (:func:`ema_lab.bench.counting.count_host_launches`: a CUDA graph's replay is
  one), and the device memory each ema_lab EMA adds (:func:`extra_memory`).

The Markdown file ends with a line per model and thread count, met or not: on CPU the issue 12 targets
(the default no slower than the fastest peer, >= 1.2x ultralytics on the launch-bound models yolo26n,
yolo_like and tiny_tensors, ``flat_model`` within 1.5x of the floor); on CUDA the issue 29 targets (the
default >= 2x faster than ultralytics on yolo26n, yolo_like and tiny_tensors, no more than 1.05x slower on
resnet50 and gpt2, ``flat_model`` within 3x of the floor on every model), then the same for
``cuda_graph=True``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata as md
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from copy import deepcopy
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

import torch
from result_homes import STUDIES, shown
from torch import nn

from ema_lab import ModelEMA, flatten_model, flatten_tensors
from ema_lab.bench import models
from ema_lab.bench.counting import count_host_launches, kernel_launches_or_reason
from ema_lab.bench.environment import environment
from ema_lab.bench.timing import quantiles, time_candidates

DECAY = 0.9999
MODELS = ("yolo26n", "yolo_like", "yolo", "resnet50", "gpt2", "tiny_tensors", "tiny_cnn", "tiny_transformer")
DEVICES = ("cpu", "cuda")
LAUNCH_BOUND = ("yolo26n", "yolo_like", "tiny_tensors")
BANDWIDTH_BOUND = ("resnet50", "gpt2")  # issue 29: on CUDA no slower than ultralytics (NO_SLOWER)
FLOOR = "floor (one lerp_)"
FLOOR_HUGE = "floor in huge pages (one lerp_)"
DEFAULT = "ema_lab ModelEMA() default"
FLAT_MODEL = "ema_lab flat_model"
GRAPH = "ema_lab ModelEMA(cuda_graph=True)"  # CUDA only
FLAT_GRAPH = "ema_lab flat_model, cuda_graph=True"
BASELINE = "ema_lab baseline ModelEMA() default"  # --baseline: another version's default
OURS = (FLOOR, FLOOR_HUGE, DEFAULT, FLAT_MODEL, GRAPH, FLAT_GRAPH, "ema_lab gated", BASELINE)
NOISE = 1.05  # the default counts as slower than the baseline only beyond this ratio of medians
# On an accelerator: updates per measurement, and the warm-up before the first (the H200 idles at 345 MHz).
CALLS = 10
WARMUP_S = 2.0
# Issue 29's targets on CUDA, against ultralytics' ModelEMA: ultralytics' time / the default's on the
# launch-bound models, the default's / ultralytics' on the others, and flat_model's time / the floor's.
FASTER = 2.0
NO_SLOWER = 1.05
FLAT_CUDA = 3.0


def yolo_like(blocks: int = 99, c: int = 32) -> nn.Module:
    """99 Conv+BN+SiLU blocks of 32 channels, 3x3 and 1x1 alternating: 495 float tensors, 0.52M elements."""
    layers = []
    for i in range(blocks):
        k = 3 if i % 2 == 0 else 1
        layers += [nn.Conv2d(c, c, k, padding=k // 2, bias=False), nn.BatchNorm2d(c), nn.SiLU()]
    return nn.Sequential(*layers)


def build(name: str) -> nn.Module:
    """A benchmark model by name: the real yolo26n (needs ultralytics), yolo_like, or a zoo model."""
    if name == "yolo26n":
        from ultralytics.nn.tasks import DetectionModel

        return DetectionModel("yolo26n.yaml", verbose=False)
    if name == "yolo_like":
        return yolo_like()
    return models.build(name)


def float_elements(model: nn.Module) -> int:
    """Float elements of the distinct float state_dict tensors (what one EMA update averages)."""
    seen = {v.data_ptr(): v.numel() for v in model.state_dict().values() if v.is_floating_point()}
    return sum(seen.values())


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


def load_package(path: Path) -> ModuleType:
    """Import the package folder ``path`` under its folder name (its relative imports intact)."""
    spec = importlib.util.spec_from_file_location(path.name, path / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.name] = module
    spec.loader.exec_module(module)
    return module


def no_device_reason(device: str) -> str | None:
    """Why ``device`` cannot be benchmarked here, or None."""
    if device == "cuda" and not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


def peer_candidates(
    name: str, baseline: ModuleType | None = None, device: str = "cpu"
) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """Zero-argument update functions per candidate (each on its own model copy on ``device``), and skip
    reasons."""
    fns: dict[str, Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    try:
        base = build(name).to(device)
    except Exception as exc:  # noqa: BLE001 - yolo26n without ultralytics: reported, not fatal
        return fns, {name: f"skipped: {type(exc).__name__}: {exc}"}
    n = float_elements(base)
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    fns[FLOOR] = lambda: a.lerp_(b, 1 - DECAY)
    if device == "cpu":
        # The same two buffers where ema_lab allocates its own: 2 MiB pages where the kernel grants them.
        (ah,), (bh,) = flatten_tensors([a.clone()]), flatten_tensors([b.clone()])
        fns[FLOOR_HUGE] = lambda: ah.lerp_(bh, 1 - DECAY)

    def ours(flat_model: bool = False, **kwargs: object) -> Callable[[], object]:
        model = deepcopy(base)
        if flat_model:
            flatten_model(model)
        ema = ModelEMA(model, **kwargs)
        ema.updates = 10_000
        return lambda: ema.update(model)

    fns[DEFAULT] = ours()
    fns[FLAT_MODEL] = ours(flat_model=True)
    fns["ema_lab gated"] = ours(strategy="gated")
    if device == "cuda":
        fns[GRAPH] = ours(cuda_graph=True)
        fns[FLAT_GRAPH] = ours(flat_model=True, cuda_graph=True)
    if baseline is not None:
        m_b = deepcopy(base)
        old = baseline.ModelEMA(m_b)
        old.updates = 10_000
        fns[BASELINE] = lambda: old.update(m_b)

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


def synchronize(device: str) -> None:
    """Wait for the work queued on ``device``; nothing to wait for on CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def time_synced(
    candidates: dict[str, Callable[[], object]],
    device: str,
    *,
    rounds: int,
    calls: int = CALLS,
    warmup_s: float = WARMUP_S,
    threads: int = 1,
) -> dict[str, list[float]]:
    """Seconds per call of each candidate, one value per round: the wall time of ``calls`` back-to-back
    calls between two ``synchronize(device)`` calls, divided by ``calls``.

    The rounds visit every candidate, the order rotating; before them, every candidate is called in turn
    until ``warmup_s`` have passed (at least once), at ``threads`` intra-op threads like the measurement.
    On CPU the synchronisations are no-ops.
    """
    if not candidates:
        raise ValueError("time_synced needs at least one candidate")
    if rounds < 1 or calls < 1 or threads < 1:
        raise ValueError(f"rounds, calls and threads must be >= 1, got {rounds}, {calls}, {threads}")
    names = list(candidates)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        end = time.perf_counter() + warmup_s
        while True:
            for fn in candidates.values():
                for _ in range(calls):
                    fn()
            synchronize(device)
            if time.perf_counter() >= end:
                break
        times: dict[str, list[float]] = {k: [] for k in names}
        for r in range(rounds):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                fn = candidates[k]
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                synchronize(device)
                times[k].append((time.perf_counter() - t0) / calls)
    finally:
        torch.set_num_threads(previous)
    return times


def kernels_per_update(
    candidates: dict[str, Callable[[], object]], device: str
) -> tuple[dict[str, int | str], dict[str, int]]:
    """One call of each candidate: its CUDA kernels (memcpy and memset included), or why they cannot be
    counted ("not available: ..."); and where they can, the host calls that launched them (a CUDA
    graph's replay is one call for all its kernels)."""
    kernels: dict[str, int | str] = {}
    host: dict[str, int] = {}
    for k, fn in candidates.items():
        counts = kernel_launches_or_reason(fn, device=device)
        if isinstance(counts, str):  # why they cannot be counted
            kernels[k] = counts
            continue
        kernels[k] = sum(counts.values())
        host[k] = count_host_launches(fn, device=device)
    return kernels, host


def run(
    names: tuple[str, ...],
    rounds: int,
    target_s: float,
    threads: tuple[int, ...] = (1,),
    builds: int = 1,
    baseline: ModuleType | None = None,
    device: str = "cpu",
) -> dict:
    """Time every candidate on every model at each thread count; return a JSON-able record.

    ``builds`` > 1 makes every candidate (model copy and EMA) afresh that many times and pools the rounds
    of all builds: where each buffer lands in physical memory moves a bandwidth-bound update by up to
    ~10 % on this machine, and a single build would carry one draw of that into the comparison.
    """
    torch.set_grad_enabled(True)
    rows = []
    per_build: list[dict] = []  # per (model, threads, build): ultralytics' median over the default's
    skipped: dict[str, str] = {}
    memory: dict[str, dict[str, int]] = {}  # on CUDA: extra_memory per model
    for name in names:
        pooled: dict[int, dict[str, list[float]]] = {n: {} for n in threads}
        kernels: dict[str, int | str] = {}
        host: dict[str, int] = {}
        for build_index in range(builds):
            fns, skip = peer_candidates(name, baseline, device)
            skipped.update(skip)
            if not fns:
                break
            for n_threads in threads:
                if device == "cpu":
                    timed = time_candidates(fns, "cpu", rounds=rounds, target_s=target_s, threads=n_threads)
                    times = {k: list(t.times_s) for k, t in timed.items()}
                else:
                    times = time_synced(fns, device, rounds=rounds, threads=n_threads)
                for k, v in times.items():
                    pooled[n_threads].setdefault(k, []).extend(v)
                medians = {k: quantiles(v)[1] for k, v in times.items()}
                ultra = next((m for k, m in medians.items() if k.startswith("ultralytics")), None)
                if ultra is not None:
                    ratio = ultra / medians[DEFAULT]
                    per_build.append({"model": name, "threads": n_threads, "ultralytics_over_default": ratio})
            if device != "cpu" and build_index == 0:
                kernels, host = kernels_per_update(fns, device)
            del fns
            gc.collect()
        if not pooled[threads[0]]:
            print(skipped.get(name), flush=True)
            continue
        if device == "cuda":
            memory[name] = extra_memory(name, device)
        for n_threads in threads:
            stats = {k: quantiles(v) for k, v in pooled[n_threads].items()}
            floor = stats[FLOOR][1]
            ultra = next((q[1] for k, q in stats.items() if k.startswith("ultralytics")), None)
            for k, (q1, med, q3) in stats.items():
                rows.append(
                    {
                        "model": name,
                        "device": device,
                        "candidate": k,
                        "median_ms": 1e3 * med,
                        "q1_ms": 1e3 * q1,
                        "q3_ms": 1e3 * q3,
                        "x_floor": med / floor,
                        "ultralytics_over_this": None if ultra is None else ultra / med,
                        "kernels": kernels.get(k),
                        "host_launches": host.get(k),
                        "threads": n_threads,
                        "rounds": len(pooled[n_threads][k]),
                        "builds": builds,
                    }
                )
            print(
                format_table([r for r in rows if r["model"] == name and r["threads"] == n_threads]),
                flush=True,
            )
    env = environment(device)
    env["threads"] = list(threads)
    env["peers"] = {d: _version(d) for d in ("ultralytics", "timm", "ema-pytorch", "torch")}
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/peers.py", *sys.argv[1:]]),
        "device": device,
        "timing": timing_method(device, rounds, target_s),
        "environment": env,
        "skipped": skipped,
        "rows": rows,
        "per_build": per_build,
        "memory": memory,
    }


def timing_method(device: str, rounds: int, target_s: float) -> str:
    """One sentence saying how the figures were measured."""
    if device == "cpu":
        return (
            f"median of {rounds} interleaved rounds per build, each measurement about {target_s} s of calls "
            "(ema_lab.bench.timing.time_candidates), all candidates in one process"
        )
    return (
        f"wall time of {CALLS} back-to-back updates between two torch.{device}.synchronize() calls, "
        f"/ {CALLS}, median of {rounds} interleaved rounds per build after {WARMUP_S:g} s of warm-up, all "
        "candidates in one process; kernels: torch.profiler, one steady update"
    )


def _ultralytics(got: dict[str, float]) -> float | None:
    return next((v for k, v in got.items() if k.startswith("ultralytics")), None)


def targets(rows: list[dict]) -> list[str]:
    """The issue 12 targets (CPU) per (model, threads), each line saying met or NOT met, with the figures."""
    lines = []
    keys = sorted({(r["model"], r["threads"]) for r in rows}, key=lambda k: (k[1], MODELS.index(k[0])))
    for model, threads in keys:
        got = {
            r["candidate"]: r["median_ms"] for r in rows if r["model"] == model and r["threads"] == threads
        }
        peers = {k: v for k, v in got.items() if k not in OURS}
        default, flat = got[DEFAULT], got[FLAT_MODEL]
        best = min(peers, key=peers.get) if peers else None
        checks = []
        if best is not None:
            checks.append(
                (
                    "default <= fastest peer",
                    default <= peers[best],
                    f"{default:.3f} vs {best} {peers[best]:.3f}",
                )
            )
        ultra = _ultralytics(peers)
        if ultra is not None and model in LAUNCH_BOUND:
            checks.append(("default >= 1.2x ultralytics", ultra / default >= 1.2, f"{ultra / default:.2f}x"))
        checks.append(("flat_model <= 1.5x floor", flat / got[FLOOR] <= 1.5, f"{flat / got[FLOOR]:.2f}x"))
        if FLOOR_HUGE in got:
            ratio = flat / got[FLOOR_HUGE]
            checks.append(("flat_model <= 1.5x huge-page floor", ratio <= 1.5, f"{ratio:.2f}x"))
        if BASELINE in got:
            ratio = default / got[BASELINE]
            checks.append(
                (f"default <= {NOISE}x baseline", ratio <= NOISE, f"{ratio:.3f}x the baseline's time")
            )
        for what, ok, figure in checks:
            lines.append(f"- {model}, {threads} thread(s): {what}: {'met' if ok else 'NOT met'} ({figure})")
    return lines


def targets_cuda(rows: list[dict]) -> list[str]:
    """The issue 29 targets per (model, threads) on CUDA: for the default, then for ``cuda_graph=True`` where
    it ran, one line against ultralytics and one for its flattened model against the floor, each saying met
    or NOT met with the figures."""
    lines = []
    keys = sorted({(r["model"], r["threads"]) for r in rows}, key=lambda k: (k[1], MODELS.index(k[0])))
    for model, threads in keys:
        got = {
            r["candidate"]: r["median_ms"] for r in rows if r["model"] == model and r["threads"] == threads
        }
        ultra = _ultralytics(got)
        at = f"- {model}, {threads} thread(s): "
        for ours, flat, label, who, flat_label in (
            (DEFAULT, FLAT_MODEL, "default", "the default", "flat_model"),
            (GRAPH, FLAT_GRAPH, "cuda_graph", "cuda_graph", "flat_model+cuda_graph"),
        ):
            if ours not in got:
                continue
            if ultra is None:
                lines.append(at + f"{label} vs ultralytics: not measured (ultralytics not installed)")
            else:
                mine = got[ours]
                versus = f"{label} {mine:.3f} ms, ultralytics {ultra:.3f} ms: {who} "
                versus += f"{ultra / mine:.2f}x faster" if mine <= ultra else f"{mine / ultra:.2f}x slower"
                if model in LAUNCH_BOUND:
                    ok = ultra / mine >= FASTER
                    lines.append(at + f"{versus}; target >= {FASTER:g}x faster: {'met' if ok else 'NOT met'}")
                elif model in BANDWIDTH_BOUND:
                    ok = mine / ultra <= NO_SLOWER
                    lines.append(
                        at + f"{versus}; target <= {NO_SLOWER}x slower: {'met' if ok else 'NOT met'}"
                    )
                else:
                    lines.append(at + f"{versus}; no issue 29 target for this model")
            ratio = got[flat] / got[FLOOR]
            ok = ratio <= FLAT_CUDA
            lines.append(
                at + f"{flat_label} {got[flat]:.3f} ms, floor {got[FLOOR]:.3f} ms: {ratio:.2f}x the floor; "
                f"target <= {FLAT_CUDA:g}x: {'met' if ok else 'NOT met'}"
            )
    return lines


def extra_memory(name: str, device: str) -> dict[str, int]:
    """Device bytes each ema_lab EMA adds over its model alone: at its peak (``max_memory_allocated`` from
    just before the EMA is made through 3 updates) and held after them (``memory_allocated``; the peak
    includes the moment the EMA's tensors are copied into their flat buffers), and the model's float bytes."""
    out: dict[str, int] = {}
    for label, kwargs in ((DEFAULT, {}), (GRAPH, {"cuda_graph": True})):
        model = build(name).to(device)
        out["model float bytes"] = 4 * float_elements(model)
        gc.collect()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        ema = ModelEMA(model, **kwargs)
        for _ in range(3):
            ema.update(model)
        torch.cuda.synchronize(device)
        out[label] = torch.cuda.max_memory_allocated(device) - before
        out[f"{label}, held"] = torch.cuda.memory_allocated(device) - before
        del ema, model
    return out


def format_memory(memory: dict[str, dict[str, int]]) -> str:
    """The extra device memory of each EMA per model, in MiB and as a multiple of the model's floats."""
    lines = ["## Extra device memory over the model alone (3 updates): peak, then held after them", ""]
    for name, got in memory.items():
        model = got["model float bytes"]
        for label in (DEFAULT, GRAPH):
            peak, held = got[label], got[f"{label}, held"]
            lines.append(
                f"- {name}: {label}: peak {peak / 2**20:.1f} MiB ({peak / model:.2f}x the model), "
                f"held {held / 2**20:.1f} MiB ({held / model:.2f}x)"
            )
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """A Markdown table: model, candidate, median ms (IQR), times the floor, kernels and host launches
    per update."""
    lines = [
        "| model | threads | candidate | median ms (q1-q3) | x floor | ultralytics / this | kernels "
        "| host launches |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        u, k, h = r.get("ultralytics_over_this"), r.get("kernels"), r.get("host_launches")
        lines.append(
            f"| {r['model']} | {r['threads']} | {r['candidate']} | {r['median_ms']:.3f} "
            f"({r['q1_ms']:.3f}-{r['q3_ms']:.3f}) | {r['x_floor']:.2f} | {'-' if u is None else f'{u:.2f}'} "
            f"| {'-' if k is None else k} | {'-' if h is None else h} |"
        )
    return "\n".join(lines)


def format_per_build(per_build: list[dict]) -> str:
    """One line per (model, threads): ultralytics' median over the default's in each build, in order."""
    lines = ["## ultralytics / default in each build (how much one build's memory layout moves it)", ""]
    keys = list(dict.fromkeys((r["model"], r["threads"]) for r in per_build))
    for model, threads in keys:
        ratios = [
            r["ultralytics_over_default"] for r in per_build if (r["model"], r["threads"]) == (model, threads)
        ]
        lines.append(f"- {model}, {threads} thread(s): " + ", ".join(f"{x:.2f}x" for x in ratios))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--device cuda`` without a CUDA device is a usage error (exit 2)."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", default="cpu", choices=list(DEVICES))
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--rounds", type=int, default=31, help="rounds per build")
    parser.add_argument("--builds", type=int, default=1, help="fresh copies of the candidates, rounds pooled")
    parser.add_argument("--note", default="", help="a line for the Markdown header (e.g. the machine's load)")
    parser.add_argument("--target-s", type=float, default=0.02, help="CPU: seconds of calls per measurement")
    parser.add_argument(
        "--out", type=Path, default=STUDIES, metavar="FOLDER", help=f"folder (default: {shown(STUDIES)})"
    )
    parser.add_argument("--suffix", default="", help="appended to the file stem, keeps older runs")
    parser.add_argument("--baseline", type=Path, help="folder of another version's core package (see above)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.builds < 1 or min(args.threads) < 1:
        parser.error("--rounds, --builds and --threads must be >= 1")
    reason = no_device_reason(args.device)
    if reason:
        parser.error(f"--device {args.device}: {reason}")
    return args


def result_stem(out: Path, created: str, device: str, suffix: str = "") -> Path:
    """``<out>/peers-<date>[-<device>]<suffix>``: a CPU run keeps the name it always had."""
    return out / f"peers-{created[:10]}{'' if device == 'cpu' else '-' + device}{suffix}"


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, write docs/results/peers-<date>[-cuda].json and .md."""
    args = parse_args(argv)
    baseline = load_package(args.baseline.resolve()) if args.baseline else None
    record = run(
        tuple(args.models),
        args.rounds,
        args.target_s,
        tuple(args.threads),
        args.builds,
        baseline,
        args.device,
    )
    record["note"] = args.note
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(out, record["created"], args.device, args.suffix)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    env = record["environment"]
    where = f"{env['cpu']} ({env['cpu_count']} cores)"
    if args.device != "cpu":
        where = f"{env['device_name']} (CUDA {env.get('cuda')}), host {where}"
    header = (
        f"# EMA update vs peers\n\n`PYTHONPATH=. python {record['command']}`\n\n"
        f"{where}, intra-op threads {env['threads']}, torch "
        f"{env['torch']}, peers {env['peers']}, {record['created']}, {args.rounds} rounds x {args.builds} "
        f"build(s), rounds pooled\n\nTiming: {record['timing']}\n\n"
        f"{args.note + chr(10) + chr(10) if args.note else ''}Skipped: {record['skipped'] or 'none'}\n\n"
    )
    if args.device == "cpu":
        checks = "## Issue 12 targets (CPU)\n\n" + "\n".join(targets(record["rows"]))
    else:
        checks = f"## Issue 29 targets ({args.device})\n\n" + "\n".join(targets_cuda(record["rows"]))
    body = format_table(record["rows"]) + "\n\n" + checks
    if record["memory"]:
        body += "\n\n" + format_memory(record["memory"])
    if args.builds > 1:
        body += "\n\n" + format_per_build(record["per_build"])
    stem.with_suffix(".md").write_text(header + body + "\n")
    print(checks, flush=True)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
