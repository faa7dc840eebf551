"""The bar plots: each step suite's headline and the launch strategies, in units of the chunked
floor (NOTE [ Plots a person reads ] in ``fastdp/bench/plots.py``)."""

from __future__ import annotations

from fastdp.bench.plot_style import (
    BAR_IN,
    COLORS,
    HEADLINE_MODES,
    LABELS,
    STRATEGIES,
    WIDTH_IN,
    finish,
    legend_below,
    plt,
    times,
)
from fastdp.bench.report import launch_rows, med


def _devkey(r: dict) -> str:
    d = r.get("devices") or []
    if not d:
        return "no device_ids, no GPU: the wrapper calls the module (pass-through)"
    if len(set(d)) > 1:
        return f"{len(d)} GPUs ({', '.join(d)})"
    return f"{len(d)} replica{'s' if len(d) > 1 else ''} on {d[0]}"


def _row_bars(ax, y0: float, values: list[tuple[str, float | None, str, str]]) -> None:  # noqa: ANN001
    """Horizontal bars from ``y0`` down, one per (label, value, colour, text); value printed."""
    for j, (label, v, color, text) in enumerate(values):
        y = y0 + j * BAR_IN
        if v is None:
            ax.text(
                0.02,
                y,
                text,
                va="center",
                fontsize=10,
                color=color,
                transform=ax.get_yaxis_transform(),
            )
            continue
        ax.barh(y, v, BAR_IN * 0.9, color=color, label=label)
        ax.text(
            v,
            y,
            f" {text}",
            va="center",
            fontsize=10,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.8},
        )


def _unit(group: dict[str, dict]) -> tuple[str, float | None]:
    floor = group.get("floor") or group.get("model_chunks")
    if floor and med(floor):
        return "floor", med(floor)
    return "bare", med(group.get("bare", {}))


def steps_figure(records: list[dict], suite: str):  # noqa: ANN201
    """Headline of a step suite: each mode's step time in units of the chunked floor."""
    recs = [r for r in records if r.get("suite") == suite and med(r) is not None]
    panels = list(dict.fromkeys(r.get("replicas") for r in recs if r["mode"] in HEADLINE_MODES))
    if not panels:
        return None
    groups: dict[tuple, dict[str, dict]] = {}
    for r in recs:
        key = (r.get("replicas"), r.get("workload"), r.get("input"), r.get("step"))
        groups.setdefault(key, {})[r["mode"]] = r
    modes = [m for m in HEADLINE_MODES if any(r["mode"] == m for r in recs)]
    rows = {p: [k for k in groups if k[0] == p] for p in panels}
    heights = [len(rows[p]) * (len(modes) + 1) * BAR_IN + 0.9 for p in panels]
    fig, axes = plt().subplots(
        len(panels),
        1,
        figsize=(WIDTH_IN, sum(heights) + 1.6),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    unit_name = "floor"
    for ax, panel in zip(axes[:, 0], panels):
        labels = []
        for i, key in enumerate(rows[panel]):
            g = groups[key]
            unit_name, unit = _unit(g)
            y0 = i * (len(modes) + 1) * BAR_IN
            bars = []
            for m in modes:
                r = g.get(m)
                v = med(r) / unit if r and unit else None
                bars.append(
                    (
                        LABELS[m],
                        v,
                        COLORS[m],
                        times(v) if v is not None else (r or {}).get("status", "-"),
                    )
                )
            _row_bars(ax, y0, bars)
            if unit_name == "floor" and g.get("bare") and unit:
                ax.plot(
                    med(g["bare"]) / unit,
                    y0 + (len(modes) - 1) * BAR_IN / 2,
                    "d",
                    color=COLORS["bare"],
                    markersize=8,
                    label=LABELS["bare"],
                )
            fd, dp = g.get("fastdp"), g.get("dp_algo")
            gain = ""
            if fd and dp and med(fd):
                k = med(dp) / med(fd)
                gain = (
                    f"\n{k:.2f}x faster than DP's algorithm"
                    if k >= 1
                    else f"\n{1 / k:.2f}x slower than DP's algorithm"
                )
            ms = f"{unit:.3g} ms" if unit else "-"
            labels.append(
                (
                    y0 + (len(modes) - 1) * BAR_IN / 2,
                    f"{' '.join(x for x in key[1:3] if x and x != 'tensor')}"
                    f"{' ' + key[3] if suite == 'passthrough' else ''}"
                    f"\n{unit_name} {ms}{gain}",
                )
            )
        ax.axvline(
            1.0,
            color=COLORS["floor"],
            linestyle="--",
            linewidth=1.2,
            label=LABELS["floor"] if unit_name == "floor" else "bare module (= 1)",
        )
        ax.set_yticks([y for y, _ in labels], [t for _, t in labels])
        ax.set_ylim(len(rows[panel]) * (len(modes) + 1) * BAR_IN - BAR_IN, -BAR_IN)
        ax.set_xlim(0, ax.get_xlim()[1] * 1.12)
        ax.set_xlabel(
            f"step time / {'chunked floor' if unit_name == 'floor' else 'bare module'}"
            " (lower is better)"
        )
        ax.set_title(
            _devkey(
                next(
                    (
                        r
                        for k, g in groups.items()
                        if k[0] == panel
                        for r in g.values()
                        if r.get("devices")
                    ),
                    {},
                )
            ),
            loc="left",
        )
        ax.grid(axis="x", alpha=0.3)
    legend_below(fig, axes[:, 0])
    fig.suptitle(
        f"{suite}: forward and training step time against the bare module and nn.DataParallel"
        if suite == "passthrough"
        else f"{suite}: training step time against the floor and DataParallel's algorithm"
    )
    finish(fig, 0.9)
    return fig


def launch_figure(records: list[dict]):  # noqa: ANN201
    """Each launch strategy's step time in units of the chunked floor; auto's pick printed."""
    rows = [r for r in launch_rows(records) if r.get("floor_ms") and (r.get("replicas") or 0) > 1]
    if not rows:
        return None
    suites = {r["suite"] for r in rows}
    per = len(STRATEGIES) + 1
    fig, ax = plt().subplots(figsize=(WIDTH_IN, len(rows) * per * BAR_IN + 2.2))
    ticks = []
    for i, r in enumerate(rows):
        y0 = i * per * BAR_IN
        bars = []
        for name, color in STRATEGIES:
            v = r.get(f"{name}_x_floor")
            text = times(v) if v is not None else "-"
            if name == "auto" and v is not None:
                pick = r.get("auto_pick")
                text += f"  (auto -> {pick if isinstance(pick, str) else 'mixed'})"
            bars.append((name, v, color, text))
        _row_bars(ax, y0, bars)
        where = f"{r['suite']}: " if len(suites) > 1 else ""
        ticks.append(
            (
                y0 + BAR_IN,
                f"{where}{r['workload']}, {r['replicas']} replicas\nfloor {r['floor_ms']:.3g} ms",
            )
        )
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1.2, label=LABELS["floor"])
    ax.set_yticks([y for y, _ in ticks], [t for _, t in ticks])
    ax.set_ylim(len(rows) * per * BAR_IN - BAR_IN, -BAR_IN)
    ax.set_xlim(0, ax.get_xlim()[1] * 1.25)
    ax.set_xlabel("step time / chunked floor (lower is better)")
    ax.grid(axis="x", alpha=0.3)
    legend_below(fig, [ax])
    fig.suptitle("Launch strategies: training step time in units of the chunked floor")
    finish(fig, 0.7)
    return fig
