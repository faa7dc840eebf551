"""Ratios within the run, the headline figures, the stdout table, and the JSON file.

Every ratio is computed from medians measured in the same run; nothing is hard-coded. A ratio
below 1 means faster (``x floor`` = time / the chunked floor's time: the bare module on the same
chunks in turn, the yardstick of every step table; ``x bare`` = time / bare module's time on the
whole batch, ``x dp_algo`` = time / DataParallel's algorithm's time on the same devices).
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Callable

STEP_SUITES = ("passthrough", "cpu-replicas", "gpu-steps", "multigpu-steps")
SCHEMA = "fastdp-bench/1"


def med(r: dict) -> float | None:
    return (r.get("time_ms") or {}).get("median_ms")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def add_ratios(records: list[dict]) -> None:
    """Adds ``ratios`` to every timed record (in place)."""
    by_cfg: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        suite = r.get("suite", "")
        if suite in STEP_SUITES:  # one task: one workload, input, step and replica count
            key = (suite, r.get("workload"), r.get("input"), r.get("step"), r.get("replicas"))
        elif "replicate" in suite or suite.startswith("overhead"):
            key = (suite, r.get("workload"), r.get("replicas"))
        elif suite == "module-build":
            key = (suite, r.get("workload"))
        elif r.get("kind") in ("scatter", "gather", "broadcast", "view"):
            key = (suite, r["op"], r["bytes"], r.get("threads"))
        else:
            continue
        by_cfg[key][r.get("mode")] = r
    for group in by_cfg.values():
        b = group.get("bare")
        floor = group.get("floor") or group.get("model_chunks")
        for mode, r in group.items():
            if med(r) is None:
                continue
            rat = {
                "vs_floor": _ratio(med(r), med(floor))
                if floor and mode not in ("floor", "model_chunks")
                else None,
                "vs_bare": _ratio(med(r), med(b)) if b and mode != "bare" else None,
                "vs_dp_algo": _ratio(med(r), med(group.get("dp_algo", {})))
                if mode not in ("dp_algo", "bare")
                else None,
                "vs_torch_dp": _ratio(med(r), med(group.get("torch_dp", {})))
                if mode != "torch_dp"
                else None,
                "vs_torch": _ratio(med(r), med(group.get("torch", {})))
                if mode != "torch"
                else None,
                "vs_without": _ratio(med(r), med(group.get("without", {})))
                if mode != "without"
                else None,
            }
            if (
                "overhead_ms" in r
                and "overhead_ms" in group.get("dp_algo", {})
                and mode != "dp_algo"
            ):
                rat["overhead_vs_dp_algo"] = _ratio(
                    r["overhead_ms"], group["dp_algo"]["overhead_ms"]
                )
            if "wrapper_calls_per_step" in r and mode != "dp_algo":
                rat["wrapper_calls_vs_dp_algo"] = _ratio(
                    r["wrapper_calls_per_step"],
                    group.get("dp_algo", {}).get("wrapper_calls_per_step"),
                )
            r["ratios"] = {k: v for k, v in rat.items() if v is not None}


def headline(records: list[dict]) -> dict:
    """The figures a reader looks for first, each copied from a record of this run."""
    out: dict = {}
    rep = {
        (r["layers"], r["mode"]): r
        for r in records
        if r.get("suite") == "replicate" and med(r) is not None
    }
    rows = []
    for layers in sorted({k[0] for k in rep}):
        f, d = rep.get((layers, "fastdp")), rep.get((layers, "dp_algo"))
        if f and d:
            rows.append(
                {
                    "layers": layers,
                    "replicas": f["replicas"],
                    "fastdp_ms": med(f),
                    "dp_algo_ms": med(d),
                    "ratio": med(f) / med(d),
                }
            )
    if rows:
        out["replicate_cpu"] = rows
    ov = [
        {
            "workload": r["workload"],
            "mode": r["mode"],
            "params": r.get("params"),
            "overhead_ms": r.get("overhead_ms"),
            "wrapper_calls_per_step": r.get("wrapper_calls_per_step"),
            "step_ms": med(r),
        }
        for r in records
        if r.get("suite", "").startswith("overhead")
        and r.get("mode") != "model_chunks"
        and med(r) is not None
    ]
    if ov:
        out["overhead"] = ov
    steps = [
        {
            "suite": r["suite"],
            "workload": r["workload"],
            "input": r["input"],
            "replicas": r["replicas"],
            "mode": r["mode"],
            "step_ms": med(r),
            **r.get("ratios", {}),
        }
        for r in records
        if r.get("suite") in STEP_SUITES[1:] and r.get("mode") == "fastdp" and med(r) is not None
    ]
    if steps:
        out["steps_fastdp"] = steps
    launch = launch_rows(records)
    if launch:
        out["launch"] = launch
    bad = [
        f"{r.get('suite')}/{r.get('workload', r.get('op'))}/{r.get('mode')}"
        f"/{r.get('replicas')}: {r.get('status')}"
        for r in records
        if r.get("status") not in ("ok", "unsupported")
    ]
    out["not_ok"] = bad
    return out


LAUNCH_MODES = {"fastdp_threads": "threads", "fastdp_inline": "inline", "fastdp": "auto"}


def launch_rows(records: list[dict]) -> list[dict]:
    """Per step configuration: the floor and each launch strategy (ms, x floor), auto's pick, and
    auto / threads, all from this run's medians."""
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        if r.get("suite") in STEP_SUITES[1:] or r.get("suite", "").startswith("overhead"):
            key = (r["suite"], r.get("workload"), r.get("input"), r.get("replicas"))
            groups[key][r.get("mode")] = r
    rows = []
    for (suite, workload, inp, n), g in groups.items():
        floor = g.get("floor") or g.get("model_chunks")
        if not floor or med(floor) is None or not any(m in g for m in LAUNCH_MODES):
            continue
        row = {
            "suite": suite,
            "workload": workload,
            "input": inp,
            "replicas": n,
            "floor_ms": med(floor),
        }
        for m, name in LAUNCH_MODES.items():
            row[f"{name}_ms"] = med(g.get(m, {}))
            row[f"{name}_x_floor"] = _ratio(med(g.get(m, {})), med(floor))
        picks = [p["choice"] for p in g.get("fastdp", {}).get("launch_pick") or []]
        row["auto_pick"] = picks[0] if len(set(picks)) == 1 else (picks or None)
        row["auto_x_threads"] = _ratio(row["auto_ms"], row["threads_ms"])
        rows.append(row)
    return rows


