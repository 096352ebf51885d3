"""The peers' decay schedules and post-hoc EMA, run at named versions, against ema_lab's (issue 41).

    python3 -m venv build/peers-venv
    build/peers-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 timm==1.0.31 diffusers==0.42.1 \\
        ema-pytorch==0.8.3 ultralytics==8.4.190
    PYTHONPATH=. build/peers-venv/bin/python benchmarks/peer_schedules.py --out [--edm2 EDM2_GIT_DIR]

(or ``nox -s peer_schedules``). Never into the project's venv: ultralytics brings ultralytics-thop,
which clashes with the pinned thop. ``--edm2`` is a checkout (or bare clone) of NVlabs/edm2: its
``training/phema.py`` (numpy and torch only; licensed CC BY-NC-SA, so read at run time, not copied
here) is loaded from ``HEAD``.

Each peer runs on a one-element float64 model. Before every update the EMA's weight is set to 1 and the
model's to 0, so that the EMA reads, after it, the decay that update applied (1 where a peer skips the
update, 0 where it copies). That is compared over ``--steps`` updates with the ema_lab schedule of the
matching arguments, called directly (largest difference), and with ``ema_lab.ModelEMA(decay=schedule)``
read the same way (how many of the steps read bit for bit the same). ultralytics' ramp is compared
with ``ModelEMA``'s number form (``decay, tau``).

Update every k steps: a weight equal to the step index t, tracked for 20,000 steps with sigma_rel 0.05,
reads T (gamma + 1) / (gamma + 2) under the power profile; ema-pytorch's KarrasEMA(update_every=k)
applies the one-step decay once per k steps, ema_lab's ``ModelEMA(every=k)`` the product of the k decays
(EDM2 the same, as ``t_delta = k``).

Post-hoc: a float32 random walk (``--dim`` weights, ``--posthoc-steps`` steps) is tracked by
ema-pytorch's PostHocEMA (sigma_rel 0.05 and 0.10, update_every=1, float32 checkpoints every
``--every``) beside a KarrasEMA of sigma_rel 0.075; its checkpoints are converted to ema_lab snapshots;
sigma_rel 0.075 is synthesized by both and compared with each other and with the tracked one, the error
stated as a fraction of the distance from the tracked EMA to the nearest snapshot EMA (0.10). The same
again with ema_lab alone (ModelEMA's of power schedules, ``save_step``), and with PostHocEMA at its
default update_every=100 against a power EMA updated every step.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from result_homes import add_study_out, shown
from torch import nn

from ema_lab import ModelEMA
from ema_lab import posthoc as ours_posthoc
from ema_lab.schedules import constant, harmonic, power, sigma_rel_to_gamma, warmup
from ema_lab.snapshots import check_folder, save_step

PEERS = ("torch", "timm", "diffusers", "ema-pytorch", "ultralytics")
NAME = "peer-schedules"


class One(nn.Module):
    """A model of one float64 weight: what an EMA of it reads is the decay it applied."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, dtype=torch.float64))


@torch.no_grad()
def read_decays(
    ema_weight: Callable[[], torch.Tensor], model: One, update: Callable[[int], None], steps: int
):
    """The decay each of ``steps`` updates applies: the EMA reads it after going from 1 towards 0."""
    out = torch.empty(steps, dtype=torch.float64)
    for n in range(1, steps + 1):
        ema_weight().fill_(1.0)
        model.w.fill_(0.0)
        update(n)
        out[n - 1] = ema_weight().item()
    return out


def ema_lab_reads(decay, steps: int, **kwargs) -> torch.Tensor:
    """What ``ema_lab.ModelEMA(One(), decay, **kwargs)`` applies per update."""
    model = One()
    ema = ModelEMA(model, decay, **kwargs)
    return read_decays(lambda: ema.ema.w, model, lambda n: ema.update(model), steps)


