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

from fastdp.bench.plot_style import DPI, OKABE_ITO, RC, available, plt
from fastdp.bench.report import STEP_SUITES

__all__ = ["OKABE_ITO", "DPI", "available", "plt", "figures", "write_all"]


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
