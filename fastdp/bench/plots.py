"""PNG plots (matplotlib, Agg backend). Each returns the paths written; without matplotlib the
caller gets ``available() == False`` and writes none."""

from __future__ import annotations

import os
from collections import defaultdict

from fastdp.bench.report import STEP_SUITES, launch_rows, med

COLORS = {"fastdp": "#1f77b4", "fastdp_noext": "#9ecae1", "dp_algo": "#ff7f0e",
          "torch_dp": "#d62728", "torch": "#d62728", "bare": "black"}
BAR_MODES = ("fastdp", "fastdp_noext", "dp_algo", "torch_dp")
LABELS = {"fastdp": "fastdp", "fastdp_noext": "fastdp, extension disabled",
          "dp_algo": "DataParallel's algorithm (fresh replicas)", "torch_dp": "nn.DataParallel",
          "torch": "torch.nn.parallel", "bare": "bare module (whole batch)"}


def _plain_log(ax, axis: str = "y") -> None:  # noqa: ANN001
    """Log scale with tick labels written as plain numbers (0.3, 2, 40), not 3x10^-1."""
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_formatter(fmt)
    target.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if _lead(v) in (2, 5) else ""))


def _lead(v: float) -> int:
    """Leading significant digit of ``v`` > 0."""
    import math

    return int(round(v / 10 ** math.floor(math.log10(v)), 6)) if v > 0 else 0


def _legend_below(fig, axes) -> None:  # noqa: ANN001
    seen: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=min(len(seen), 3),
               fontsize=8, frameon=False)


def available() -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        return False
    return True


def _plt():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _devkey(r: dict) -> str:
    d = r.get("devices") or []
    if not d:
        return "no device_ids, no GPU: the wrapper calls the module (pass-through)"
    return f"{len(d)} x {d[0]}" if len(set(d)) == 1 else f"{len(d)} GPUs ({', '.join(d)})"