def row(peer: str, peer_args: str, ours: str, peer_reads: torch.Tensor, expected, lab_reads=None) -> dict:
    """One comparison: the largest difference from the expected decays, and bitwise agreement with ema_lab."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    diff = (peer_reads - expected).abs()
    r = {
        "peer": peer,
        "peer arguments": peer_args,
        "ema_lab": ours,
        "steps": len(peer_reads),
        "max |peer - ema_lab schedule|": diff.max().item(),
        "at step": int(diff.argmax()) + 1,
    }
    if lab_reads is not None:
        r["steps bitwise equal to ema_lab ModelEMA"] = int((peer_reads == lab_reads).sum())
    print(f"{peer:12} {peer_args:70} {ours:55} {r['max |peer - ema_lab schedule|']:.3g}", flush=True)
    return r


def timm_rows(steps: int) -> list[dict]:
    from timm.utils.model_ema import ModelEmaV3

    cases = [
        ("use_warmup=True", warmup(), {"use_warmup": True}),
        (
            "use_warmup=True, decay=0.999, warmup_gamma=10, warmup_power=0.75, min_decay=0.5, "
            "update_after_step=1000",
            warmup(0.999, 10.0, 0.75, 0.5, 1000),
            {"use_warmup": True, "decay": 0.999, "warmup_gamma": 10.0, "warmup_power": 0.75, "min_decay": 0.5}
            | {"update_after_step": 1000},
        ),
        ("(defaults: no warm-up)", constant(), {}),
        (
            "decay=0.9998, update_after_step=100",
            constant(0.9998, 100),
            {"decay": 0.9998, "update_after_step": 100},
        ),
    ]
    rows = []
    for args, schedule, kwargs in cases:
        model = One()
        ema = ModelEmaV3(model, **kwargs)
        reads = read_decays(
            lambda e=ema: e.module.w, model, lambda n, e=ema, m=model: e.update(m, step=n), steps
        )
        expected = [schedule(n) for n in range(1, steps + 1)]
        rows.append(
            row("timm ModelEmaV3", args, repr(schedule), reads, expected, ema_lab_reads(schedule, steps))
        )
    return rows


def diffusers_rows(steps: int) -> list[dict]:
    from diffusers.training_utils import EMAModel

    cases = [
        ("use_ema_warmup=True", warmup(), {"use_ema_warmup": True}),
        (
            "use_ema_warmup=True, decay=0.999, inv_gamma=10, power=0.75, min_decay=0.5, "
            "update_after_step=1000",
            warmup(0.999, 10.0, 0.75, 0.5, 1000),
            {"use_ema_warmup": True, "decay": 0.999, "inv_gamma": 10.0, "power": 0.75, "min_decay": 0.5}
            | {"update_after_step": 1000},
        ),
        ("(defaults: (1 + s) / (10 + s))", harmonic(), {}),
        (
            "decay=0.999, min_decay=0.1, update_after_step=50",
            harmonic(0.999, 0.1, 50),
            {"decay": 0.999, "min_decay": 0.1, "update_after_step": 50},
        ),
    ]
    rows = []
    for args, schedule, kwargs in cases:
        model = One()
        ema = EMAModel(model.parameters(), **kwargs)
        reads = read_decays(
            lambda e=ema: e.shadow_params[0], model, lambda n, e=ema, m=model: e.step(m.parameters()), steps
        )
        expected = [schedule(n) for n in range(1, steps + 1)]
        rows.append(
            row("diffusers EMAModel", args, repr(schedule), reads, expected, ema_lab_reads(schedule, steps))
        )
    return rows


def ema_pytorch_rows(steps: int) -> list[dict]:
    from ema_pytorch import EMA, KarrasEMA

    rows = []
    cases = [
        ("update_every=1 (update_after_step=100 by default)", warmup(after=100), {"update_every": 1}),
        (
            "beta=0.999, inv_gamma=10, power=0.75, min_value=0.5, update_after_step=1000, update_every=1",
            warmup(0.999, 10.0, 0.75, 0.5, 1000),
            {"beta": 0.999, "inv_gamma": 10.0, "power": 0.75, "min_value": 0.5, "update_after_step": 1000}
            | {"update_every": 1},
        ),
    ]
    for args, schedule, kwargs in cases:
        model = One()
        ema = EMA(model, include_online_model=False, **kwargs)
        reads = read_decays(lambda e=ema: e.ema_model.w, model, lambda n, e=ema: e.update(), steps)
        expected = [schedule(n) for n in range(1, steps + 1)]
        rows.append(
            row("ema-pytorch EMA", args, repr(schedule), reads, expected, ema_lab_reads(schedule, steps))
        )

    # Its default update_every=10: the one-step decay on calls 1, 11, 21, ..., nothing in between.
    schedule = warmup(after=100)
    model = One()
    ema = EMA(model, include_online_model=False)
    reads = read_decays(lambda: ema.ema_model.w, model, lambda n: ema.update(), steps)
    expected = [schedule(n) if (n - 1) % 10 == 0 else 1.0 for n in range(1, steps + 1)]
    rows.append(
        row(
            "ema-pytorch EMA",
            "(defaults: update_every=10)",
            f"{schedule!r} on calls 1, 11, ...",
            reads,
            expected,
        )
    )

    # KarrasEMA counts from 0 after its first call's copy: on call n it applies ema_lab's power at n + 1.
    for args, kwargs in (
        ("gamma=6.94, update_every=1", {"gamma": 6.94}),
        ("sigma_rel=0.05, update_every=1", {"sigma_rel": 0.05}),
    ):
        schedule = power(**kwargs)
        model = One()
        ema = KarrasEMA(model, update_every=1, **kwargs)
        reads = read_decays(lambda e=ema: e.ema_model.w, model, lambda n, e=ema: e.update(), steps)
        expected = [0.0] + [schedule(n + 1) for n in range(2, steps + 1)]
        rows.append(
            row("ema-pytorch KarrasEMA", args, f"{schedule!r} at n + 1 (0 at n = 1)", reads, expected)
        )
    return rows


def edm2_phema(folder: Path) -> tuple[types.ModuleType, str]:
    """EDM2's training/phema.py at HEAD of ``folder`` (a checkout or a bare clone), and that commit."""
    git = ["git", "-C", str(folder)]
    source = subprocess.run(
        [*git, "show", "HEAD:training/phema.py"], capture_output=True, text=True, check=True
    )
    commit = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    module = types.ModuleType("edm2_phema")
    exec(compile(source.stdout, "edm2/training/phema.py", "exec"), module.__dict__)
    return module, commit


