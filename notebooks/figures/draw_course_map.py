"""Draw the course map each notebook opens with: ``python notebooks/figures/draw_course_map.py``.

Seven boxes, one per notebook, in reading order; the notebook at hand is filled. No data.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

HERE = Path(__file__).resolve().parent
plt.rcParams.update(
    {"svg.hashsalt": "course_map", "svg.fonttype": "none", "font.size": 13, "font.family": "DejaVu Sans"}
)

# notebook number -> its subject, two short lines
COURSE = {
    1: "what an op\ncosts",
    2: "the EMA\nand its step",
    3: "the float64\nbuffer bug",
    4: "timing\nhonestly",
    5: "one buffer,\none lerp_",
    6: "many\nprocesses",
    7: "choosing\nthe decay",
}


def course_map(here: int) -> None:
    """The seven notebooks in a row; ``here`` filled, those before it a lighter shade."""
    width, gap = 1.36, 0.16
    fig, ax = plt.subplots(figsize=(9.6, 1.5))
    ax.set(xlim=(-0.05, len(COURSE) * (width + gap) - gap + 0.05), ylim=(-0.05, 1.25))
    ax.axis("off")
    for i, (number, subject) in enumerate(COURSE.items()):
        x = i * (width + gap)
        fill, ink, edge = (
            ("#3b6ea5", "white", "#1f3f66") if number == here else ("#eef2f7", "#333", "#9aa7b8")
        )
        ax.add_patch(
            FancyBboxPatch(
                (x, 0.0), width, 1.0, boxstyle="round,pad=0.0,rounding_size=0.08", fc=fill, ec=edge, lw=1.2
            )
        )
        ax.text(x + width / 2, 0.74, f"{number:02d}", ha="center", va="center", color=ink, fontweight="bold")
        ax.text(
            x + width / 2, 0.33, subject, ha="center", va="center", color=ink, fontsize=11, linespacing=1.1
        )
        if i:
            ax.annotate(
                "",
                xy=(x - 0.02, 0.5),
                xytext=(x - gap + 0.02, 0.5),
                arrowprops={"arrowstyle": "->", "color": "#777"},
            )
    fig.savefig(HERE / f"course_map_{here:02d}.svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    for number in COURSE:
        course_map(number)
