"""PNG plots (matplotlib, Agg backend): ``figures(records)`` builds them, ``write_all`` saves them;
without matplotlib ``available()`` is False and the caller writes none.

Plots a person reads: each step suite's headline (``steps_<suite>.png``) answers two questions at a
glance: how far fastdp is from the chunked floor (the bare module on the same chunks in turn, = 1)
and how much faster it is than DataParallel's algorithm. Every figure: at most 1600 px wide, text >=
10 pt and horizontal (axis titles of y axes aside), bars only on linear axes with their values
printed, every plotted series in the legend, colours from the Okabe-Ito colour-blind-safe palette.
tests/test_tools_bench_plots.py checks these on the figures of a real run.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any

from fastdp.bench.report import LAUNCH_MODES, STEP_SUITES, by_mode, launch_entries, med

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
# mode -> (colour, marker, legend label)
STYLE = {
    "fastdp": ("blue", "o", "fastdp"),
    "fastdp_noext": ("sky", "v", "fastdp, extension disabled"),
    "fastdp_threads": ("orange", "^", "fastdp, launch=threads"),
    "fastdp_inline": ("green", "s", "fastdp, launch=inline"),
    "dp_algo": ("vermillion", "D", "DataParallel's algorithm (fresh replicas)"),
    "torch_dp": ("purple", "P", "nn.DataParallel"),
    "torch": ("purple", "P", "torch.nn.parallel"),
    "bare": ("black", None, "bare module on the whole batch"),
    "floor": ("black", None, "chunked floor: bare module on the same chunks in turn (= 1)"),
}
COLORS = {m: OKABE_ITO[c] for m, (c, _, _) in STYLE.items()}
MARKERS = {m: k for m, (_, k, _) in STYLE.items() if k}
LABELS = {m: label for m, (_, _, label) in STYLE.items()}
HEADLINE_MODES = ("fastdp", "dp_algo", "torch_dp")
RC = {"font.size": 11, "axes.titlesize": 11, "axes.labelsize": 11, "figure.titlesize": 12}
RC |= dict.fromkeys(("xtick.labelsize", "ytick.labelsize", "legend.fontsize"), 10)  # >= 10 pt
WIDTH_IN, DPI = 11.0, 110  # 1210 px
BAR_IN = 0.24  # height of one horizontal bar
LABEL_BOX = {"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.8}


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def available() -> bool:
    try:
        plt()
    except ImportError:
        return False
    return True


def legend_below(fig, axes) -> None:
    """One legend for the figure, below the axes, each label once."""
    seen: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(
        list(seen.values()), list(seen), loc="lower center", ncol=min(len(seen), 2), frameon=False
    )


def finish(fig, legend_in: float) -> None:
    """Lay the axes out between the legend (``legend_in`` inches at the bottom) and the title."""
    h = fig.get_figheight()
    fig.tight_layout(rect=(0, legend_in / h, 1, 1 - 0.45 / h))


def times(v: float) -> str:
    """A ratio as printed on a plot: 3 significant digits, never rounded to 0 (0.0031x)."""
    return f"{v:.3g}x" if v >= 0.01 else f"{v:.2g}x"


def figures(records: list[dict]) -> dict[str, Any]:
    """File name -> matplotlib Figure, for every plot this run's records allow."""
    out: dict[str, Any] = {}
    with plt().rc_context(RC):
        out["launch_x_floor.png"] = launch_figure(records)
        for s in dict.fromkeys(r.get("suite") for r in records if r.get("suite")):
            if s in STEP_SUITES:
                out[f"steps_{s}.png"] = steps_figure(records, s)
            elif s == "replicate":
                out["replicate.png"] = replicate_figure(records)
            elif s.startswith("overhead"):
                out[f"{s}.png"] = overhead_figure(records, s)
            elif s.endswith("comm"):
                out[f"bandwidth_{s}.png"] = bandwidth_figure(records, s)
    return {k: v for k, v in out.items() if v is not None}


def write_all(records: list[dict], out: str) -> list[str]:
    paths = []
    for name, fig in figures(records).items():
        paths.append(os.path.join(out, name))
        fig.savefig(paths[-1], dpi=DPI)
        plt().close(fig)
    return paths