def _fmt(v: object, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        a = abs(v)
        return f"{v:.{nd}g}" if a < 1000 else f"{v:,.0f}"
    return str(v)


def _table(title: str, headers: list[str], rows: list[list]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    w = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w[i]) for i, h in enumerate(headers))
    body = [
        "  ".join(c.rjust(w[i]) if i >= 1 and _num(c) else c.ljust(w[i]) for i, c in enumerate(r))
        for r in cells
    ]
    return "\n".join([f"== {title}", line, "-" * len(line), *body, ""])


def _num(c: str) -> bool:
    return (
        c.replace(".", "")
        .replace(",", "")
        .replace("-", "")
        .replace("e", "")
        .replace("+", "")
        .isdigit()
        or c == "-"
    )


def _status(r: dict) -> str:
    s = r.get("status", "ok")
    return {"check_failed": "CHECK FAILED", "ok": "ok"}.get(s, s)


def _t(r: dict, k: str) -> float | None:
    return (r.get("time_ms") or {}).get(k)


def _rat(r: dict, k: str) -> float | None:
    return (r.get("ratios") or {}).get(k)


_SECTIONS = {
    "passthrough": (
        "Pass-through (no GPU: FastDataParallel(m) calls the module), ms per call",
        ["workload", "step", "mode", "status", "median", "min", "max", "+us", "x bare"],
        lambda r: [
            r.get("workload"),
            r.get("step"),
            _mode(r),
            _status(r),
            _t(r, "median_ms"),
            _t(r, "min_ms"),
            _t(r, "max_ms"),
            r.get("overhead_us"),
            _rat(r, "vs_bare"),
        ],
    ),
    "steps": (
        "Training step (forward + backward), ms",
        [
            "workload",
            "input",
            "devices",
            "mode",
            "launch",
            "status",
            "median",
            "min",
            "max",
            "x floor",
            "x bare",
            "x dp_algo",
            "x torch_dp",
        ],
        lambda r: [
            r.get("workload"),
            r.get("input"),
            _devs(r),
            _mode(r),
            _launch(r),
            _status(r),
            _t(r, "median_ms"),
            _t(r, "min_ms"),
            _t(r, "max_ms"),
            _rat(r, "vs_floor"),
            _rat(r, "vs_bare"),
            _rat(r, "vs_dp_algo"),
            _rat(r, "vs_torch_dp"),
        ],
    ),
    "overhead": (
        "Host overhead and Python calls per step (4 replicas, 2 samples each); "
        "overhead = step - model_chunks",
        [
            "workload",
            "params",
            "mode",
            "launch",
            "status",
            "step ms",
            "x floor",
            "overhead ms",
            "calls/step",
            "in model",
            "wrapper calls",
            "in fastdp",
            "x dp_algo (ovh)",
        ],
        lambda r: [
            r.get("workload"),
            r.get("params"),
            _mode(r),
            _launch(r),
            _status(r),
            _t(r, "median_ms"),
            _rat(r, "vs_floor"),
            r.get("overhead_ms"),
            r.get("calls_per_step"),
            (r.get("calls") or {}).get("model"),
            r.get("wrapper_calls_per_step"),
            (r.get("calls_in") or {}).get("fastdp"),
            _rat(r, "overhead_vs_dp_algo"),
        ],
    ),
    "replicate": (
        "Steady-state replicate() of Linear(32,32) x layers, ms per call",
        ["layers", "replicas", "mode", "status", "median", "min", "max", "x dp_algo", "x torch"],
        lambda r: [
            r.get("layers") if "mlp" in r.get("workload", "") else r.get("workload"),
            r.get("replicas"),
            r["mode"],
            _status(r),
            _t(r, "median_ms"),
            _t(r, "min_ms"),
            _t(r, "max_ms"),
            _rat(r, "vs_dp_algo"),
            _rat(r, "vs_torch"),
        ],
    ),
    "replicate_gpu": (
        "replicate() and the parameter broadcast alone, ms per call",
        [
            "workload",
            "params",
            "MiB",
            "devices",
            "mode",
            "status",
            "median",
            "min",
            "max",
            "x dp_algo",
            "x torch",
        ],
        lambda r: [
            r.get("workload"),
            r.get("params"),
            (r.get("param_bytes") or 0) / 2**20,
            _devs(r),
            r["mode"],
            _status(r),
            _t(r, "median_ms"),
            _t(r, "min_ms"),
            _t(r, "max_ms"),
            _rat(r, "vs_dp_algo"),
            _rat(r, "vs_torch"),
        ],
    ),
    "compile": (
        "torch.compile on persistent replicas: training step ms; x floor = vs the same "
        "kind of floor (module on the chunks in turn), x eager = vs eager fastdp",
        [
            "workload",
            "devices",
            "mode",
            "status",
            "median",
            "min",
            "x floor",
            "x eager",
            "first step s",
            "frames",
            "recompiles/20",
        ],
        lambda r: [
            r.get("workload"),
            _devs(r),
            r["mode"],
            _status(r),
            _t(r, "median_ms"),
            _t(r, "min_ms"),
            _rat(r, "vs_floor"),
            _rat(r, "vs_fastdp_eager"),
            r.get("first_step_s"),
            r.get("frames_first_step"),
            r.get("recompiles_20_steps"),
        ],
    ),
    "module-build": (
        "Building nn.Sequential(Linear(32, 32) x layers) while a persistent wrapper "
        "is alive vs with none, ms (NOTE [ Replica invalidation ])",
        ["workload", "mode", "status", "median", "min", "max", "x without", "nn.Module untouched"],
        lambda r: [
            r.get("workload"),
            r["mode"],
            _status(r),
            _t(r, "median_ms"),
            _t(r, "min_ms"),
            _t(r, "max_ms"),
            _rat(r, "vs_without"),
            r.get("nn_module_untouched"),
        ],
    ),
    "comm": (
        "Collectives: effective GB/s = bytes / time; x limit = GB/s / plain copy GB/s; "
        "rows that move no byte (views) in us per call",
        [
            "op",
            "bytes",
            "impl",
            "threads",
            "status",
            "median ms",
            "GB/s",
            "us/call",
            "x limit",
            "x torch",
        ],  # fmt: skip
        lambda r: [
            r.get("op"),
            _bytes(r.get("bytes")),
            r["mode"],
            r.get("threads"),
            _status(r),
            _t(r, "median_ms"),
            r.get("gbps"),
            r.get("us_per_call"),
            r.get("frac_of_limit"),
            _rat(r, "vs_torch"),
        ],
    ),
}


