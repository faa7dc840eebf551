"""PNG plots (matplotlib, Agg backend): ``figures(records)`` builds them, ``write_all`` saves them.
Without matplotlib ``available()`` is False and the caller writes none.

NOTE [ Plots a person reads ]
Each step suite's headline (``steps_<suite>.png``) answers two questions at a glance: how far
fastdp is from the chunked floor (the bare module on the same chunks in turn, = 1) and how much
faster it is than DataParallel's algorithm. Every figure: at most 1600 px wide, text >= 10 pt and
horizontal (axis titles of y axes aside), bars only on linear axes with their values printed,
every plotted series in the legend, colours from the Okabe-Ito colour-blind-safe palette.
tests/test_bench_plots.py checks these on the figures of a real run.
"""

from __future__ import annotations

import os
from typing import Any

from fastdp.bench.report import STEP_SUITES

# Okabe & Ito, "Color Universal Design": distinct under the common colour-vision deficiencies.
OKABE_ITO = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky": "#56B4E9",
    "green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "purple": "#CC79A7",
    "grey": "#999999",
}
COLORS = {
    "fastdp": OKABE_ITO["blue"],
    "fastdp_noext": OKABE_ITO["sky"],
    "fastdp_threads": OKABE_ITO["orange"],
    "fastdp_inline": OKABE_ITO["green"],
    "dp_algo": OKABE_ITO["vermillion"],
    "torch_dp": OKABE_ITO["purple"],
    "torch": OKABE_ITO["purple"],
    "bare": OKABE_ITO["black"],
    "floor": OKABE_ITO["black"],
}
LABELS = {
    "fastdp": "fastdp",
    "fastdp_noext": "fastdp, extension disabled",
    "fastdp_threads": "fastdp, launch=threads",
    "fastdp_inline": "fastdp, launch=inline",
    "dp_algo": "DataParallel's algorithm (fresh replicas)",
    "torch_dp": "nn.DataParallel",
    "torch": "torch.nn.parallel",
    "bare": "bare module on the whole batch",
    "floor": "chunked floor: bare module on the same chunks in turn (= 1)",
}
MARKERS = {
    "fastdp": "o",
    "fastdp_noext": "v",
    "fastdp_threads": "^",
    "fastdp_inline": "s",
    "dp_algo": "D",
    "torch_dp": "P",
    "torch": "P",
}
HEADLINE_MODES = ("fastdp", "dp_algo", "torch_dp")
STRATEGIES = (
    ("threads", OKABE_ITO["orange"]),
    ("inline", OKABE_ITO["green"]),
    ("auto", OKABE_ITO["blue"]),
)
RC = {
    "font.size": 11,
    "axes.titlesize": 11,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "figure.titlesize": 12,
}
WIDTH_IN, DPI = 11.0, 110  # 1210 px
BAR_IN = 0.24  # height of one horizontal bar


def available() -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        return False
    return True


def plt():  # noqa: ANN201
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def legend_below(fig, axes) -> None:  # noqa: ANN001
    """One legend for the figure, below the axes, each label once."""
    seen: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(
        list(seen.values()), list(seen), loc="lower center", ncol=min(len(seen), 2), frameon=False
    )


def finish(fig, legend_in: float) -> None:  # noqa: ANN001
    """Lay the axes out between the legend (``legend_in`` inches at the bottom) and the title."""
    h = fig.get_figheight()
    fig.tight_layout(rect=(0, legend_in / h, 1, 1 - 0.45 / h))


def times(v: float) -> str:
    """A ratio as printed on a plot: 3 significant digits, never rounded to 0 (0.0031x)."""
    return f"{v:.3g}x" if v >= 0.01 else f"{v:.2g}x"


def figures(records: list[dict]) -> dict[str, Any]:
    """File name -> matplotlib Figure, for every plot this run's records allow."""
    from fastdp.bench import plots_bars, plots_lines

    out: dict[str, Any] = {}
    with plt().rc_context(RC):
        out["launch_x_floor.png"] = plots_bars.launch_figure(records)
        for s in dict.fromkeys(r.get("suite") for r in records if r.get("suite")):
            if s in STEP_SUITES:
                out[f"steps_{s}.png"] = plots_bars.steps_figure(records, s)
            elif s == "replicate":
                out["replicate.png"] = plots_lines.replicate_figure(records)
            elif s.startswith("overhead"):
                out[f"{s}.png"] = plots_lines.overhead_figure(records, s)
            elif s.endswith("comm"):
                out[f"bandwidth_{s}.png"] = plots_lines.bandwidth_figure(records, s)
    return {k: v for k, v in out.items() if v is not None}


def write_all(records: list[dict], out: str) -> list[str]:
    paths = []
    for name, fig in figures(records).items():
        paths.append(os.path.join(out, name))
        fig.savefig(paths[-1], dpi=DPI)
        plt().close(fig)
    return paths


if __name__ == "__main__":  # python -m fastdp.bench.plots RESULTS.json [OUT_DIR]: redraw
    import json
    import sys

    src = sys.argv[1]
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.abspath(src))
    os.makedirs(dst, exist_ok=True)
    with open(src) as f:
        print("\n".join(write_all(json.load(f)["records"], dst)))