def _devkey(r: dict) -> str:
    d = r.get("devices") or []
    if not d:
        return "no device_ids, no GPU: the wrapper calls the module (pass-through)"
    if len(set(d)) > 1:
        return f"{len(d)} GPUs ({', '.join(d)})"
    return f"{len(d)} replica{'s' if len(d) > 1 else ''} on {d[0]}"


def _bar_group(ax, y0: float, values: list[tuple[str, float | None, str, str]]) -> None:
    """Horizontal bars from ``y0`` down, one per (label, value, colour, text); value printed (no
    value: the text alone at the left edge)."""
    left = ax.get_yaxis_transform()
    for j, (label, v, color, text) in enumerate(values):
        y = y0 + j * BAR_IN
        if v is None:
            ax.text(0.02, y, text, va="center", fontsize=10, color=color, transform=left)
            continue
        ax.barh(y, v, BAR_IN * 0.9, color=color, label=label)
        ax.text(v, y, f" {text}", va="center", fontsize=10, bbox=LABEL_BOX)


def _bar_axes(ax, ticks: list, slots: int, xlabel: str, line_label: str, pad: float) -> None:
    """A bar figure's axes: the tick labels (y, text), ``slots`` bar heights in all, the dashed
    line at 1, the x range widened by ``pad`` for the printed values."""
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1.2, label=line_label)
    ax.set_yticks([y for y, _ in ticks], [t for _, t in ticks])
    ax.set_ylim(slots * BAR_IN - BAR_IN, -BAR_IN)
    ax.set_xlim(0, ax.get_xlim()[1] * pad)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)


def _unit(group: dict[str, dict]) -> tuple[str, float | None]:
    floor = group.get("floor") or group.get("model_chunks")
    if floor and med(floor):
        return "floor", med(floor)
    return "bare", med(group.get("bare", {}))


def _gain(g: dict[str, dict]) -> str:
    """fastdp against DataParallel's algorithm in one configuration, as the tick label says it."""
    fd, dp = g.get("fastdp"), g.get("dp_algo")
    if not (fd and dp and med(fd)):
        return ""
    k = med(dp) / med(fd)
    how = f"{k:.2f}x faster" if k >= 1 else f"{1 / k:.2f}x slower"
    return f"\n{how} than DP's algorithm"


def _steps_panel(ax, groups: dict, keys: list, modes: list[str], suite: str) -> None:
    """One replica count: a group of bars per configuration, in units of its floor (or bare)."""
    labels, unit_name = [], "floor"
    for i, key in enumerate(keys):
        g = groups[key]
        unit_name, unit = _unit(g)
        y0 = i * (len(modes) + 1) * BAR_IN
        bars = []
        for m in modes:
            r = g.get(m)
            v = med(r) / unit if r and unit else None
            text = times(v) if v is not None else (r or {}).get("status", "-")
            bars.append((LABELS[m], v, COLORS[m], text))
        _bar_group(ax, y0, bars)
        mid = y0 + (len(modes) - 1) * BAR_IN / 2
        if unit_name == "floor" and g.get("bare") and unit:
            bare = med(g["bare"]) / unit
            ax.plot(bare, mid, "d", color=COLORS["bare"], markersize=8, label=LABELS["bare"])
        ms = f"{unit:.3g} ms" if unit else "-"
        name = " ".join(x for x in key[1:3] if x and x != "tensor")
        step = " " + key[3] if suite == "passthrough" else ""
        labels.append((mid, f"{name}{step}\n{unit_name} {ms}{_gain(g)}"))
    floor = unit_name == "floor"
    xlabel = f"step time / {'chunked floor' if floor else 'bare module'} (lower is better)"
    line_label = LABELS["floor"] if floor else "bare module (= 1)"
    _bar_axes(ax, labels, len(keys) * (len(modes) + 1), xlabel, line_label, 1.12)
    first = next((r for k in keys for r in groups[k].values() if r.get("devices")), {})
    ax.set_title(_devkey(first), loc="left")