def edm2_rows(phema: types.ModuleType, steps: int) -> list[dict]:
    """EDM2's PowerFunctionEMA updated with batch_size (t_delta) 1 and 10: the k-step product."""
    rows = []
    for k in (1, 10):
        model = One()
        ema = phema.PowerFunctionEMA(model, stds=[0.05, 0.10])
        for i, std in enumerate((0.05, 0.10)):
            schedule = power(sigma_rel=std)
            reads = read_decays(
                lambda e=ema, i=i: e.emas[i].w,
                model,
                lambda n, e=ema, k=k: e.update(cur_nimg=n * k, batch_size=k),
                steps // k,
            )
            # Its update at image n*k is ema_lab's every=k update number n*k: decay_over(power, n*k, k).
            expected = [((n * k - k) / (n * k)) ** (schedule.gamma + 1) for n in range(1, steps // k + 1)]
            lab = ema_lab_reads(schedule, steps // k * k, every=k)[k - 1 :: k]
            rows.append(
                row(
                    "EDM2 PowerFunctionEMA",
                    f"stds=[{std}], batch_size={k}",
                    f"{schedule!r}, every={k}",
                    reads,
                    expected,
                    lab,
                )
            )
    return rows


def ultralytics_rows(steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as settings:
        os.environ["YOLO_CONFIG_DIR"] = settings  # ultralytics writes its settings file there on import
        from ultralytics.utils.torch_utils import ModelEMA as UltralyticsEMA

    rows = []
    for decay, tau in ((0.9999, 2000), (0.999, 500)):
        model = One()
        ema = UltralyticsEMA(model, decay=decay, tau=tau)
        reads = read_decays(lambda e=ema: e.ema.w, model, lambda n, e=ema, m=model: e.update(m), steps)
        lab = ema_lab_reads(decay, steps, tau=tau)
        # ModelEMA's number form is the ramp: its reads are the expected values.
        rows.append(
            row(
                "ultralytics ModelEMA",
                f"decay={decay}, tau={tau}",
                f"ModelEMA(decay={decay}, tau={tau})",
                reads,
                lab,
                lab,
            )
        )
    return rows


def every_k(total: int = 20_000, sigma_rel: float = 0.05) -> dict:
    """A weight equal to the step index: what each EMA reads after ``total`` steps, updating every k."""
    from ema_pytorch import KarrasEMA

    schedule = power(sigma_rel=sigma_rel)
    profile = total * (schedule.gamma + 1) / (schedule.gamma + 2)
    out = {"steps": total, "sigma_rel": sigma_rel, "gamma": schedule.gamma, "power profile predicts": profile}
    for k in (1, 10, 100):
        theirs_model, lab_model = One(), One()
        theirs = KarrasEMA(theirs_model, sigma_rel=sigma_rel, update_every=k)
        lab = ModelEMA(lab_model, schedule, every=k)
        with torch.no_grad():
            for t in range(1, total + 1):
                theirs_model.w.fill_(float(t))
                lab_model.w.fill_(float(t))
                theirs.update()
                lab.update(lab_model)
        a, b = theirs.ema_model.w.item(), lab.ema.w.item()
        out[f"k={k}"] = {
            "ema-pytorch KarrasEMA(update_every=k)": a,
            "ema_lab ModelEMA(power, every=k)": b,
            "KarrasEMA / profile": a / profile,
            "ema_lab / profile": b / profile,
        }
        print(
            f"every k={k}: KarrasEMA {a:.1f} ({a / profile:.1%}), ema_lab {b:.1f} ({b / profile:.1%})",
            flush=True,
        )
    return out


def walk(steps: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(steps, dim, generator=g).cumsum(0)


class Vec(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(dim))


@torch.no_grad()
def posthoc(steps: int, dim: int, every: int, phema: types.ModuleType | None) -> dict:
    from ema_pytorch import KarrasEMA, PostHocEMA
    from ema_pytorch import post_hoc_ema as their_module

    xs, target = walk(steps, dim), 0.075
    out: dict = {"steps": steps, "dim": dim, "snapshot every": every, "snapshot sigma_rels": [0.05, 0.10]}
    out["target sigma_rel"] = target

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).abs().max().item()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # ema-pytorch's own run, every step.
        model = Vec(dim)
        theirs = PostHocEMA(
            model,
            sigma_rels=(0.05, 0.10),
            update_every=1,
            checkpoint_every_num_steps=every,
            checkpoint_folder=str(tmp / "theirs"),
            checkpoint_dtype=torch.float32,
        )
        direct = KarrasEMA(model, sigma_rel=target, update_every=1)
        nearest = KarrasEMA(model, sigma_rel=0.10, update_every=1)
        for x in xs:
            model.w.copy_(x)
            theirs.update()
            direct.update()
            nearest.update()
        their_synth = theirs.synthesize_ema_model(sigma_rel=target).ema_model.w.detach().clone()
        # Their checkpoints <index>.<step>.pt (float32 state_dicts) as ema_lab snapshots.
        steps_i, gammas_i, converted = [], [], {}
        for f in sorted((tmp / "theirs").glob("*.pt")):
            index, step = map(int, f.stem.split("."))
            state = torch.load(f, weights_only=True)
            converted.setdefault(step, {})[theirs.gammas[index]] = {"w": state["ema_model.w"]}
            steps_i.append(step)
            gammas_i.append(theirs.gammas[index])
        for step, states in converted.items():
            save_step(check_folder(tmp / "converted"), step, states)
        our_synth = ours_posthoc.synthesize(tmp / "converted", target)["w"]
        gap = err(direct.ema_model.w, nearest.ema_model.w)
        run = "ema-pytorch PostHocEMA(update_every=1), tracked: KarrasEMA(sigma_rel=0.075)"
        rows = [
            (run, "ema-pytorch synthesis vs tracked", err(their_synth, direct.ema_model.w), gap),
            (run, "ema_lab synthesis (same snapshots) vs tracked", err(our_synth, direct.ema_model.w), gap),
            (run, "ema_lab synthesis vs ema-pytorch synthesis", err(our_synth, their_synth), gap),
        ]
        # The weights alone: ours (lstsq, sum 1), theirs (solve), EDM2's (solve, sum 1).
        t_i, g_i = torch.tensor(steps_i), torch.tensor(gammas_i, dtype=torch.float64)
        theirs_w = their_module.solve_weights(
            t_i, g_i, torch.tensor([steps]), torch.tensor([sigma_rel_to_gamma(target)])
        )[:, 0]
        ours_w = ours_posthoc.solve_weights(gammas_i, steps_i, steps, target_sigma_rel=target)
        weights = {
            "snapshots": len(steps_i),
            "sum of ema-pytorch's weights": theirs_w.sum().item(),
            "max |ema_lab - ema-pytorch / its sum|": (ours_w - theirs_w / theirs_w.sum()).abs().max().item(),
        }
        if phema is not None:
            stds = [phema.exp_to_std(g) for g in gammas_i]
            edm2_w = torch.from_numpy(phema.solve_posthoc_coefficients(steps_i, stds, steps, target)[:, 0])
            weights["max |ema_lab - EDM2|"] = (ours_w - edm2_w).abs().max().item()
        out["weights"] = weights
        # Its synthesis scaled to weights summing to 1: what is left is the solve and float32 sums.
        scaled = err(our_synth, their_synth / theirs_w.sum().item())
        rows.append((run, "ema_lab synthesis vs ema-pytorch synthesis / the sum of its weights", scaled, gap))

        # ema_lab alone: ModelEMA's of power schedules, snapshots by save_step.
        model = Vec(dim)
        emas = {s: ModelEMA(model, power(sigma_rel=s)) for s in (0.05, 0.10, target)}
        for n, x in enumerate(xs, start=1):
            model.w.copy_(x)
            for e in emas.values():
                e.update(model)
            if n % every == 0:
                states = {emas[s].schedule.gamma: {"w": emas[s].ema.w} for s in (0.05, 0.10)}
                save_step(check_folder(tmp / "ours"), n, states)
        synth = ours_posthoc.synthesize(tmp / "ours", target)["w"]
        lab_gap = err(emas[target].ema.w, emas[0.10].ema.w)
        run = "ema_lab ModelEMA(power(sigma_rel)) + save_step, tracked: ModelEMA(power(sigma_rel=0.075))"
        rows.append((run, "ema_lab synthesis vs tracked", err(synth, emas[target].ema.w), lab_gap))

        # ema-pytorch at its default update_every=100, against a power EMA updated every step.
        model = Vec(dim)
        default = PostHocEMA(
            model,
            sigma_rels=(0.05, 0.10),
            checkpoint_every_num_steps=every,
            checkpoint_folder=str(tmp / "default"),
            checkpoint_dtype=torch.float32,
        )
        for x in xs:
            model.w.copy_(x)
            default.update()
        synth = default.synthesize_ema_model(sigma_rel=target).ema_model.w
        run = "ema-pytorch PostHocEMA (default update_every=100), tracked: ema_lab's, every step"
        rows.append((run, "ema-pytorch synthesis vs tracked", err(synth, emas[target].ema.w), lab_gap))
    keys = ("run", "comparison", "max abs difference", "the gap: max |tracked 0.075 - tracked 0.10|")
    out["comparisons"] = [dict(zip(keys, r)) for r in rows]
    for r in rows:
        print(f"{r[0]}: {r[1]}: {r[2]:.4g} ({r[2] / r[3]:.3%} of the gap)", flush=True)
    print(out["weights"], flush=True)
    return out


def versions() -> dict[str, str | None]:
    found = {}
    for dist in PEERS:
        try:
            found[dist] = md.version(dist)
        except md.PackageNotFoundError:
            found[dist] = None
    return found


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def markdown(record: dict) -> str:
    lines = [
        "# The peers' decay schedules and post-hoc EMA against ema_lab's",
        "",
        f"{record['date']}, {record['machine']}, Python {record['python']}; peers: "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items())
        + (f", EDM2 {record['edm2 commit'][:12]}" if record.get("edm2 commit") else "")
        + ". Written by `benchmarks/peer_schedules.py`.",
        "",
        "Each peer updates a one-element float64 model whose EMA is set to 1 and the model to 0 before each "
        "update: the EMA then reads the decay the update applied.",
        "",
        "| peer | peer arguments | ema_lab | steps | max difference | bitwise equal to ema_lab ModelEMA |",
        "|---|---|---|---|---|---|",
    ]
    for r in record["schedules"]:
        equal = r.get("steps bitwise equal to ema_lab ModelEMA")
        lines.append(
            f"| {r['peer']} | `{r['peer arguments']}` | `{r['ema_lab']}` | {r['steps']:,} | "
            f"{r['max |peer - ema_lab schedule|']:.3g} | {'-' if equal is None else f'{equal:,}'} |"
        )
    ek = record["every k"]
    lines += [
        "",
        f"## Update every k steps (a weight equal to the step index, {ek['steps']:,} steps, sigma_rel "
        f"{ek['sigma_rel']}: the power profile predicts {ek['power profile predicts']:,.0f})",
        "",
        "| k | ema-pytorch KarrasEMA(update_every=k) | ema_lab ModelEMA(power, every=k) |",
        "|---|---|---|",
    ]
    for k in (1, 10, 100):
        v = ek[f"k={k}"]
        a, b = v["ema-pytorch KarrasEMA(update_every=k)"], v["ema_lab ModelEMA(power, every=k)"]
        lines.append(
            f"| {k} | {a:,.0f} ({v['KarrasEMA / profile']:.1%}) | {b:,.0f} ({v['ema_lab / profile']:.1%}) |"
        )
    ph = record["posthoc"]
    lines += [
        "",
        f"## Post-hoc EMA (float32 random walk of {ph['dim']} weights, {ph['steps']:,} steps, snapshots of "
        f"sigma_rel 0.05 and 0.10 every {ph['snapshot every']}, synthesized sigma_rel "
        f"{ph['target sigma_rel']})",
        "",
        "The gap: the largest difference between the tracked EMAs of sigma_rel 0.075 and 0.10 (what taking "
        "the nearest snapshot EMA instead would cost).",
        "",
        "| run | comparison | max abs difference | fraction of the gap |",
        "|---|---|---|---|",
    ]
    for c in ph["comparisons"]:
        d, gap = c["max abs difference"], c["the gap: max |tracked 0.075 - tracked 0.10|"]
        lines.append(f"| {c['run']} | {c['comparison']} | {d:.3g} | {d / gap:.3%} |")
    lines += ["", "Weights of the snapshots, ema_lab's against the peers' (same snapshots):", ""]
    lines += [f"- {k}: {v:.4g}" for k, v in ph["weights"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=100_000, help="updates per schedule comparison")
    parser.add_argument("--posthoc-steps", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=1000, help="weights in the post-hoc walk")
    parser.add_argument("--every", type=int, default=500, help="post-hoc snapshot interval")
    parser.add_argument("--edm2", type=Path, help="a checkout or bare clone of NVlabs/edm2")
    add_study_out(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    phema, commit = edm2_phema(args.edm2) if args.edm2 else (None, None)
    rows = timm_rows(args.steps) + diffusers_rows(args.steps) + ema_pytorch_rows(args.steps)
    if phema is not None:
        rows += edm2_rows(phema, args.steps)
    rows += ultralytics_rows(args.steps)
    record = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{cpu()}, 1 thread",
        "python": platform.python_version(),
        "versions": versions(),
        "edm2 commit": commit,
        "schedules": rows,
        "every k": every_k(),
        "posthoc": posthoc(args.posthoc_steps, args.dim, args.every, phema),
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{NAME}.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / f"{NAME}.md").write_text(markdown(record))
        print(f"wrote {shown(args.out)}{NAME}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
