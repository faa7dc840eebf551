"""The line plots: host overhead per workload, replicate cost by depth, collective bandwidth by
size (NOTE [ Plots a person reads ] in ``fastdp/bench/plots.py``)."""

from __future__ import annotations

from collections import defaultdict

from fastdp.bench.plot_style import (
    COLORS,
    LABELS,
    MARKERS,
    OKABE_ITO,
    WIDTH_IN,
    finish,
    legend_below,
    plt,
    times,
)
from fastdp.bench.report import med


def _plain_log(axis) -> None:  # noqa: ANN001
    """Log scale with tick labels written as plain numbers (0.3, 2, 40), not 3x10^-1."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_locator(LogLocator(subs=()))


def overhead_figure(records: list[dict], suite: str):  # noqa: ANN201
    """The wrapper's own cost per step (step minus the bare module on the same chunks) and its
    Python calls, per workload in order of parameter tensors; flat means O(1) per step."""
    recs = [
        r
        for r in records
        if r.get("suite") == suite and r.get("mode") != "model_chunks" and r.get("params")
    ]
    if not recs:
        return None
    works = sorted({(r["params"], r["workload"]) for r in recs})
    xpos = {w: i for i, (_, w) in enumerate(works)}
    fig, axes = plt().subplots(1, 2, figsize=(WIDTH_IN, 5.2))
    below = False
    for ax, key, ylabel in (
        (axes[0], "overhead_ms", "host overhead per step (ms, log)"),
        (axes[1], "wrapper_calls_per_step", "wrapper Python calls per step"),
    ):
        series: dict[tuple, list[dict]] = defaultdict(list)
        for r in recs:
            if r.get(key) is not None:
                series[(r["mode"], r.get("replicas"))].append(r)
        positive = [r[key] for rs in series.values() for r in rs if r[key] > 0]
        bottom = min(positive) / 3 if positive else 1e-3
        for (mode, n), rs in series.items():
            rs.sort(key=lambda r: r["params"])
            xs, ys = [xpos[r["workload"]] for r in rs], [r[key] for r in rs]
            ax.plot(
                xs,
                [max(y, bottom) for y in ys],
                "-",
                marker=MARKERS.get(mode, "o"),
                color=COLORS.get(mode),
                label=f"{LABELS.get(mode, mode)}, {n} replicas",
            )
            for x, y in zip(xs, ys):
                if y <= 0:  # at or below the floor: drawn on the bottom edge, said so
                    below = True
                    ax.plot(
                        x,
                        bottom,
                        "v",
                        color="black",
                        markersize=12,
                        markerfacecolor="none",
                        label="at or below the floor (<= 0), drawn at the bottom",
                    )
                elif mode == "fastdp" and key == "overhead_ms":
                    ax.annotate(
                        f"{y:.2g}",
                        (x, y),
                        textcoords="offset points",
                        xytext=(6, -4),
                        fontsize=10,
                        color=COLORS[mode],
                    )
        ax.set_yscale("log")
        _plain_log(ax.yaxis)
        ax.set_ylim(bottom=bottom / 1.5)
        ax.set_xticks(range(len(works)), [f"{w}\n{p} tensors" for p, w in works])
        ax.set_xlim(-0.4, len(works) - 0.6)
        ax.set_xlabel("workload (parameter tensors)")
        ax.set_ylabel(ylabel)
        ax.grid(which="major", alpha=0.3)
    legend_below(fig, axes)
    fig.suptitle(
        f"{suite}: the wrapper's own cost per training step "
        "(step minus the bare module on the same chunks)"
    )
    finish(fig, 1.3 if below else 1.0)
    return fig


def replicate_figure(records: list[dict]):  # noqa: ANN201
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
        ax.loglog(
            xs,
            [pts[x] for x in xs],
            "-",
            marker=MARKERS.get(mode, "o"),
            color=COLORS.get(mode),
            label=labels.get(mode, mode),
        )
    f, d = series.get("fastdp", {}), series.get("dp_algo", {})
    for x in sorted(set(f) & set(d)):
        ax.annotate(
            times(f[x] / d[x]), (x, f[x]), textcoords="offset points", xytext=(-12, 9), fontsize=10
        )
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


def _bytes_axis(ax) -> None:  # noqa: ANN001
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


def bandwidth_figure(records: list[dict], suite: str):  # noqa: ANN201
    """Effective GB/s of each collective by size, torch vs fastdp, with the plain-copy limit;
    the last panel shows fastdp's bandwidth as a fraction of the limit."""
    recs = [r for r in records if r.get("suite") == suite and r.get("gbps")]
    ops = [o for o in dict.fromkeys(r["op"] for r in recs) if not o.startswith("limit")]
    if not ops:
        return None
    cols = 2
    rows = (len(ops) + 1 + cols - 1) // cols
    fig, axes = plt().subplots(rows, cols, figsize=(WIDTH_IN, 3.6 * rows + 1.2), squeeze=False)
    flat = list(axes.flat)
    for ax, op in zip(flat, ops):
        for mode in ("torch", "fastdp"):
            pts = sorted(
                (r["bytes"], r["gbps"]) for r in recs if r["op"] == op and r["mode"] == mode
            )
            if pts:
                ax.loglog(
                    *zip(*pts), "-", marker=MARKERS[mode], color=COLORS[mode], label=LABELS[mode]
                )
        lim = sorted(
            (r["bytes"], r["limit_gbps"])
            for r in recs
            if r["op"] == op and r.get("limit_gbps") and r["mode"] == "fastdp"
        )
        if lim:
            ax.loglog(*zip(*lim), "--", color=OKABE_ITO["grey"], label="plain copy of the bytes")
        ax.set_title(op)
        ax.set_ylabel("GB/s (bytes / time)")
        _bytes_axis(ax)
        _plain_log(ax.yaxis)
        ax.grid(which="major", alpha=0.3)
    ax = flat[len(ops)]
    styles = list(zip(("orange", "sky", "green", "vermillion", "yellow", "grey"), "s^vDXh"))
    for i, op in enumerate(ops):
        pts = sorted(
            (r["bytes"], r["frac_of_limit"])
            for r in recs
            if r["op"] == op and r["mode"] == "fastdp" and r.get("frac_of_limit") is not None
        )
        if pts:
            color, marker = styles[i % len(styles)]
            ax.semilogx(
                *zip(*pts),
                "-",
                marker=marker,
                color=OKABE_ITO[color],
                label=f"fastdp {op} / plain copy",
            )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="= the plain copy")
    ax.set_title("fastdp as a fraction of the plain copy")
    ax.set_ylabel("fraction of the copy's GB/s")
    _bytes_axis(ax)
    ax.grid(which="major", alpha=0.3)
    for extra in flat[len(ops) + 1 :]:
        extra.set_visible(False)
    legend_below(fig, flat[: len(ops) + 1])
    devs = next((r.get("devices") for r in recs if r.get("devices")), [])
    fig.suptitle(
        f"{suite}: bandwidth by message size (devices {', '.join(devs)}; higher is better)"
    )
    finish(fig, 0.35 * (len(ops) + 3) / 2 + 0.3)
    return fig