def steps_figure(records: list[dict], suite: str):
    """Headline of a step suite: each mode's step time in units of the chunked floor."""
    recs = [r for r in records if r.get("suite") == suite and med(r) is not None]
    panels = list(dict.fromkeys(r.get("replicas") for r in recs if r["mode"] in HEADLINE_MODES))
    if not panels:
        return None
    groups = by_mode(
        recs, lambda r: (r.get("replicas"), r.get("workload"), r.get("input"), r.get("step"))
    )
    modes = [m for m in HEADLINE_MODES if any(r["mode"] == m for r in recs)]
    entries = {p: [k for k in groups if k[0] == p] for p in panels}
    heights = [len(entries[p]) * (len(modes) + 1) * BAR_IN + 0.9 for p in panels]
    size = {"figsize": (WIDTH_IN, sum(heights) + 1.6), "gridspec_kw": {"height_ratios": heights}}
    fig, axes = plt().subplots(len(panels), 1, squeeze=False, **size)
    for ax, panel in zip(axes[:, 0], panels):
        _steps_panel(ax, groups, entries[panel], modes, suite)
    legend_below(fig, axes[:, 0])
    fig.suptitle(
        f"{suite}: forward and training step time against the bare module and nn.DataParallel"
        if suite == "passthrough"
        else f"{suite}: training step time against the floor and DataParallel's algorithm"
    )
    finish(fig, 0.9)
    return fig


def launch_figure(records: list[dict]):
    """Each launch strategy's step time in units of the chunked floor; auto's pick printed."""
    entries = [
        r for r in launch_entries(records) if r.get("floor_ms") and (r.get("replicas") or 0) > 1
    ]
    if not entries:
        return None
    suites = {r["suite"] for r in entries}
    per = len(LAUNCH_MODES) + 1
    fig, ax = plt().subplots(figsize=(WIDTH_IN, len(entries) * per * BAR_IN + 2.2))
    ticks = []
    for i, r in enumerate(entries):
        y0 = i * per * BAR_IN
        bars = []
        for mode, name in LAUNCH_MODES.items():
            v = r.get(f"{name}_x_floor")
            text = times(v) if v is not None else "-"
            if name == "auto" and v is not None:
                pick = r.get("auto_pick")
                text += f"  (auto -> {pick if isinstance(pick, str) else 'mixed'})"
            bars.append((name, v, COLORS[mode], text))
        _bar_group(ax, y0, bars)
        where = f"{r['suite']}: " if len(suites) > 1 else ""
        text = f"{where}{r['workload']}, {r['replicas']} replicas\nfloor {r['floor_ms']:.3g} ms"
        ticks.append((y0 + BAR_IN, text))
    xlabel = "step time / chunked floor (lower is better)"
    _bar_axes(ax, ticks, len(entries) * per, xlabel, LABELS["floor"], 1.25)
    legend_below(fig, [ax])
    fig.suptitle("Launch strategies: training step time in units of the chunked floor")
    finish(fig, 0.7)
    return fig


def _line(mode: str) -> dict:
    """A mode's line style: its marker and colour."""
    return {"marker": MARKERS.get(mode, "o"), "color": COLORS.get(mode)}


def _note(ax, text: str, xy: tuple, offset: tuple, **kw: object) -> None:
    """``text`` printed at ``offset`` points from the data point ``xy``."""
    ax.annotate(text, xy, textcoords="offset points", xytext=offset, fontsize=10, **kw)


# A value at or below the floor (<= 0) on a log axis: a hollow triangle on the bottom edge.
BELOW = {"color": "black", "markersize": 12, "markerfacecolor": "none"}
BELOW_LABEL = "at or below the floor (<= 0), drawn at the bottom"


