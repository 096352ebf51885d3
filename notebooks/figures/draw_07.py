"""Draw notebook 07's diagram (no data, two formulas): ``python notebooks/figures/draw_07.py``."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
plt.rcParams.update({"svg.fonttype": "none", "font.size": 13, "font.family": "DejaVu Sans"})
plt.rcParams["svg.hashsalt"] = "07"  # the same ids on every redraw: a redraw that changes nothing is no diff


def shares(decays: list[float]) -> list[float]:
    """What the EMA after len(decays) updates gives the initial weights, then each step (oldest first)."""
    out, kept = [], 1.0
    for d in reversed(decays):  # the newest step keeps 1 - d; everything older is multiplied by d
        out.append(kept * (1 - d))
        kept *= d
    return [kept, *reversed(out)]


def start_bias(n: int = 10) -> None:
    """07: after 10 updates a constant d = 0.999 still reads the initial weights; a warm-up has let go.

    The warm-up is the one timm and diffusers use when asked (``use_warmup``, ``use_ema_warmup``),
    ``1 - (1 + (n - 1) / gamma) ** -power`` with their defaults gamma = 1, power = 2/3
    (ema_lab.schedules.warmup), which copies the model at n = 1.
    """
    rows = [
        ("constant d = 0.999", [0.999] * n, "#c0504d"),
        (r"warm-up $d(n) = 1 - n^{-2/3}$", [1 - k ** (-2 / 3) for k in range(1, n + 1)], "#3b6ea5"),
    ]
    fig, ax = plt.subplots(figsize=(9, 3.9))
    ax.set(xlim=(-0.2, n + 1.2), ylim=(-0.9, 2 * 2.4 + 0.2))
    ax.axis("off")
    for r, (label, decays, color) in enumerate(rows):
        y = (len(rows) - 1 - r) * 2.4
        w = shares(decays)
        ax.text(-0.1, y + 1.55, f"{label}: the EMA after {n} updates is", fontweight="bold")
        for i, s in enumerate(w):
            shade = 0.12 + 0.88 * s / max(w)  # the larger the share, the darker the box
            ax.add_patch(Rectangle((i + 0.05, y), 0.9, 1.0, fc=color, alpha=shade, ec=color))
            text = f"{100 * s:.0f}%" if s >= 0.01 or s == 0 else f"{100 * s:.1f}%"
            ink = "white" if shade > 0.56 else "black"
            ax.text(i + 0.5, y + 0.5, text, ha="center", va="center", color=ink)
    for i in range(n + 1):
        name = "initial\nweights" if i == 0 else f"step {i}"
        ax.text(i + 0.5, -0.45, name, ha="center", va="center", fontsize=11)
    fig.savefig(HERE / "07_start_bias.svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    start_bias()