def _section(suite: str) -> str:
    if suite in STEP_SUITES[1:]:
        return "steps"
    if suite == "replicate":
        return "replicate"
    for k, name in (("overhead", "overhead"), ("replicate", "replicate_gpu"), ("comm", "comm")):
        if k in suite:
            return name
    return suite


def _mode(r: dict) -> str:
    """The mode as the table names it: the references say what they are."""
    mode = r.get("mode")
    if mode == "bare":
        return "bare (whole batch)"
    if mode in ("floor", "model_chunks"):
        return "floor (chunks in turn)"
    return str(mode)


def _launch(r: dict) -> str:
    """The strategy a fastdp record ran: forced, ``auto → pick``, or why auto picked none."""
    launch = r.get("launch")
    if launch is None:
        return "-"
    if launch != "auto":
        return launch
    picks = sorted({p["choice"] for p in r.get("launch_pick") or [] if p.get("choice")})
    if picks:
        return f"auto → {'/'.join(picks)}"
    if len(r.get("devices") or []) <= 1:
        return "direct (1 replica)"
    return "auto (trial unfinished)"


def _devs(r: dict) -> str:
    d = r.get("devices")
    if not d:  # the bare module of a replica count's configuration: one device, whole batch
        return f"1 (for x{r['replicas']})" if r.get("mode") == "bare" and r.get("replicas") else "-"
    return f"{d[0]} x{len(d)}" if len(set(d)) == 1 else ",".join(x.split(":")[-1] for x in d)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def format_tables(records: list[dict]) -> str:
    order: list[str] = []
    for r in records:
        if r.get("suite") and r["suite"] not in order:
            order.append(r["suite"])
    parts = [] if records else ["(nothing was measured: no requested suite can run here)"]
    for suite in order:
        title, headers, row = _SECTIONS.get(_section(suite), _SECTIONS["steps"])
        rows = [
            row(r) for r in records if r.get("suite") == suite and r.get("status") != "unsupported"
        ]
        parts.append(_table(f"{suite}: {title}", headers, rows))
    errs = [r for r in records if r.get("error") and r.get("status") != "unsupported"]
    if errs:
        parts.append("== Errors and failed checks")
        parts += [
            f"  {r.get('suite')} {r.get('workload', r.get('op'))} {r.get('mode')} "
            f"{_devs(r)}: {r.get('error')}"
            for r in errs
        ]
    fails = [r for r in records if r.get("status") == "check_failed"]
    parts += [
        f"  CHECK FAILED {r.get('suite')} {r.get('workload', r.get('op'))} {r.get('mode')} "
        f"{_devs(r)}: {(r.get('check') or {}).get('why', r.get('check'))}"
        for r in fails
    ]
    unsup = {r.get("error") for r in records if r.get("status") == "unsupported"}
    parts += [f"note: {u}" for u in unsup]
    return "\n".join(parts)


