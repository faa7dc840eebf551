"""The bench's figures follow the rules of ``fastdp/bench/plots.py``'s docstring: checked on
the figures drawn from committed runs (CPU suites and the one-GPU run), every figure kind."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("matplotlib")

from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from fastdp.bench import plots  # noqa: E402

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results"
)
RUNS = (
    "cpu-2core-2026-11-24-snapshots",
    "cpu-xeon-2core-2026-11-22-cpu-suites",
    "gpu-h100-2026-11-24-shared-gpu/gpu-comm",
    "gpu-h100-2026-11-24-shared-gpu/gpu-steps",
)
PALETTE = {c.lower() for c in plots.OKABE_ITO.values()}


def _figures() -> list[tuple[str, object]]:
    out = []
    for run in RUNS:
        with open(os.path.join(RESULTS, run, "results.json")) as f:
            records = json.load(f)["records"]
        out += [(f"{run}/{name}", fig) for name, fig in plots.figures(records).items()]
    return out


FIGURES = _figures()


def test_every_figure_kind_is_drawn():
    names = {name.rsplit("/", 1)[1] for name, _ in FIGURES}
    assert {
        "launch_x_floor.png",
        "steps_cpu-replicas.png",
        "steps_passthrough.png",
        "steps_gpu-steps.png",
        "overhead.png",
        "replicate.png",
        "bandwidth_gpu-comm.png",
    } <= names


@pytest.fixture(params=FIGURES, ids=[name for name, _ in FIGURES])
def fig(request):
    _, figure = request.param
    figure.canvas.draw()
    yield figure
    plots.plt().close(figure)


def _axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def test_at_most_1600_px_wide(fig):
    assert fig.get_figwidth() * plots.DPI <= 1600


def test_text_is_at_least_10_pt_and_horizontal(fig):
    ylabels = {id(ax.yaxis.label) for ax in fig.axes}
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip():
            continue
        assert t.get_fontsize() >= 10, (t.get_text(), t.get_fontsize())
        if id(t) not in ylabels:
            assert t.get_rotation() == 0, t.get_text()


def test_axes_are_labelled_and_titled(fig):
    for ax in _axes(fig):
        assert ax.get_xlabel(), ax
        assert ax.get_title() or ax.get_title(loc="left") or fig._suptitle is not None


def test_no_bars_on_log_axes_and_bar_values_printed(fig):
    for ax in _axes(fig):
        bars = [b for c in ax.containers if isinstance(c, BarContainer) for b in c]
        if bars:
            assert ax.get_xscale() == ax.get_yscale() == "linear"
            assert len([t for t in ax.texts if t.get_text().strip()]) >= len(bars)


def _series(fig) -> list[tuple[str, object]]:
    """(label, artist) of every labelled line and bar group plotted."""
    out = []
    for ax in _axes(fig):
        out += [
            (line.get_label(), line)
            for line in ax.get_lines()
            if not line.get_label().startswith("_")
        ]
        out += [(c.get_label(), c) for c in ax.containers if isinstance(c, BarContainer)]
    return out


def test_every_series_is_in_the_legend(fig):
    legends = [lg for lg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)] if lg]
    shown = {t.get_text() for lg in legends for t in lg.get_texts()}
    series = _series(fig)
    assert series and all(label in shown for label, _ in series), {
        label for label, _ in series
    } - shown
    unlabelled = [
        line
        for ax in _axes(fig)
        for line in ax.get_lines()
        if line.get_label().startswith("_") and line.get_marker() not in ("None", None)
    ]
    assert not unlabelled  # a marker nobody can look up


def _style(artist) -> tuple:
    from matplotlib.colors import to_hex

    if isinstance(artist, Line2D):
        return (to_hex(artist.get_color()), artist.get_marker(), artist.get_linestyle())
    return (to_hex(artist.patches[0].get_facecolor()), "bar", "")


def test_series_colours_are_colour_blind_safe_and_distinct(fig):
    styles: dict[str, tuple] = {}
    for label, artist in _series(fig):
        styles.setdefault(label, _style(artist))
    assert {s[0] for s in styles.values()} <= PALETTE
    assert len(set(styles.values())) == len(styles), styles
