"""EMA under torch.distributed: DDP and FSDP2 demos run as real processes (gloo, 127.0.0.1), checked.

``python -m ema_lab.lessons.distributed --world-size 2`` spawns one process per rank. Each rank trains the
same tiny transformer on its slice of a global batch, twice:

- DDP: ``ModelEMA`` on the ``DistributedDataParallel`` model. Gradients are averaged in backward,
  so every rank steps to the same weights and its full EMA copy stays bit-identical without any
  collective in ``update()``. Because no rank waits for another, keeping it on rank 0 only is safe.
- FSDP2: ``fully_shard`` turns parameters into sharded DTensors; ``ModelEMA`` cannot deep-copy the
  model, and ``ShardedModelEMA`` averages the local shards with one foreach call and no collective.
  The full EMA for a checkpoint is gathered with ``torch.distributed.checkpoint.state_dict``.

The parent process then trains a single-process reference on the whole global batch (same averaged
gradient) and compares. Collectives during ``update()`` are counted with torch's ``CommDebugMode``.
Exit status: 0 when every check passes, 1 on a mismatch, a worker error or the time limit.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from torch import Tensor, nn

from ..bench.counting import count_ops
from ..ema import ModelEMA
from ..sharded import ShardedModelEMA
from .models import build

__all__ = [
    "Config",
    "ddp_model_ema",
    "missing_apis",
    "run",
    "ddp_demo",
    "fsdp_demo",
    "reference",
    "summarise",
    "Report",
    "run_cli",
    "format_report",
    "main",
    "loopback_interface",
]

#: (import path, name) of every torch API the demos need; checked before anything is spawned.
REQUIRED_APIS = (
    ("torch.distributed", "init_process_group"),
    ("torch.distributed.device_mesh", "init_device_mesh"),
    ("torch.distributed.fsdp", "fully_shard"),
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor.debug", "CommDebugMode"),
    ("torch.distributed.checkpoint.state_dict", "get_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "set_model_state_dict"),
)


def missing_apis() -> list[str]:
    """The torch APIs this module needs that the installed torch lacks (empty when all are there)."""
    import importlib

    if not torch.distributed.is_available():
        return ["torch.distributed (this torch build has no distributed support)"]
    out = []
    for mod, name in REQUIRED_APIS:
        try:
            getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            out.append(f"{mod}.{name}")
    return out


@dataclass(frozen=True)
class Config:
    """What the demo trains and how long it may take."""

    world_size: int = 2
    steps: int = 8
    batch_per_rank: int = 4
    seq_len: int = 8
    model: str = "tiny_transformer"
    decay: float = 0.9
    tau: float = 2.0  # short ramp, so a few steps move the EMA far from the initial weights
    lr: float = 0.05
    seed: int = 0
    timeout_s: float = 120.0
    timing_repeats: int = 20
    atol: float = 1e-5  # float32 sums in a different order (all-reduce vs one batch), not a logic slack


def ddp_model_ema(model: nn.Module, rank0_only: bool = False, **kwargs: object) -> ModelEMA | None:
    """A ``ModelEMA`` of a DDP model on every rank, or on rank 0 only (``None`` elsewhere).

    ``update()`` issues no collective, so ranks without an EMA never leave the others waiting.
    """
    import torch.distributed as dist

    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return None
    return ModelEMA(model, **kwargs)


def loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS), if found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in names if n.startswith("lo")), None)


def global_batch(cfg: Config, step: int, vocab: int) -> tuple[Tensor, Tensor]:
    """Tokens and next-token targets for the whole world at ``step``, the same in every process."""
    g = torch.Generator().manual_seed(1000 * cfg.seed + step)
    n = cfg.batch_per_rank * cfg.world_size
    tokens = torch.randint(vocab, (n, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _vocab(model: nn.Module) -> int:
    return model.embed.num_embeddings


def _distinct_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and persistent buffers, shared tensors counted once."""
    seen, total = set(), 0
    for t in module.state_dict(keep_vars=True).values():
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _snapshot(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone().cpu() for k, v in sd.items()}