def header(meta: dict) -> str:
    fd = meta["fastdp"]
    return (
        f"fastdp.bench  {meta['date']}  torch {meta['torch']}  cuda {meta['cuda']}  "
        f"fastdp {fd['version']} ({(fd['commit'] or '?')[:10]}"
        f"{'+dirty' if fd.get('dirty') else ''})\n"
        f"machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, "
        f"{meta['machine']['torch_threads']} torch thread(s), "
        f"GPUs: {', '.join(meta['machine']['gpu']['names']) or 'none'}\n"
    )


def write_json(path: str, meta: dict, records: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"schema": SCHEMA, "meta": meta, "headline": headline(records), "records": records}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")


def _load(meta: dict) -> str:
    la = meta.get("load_average") or {}
    if la.get("start") is None:
        return "unknown"
    return f"{la['start']:.1f} at start, {la['end']:.1f} at end"


def _markdown_table(
    rows: list[dict] | None, header: str, rule: str, row: Callable[[dict], str]
) -> list[str]:
    """A Markdown table of ``rows`` (a line each by ``row``), then a blank line; none if no rows."""
    if not rows:
        return []
    return [header, rule, *(row(r) for r in rows), ""]


def headline_markdown(doc: dict) -> str:
    """The headline figures of a results file as Markdown tables (for bench/README.md)."""
    meta, head = doc["meta"], doc["headline"]
    gpu = meta["machine"]["gpu"]
    lines = [
        f"Measured {meta['date']} on {meta['machine']['cpu']} ({meta['machine']['cores']} "
        f"cores{', GPUs: ' + ', '.join(gpu['names']) if gpu['names'] else ', no GPU'}), "
        f"torch {meta['torch']}, fastdp {meta['fastdp']['version']} at commit "
        f"`{(meta['fastdp']['commit'] or '?')[:10]}`"
        f"{' (uncommitted changes)' if meta['fastdp'].get('dirty') else ''}, "
        f"command `{meta['command']}`, {meta['machine']['torch_threads']} torch thread(s), "
        f"1-min load average {_load(meta)}.",
        "",
    ]
    lines += _markdown_table(
        head.get("replicate_cpu"),
        "| layers | replicas | fastdp replicate (ms) | DataParallel's algorithm (ms) | ratio |",
        "|---:|---:|---:|---:|---:|",
        lambda r: (
            f"| {r['layers']} | {r['replicas']} | {r['fastdp_ms']:.3g} | "
            f"{r['dp_algo_ms']:.3g} | {r['ratio']:.3f} |"
        ),
    )
    lines += _markdown_table(
        head.get("overhead"),
        "| workload | parameter tensors | mode | step (ms) | host overhead (ms) | "
        "wrapper Python calls per step |",
        "|---|---:|---|---:|---:|---:|",
        lambda r: (
            f"| {r['workload']} | {r['params']} | {r['mode']} | {_fmt(r['step_ms'])} | "
            f"{_fmt(r['overhead_ms'])} | {_fmt(r['wrapper_calls_per_step'])} |"
        ),
    )
    lines += _markdown_table(
        head.get("steps_fastdp"),
        "| suite | workload | input | replicas | fastdp step (ms) | x floor | x bare "
        "| x dp_algo | x nn.DataParallel |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
        lambda r: (
            f"| {r['suite']} | {r['workload']} | {r['input']} | {r['replicas']} | "
            f"{_fmt(r['step_ms'])} | {_fmt(r.get('vs_floor'))} | {_fmt(r.get('vs_bare'))} | "
            f"{_fmt(r.get('vs_dp_algo'))} | {_fmt(r.get('vs_torch_dp'))} |"
        ),
    )
    lines += _markdown_table(
        head.get("launch"),
        "| suite | workload | replicas | floor (ms) | threads (x floor) "
        "| inline (x floor) | auto (x floor) | auto picked | auto / threads |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
        lambda r: (
            f"| {r['suite']} | {r['workload']} | {r['replicas']} | {_fmt(r['floor_ms'])} | "
            f"{_fmt(r['threads_ms'])} ({_fmt(r['threads_x_floor'])}) | "
            f"{_fmt(r['inline_ms'])} ({_fmt(r['inline_x_floor'])}) | "
            f"{_fmt(r['auto_ms'])} ({_fmt(r['auto_x_floor'])}) | {r['auto_pick']} | "
            f"{_fmt(r['auto_x_threads'])} |"
        ),
    )
    if head.get("not_ok"):
        lines += ["Not ok in this run: " + "; ".join(head["not_ok"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m fastdp.bench.report RESULTS.json: Markdown headline
    import sys

    with open(sys.argv[1]) as f:
        print(headline_markdown(json.load(f)))