def _plain_log(axis) -> None:
    """Log scale with tick labels written as plain numbers (0.3, 2, 40), not 3x10^-1."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_locator(LogLocator(subs=()))


def _overhead_panel(ax, recs: list[dict], key: str, ylabel: str, works: list) -> bool:
    """One quantity per workload, a line per (mode, replicas), log scale; values <= 0 drawn at
    the bottom edge and said so. Returns whether any was."""
    xpos = {w: i for i, (_, w) in enumerate(works)}
    series: dict[tuple, list[dict]] = defaultdict(list)
    for r in recs:
        if r.get(key) is not None:
            series[(r["mode"], r.get("replicas"))].append(r)
    positive = [r[key] for rs in series.values() for r in rs if r[key] > 0]
    bottom, below = (min(positive) / 3 if positive else 1e-3), False
    for (mode, n), rs in series.items():
        rs.sort(key=lambda r: r["params"])
        xs, ys = [xpos[r["workload"]] for r in rs], [r[key] for r in rs]
        label = f"{LABELS.get(mode, mode)}, {n} replicas"
        ax.plot(xs, [max(y, bottom) for y in ys], "-", label=label, **_line(mode))
        for x, y in zip(xs, ys):
            if y <= 0:
                below = True
                ax.plot(x, bottom, "v", label=BELOW_LABEL, **BELOW)
            elif mode == "fastdp" and key == "overhead_ms":
                _note(ax, f"{y:.2g}", (x, y), (6, -4), color=COLORS[mode])
    ax.set_yscale("log")
    _plain_log(ax.yaxis)
    ax.set_ylim(bottom=bottom / 1.5)
    ax.set_xticks(range(len(works)), [f"{w}\n{p} tensors" for p, w in works])
    ax.set_xlim(-0.4, len(works) - 0.6)
    ax.set_xlabel("workload (parameter tensors)")
    ax.set_ylabel(ylabel)
    ax.grid(which="major", alpha=0.3)
    return below


def overhead_figure(records: list[dict], suite: str):
    """The wrapper's own cost per step (step minus the bare module on the same chunks) and its
    Python calls, per workload in order of parameter tensors; flat means O(1) per step."""
    recs = [r for r in records if r.get("suite") == suite and r.get("params")]
    recs = [r for r in recs if r.get("mode") != "model_chunks"]
    if not recs:
        return None
    works = sorted({(r["params"], r["workload"]) for r in recs})
    fig, axes = plt().subplots(1, 2, figsize=(WIDTH_IN, 5.2))
    below = _overhead_panel(axes[0], recs, "overhead_ms", "host overhead per step (ms, log)", works)
    below |= _overhead_panel(
        axes[1], recs, "wrapper_calls_per_step", "wrapper Python calls per step", works
    )
    legend_below(fig, axes)
    fig.suptitle(
        f"{suite}: the wrapper's own cost per training step "
        "(step minus the bare module on the same chunks)"
    )
    finish(fig, 1.3 if below else 1.0)
    return fig


def replicate_figure(records: list[dict]):
    """replicate() time against depth, log-log, each depth's fastdp / DataParallel ratio printed."""
    recs = [r for r in records if r.get("suite") == "replicate" and med(r) is not None]
    if not recs:
        return None
    fig, ax = plt().subplots(figsize=(9, 5.5))
    series: dict[str, dict] = defaultdict(dict)
    for r in recs:
        series[r["mode"]][r["layers"]] = med(r)
    labels = {
        "fastdp": "FastDataParallel.replicate (steady state)",
        "dp_algo": LABELS["dp_algo"],
        "torch": "torch.nn.parallel.replicate",
    }
    for mode, pts in series.items():
        xs = sorted(pts)
        ax.loglog(xs, [pts[x] for x in xs], "-", label=labels.get(mode, mode), **_line(mode))
    f, d = series.get("fastdp", {}), series.get("dp_algo", {})
    for x in sorted(set(f) & set(d)):
        _note(ax, times(f[x] / d[x]), (x, f[x]), (-12, 9))
    _plain_log(ax.xaxis)
    _plain_log(ax.yaxis)
    ax.set_xlabel("layers (Linear(32, 32) in nn.Sequential)")
    ax.set_ylabel("replicate() time per call (ms)")
    ax.set_title(
        f"replicate() on {recs[0].get('replicas')} CPU replicas by depth\n"
        "(printed: fastdp's time / DataParallel's algorithm's)"
    )
    ax.grid(which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _bytes_axis(ax) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter

    def fmt(v: float, _: object) -> str:
        for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if v >= 1 << k:
                return f"{v / (1 << k):g} {unit}"
        return f"{v:g} B"

    ax.xaxis.set_major_locator(FixedLocator([float(16**k) for k in range(3, 9)]))
    ax.xaxis.set_major_formatter(FuncFormatter(fmt))
    ax.xaxis.set_minor_locator(FixedLocator([]))
    ax.set_xlabel("message size")


def _by_size(recs: list[dict], op: str, mode: str, key: str) -> list[tuple]:
    """(bytes, value of ``key``) of ``mode``'s ``op`` records that have one, by size."""
    return sorted(
        (r["bytes"], r[key]) for r in recs if (r["op"], r["mode"]) == (op, mode) and r.get(key)
    )


def _bandwidth_panel(ax, recs: list[dict], op: str) -> None:
    """One collective's GB/s by size: torch, fastdp and the plain copy of the same bytes."""
    for mode in ("torch", "fastdp"):
        if pts := _by_size(recs, op, mode, "gbps"):
            ax.loglog(*zip(*pts), "-", label=LABELS[mode], **_line(mode))
    if lim := _by_size(recs, op, "fastdp", "limit_gbps"):
        ax.loglog(*zip(*lim), "--", color=OKABE_ITO["grey"], label="plain copy of the bytes")
    ax.set_title(op)
    ax.set_ylabel("GB/s (bytes / time)")
    _bytes_axis(ax)
    _plain_log(ax.yaxis)
    ax.grid(which="major", alpha=0.3)


def _fraction_panel(ax, recs: list[dict], ops: list[str]) -> None:
    """fastdp's GB/s of every collective as a fraction of the plain copy's."""
    styles = list(zip(("orange", "sky", "green", "vermillion", "yellow", "grey"), "s^vDXh"))
    for i, op in enumerate(ops):
        if pts := _by_size(recs, op, "fastdp", "frac_of_limit"):
            color, marker = styles[i % len(styles)]
            label = f"fastdp {op} / plain copy"
            ax.semilogx(*zip(*pts), "-", marker=marker, color=OKABE_ITO[color], label=label)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="= the plain copy")
    ax.set_title("fastdp as a fraction of the plain copy")
    ax.set_ylabel("fraction of the copy's GB/s")
    _bytes_axis(ax)
    ax.grid(which="major", alpha=0.3)


