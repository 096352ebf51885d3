"""Post-hoc EMA (Karras et al. 2024): power-function EMAs saved as snapshots, and the EMA of any length
synthesized from them, as EDM2's ``training/phema.py`` does (ema-pytorch leaves the weights unscaled)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from .checks import check_gamma, check_int, is_int, one_of, require
from .ema import ModelEMA
from .pairs import key_diff
from .schedules import power, sigma_rel_to_gamma
from .snapshots import check_folder, check_step, list_snapshots, read_snapshot, remove_step, save_step

__all__ = ["PostHocEMA", "power_inner_products", "solve_weights", "synthesize"]


def power_inner_products(t_a: Tensor, gamma_a: Tensor, t_b: Tensor, gamma_b: Tensor) -> Tensor:
    """Inner products of power profiles ``(g + 1) / t * (x / t) ** g`` (EDM2's power_function_correlation)."""
    t_short, t_long = torch.minimum(t_a, t_b), torch.maximum(t_a, t_b)
    g_long = torch.where(t_a > t_b, gamma_a, gamma_b)
    return (gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1) * (t_short / t_long) ** g_long / t_long


def solve_weights(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[int],
    target_step: int,
    *,
    target_gamma: float | None = None,
    target_sigma_rel: float | None = None,
) -> Tensor:
    """The float64 weights, summing to 1, of the snapshots whose sum best fits the target (Algorithm 3)."""
    one_of("target_gamma", target_gamma, "target_sigma_rel", target_sigma_rel)
    sizes = (len(snapshot_gammas), len(snapshot_steps))
    require(sizes[0] == sizes[1] > 0, "the snapshot gammas and steps", sizes, "as many, at least one")
    for g, s in zip(snapshot_gammas, snapshot_steps):
        check_gamma("a snapshot gamma", g)
        check_step("a snapshot step", s)
    check_step("target_step", target_step)
    target_gamma = sigma_rel_to_gamma(target_sigma_rel) if target_gamma is None else target_gamma
    check_gamma("target_gamma", target_gamma)
    g, t = (torch.tensor(x, dtype=torch.float64)[:, None] for x in (snapshot_gammas, snapshot_steps))
    gram = power_inner_products(t, g, t.T, g.T)
    target = [torch.tensor(float(x), dtype=torch.float64) for x in (target_step, target_gamma)]
    # lstsq: the Gram matrix may be singular.
    weights = torch.linalg.lstsq(gram, power_inner_products(t, g, *target), driver="gelsd").solution[:, 0]
    return weights / weights.sum()  # as EDM2: weights that never move come out exact


def synthesize(
    folder: str | os.PathLike,
    sigma_rel: float | None = None,
    step: int | None = None,
    *,
    gamma: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """The EMA of length ``sigma_rel`` (or ``gamma``) at ``step`` (default: the last), from the snapshots."""
    one_of("sigma_rel", sigma_rel, "gamma", gamma)
    require(dtype in (torch.float32, torch.float64), "dtype", dtype, "torch.float32 or torch.float64")
    if not (snapshots := list_snapshots(folder)):
        raise ValueError(f"no snapshots in {str(folder)!r}")
    steps = sorted({s.step for s in snapshots})
    step = steps[-1] if step is None else step
    require(step in steps, "step", step, f"one of the snapshots' steps ({steps[0]} .. {steps[-1]})")
    used = [s for s in snapshots if s.step <= step]
    weights = solve_weights(
        [s.gamma for s in used], [s.step for s in used], step, target_gamma=gamma, target_sigma_rel=sigma_rel
    )
    out: dict[str, Tensor] = {}
    first: tuple = ()  # the first snapshot's run and layout: every other must be of that run and model
    for snapshot, w in zip(used, weights.tolist()):
        data = read_snapshot(snapshot)
        tensors = data["tensors"]
        kind = {
            k: f"{tuple(v.shape)} {'' if v.is_floating_point() else 'not '}float" for k, v in tensors.items()
        }
        run, layout = first = first or (data["run"], kind)
        if data["run"] != run:
            why = f"of run {data['run']!r}, {used[0].path} of run {run!r}"
            raise ValueError(f"{snapshot.path} is {why}: a folder holds the snapshots of one run")
        if kind != layout:
            bad = [k for k in kind if kind[k] != layout.get(k)]
            why = key_diff(layout, kind) if kind.keys() != layout.keys() else f"{bad[0]!r}: {kind[bad[0]]}"
            raise ValueError(f"{snapshot.path} holds another model's tensors than {used[0].path} ({why})")
        for k, v in tensors.items():
            if k in out and v.is_floating_point():
                out[k].add_(v, alpha=w)
            else:
                out[k] = v.to(dtype) * w if v.is_floating_point() else v.clone()
        del data, tensors  # unmaps the file before the next one is read
    return out


class PostHocEMA(ModelEMA):
    """Power-function EMAs, one per length in ``sigma_rels``, saved every ``snapshot_every`` updates."""

    def __init__(
        self,
        model: nn.Module,
        folder: str | os.PathLike,
        sigma_rels: Iterable[float] = (0.05, 0.10),
        snapshot_every: int = 1000,
        updates: int = 0,
    ) -> None:
        lengths = []  # a list, a tuple, a NumPy array: any non-empty run of numbers
        with contextlib.suppress(TypeError):
            lengths = [] if isinstance(sigma_rels, (str, bytes)) else list(sigma_rels)
        if not lengths:
            raise ValueError(f"sigma_rels must be a non-empty sequence of lengths, got {sigma_rels!r}")
        schedules = [power(sigma_rel=s) for s in lengths]
        gammas = [s.gamma for s in schedules]
        if len(set(gammas)) != len(gammas):
            raise ValueError(f"sigma_rels must be distinct profiles, got {lengths!r} (gammas {gammas})")
        check_int("snapshot_every", snapshot_every, 1)
        check_int("updates", updates, 0)
        self.folder, self.snapshot_every = check_folder(folder), snapshot_every  # a bad folder fails here
        listed = list_snapshots(self.folder)
        if later := [s.step for s in listed if s.step > updates]:
            why = f"resume with updates={max(later)} (then load any checkpoint of it) or give an empty folder"
            raise ValueError(f"{self.folder} holds snapshots up to update {max(later)}: {why}")
        super().__init__(model, decay=schedules, updates=updates, strategy="flat")
        self.run, self.saved = secrets.token_hex(8), updates  # the last update this run saved (or resumed at)
        if updates:
            saved = {s.gamma: s for s in listed if s.step == updates}
            for ema, s in zip(self.emas, self.schedules):
                if s.gamma not in saved:
                    raise ValueError(f"no snapshot of update {updates}, gamma {s.gamma!r} in {self.folder}")
                data = read_snapshot(saved[s.gamma])
                ema.load_state_dict(data["tensors"])
                self.run = data["run"]

    def update(self, model: nn.Module) -> None:
        """:meth:`ModelEMA.update`, saving every ``snapshot_every`` updates (a failed save undoes it)."""
        if not self.enabled or (self.updates + 1) % self.snapshot_every:
            super().update(model)
            return
        copies = [{k: v.clone() for k, v in ema.state_dict().items()} for ema in self.emas]  # to undo it
        super().update(model)
        try:
            self.save()
        except BaseException:
            for ema, copy in zip(self.emas, copies):  # in place: the step's buffers stay the EMAs' memory
                for k, v in ema.state_dict().items():  # detached: no autograd
                    v.copy_(copy[k])
            self.updates -= 1  # as before it
            raise

    def save(self) -> None:
        """Save every EMA's snapshot of this update as one step, after removing this run's own later steps."""
        later = [s for s in list_snapshots(self.folder) if s.step > self.saved]
        if others := [s.step for s in later if read_snapshot(s)["run"] != self.run]:
            why = f"after run {self.run}'s last save ({self.saved}): another run writes there"
            raise ValueError(f"{self.folder} holds update {max(others)}, {why}; give each run its own folder")
        for step in sorted({s.step for s in later}, reverse=True):  # the latest first: a prefix stays
            remove_step(self.folder, step)
        states = {s.gamma: e.state_dict() for e, s in zip(self.emas, self.schedules)}
        save_step(self.folder, self.updates, states, self.run)
        self.saved = self.updates

    def state_dict(self) -> dict:
        """:meth:`ModelEMA.state_dict`, the run it continues and the last update it saved (``saved``)."""
        return {**super().state_dict(), "run": self.run, "saved": self.saved}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``'s run; its steps after ``state``'s last save are replaced as it saves."""
        if isinstance(state, dict) and "saved" not in state:  # a state saved before it held "saved": as then
            state = {**state, "saved": self.saved}
        super().load_state_dict(state)
        self.run, self.saved = state["run"], state["saved"]

    def _check_state(self, state: dict) -> None:
        super()._check_state(state)  # a dict of the keys of state_dict(), "updates" an int
        if self.saved and state["run"] != self.run:
            why = f"the snapshots in {self.folder} of {self.run!r}"
            raise ValueError(f"the state is of run {state['run']!r}, {why}")
        if not (is_int(state["saved"]) and 0 <= state["saved"] <= state["updates"]):
            why = f"need an int in [0, {state['updates']}]"
            raise ValueError(f"the state's saved is {state['saved']!r}: {why}")

    def synthesize(self, sigma_rel: float, step: int | None = None) -> dict[str, Tensor]:
        """The state_dict of the EMA of length ``sigma_rel`` at ``step`` (default: the last snapshot)."""
        return synthesize(self.folder, sigma_rel, step)
