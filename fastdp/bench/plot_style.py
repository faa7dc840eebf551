"""The plots' shared style: palette, labels, sizes and the helpers every figure uses
(NOTE [ Plots a person reads ] in ``fastdp/bench/plots.py``)."""

from __future__ import annotations

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
