"""Draw the idea diagrams of notebooks 04 and 05 (no data): ``python notebooks/figures/draw_04_05.py``."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

HERE = Path(__file__).resolve().parent
plt.rcParams.update(
    {"svg.hashsalt": "ema_lab", "svg.fonttype": "none", "font.size": 13, "font.family": "DejaVu Sans"}
)


def box(ax, x: float, y: float, w: float, h: float, text: str, color: str) -> None:
    """A rounded box with centred text."""
    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#444")
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=12)


def arrow(ax, xy_from: tuple[float, float], xy_to: tuple[float, float], text: str = "") -> None:
    """An arrow with an optional label at its start."""
    ax.annotate(text, xy=xy_to, xytext=xy_from, fontsize=11, arrowprops={"arrowstyle": "->", "color": "#444"})


def sync_points() -> None:
    """04: the host queues kernels and runs ahead; .item() (or print, .cpu()) waits for the GPU to finish."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.set(xlim=(0, 10), ylim=(0, 4))
    ax.axis("off")
    ax.text(0.05, 3.0, "host\n(Python)", va="center", fontweight="bold")
    ax.text(0.05, 1.0, "GPU", va="center", fontweight="bold")
    for i, x in enumerate((1.4, 2.3, 3.2)):
        box(ax, x, 2.7, 0.8, 0.6, f"op {i + 1}", "#cfe2f3")
        box(ax, 2.0 + 1.6 * i, 0.7, 1.5, 0.6, f"kernel {i + 1}", "#d9ead3")
        arrow(ax, (x + 0.4, 2.7), (2.6 + 1.6 * i, 1.3))
    box(ax, 4.2, 2.7, 2.4, 0.6, "x.item(): waits", "#f4cccc")
    ax.plot([6.6, 6.9], [3.0, 3.0], color="#c00", lw=2, ls=":")
    arrow(ax, (6.8, 1.0), (6.9, 2.65))
    ax.text(7.05, 1.9, "value copied\nto the host", fontsize=11)
    box(ax, 7.0, 2.7, 1.6, 0.6, "next line", "#cfe2f3")
    ax.text(
        5.0,
        0.15,
        "the same wait: print(x), x.cpu(), x.tolist(), torch.cuda.synchronize()",
        ha="center",
        fontsize=11,
    )
    fig.savefig(HERE / "04_sync_points.svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


def ulp() -> None:
    """05: near 1.0, bfloat16 values lie 2^-7 apart; a step of 1e-6 ends nearer 1.0 and rounds back."""
    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.set(xlim=(-0.2, 10.2), ylim=(-1.4, 1.6))
    ax.axis("off")
    ax.plot([0, 10], [0, 0], color="#444")
    for x, label in ((1, "1.0"), (9, "1.0 + 2⁻⁷\n(= 1.0078)")):
        ax.plot([x, x], [-0.2, 0.2], color="#444", lw=2)
        ax.text(x, -0.45, label, ha="center", va="top")
    ax.axvline(5, ymin=0.35, ymax=0.6, color="#c00", ls="--")
    ax.text(5, -0.45, "half-way\n(half an ulp)", ha="center", va="top", color="#c00")
    ax.plot(1.05, 0, "o", color="tab:blue")
    arrow(ax, (1.05, 1.1), (1.05, 0.12))
    ax.text(1.25, 1.1, "EMA after one step: 1.0 + 0.0000008 is nearer 1.0: rounds back to 1.0", fontsize=12)
    ax.text(9.2, 0.35, "next bf16 value", fontsize=11)
    fig.savefig(HERE / "05_ulp.svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


def stale_views() -> None:
    """05: model.half() gives each parameter new memory; the flat buffer still holds the old values."""
    fig, ax = plt.subplots(figsize=(9, 3.0))
    ax.set(xlim=(0, 10), ylim=(0, 3.4))
    ax.axis("off")
    box(ax, 0.2, 2.2, 4.0, 0.7, "model_flat (fp32)", "#d9ead3")
    for i in range(4):
        box(ax, 0.3 + i * 1.0, 0.4, 0.8, 0.6, f"p{i}", "#cfe2f3")
        arrow(ax, (0.7 + i * 1.0, 1.0), (0.7 + i * 1.0, 2.15))
    ax.text(2.2, 1.55, "before: views", ha="center", fontsize=11)
    ax.text(5.0, 1.6, "model.half()", ha="center", fontweight="bold")
    arrow(ax, (4.4, 1.3), (5.6, 1.3))
    box(ax, 5.8, 2.2, 4.0, 0.7, "model_flat: no longer the model", "#eeeeee")
    for i in range(4):
        box(ax, 5.9 + i * 1.0, 0.4, 0.8, 0.6, f"p{i}", "#fce5cd")
    ax.text(7.8, 1.55, "after: new fp16 memory", ha="center", fontsize=11, color="#c00")
    fig.savefig(HERE / "05_stale_views.svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    sync_points()
    ulp()
    stale_views()
