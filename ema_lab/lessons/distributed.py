"""EMA under torch.distributed: DDP and FSDP2 runs in real gloo processes on 127.0.0.1, for tests and a CLI.

``python -m ema_lab.lessons.distributed --world-size 2`` starts one process per rank. Each rank trains
the zoo's tiny transformer on its slice of a global batch, with DDP and ``ModelEMA``, then with FSDP2
(``fully_shard``) and ``ShardedModelEMA``. The parent trains the same model in one process, in
float64, on the whole batch (the same averaged gradient) and compares; it prints ``result: OK`` and
exits 0 when both EMAs match. :func:`launch` + :func:`rank_run` give each rank's results to check;
:func:`buffers_run` trains a model with a BatchNorm, whose EMA buffers differ by rank until
``sync_buffers()``. Notebook 06 shows the same training-plus-EMA code in its own script, run by
:func:`torchrun`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from torch import Tensor, nn

from ..bench.counting import count_ops
from ..bench.models import build
from ..ema import ModelEMA
from ..sharded import ShardedModelEMA

__all__ = [
    "skip_reason",
    "loopback_interface",
    "ddp_model_ema",
    "launch",
    "reference",
    "batchnorm_model",
    "buffers_run",
    "torchrun",
    "main",
]

#: (import path, name) of every torch API the runs need; checked before anything is spawned.
REQUIRED_APIS = (
    ("torch.distributed", "init_process_group"),
    ("torch.distributed.device_mesh", "init_device_mesh"),
    ("torch.distributed.fsdp", "fully_shard"),
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor.debug", "CommDebugMode"),
    ("torch.distributed.checkpoint.state_dict", "get_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "set_model_state_dict"),
)


#: The oldest torch whose FSDP2 run on CPU over gloo was seen to work: on 2.6 its forward fails inside torch
#: ("'Stream' object has no attribute 'record_event'"), on 2.8 the sharded EMA ended 0.19 off (not traced).
FSDP2_CPU_MIN = "2.9"


def _unavailable() -> tuple[list[str], list[str]]:
    """(torch APIs the installed torch lacks, packages not installed that torch's modules import)."""
    import importlib

    if not torch.distributed.is_available():
        return ["torch.distributed (this torch build has no distributed support)"], []
    apis = [] if torch.__version__ >= FSDP2_CPU_MIN else [f"FSDP2 training on CPU (torch >= {FSDP2_CPU_MIN})"]
    packages: dict[str, None] = {}
    for mod, name in REQUIRED_APIS:
        try:
            getattr(importlib.import_module(mod), name)
        except ModuleNotFoundError as exc:
            # torch has the module, but it imports a package that is missing (CommDebugMode needs numpy).
            if exc.name and exc.name.split(".")[0] != "torch":
                packages[f"{exc.name} (not installed; {mod} imports it)"] = None
            else:
                apis.append(f"{mod}.{name}")
        except (ImportError, AttributeError):
            apis.append(f"{mod}.{name}")
    return apis, list(packages)


def skip_reason() -> str | None:
    """Why the runs cannot start here, as one line ("skipped: ..."), or None when they can."""
    apis, packages = _unavailable()
    reasons = [f"this torch ({torch.__version__}) lacks {', '.join(apis)}"] if apis else []
    reasons += [", ".join(packages)] if packages else []
    return f"skipped: {'; '.join(reasons)}" if reasons else None


@dataclass(frozen=True)
class Config:
    """What the ranks train."""

    world_size: int = 2
    steps: int = 8
    batch_per_rank: int = 4
    seq_len: int = 8
    model: str = "tiny_transformer"
    decay: float = 0.9
    tau: float = 2.0  # short ramp, so a few steps move the EMA far from the initial weights
    lr: float = 0.05
    seed: int = 0


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


def shard_model(model: nn.Module, mesh: object, groups: Iterable[nn.Module] | None = None) -> nn.Module:
    """FSDP2 recipe: one ``fully_shard`` group per module of ``groups`` (default: per transformer block),
    then the root (the rest: embeddings, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in getattr(getattr(model, "blocks", None), "layers", []) if groups is None else groups:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def torchrun(nproc: int, script: Path, *args: str) -> str:
    """Run ``script`` (in its folder) on ``nproc`` gloo ranks with ``torchrun --standalone``; rank 0's output.

    torchrun's logs go to ``logs/`` beside the script (else a new temporary folder per run), and gloo is kept
    on the loopback interface. Raises ``RuntimeError`` with the end of the ranks' errors when one fails.
    """
    script = Path(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [f"--log-dir={script.parent / 'logs'}", script.name, *args]
    env = dict(os.environ)
    lo = loopback_interface()
    if lo is not None:  # gloo binds the interface its hostname resolves to unless told otherwise
        env["GLOO_SOCKET_IFNAME"] = lo
    proc = subprocess.run(cmd, cwd=script.parent, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc.stdout


# --- running ranks ---------------------------------------------------------------------------------------


def _worker(
    rank: int, fn: Callable[..., object], world: int, port: int, timeout_s: float, out: str, args: tuple
) -> None:
    """One rank: join the group through the parent's store, run ``fn``, save its result, always clean up."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks on a 2-core machine
    lo = loopback_interface()
    if lo is not None:  # gloo binds the interface its hostname resolves to unless told otherwise
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        torch.save(fn(rank, world, *args), Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # DDP and FSDP2 leave references to the group inside torch, so its gloo threads outlive
    # destroy_process_group(); running on into Python's shutdown they can abort the rank (SIGABRT,
    # "terminate called without an active exception"). A rank that is done ends without that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    fn: Callable[..., object], world_size: int, *args: object, timeout_s: float = 120.0
) -> list[object]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return each rank's result.

    ``fn`` must be importable by name (spawned processes unpickle it) and return something
    ``torch.save`` can write. Raises ``TimeoutError`` after ``timeout_s`` (its processes killed) and
    ``RuntimeError`` with the worker's traceback when a rank fails.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    # The parent hosts the rendezvous store on a free loopback port: no port to guess, no race.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="ema_lab_dist_") as out:
        ctx = mp.start_processes(
            _worker,
            args=(fn, world_size, store.port, timeout_s, out, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out after {timeout_s:g} s")
        except mp.ProcessRaisedException as e:
            raise RuntimeError(f"a worker failed: {e}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
            # Newer torch hands a failed rank's traceback over in a temporary file it leaves behind.
            for name in getattr(ctx, "error_files", ()):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(name)
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world_size)]


# --- the DDP and FSDP2 run of one rank -------------------------------------------------------------------


def global_batch(cfg: Config, step: int, vocab: int) -> tuple[Tensor, Tensor]:
    """Tokens and next-token targets for the whole world at ``step``, the same in every process."""
    g = torch.Generator().manual_seed(1000 * cfg.seed + step)
    n = cfg.batch_per_rank * cfg.world_size
    tokens = torch.randint(vocab, (n, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def distinct_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and persistent buffers, shared (tied) tensors counted once."""
    seen, total = set(), 0
    for t in module.state_dict(keep_vars=True).values():
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _snapshot(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone().cpu() for k, v in sd.items()}


def _train(cfg: Config, model: nn.Module, rank: int, emas: list[ModelEMA | ShardedModelEMA | None]) -> tuple:
    """SGD on this rank's slice of each global batch; the EMAs updated after each step, observed."""
    from torch.distributed.tensor.debug import CommDebugMode

    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    part = slice(rank * cfg.batch_per_rank, (rank + 1) * cfg.batch_per_rank)
    vocab = build(cfg.model).embed.num_embeddings
    comms, ops = [], []
    for step in range(cfg.steps):
        tokens, targets = global_batch(cfg, step, vocab)
        opt.zero_grad(set_to_none=True)
        _loss(model, tokens[part], targets[part]).backward()  # gradients averaged across ranks here
        opt.step()
        with CommDebugMode() as comm:
            ops.append(dict(count_ops(emas[0].update, model)))
            for ema in emas[1:]:
                if ema is not None:
                    ema.update(model)
        comms.append(comm.get_total_counts())
    return comms, ops


def rank_run(rank: int, world: int, cfg: Config) -> dict[str, object]:
    """One rank: DDP + ``ModelEMA`` (and a rank-0-only one), then FSDP2 + ``ShardedModelEMA``; what it saw."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(build(cfg.model, cfg.seed))
    ema = ddp_model_ema(ddp, decay=cfg.decay, tau=cfg.tau)
    ema0 = ddp_model_ema(ddp, rank0_only=True, decay=cfg.decay, tau=cfg.tau)
    ddp_comms, ddp_ops = _train(cfg, ddp, rank, [ema, ema0])

    mesh = init_device_mesh("cpu", (world,))
    model = shard_model(build(cfg.model, cfg.seed), mesh)
    try:
        ModelEMA(model)
        refused = None
    except TypeError as e:
        refused = f"TypeError: {e}"
    sharded = ShardedModelEMA(model, decay=cfg.decay, tau=cfg.tau)
    fsdp_comms, fsdp_ops = _train(cfg, model, rank, [sharded])
    full = sharded.full_state_dict(cpu_offload=True)  # a collective; only rank 0 receives the tensors
    eval_model = shard_model(build(cfg.model, cfg.seed + 1), mesh)  # evaluation: load shard to shard
    sharded.copy_to(eval_model)
    via_model = get_model_state_dict(
        eval_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {
        "ddp_state": _snapshot(ema.ema.state_dict()),
        "ddp_bytes": distinct_bytes(ema.ema),
        "rank0_only_state": None if ema0 is None else _snapshot(ema0.ema.state_dict()),
        "rank0_only_bytes": 0 if ema0 is None else distinct_bytes(ema0.ema),
        "ddp_collectives": ddp_comms,
        "ddp_ops": ddp_ops,
        "fsdp_state": _snapshot(full),
        "fsdp_via_model_state": _snapshot(via_model),
        "fsdp_bytes": sharded.local_bytes(),
        "fsdp_rows": {k: (t.shape[0] if t.dim() else 1) for k, t in sharded.local_tensors().items()},
        "fsdp_collectives": fsdp_comms,
        "fsdp_ops": fsdp_ops,
        "fsdp_rebuilds": sharded.rebuilds,
        "modelema_refused": refused,
        "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
    }


# --- BatchNorm: buffers each rank updates from its own batch ----------------------------------------------


def batchnorm_model(seed: int = 0) -> nn.Module:
    """A small MLP with a BatchNorm: the same initial weights in every process."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.SiLU(), nn.Linear(16, 3))


def _train_batchnorm(
    model: nn.Module, ema: ModelEMA | ShardedModelEMA, rank: int, world: int, steps: int
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)  # the same global batch everywhere; each rank takes its part
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 3, generator=g)
        opt.zero_grad(set_to_none=True)
        part = slice(4 * rank, 4 * (rank + 1))
        nn.functional.mse_loss(model(x[part]), y[part]).backward()
        opt.step()
        ema.update(model)


def buffers_run(rank: int, world: int, steps: int = 5) -> dict[str, object]:
    """DDP + ``ModelEMA``, then FSDP2 + ``ShardedModelEMA``, of :func:`batchnorm_model`: each EMA's full
    state before and after ``sync_buffers()``, and the collectives that call issued."""
    import warnings

    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DistributedDataParallel(batchnorm_model())
        ema = ModelEMA(ddp, decay=0.9, tau=2)
        _train_batchnorm(ddp, ema, rank, world, steps)
    out["ddp_warnings"] = [str(w.message) for w in caught]
    out["ddp_before"] = _snapshot(ema.ema.state_dict())
    with CommDebugMode() as comm:
        ema.sync_buffers()
    out["ddp_sync_collectives"] = comm.get_total_counts()
    out["ddp_after"] = _snapshot(ema.ema.state_dict())
    ema.update(ddp)  # after the in-place sync, the cached step still holds the EMA's tensors
    out["ddp_rebuilds"] = ema.rebuilds
    if torch.__version__ >= FSDP2_CPU_MIN:
        from torch.distributed.device_mesh import init_device_mesh

        model = batchnorm_model()
        shard_model(model, init_device_mesh("cpu", (world,)), groups=(model[0], model[3]))
        sharded = ShardedModelEMA(model, decay=0.9, tau=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train_batchnorm(model, sharded, rank, world, steps)
        out["fsdp_warnings"] = [str(w.message) for w in caught]
        out["fsdp_before"] = _snapshot(sharded.full_state_dict(cpu_offload=False))  # every rank gets it all
        with CommDebugMode() as comm:
            sharded.sync_buffers()
        out["fsdp_sync_collectives"] = comm.get_total_counts()
        out["fsdp_after"] = _snapshot(sharded.full_state_dict(cpu_offload=False))
        sharded.update(model)
        out["fsdp_rebuilds"] = sharded.rebuilds
    return out


def reference(
    cfg: Config, dtype: torch.dtype = torch.float64
) -> tuple[dict[str, Tensor], dict[str, Tensor], int]:
    """One process, whole global batch per step, in ``dtype``: the EMA state, the initial weights, EMA bytes.

    The bytes are those of the float32 model (what the ranks hold), tied weights counted once.
    """
    model = build(cfg.model, cfg.seed)
    full_bytes = distinct_bytes(model)
    model = model.to(dtype)
    init = _snapshot(model.state_dict())
    ema = ModelEMA(model, decay=cfg.decay, tau=cfg.tau)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        tokens, targets = global_batch(cfg, step, model.embed.num_embeddings)
        opt.zero_grad(set_to_none=True)
        _loss(model, tokens, targets).backward()
        opt.step()
        ema.update(model)
    return _snapshot(ema.ema.state_dict()), init, full_bytes


def max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Largest elementwise difference between two state dicts; raises if their keys or shapes differ."""
    if a.keys() != b.keys():
        raise ValueError(f"state_dict keys differ: {sorted(a.keys() ^ b.keys())[:5]}")
    for k in a:
        if a[k].shape != b[k].shape:
            raise ValueError(f"entry {k!r}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())


# --- command line ----------------------------------------------------------------------------------------

ATOL = 1e-5  # float32 ranks vs a float64 reference after a few steps: rounding, not a logic slack


def main(argv: list[str] | None = None) -> int:
    """Command line: run the ranks and the float64 reference, print what they hold; 0 if both EMAs match."""
    parser = argparse.ArgumentParser(
        prog="python -m ema_lab.lessons.distributed", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the ranks")
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.steps < 1 or args.timeout <= 0:
        parser.error("--world-size must be >= 2, --steps >= 1 and --timeout > 0")
    cfg = Config(world_size=args.world_size, steps=args.steps)
    print(
        f"ema_lab.lessons.distributed: world size {cfg.world_size}, gloo on 127.0.0.1, model {cfg.model}, "
        f"{cfg.steps} steps, batch {cfg.batch_per_rank} per rank, decay {cfg.decay}, tau {cfg.tau}",
        flush=True,
    )
    reason = skip_reason()
    if reason:
        print(reason)
        return 0
    torch.set_num_threads(1)
    try:
        ranks = launch(rank_run, cfg.world_size, cfg, timeout_s=args.timeout)
    except (TimeoutError, RuntimeError) as e:
        print(f"FAILED: {e}\nresult: FAILED")
        return 1
    ref, init, full = reference(cfg)
    print(f"full EMA: {full:,} bytes; ModelEMA(fully_shard model) -> {ranks[0]['modelema_refused']}")
    print("rank  DDP EMA bytes  FSDP2 shard bytes  collectives in update() (DDP, FSDP2)")
    for i, r in enumerate(ranks):
        comms = (sum(r["ddp_collectives"]), sum(r["fsdp_collectives"]))
        print(f"{i:>4}  {r['ddp_bytes']:>13,}  {r['fsdp_bytes']:>17,}  {comms}")
    diffs = {
        "DDP": max_abs_diff(ranks[0]["ddp_state"], ref),
        "FSDP2": max_abs_diff(ranks[0]["fsdp_state"], ref),
    }
    moved = max_abs_diff(ref, init)
    print(
        f"max |EMA - float64 one-process EMA|: DDP {diffs['DDP']:.2e}, FSDP2 {diffs['FSDP2']:.2e} "
        f"(tolerance {ATOL:g}); the EMA moved from the initial weights by up to {moved:.3f}"
    )
    ok = max(diffs.values()) <= ATOL < moved
    print("result: OK" if ok else "result: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    # Re-import under the package name so spawned ranks unpickle ``ema_lab.lessons.distributed.rank_run``.
    from ema_lab.lessons.distributed import main as _main

    sys.exit(_main())