def step_times(records: list[dict], suite: str, path: str) -> str | None:
    """Bars per workload and mode, one panel per device set; the bare module as a black line."""
    recs = [r for r in records if r.get("suite") == suite]
    wrapped = [r for r in recs if r.get("mode") in BAR_MODES]
    if not wrapped:
        return None
    plt = _plt()
    groups = list(dict.fromkeys(_group(r) for r in recs))
    panels = list(dict.fromkeys(r.get("replicas") for r in wrapped))
    names = {r.get("replicas"): _devkey(r) for r in wrapped if r.get("status") != "unsupported"}
    bare = {(_group(r), r.get("replicas")): med(r) for r in recs if r.get("mode") == "bare"}
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7, 1.3 * len(groups) + 2),
                                                      3.2 * len(panels) + 0.6), squeeze=False)
    width = 0.8 / len(BAR_MODES)
    for ax, panel in zip(axes[:, 0], panels):
        cell = {(_group(r), r["mode"]): r for r in wrapped if r.get("replicas") == panel}
        for j, mode in enumerate(BAR_MODES):
            xs, ys, hatch = [], [], []
            for i, g in enumerate(groups):
                r = cell.get((g, mode))
                if r is not None and med(r) is not None:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(med(r))
                    hatch.append(r.get("status") == "check_failed")
                elif r is not None and r.get("status") not in (None, "ok", "unsupported"):
                    ax.annotate(r["status"][:5], (i - 0.4 + width * (j + 0.5), 0),
                                xycoords=("data", "axes fraction"), rotation=90, fontsize=6,
                                ha="center", va="bottom", color=COLORS[mode])
            if not xs:
                continue
            bars = ax.bar(xs, ys, width, color=COLORS[mode], label=LABELS[mode])
            for b, h in zip(bars, hatch):
                if h:
                    b.set_hatch("//")
                    b.set_edgecolor("black")
        for i, g in enumerate(groups):
            if bare.get((g, panel)):
                ax.hlines(bare[(g, panel)], i - 0.45, i + 0.45, colors="black", linewidth=2,
                          label=LABELS["bare"])
        ax.set_yscale("log")
        _plain_log(ax)
        ax.set_xticks(range(len(groups)), ["\n".join(x for x in g if x) for g in groups],
                      fontsize=8)
        ax.set_ylabel("time per step (ms, log)")
        ax.set_title(names.get(panel, f"{panel} replicas"), fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
    _legend_below(fig, axes[:, 0])
    what = "forward or training step" if suite == "passthrough" else \
        "training step (forward + backward)"
    fig.suptitle(f"{suite}: {what} time by workload and mode\n(lower is better; black line: "
                 "bare module on the whole batch; hatched: correctness check failed)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.55 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _group(r: dict) -> tuple:
    inp = (r.get("input") or "").split(":")[-1]
    inp = "" if inp in ("tensor", "dict16") else inp
    step = r.get("step") if r.get("suite") == "passthrough" else ""
    return (r.get("workload"), inp, step)


def replicate_cost(records: list[dict], path: str) -> str | None:
    """Replicate cost against number of layers, log-log, with the fastdp / dp_algo ratio."""
    recs = [r for r in records if r.get("suite") == "replicate" and med(r) is not None]
    if not recs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = defaultdict(dict)
    for r in recs:
        series[r["mode"]][r["layers"]] = med(r)
    labels = {"fastdp": "FastDataParallel.replicate (steady state)",
              "dp_algo": "DataParallel's algorithm (fresh replicas)"}
    for mode, pts in series.items():
        xs = sorted(pts)
        ax.loglog(xs, [pts[x] for x in xs], "o-", color=COLORS.get(mode), label=labels.get(
            mode, mode))
    f, d = series.get("fastdp", {}), series.get("dp_algo", {})
    for x in sorted(set(f) & set(d)):
        ax.annotate(f"{f[x] / d[x]:.2f}x", (x, f[x]), textcoords="offset points",
                    xytext=(-10, 8), fontsize=8)
    n = recs[0].get("replicas")
    _plain_log(ax, "x")
    _plain_log(ax, "y")
    ax.set_xlabel("layers (Linear(32, 32) in nn.Sequential)")
    ax.set_ylabel("replicate() time per call (ms)")
    ax.set_title(f"replicate() cost on {n} CPU replicas vs number of layers\n"
                 "(labels: fastdp / DataParallel's algorithm)", fontsize=10)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def overhead(records: list[dict], suite: str, path: str) -> str | None:
    """Host overhead and wrapper Python calls per step against parameter tensors, log-log."""
    recs = [r for r in records if r.get("suite") == suite and r.get("mode") != "model_chunks"
            and r.get("params")]
    if not recs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    for ax, key, ylabel in ((axes[0], "overhead_ms", "host overhead per step (ms)"),
                            (axes[1], "wrapper_calls_per_step", "wrapper Python calls per step")):
        by_mode = defaultdict(list)
        for r in recs:
            if r.get(key) is not None:
                by_mode[(r["mode"], r.get("replicas"))].append(r)
        for (mode, n), rs in by_mode.items():
            rs.sort(key=lambda r: r["params"])
            mlps = [r for r in rs if r["workload"].startswith("mlp")]
            others = [r for r in rs if not r["workload"].startswith("mlp")]
            ax.plot([r["params"] for r in mlps], [max(r[key], 1e-3) for r in mlps], "o-",
                    color=COLORS.get(mode), label=f"{LABELS.get(mode, mode)}, {n} replicas")
            ax.plot([r["params"] for r in others], [max(r[key], 1e-3) for r in others], "s",
                    color=COLORS.get(mode))
            for r in rs:
                ax.annotate(r["workload"], (r["params"], max(r[key], 1e-3)), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_log(ax, "x")
        _plain_log(ax, "y")
        ax.set_xlabel("parameter tensors in the model")
        ax.set_ylabel(ylabel)
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{suite}: the wrapper's own cost per training step = step minus the bare module "
                 "on the same chunks\n(circles: MLPs of 10/100/1000 layers; squares: other "
                 "workloads; flat = O(1) Python work per step)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bytes_axis(ax) -> None:  # noqa: ANN001
    from matplotlib.ticker import FixedLocator, FuncFormatter

    def fmt(v: float, _: object) -> str:
        for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if v >= 1 << k:
                return f"{v / (1 << k):g} {unit}"
        return f"{v:g} B"

    ax.xaxis.set_major_locator(FixedLocator([float(4 ** k) for k in range(5, 16)]))
    ax.xaxis.set_major_formatter(FuncFormatter(fmt))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)


def bandwidth(records: list[dict], suite: str, path: str) -> str | None:
    """Effective GB/s of each collective by size, torch vs fastdp, with the plain-copy limit;
    the last panel shows fastdp's bandwidth as a fraction of the limit."""
    recs = [r for r in records if r.get("suite") == suite and r.get("gbps")]
    ops = [o for o in dict.fromkeys(r["op"] for r in recs) if not o.startswith("limit")]
    if not ops:
        return None
    plt = _plt()
    cols = 3
    rows = (len(ops) + 1 + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax, op in zip(flat, ops):
        for mode in ("torch", "fastdp"):
            pts = sorted((r["bytes"], r["gbps"]) for r in recs if r["op"] == op
                         and r["mode"] == mode)
            if pts:
                ax.loglog(*zip(*pts), "o-", color=COLORS[mode], label=LABELS[mode])
        lim = sorted((r["bytes"], r["limit_gbps"]) for r in recs if r["op"] == op
                     and r.get("limit_gbps") and r["mode"] == "fastdp")
        if lim:
            lname = next(r["limit_op"] for r in recs if r["op"] == op and r.get("limit_op"))
            ax.loglog(*zip(*lim), "k--", label=f"plain copy ({lname[6:].upper()})")
        ax.set_title(op, fontsize=9)
        ax.set_ylabel("effective GB/s (bytes / time)")
        _bytes_axis(ax)
        _plain_log(ax)
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = flat[len(ops)]
    for op in ops:
        pts = sorted((r["bytes"], r["frac_of_limit"]) for r in recs if r["op"] == op
                     and r["mode"] == "fastdp" and r.get("frac_of_limit") is not None)
        if pts:
            ax.loglog(*zip(*pts), "o-", label=op)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    _plain_log(ax)
    ax.set_title("fastdp as a fraction of the plain-copy limit", fontsize=9)
    ax.set_ylabel("fraction of the copy limit")
    _bytes_axis(ax)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=7)
    for extra in flat[len(ops) + 1:]:
        extra.set_visible(False)
    devs = next((r.get("devices") for r in recs if r.get("devices")), [])
    fig.suptitle(f"{suite}: bandwidth by message size vs a plain copy of the same bytes "
                 f"(devices {', '.join(devs)}; higher is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


STRATEGIES = (("threads", "#ff7f0e"), ("inline", "#2ca02c"), ("auto", "#1f77b4"))


def launch_x_floor(records: list[dict], path: str) -> str | None:
    """x floor per workload (and replica count) for each launch strategy; 1 = the chunked floor."""
    rows = [r for r in launch_rows(records) if r.get("floor_ms")]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(rows) + 2), 4.2))
    width = 0.8 / len(STRATEGIES)
    for j, (name, color) in enumerate(STRATEGIES):
        xs = [i - 0.4 + width * (j + 0.5) for i, r in enumerate(rows)
              if r.get(f"{name}_x_floor") is not None]
        ys = [r[f"{name}_x_floor"] for r in rows if r.get(f"{name}_x_floor") is not None]
        ax.bar(xs, ys, width, color=color, label=name)
    for i, r in enumerate(rows):
        if r.get("auto_pick") and r.get("auto_x_floor") is not None:
            ax.annotate(f"{r['auto_pick']}", (i + 0.4 - width / 2, r["auto_x_floor"]),
                        fontsize=6, ha="center", va="bottom", rotation=90)
    ax.axhline(1.0, color="black", linewidth=1.5, label="chunked floor")
    ax.set_xticks(range(len(rows)), [f"{r['workload']}\nx{r['replicas']}\n"
                                     f"{r['suite'].replace('-steps', '')}" for r in rows],
                  fontsize=7)
    ax.set_ylabel("step time / chunked floor")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Launch strategies: training step time in units of the chunked floor\n(lower is "
                 "better; auto's pick written above its bar)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(records: list[dict], out: str) -> list[str]:
    paths = [p for p in [launch_x_floor(records, os.path.join(out, "launch_x_floor.png"))] if p]
    suites = list(dict.fromkeys(r.get("suite") for r in records if r.get("suite")))
    for s in suites:
        p = None
        if s in STEP_SUITES:
            p = step_times(records, s, os.path.join(out, f"steps_{s}.png"))
        elif s == "replicate":
            p = replicate_cost(records, os.path.join(out, "replicate.png"))
        elif s.startswith("overhead"):
            p = overhead(records, s, os.path.join(out, f"{s}.png"))
        elif s.endswith("comm"):
            p = bandwidth(records, s, os.path.join(out, f"bandwidth_{s}.png"))
        if p:
            paths.append(p)
    return paths


if __name__ == "__main__":  # python -m fastdp.bench.plots RESULTS.json [OUT_DIR]: redraw
    import json
    import sys

    src = sys.argv[1]
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.abspath(src))
    os.makedirs(dst, exist_ok=True)
    with open(src) as f:
        print("\n".join(write_all(json.load(f)["records"], dst)))