def bandwidth_figure(records: list[dict], suite: str):
    """Effective GB/s of each collective by size, torch vs fastdp, with the plain-copy limit;
    the last panel shows fastdp's bandwidth as a fraction of the limit."""
    recs = [r for r in records if r.get("suite") == suite and r.get("gbps")]
    ops = [o for o in dict.fromkeys(r["op"] for r in recs) if not o.startswith("limit")]
    if not ops:
        return None
    down = (len(ops) + 2) // 2  # two columns: a panel per collective, then the fraction panel
    fig, axes = plt().subplots(down, 2, figsize=(WIDTH_IN, 3.6 * down + 1.2), squeeze=False)
    flat = list(axes.flat)
    for ax, op in zip(flat, ops):
        _bandwidth_panel(ax, recs, op)
    _fraction_panel(flat[len(ops)], recs, ops)
    for extra in flat[len(ops) + 1 :]:
        extra.set_visible(False)
    legend_below(fig, flat[: len(ops) + 1])
    devs = next((r.get("devices") for r in recs if r.get("devices")), [])
    fig.suptitle(
        f"{suite}: bandwidth by message size (devices {', '.join(devs)}; higher is better)"
    )
    finish(fig, 0.35 * (len(ops) + 3) / 2 + 0.3)
    return fig


if __name__ == "__main__":  # python -m fastdp.bench.plots RESULTS.json [OUT_DIR]: redraw
    src = sys.argv[1]
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.abspath(src))
    os.makedirs(dst, exist_ok=True)
    with open(src) as f:
        print("\n".join(write_all(json.load(f)["records"], dst)))