def _time_updates(ema: ModelEMA | ShardedModelEMA, model: nn.Module, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` extra updates (after the results were taken: they move the EMA)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ema.update(model)
        out.append(time.perf_counter() - t0)
    return out


def ddp_demo(cfg: Config, rank: int) -> dict[str, object]:
    """Train with DDP; return this rank's EMA state, bytes, collectives per update and timings."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build(cfg.model, cfg.seed))
    ema = ddp_model_ema(model, decay=cfg.decay, tau=cfg.tau)
    ema0 = ddp_model_ema(model, rank0_only=True, decay=cfg.decay, tau=cfg.tau)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    part = slice(rank * cfg.batch_per_rank, (rank + 1) * cfg.batch_per_rank)
    comms, ops = [], []
    for step in range(cfg.steps):
        tokens, targets = global_batch(cfg, step, _vocab(model.module))
        opt.zero_grad(set_to_none=True)
        _loss(model, tokens[part], targets[part]).backward()  # DDP all-reduces (averages) gradients here
        opt.step()
        with CommDebugMode() as comm:
            ops.append(dict(count_ops(ema.update, model)))
            if ema0 is not None:
                ema0.update(model)
        comms.append(comm.get_total_counts())
    state = _snapshot(ema.ema.state_dict())
    return {
        "state": state,
        "rank0_only_state": None if ema0 is None else _snapshot(ema0.ema.state_dict()),
        "bytes": _distinct_bytes(ema.ema),
        "rank0_only_bytes": 0 if ema0 is None else _distinct_bytes(ema0.ema),
        "collectives": comms,
        "ops": ops,
        "update_s": _time_updates(ema, model, cfg.timing_repeats),
    }


def shard_model(model: nn.Module, mesh: object) -> nn.Module:
    """FSDP2 recipe: one ``fully_shard`` group per transformer block, then the root (embeddings, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in getattr(getattr(model, "blocks", None), "layers", []):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp_demo(cfg: Config, rank: int) -> dict[str, object]:
    """Train with FSDP2; return this rank's EMA shard bytes, the gathered EMA, collectives and timings."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (cfg.world_size,))
    model = shard_model(build(cfg.model, cfg.seed), mesh)
    try:
        ModelEMA(model)
        deepcopy_error = None
    except Exception as e:  # noqa: BLE001 (the message is the result shown)
        deepcopy_error = f"{type(e).__name__}: {e}"
    ema = ShardedModelEMA(model, decay=cfg.decay, tau=cfg.tau)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    part = slice(rank * cfg.batch_per_rank, (rank + 1) * cfg.batch_per_rank)
    comms, ops = [], []
    for step in range(cfg.steps):
        tokens, targets = global_batch(cfg, step, _vocab(model))
        opt.zero_grad(set_to_none=True)
        _loss(model, tokens[part], targets[part]).backward()  # FSDP reduce-scatters (averages) gradients
        opt.step()
        with CommDebugMode() as comm:
            ops.append(dict(count_ops(ema.update, model)))
        comms.append(comm.get_total_counts())
    full = ema.full_state_dict(cpu_offload=True)  # a collective; only rank 0 receives the tensors
    # Evaluation path: load the EMA shard-to-shard into a second FSDP model and gather that one.
    eval_model = shard_model(build(cfg.model, cfg.seed + 1), mesh)
    ema.copy_to(eval_model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    via_model = get_model_state_dict(eval_model, options=options)
    return {
        "state": _snapshot(full),
        "via_model_state": _snapshot(via_model),
        "bytes": ema.local_bytes(),
        "deepcopy_error": deepcopy_error,
        "collectives": comms,
        "ops": ops,
        "rebuilds": ema.rebuilds,
        "update_s": _time_updates(ema, model, cfg.timing_repeats),
    }


def _worker(rank: int, cfg: Config, port: int, outdir: str) -> None:
    """One rank: join the group through the parent's store, run both demos, save results, always clean up."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a 2-core machine; timings at a fixed thread count
    lo = loopback_interface()
    if lo is not None:  # gloo binds the interface its hostname resolves to unless told otherwise
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    timeout = timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.world_size, timeout=timeout)
    try:
        result = {"ddp": ddp_demo(cfg, rank), "fsdp": fsdp_demo(cfg, rank)}
        result["gloo_interface"] = os.environ.get("GLOO_SOCKET_IFNAME")
        torch.save(result, Path(outdir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def reference(cfg: Config) -> tuple[dict[str, Tensor], dict[str, Tensor], int]:
    """Single process, whole global batch per step: the EMA state, the initial weights, the EMA's bytes."""
    torch.set_num_threads(1)
    model = build(cfg.model, cfg.seed)
    init = _snapshot(model.state_dict())
    ema = ModelEMA(model, decay=cfg.decay, tau=cfg.tau)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        tokens, targets = global_batch(cfg, step, _vocab(model))
        opt.zero_grad(set_to_none=True)
        _loss(model, tokens, targets).backward()
        opt.step()
        ema.update(model)
    return _snapshot(ema.ema.state_dict()), init, _distinct_bytes(ema.ema)


def max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Largest elementwise difference between two state dicts; raises if their keys or shapes differ."""
    if a.keys() != b.keys():
        raise ValueError(f"state_dict keys differ: {sorted(a.keys() ^ b.keys())[:5]}")
    for k in a:
        if a[k].shape != b[k].shape:
            raise ValueError(f"entry {k!r}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())


@dataclass
class Report:
    """Everything the demo measured and checked; ``failures`` empty means every check passed."""

    config: Config
    skipped: str | None = None
    ranks: list[dict[str, object]] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    figures: dict[str, object] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing failed (a skip is not a pass: ``ok`` is False and ``skipped`` says why)."""
        return self.skipped is None and not self.failures and bool(self.checks)

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly summary (no tensors)."""
        return {
            "config": asdict(self.config),
            "skipped": self.skipped,
            "ok": self.ok,
            "checks": self.checks,
            "figures": self.figures,
            "failures": self.failures,
        }


def _spawn(cfg: Config, outdir: str) -> str | None:
    """Run the ranks; return None on success, else why they failed. Kills its own workers on timeout."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # The parent hosts the rendezvous store on a free loopback port: no port to guess, no race.
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=cfg.timeout_s), wait_for_workers=False
    )
    ctx = mp.start_processes(
        _worker, args=(cfg, store.port, outdir), nprocs=cfg.world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + cfg.timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                return f"timed out after {cfg.timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 (a worker's traceback, reported as the failure)
        return f"a worker failed: {e}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return None


def _check(report: Report, name: str, passed: bool, detail: str) -> None:
    report.checks[name] = bool(passed)
    if not passed:
        report.failures.append(f"{name}: {detail}")


def summarise(report: Report, ref: dict[str, Tensor], init: dict[str, Tensor], full_bytes: int) -> None:
    """Compare the ranks' results in ``report`` with the single-process ``ref``; fill checks and figures."""
    cfg, ranks = report.config, report.ranks
    moved = max_abs_diff(ref, init)
    report.figures["ema_moved_from_init"] = moved
    report.figures["full_ema_bytes_reference"] = full_bytes
    _check(report, "reference EMA moved from the initial weights", moved > 100 * cfg.atol, f"{moved:.2e}")
    # DDP
    ddp = [r["ddp"] for r in ranks]
    identical = all(
        all(torch.equal(d["state"][k], ddp[0]["state"][k]) for k in ddp[0]["state"]) for d in ddp[1:]
    )
    _check(report, "DDP: EMA bit-identical on every rank", identical, "ranks disagree")
    diff = max_abs_diff(ddp[0]["state"], ref)
    report.figures["ddp_max_abs_diff"] = diff
    _check(report, "DDP: EMA equals the single-process reference", diff <= cfg.atol, f"{diff:.2e}")
    r0 = ddp[0]["rank0_only_state"]
    same0 = r0 is not None and all(torch.equal(r0[k], ddp[0]["state"][k]) for k in r0)
    _check(report, "DDP: rank-0-only EMA equals the per-rank EMA", same0, "differs")
    _check(
        report,
        "DDP: rank-0-only EMA held by rank 0 only",
        [d["rank0_only_bytes"] > 0 for d in ddp] == [True] + [False] * (cfg.world_size - 1),
        str([d["rank0_only_bytes"] for d in ddp]),
    )
    n = sum(sum(c) for c in (d["collectives"] for d in ddp))
    _check(report, "DDP: no collective during update()", n == 0, f"{n} collectives")
    # FSDP2
    fs = [r["fsdp"] for r in ranks]
    diff = max_abs_diff(fs[0]["state"], ref)
    report.figures["fsdp_max_abs_diff"] = diff
    _check(report, "FSDP2: gathered EMA equals the single-process reference", diff <= cfg.atol, f"{diff:.2e}")
    via = fs[0]["via_model_state"]
    same = via.keys() == fs[0]["state"].keys() and all(torch.equal(via[k], fs[0]["state"][k]) for k in via)
    _check(report, "FSDP2: copy_to + get_model_state_dict gives the same EMA", same, "differs")
    _check(
        report,
        "FSDP2: full state_dict on rank 0 only (cpu_offload)",
        all(len(f["state"]) == 0 for f in fs[1:]),
        str([len(f["state"]) for f in fs]),
    )
    n = sum(sum(c) for c in (f["collectives"] for f in fs))
    _check(report, "FSDP2: no collective during update()", n == 0, f"{n} collectives")
    # The first update also builds the cached pairs (views of the shards); count the steady state.
    lerp = "aten._foreach_lerp_.Scalar"
    ops = [c for f in fs for c in f["ops"][1:]]
    _check(
        report,
        "FSDP2: one _foreach_lerp_ and no other op per update",
        all(c == {lerp: 1} for c in ops),
        str(ops[0] if ops else "no update after the first"),
    )
    # ModelEMA's own strategy decides which ops; what DDP must not change is that they are local and alike.
    ops = [c for d in ddp for c in d["ops"][1:]]
    _check(
        report,
        "DDP: the same local ops in every update on every rank",
        all(c == ops[0] and not any(k.startswith("c10d") for k in c) for c in ops),
        str(ops[:2]),
    )
    local = [f["bytes"] for f in fs]
    _check(
        report,
        "FSDP2: shards add up to one full EMA, no rank holds it all",
        sum(local) == full_bytes and max(local) < full_bytes,
        f"{sum(local)} bytes summed vs {full_bytes}",
    )
    _check(
        report, "FSDP2: ModelEMA(fully_shard model) refused", fs[0]["deepcopy_error"] is not None, "accepted"
    )
    report.figures["fsdp_modelema_error"] = fs[0]["deepcopy_error"]
    report.figures["per_rank"] = [
        {
            "rank": i,
            "ddp_ema_bytes": r["ddp"]["bytes"],
            "ddp_rank0_only_bytes": r["ddp"]["rank0_only_bytes"],
            "fsdp_ema_bytes": r["fsdp"]["bytes"],
            "fsdp_fraction_of_full": r["fsdp"]["bytes"] / full_bytes,
            "ddp_update_ms": 1e3 * statistics.median(r["ddp"]["update_s"]),
            "fsdp_update_ms": 1e3 * statistics.median(r["fsdp"]["update_s"]),
            "ddp_ops_per_update": sum(r["ddp"]["ops"][-1].values()),
            "fsdp_ops_per_update": sum(r["fsdp"]["ops"][-1].values()),
            "fsdp_cache_builds": r["fsdp"]["rebuilds"],
            "gloo_interface": r["gloo_interface"],
        }
        for i, r in enumerate(ranks)
    ]


def run(cfg: Config) -> Report:
    """Spawn the ranks, train the reference, compare; a missing torch API gives a skipped report."""
    report = Report(cfg)
    missing = missing_apis()
    if missing:
        report.skipped = f"skipped: this torch ({torch.__version__}) lacks {', '.join(missing)}"
        return report
    if cfg.world_size < 2:
        raise ValueError(f"world_size must be at least 2 to show anything distributed, got {cfg.world_size}")
    with tempfile.TemporaryDirectory(prefix="ema_lab_dist_") as tmp:
        error = _spawn(cfg, tmp)
        if error is not None:
            report.failures.append(error)
            return report
        report.ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(cfg.world_size)]
    summarise(report, *reference(cfg))
    return report


def format_report(report: Report) -> str:
    """The human-readable result: configuration, per-rank memory and time, every check."""
    cfg = report.config
    lines = [
        f"ema_lab.lessons.distributed: world size {cfg.world_size}, gloo on 127.0.0.1, model {cfg.model}, "
        f"{cfg.steps} steps, batch {cfg.batch_per_rank} per rank, decay {cfg.decay}, tau {cfg.tau}, "
        "1 thread per rank"
    ]
    if report.skipped:
        return "\n".join([*lines, report.skipped])
    fig = report.figures
    if "per_rank" in fig:
        lines.append(f"full EMA (single-process reference): {fig['full_ema_bytes_reference']:,} bytes")
        lines.append(f"FSDP2: ModelEMA(fully_shard model) -> {fig['fsdp_modelema_error']}")
        lines.append(
            "rank  DDP EMA bytes  DDP rank0-only bytes  FSDP2 shard bytes (of full)  "
            "DDP update ms  FSDP2 update ms  aten ops/update DDP, FSDP2"
        )
        for r in fig["per_rank"]:
            lines.append(
                f"{r['rank']:>4}  {r['ddp_ema_bytes']:>13,}  {r['ddp_rank0_only_bytes']:>20,}  "
                f"{r['fsdp_ema_bytes']:>17,} ({r['fsdp_fraction_of_full']:.3f})  "
                f"{r['ddp_update_ms']:>13.3f}  {r['fsdp_update_ms']:>15.3f}  "
                f"{r['ddp_ops_per_update']}, {r['fsdp_ops_per_update']}"
            )
        lines.append(
            f"max |EMA - reference|: DDP {fig['ddp_max_abs_diff']:.2e}, FSDP2 {fig['fsdp_max_abs_diff']:.2e} "
            f"(tolerance {cfg.atol:g}); EMA moved from init by up to {fig['ema_moved_from_init']:.3f}"
        )
    for name, passed in report.checks.items():
        lines.append(f"[{'ok' if passed else 'FAIL'}] {name}")
    lines += [f"FAILED: {f}" for f in report.failures]
    lines.append("result: OK" if report.ok else "result: FAILED")
    return "\n".join(lines)


def run_cli(world_size: int = 2, timeout_s: float = Config.timeout_s) -> tuple[int, str, dict[str, object]]:
    """Run ``python -m ema_lab.lessons.distributed`` in a fresh interpreter: exit status, output, summary."""
    import json
    import subprocess

    # The folder holding this ema_lab package (a checkout or site-packages), so the child imports this copy.
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="ema_lab_dist_") as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, "-m", "ema_lab.lessons.distributed", "--world-size", str(world_size)]
        cmd += ["--timeout", str(timeout_s), "--json", str(out)]
        # The ranks are bounded by timeout_s; the extra margin covers interpreter start and the reference.
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s + 60)
        summary = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, summary


def main(argv: list[str] | None = None) -> int:
    """Command line: run both demos, print the report, exit 0 only if every check passed."""
    parser = argparse.ArgumentParser(
        prog="python -m ema_lab.lessons.distributed", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--timeout", type=float, default=Config.timeout_s, help="seconds for the whole run")
    parser.add_argument("--json", type=Path, help="also write the summary (no tensors) to this file")
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.steps < 1 or args.timeout <= 0:
        parser.error("--world-size must be >= 2, --steps >= 1 and --timeout > 0")
    report = run(Config(world_size=args.world_size, steps=args.steps, timeout_s=args.timeout))
    print(format_report(report), flush=True)
    if args.json is not None:
        import json

        args.json.write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    if report.skipped:
        return 0
    return 0 if report.ok else 1


if __name__ == "__main__":
    # Re-import under the package name so spawned ranks unpickle ``ema_lab.lessons.distributed._worker``.
    from ema_lab.lessons.distributed import main as _main

    sys.exit(_main())
