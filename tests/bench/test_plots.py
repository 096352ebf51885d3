"""The bench's figures keep their legends and notes off the data they draw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the bench extra is not installed")

from matplotlib.backends.backend_agg import FigureCanvasAgg

from ema_lab.bench.plots import plot_compare, plot_cost_model

RESULTS = Path(__file__).resolve().parents[2] / "results"
FULL = RESULTS / "linux-amd-epyc-2c_2026-12-03T093048Z_full_t1_cpu.json"  # 4 models, cost model v3
NO_GPT2 = RESULTS / "linux-intel-xeon-2-80ghz-2c_2026-12-03T201556Z_full_t1_cpu.json"
OLD = RESULTS / "linux-amd-epyc-2c_2026-12-02.json"  # migrated from schema 1: no cache size recorded


@pytest.mark.parametrize("path", [FULL, NO_GPT2, OLD], ids=["epyc", "xeon", "migrated"])
def test_cost_model_legends_lie_outside_every_panel(path: Path) -> None:
    fig = plot_cost_model(json.loads(path.read_text())["cost_model"]["cpu"])
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 2
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes), path.name
        assert fig.bbox.contains(box.x1 - 1, box.y0 + 1)  # and still inside the figure


def test_compare_names_an_unmeasured_model_in_its_title_not_over_the_bars() -> None:
    fig = plot_compare([json.loads(FULL.read_text()), json.loads(NO_GPT2.read_text())])
    titles = {ax.get_title().split("\n")[0]: ax for ax in fig.axes}
    assert titles["gpt2"].get_title() == "gpt2\nnot measured in run 2"
    assert titles["yolo"].get_title() == "yolo"
    assert not [t.get_text() for ax in fig.axes for t in ax.texts]  # nothing drawn inside a panel
