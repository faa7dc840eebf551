"""Ratios within the run, the headline figures, the stdout table, and the JSON file. Every ratio
is of medians measured in the same run (bench/README.md, *Reading the table and the plots*)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Callable

STEP_SUITES = ("passthrough", "cpu-replicas", "gpu-steps", "multigpu-steps")
SCHEMA = "fastdp-bench/1"


def med(r: dict) -> float | None:
    return (r.get("time_ms") or {}).get("median_ms")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def by_mode(records: list[dict], key: Callable[[dict], object]) -> dict:
    """``key(r)`` -> mode -> record, in the records' order; a record whose key is None is left
    out."""
    groups: dict = defaultdict(dict)
    for r in records:
        if (k := key(r)) is not None:
            groups[k][r.get("mode")] = r
    return groups


# ratio -> (its reference modes, the first found; the modes that get no such ratio)
RATIOS = {
    "vs_floor": (("floor", "model_chunks"), ("floor", "model_chunks")),
    "vs_bare": (("bare",), ("bare",)),
    "vs_dp_algo": (("dp_algo",), ("dp_algo", "bare")),
    "vs_torch_dp": (("torch_dp",), ("torch_dp",)),
    "vs_torch": (("torch",), ("torch",)),
    "vs_without": (("without",), ("without",)),
}
# ratio -> the record field compared with DataParallel's algorithm's in the same configuration
FIELD_RATIOS = {
    "overhead_vs_dp_algo": "overhead_ms",
    "wrapper_calls_vs_dp_algo": "wrapper_calls_per_step",
}


def _config(r: dict) -> tuple | None:
    """The configuration within which a record's ratios are taken (None: no ratios)."""
    suite = r.get("suite", "")
    if suite in STEP_SUITES:  # one task: one workload, input, step and replica count
        return (suite, r.get("workload"), r.get("input"), r.get("step"), r.get("replicas"))
    if "replicate" in suite or suite.startswith("overhead"):
        return (suite, r.get("workload"), r.get("replicas"))
    if suite == "module-build":
        return (suite, r.get("workload"))
    if r.get("kind") in ("scatter", "gather", "broadcast", "view"):
        return (suite, r["op"], r["bytes"], r.get("threads"))
    return None


def add_ratios(records: list[dict]) -> None:
    """Adds ``ratios`` (those of ``RATIOS`` and ``FIELD_RATIOS``) to every timed record."""
    for group in by_mode(records, _config).values():
        dp = group.get("dp_algo", {})
        for mode, r in group.items():
            if med(r) is None:
                continue
            rat = {}
            for name, (refs, excluded) in RATIOS.items():
                ref = next((group[m] for m in refs if m in group), None)
                if ref is not None and mode not in excluded:
                    rat[name] = _ratio(med(r), med(ref))
            if mode != "dp_algo":
                for name, key in FIELD_RATIOS.items():
                    rat[name] = _ratio(r.get(key), dp.get(key))
            r["ratios"] = {k: v for k, v in rat.items() if v is not None}


def _replicate_entries(records: list[dict]) -> list[dict]:
    """Per depth: fastdp's steady-state ``replicate()`` against DataParallel's algorithm."""
    timed = [r for r in records if r.get("suite") == "replicate" and med(r) is not None]
    entries = []
    for layers, g in sorted(by_mode(timed, lambda r: r["layers"]).items()):
        f, d = g.get("fastdp"), g.get("dp_algo")
        if f and d:
            entry = dict(layers=layers, replicas=f["replicas"], fastdp_ms=med(f), dp_algo_ms=med(d))
            entries.append({**entry, "ratio": med(f) / med(d)})
    return entries


# The fields each headline row copies from its record (then ``step_ms``, the median)
OVERHEAD_FIELDS = ("workload", "mode", "params", "overhead_ms", "wrapper_calls_per_step")
STEP_FIELDS = ("suite", "workload", "input", "replicas", "mode")


def _copy(r: dict, fields: tuple[str, ...], **more: object) -> dict:
    return {**{k: r.get(k) for k in fields}, "step_ms": med(r), **more}


def headline(records: list[dict]) -> dict:
    """The figures a reader looks for first, each copied from a record of this run."""
    timed = [r for r in records if med(r) is not None]
    overhead = [r for r in timed if r.get("suite", "").startswith("overhead")]
    steps = [r for r in timed if r.get("suite") in STEP_SUITES[1:] and r.get("mode") == "fastdp"]
    out = {
        "replicate_cpu": _replicate_entries(records),
        "overhead": [_copy(r, OVERHEAD_FIELDS) for r in overhead if r["mode"] != "model_chunks"],
        "steps_fastdp": [_copy(r, STEP_FIELDS, **r.get("ratios", {})) for r in steps],
        "launch": launch_entries(records),
    }
    out = {k: v for k, v in out.items() if v}
    out["not_ok"] = [
        f"{r.get('suite')}/{r.get('workload', r.get('op'))}/{r.get('mode')}"
        f"/{r.get('replicas')}: {r.get('status')}"
        for r in records
        if r.get("status") not in ("ok", "unsupported")
    ]
    return out


LAUNCH_MODES = {"fastdp_threads": "threads", "fastdp_inline": "inline", "fastdp": "auto"}


def launch_entries(records: list[dict]) -> list[dict]:
    """Per step configuration: the floor and each launch strategy (ms, x floor), auto's pick, and
    auto / threads, all from this run's medians."""

    def key(r: dict) -> tuple | None:
        if r.get("suite") in STEP_SUITES[1:] or r.get("suite", "").startswith("overhead"):
            return (r["suite"], r.get("workload"), r.get("input"), r.get("replicas"))
        return None

    entries = []
    for (suite, workload, inp, n), g in by_mode(records, key).items():
        floor = g.get("floor") or g.get("model_chunks")
        if not floor or med(floor) is None or not any(m in g for m in LAUNCH_MODES):
            continue
        entry = dict(suite=suite, workload=workload, input=inp, replicas=n, floor_ms=med(floor))
        for m, name in LAUNCH_MODES.items():
            entry[f"{name}_ms"] = med(g.get(m, {}))
            entry[f"{name}_x_floor"] = _ratio(med(g.get(m, {})), med(floor))
        picks = [p["choice"] for p in g.get("fastdp", {}).get("launch_pick") or []]
        entry["auto_pick"] = picks[0] if len(set(picks)) == 1 else (picks or None)
        entry["auto_x_threads"] = _ratio(entry["auto_ms"], entry["threads_ms"])
        entries.append(entry)
    return entries


def _fmt(v: object, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return f"{v:.{nd}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _table(title: str, headers: list[str], entries: list[list]) -> str:
    cells = [[_fmt(c) for c in entry] for entry in entries]
    w = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w[i]) for i, h in enumerate(headers))
    body = [
        "  ".join(c.rjust(w[i]) if i >= 1 and _num(c) else c.ljust(w[i]) for i, c in enumerate(r))
        for r in cells
    ]
    return "\n".join([f"== {title}", line, "-" * len(line), *body, ""])


_NUMBER_MARKS = str.maketrans("", "", ".,-e+")


def _num(c: str) -> bool:
    """A cell right-aligned in the table: a number as ``_fmt`` writes it, or "-"."""
    return c.translate(_NUMBER_MARKS).isdigit() or c == "-"


def _status(r: dict) -> str:
    s = r.get("status", "ok")
    return "CHECK FAILED" if s == "check_failed" else s


# suite -> its table in SECTIONS where the names differ (a suite in neither: the step table)
SECTION_OF = {
    "overhead-cuda": "overhead",
    "gpu-replicate": "replicate_gpu",
    "multigpu-replicate": "replicate_gpu",
    "gpu-comm": "comm",
    "multigpu-comm": "comm",
}


# The references as the table names them: they say what they are.
REFERENCES = {
    "bare": "bare (whole batch)",
    "floor": "floor (chunks in turn)",
    "model_chunks": "floor (chunks in turn)",
}


def _mode(r: dict) -> str:
    return REFERENCES.get(r.get("mode"), str(r.get("mode")))


def _launch(r: dict) -> str:
    """The strategy a fastdp record ran: forced, ``auto → pick``, or why auto picked none."""
    launch = r.get("launch")
    if launch != "auto":
        return launch or "-"
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


def _maybe_bytes(n: int | None) -> str:
    return "-" if n is None else _bytes(n) if n >= 1 << 10 else f"{n} B"


def _per_index(r: dict) -> str:
    return " ".join(_maybe_bytes(b) for b in r.get("optimizer_bytes") or []) or "-"


def _zero_copies(r: dict) -> str:
    return _maybe_bytes(r.get("zero_copy_bytes_per_step"))


Field = str | Callable[[dict], object]


def _layers(r: dict) -> object:
    return r.get("layers") if "mlp" in r.get("workload", "") else r.get("workload")


def _get(r: dict, field: Field) -> object:
    """A cell: ``field`` is a dotted path into the record (``time_ms.median_ms``) or a function."""
    if callable(field):
        return field(r)
    v: object = r
    for k in field.split("."):
        v = v.get(k) if isinstance(v, dict) else None
    return v


# The stdout tables as data: section -> (title, [(column header, field)]), ``_get``'s fields.
WORKLOAD, MODE, STATUS = ("workload", "workload"), ("mode", _mode), ("status", _status)
LAUNCH, RAW_MODE, DEVICES = ("launch", _launch), ("mode", "mode"), ("devices", _devs)
MEDIAN, MIN, MAX = [(k, f"time_ms.{k}_ms") for k in ("median", "min", "max")]
TIMES, STEP = [MEDIAN, MIN, MAX], ("step ms", "time_ms.median_ms")
X_FLOOR, X_BARE = ("x floor", "ratios.vs_floor"), ("x bare", "ratios.vs_bare")
X_DP, X_TORCH = ("x dp_algo", "ratios.vs_dp_algo"), ("x torch", "ratios.vs_torch")
SECTIONS: dict[str, tuple[str, list[tuple[str, Field]]]] = {
    "passthrough": (
        "Pass-through (no GPU: FastDataParallel(m) calls the module), ms per call",
        [WORKLOAD, ("step", "step"), MODE, STATUS, *TIMES, ("+us", "overhead_us"), X_BARE],
    ),
    "steps": (
        "Training step (forward + backward), ms",
        [WORKLOAD, ("input", "input"), DEVICES, MODE, LAUNCH, STATUS, *TIMES, X_FLOOR]
        + [X_BARE, X_DP, ("x torch_dp", "ratios.vs_torch_dp")],
    ),
    "overhead": (
        "Host overhead and Python calls per step (4 replicas, 2 samples each); "
        "overhead = step - model_chunks",
        [WORKLOAD, ("params", "params"), MODE, LAUNCH, STATUS, STEP, X_FLOOR]
        + [("overhead ms", "overhead_ms"), ("calls/step", "calls_per_step")]
        + [("in model", "calls.model"), ("wrapper calls", "wrapper_calls_per_step")]
        + [("in fastdp", "calls_in.fastdp"), ("x dp_algo (ovh)", "ratios.overhead_vs_dp_algo")],
    ),
    "replicate": (
        "Steady-state replicate() of Linear(32,32) x layers, ms per call",
        [("layers", _layers), ("replicas", "replicas"), RAW_MODE, STATUS, *TIMES, X_DP, X_TORCH],
    ),
    "replicate_gpu": (
        "replicate() and the parameter broadcast alone, ms per call",
        [WORKLOAD, ("params", "params"), ("MiB", lambda r: (r.get("param_bytes") or 0) / 2**20)]
        + [DEVICES, RAW_MODE, STATUS, *TIMES, X_DP, X_TORCH],
    ),
    "compile": (
        "torch.compile on persistent replicas: training step ms; x floor = vs the same "
        "kind of floor (module on the chunks in turn), x eager = vs eager fastdp",
        [WORKLOAD, DEVICES, RAW_MODE, STATUS, MEDIAN, MIN, X_FLOOR]
        + [("x eager", "ratios.vs_fastdp_eager"), ("first step s", "first_step_s")]
        + [("frames", "frames_first_step"), ("recompiles/20", "recompiles_20_steps")],
    ),
    "zero": (
        "ZeroRedundancyOptimizer (AdamW) against the unsharded AdamW: training step ms (forward, "
        "backward, optimizer step) and the optimizer step alone; optimizer state per replica index",
        [WORKLOAD, ("storage", "storage"), DEVICES, RAW_MODE, STATUS, MEDIAN, MIN, X_FLOOR]
        + [("x unsharded", "ratios.vs_unsharded"), ("state per index", _per_index)]
        + [("index 0 share", "index0_share"), ("copied/step", _zero_copies)]
        + [("reduce+refresh/step", lambda r: _maybe_bytes(r.get("reduce_refresh_bytes_per_step")))],
    ),
    "generate": (
        "Greedy generate of a tiny Llama (input: batch x prompt + new tokens): ms per call, "
        "generated tokens per second; x floor = vs the module on the chunks in turn",
        [WORKLOAD, ("input", "input"), DEVICES, MODE, LAUNCH, STATUS, MEDIAN, MIN]
        + [("tokens/s", "tokens_per_s"), X_FLOOR, X_BARE],
    ),
    "module-build": (
        "Building nn.Sequential(Linear(32, 32) x layers) while a persistent wrapper "
        "is alive vs with none, ms (NOTE [ Replica invalidation ])",
        [WORKLOAD, RAW_MODE, STATUS, *TIMES, ("x without", "ratios.vs_without")]
        + [("nn.Module untouched", "nn_module_untouched")],
    ),
    "comm": (
        "Collectives: effective GB/s = bytes / time; x limit = GB/s / plain copy GB/s; "
        "rows that move no byte (views) in us per call",
        [("op", "op"), ("bytes", lambda r: _bytes(r.get("bytes"))), ("impl", "mode")]
        + [("threads", "threads"), STATUS, ("median ms", "time_ms.median_ms"), ("GB/s", "gbps")]
        + [("us/call", "us_per_call"), ("x limit", "frac_of_limit"), X_TORCH],
    ),
}


def format_tables(records: list[dict]) -> str:
    order = list(dict.fromkeys(r["suite"] for r in records if r.get("suite")))
    parts = [] if records else ["(nothing was measured: no requested suite can run here)"]
    for suite in order:
        title, cols = SECTIONS.get(SECTION_OF.get(suite, suite), SECTIONS["steps"])
        entries = [
            [_get(r, field) for _, field in cols]
            for r in records
            if r.get("suite") == suite and r.get("status") != "unsupported"
        ]
        parts.append(_table(f"{suite}: {title}", [h for h, _ in cols], entries))

    def where(r: dict) -> str:
        return f"{r.get('suite')} {r.get('workload', r.get('op'))} {r.get('mode')} {_devs(r)}"

    errs = [r for r in records if r.get("error") and r.get("status") != "unsupported"]
    if errs:
        parts.append("== Errors and failed checks")
        parts += [f"  {where(r)}: {r.get('error')}" for r in errs]
    parts += [
        f"  CHECK FAILED {where(r)}: {(r.get('check') or {}).get('why', r.get('check'))}"
        for r in records
        if r.get("status") == "check_failed"
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


# The headline's Markdown tables as data: headline key -> (header row, fields). A launch strategy's
# field is written "its ms (its x floor)"; fields of RAW as they are, of SPECS in their format, any
# other by ``_fmt``; every column right-aligned but those of TEXT.
MARKDOWN = {
    "replicate_cpu": (
        "layers | replicas | fastdp replicate (ms) | DataParallel's algorithm (ms) | ratio",
        "layers replicas fastdp_ms dp_algo_ms ratio",
    ),
    "overhead": (
        "workload | parameter tensors | mode | step (ms) | host overhead (ms) | "
        "wrapper Python calls per step",
        "workload params mode step_ms overhead_ms wrapper_calls_per_step",
    ),
    "steps_fastdp": (
        "suite | workload | input | replicas | fastdp step (ms) | x floor | x bare | x dp_algo | "
        "x nn.DataParallel",
        "suite workload input replicas step_ms vs_floor vs_bare vs_dp_algo vs_torch_dp",
    ),
    "launch": (
        "suite | workload | replicas | floor (ms) | threads (x floor) | inline (x floor) | "
        "auto (x floor) | auto picked | auto / threads",
        "suite workload replicas floor_ms threads inline auto auto_pick auto_x_threads",
    ),
}
TEXT = ("suite", "workload", "input", "mode", "auto_pick")
RAW = (*TEXT, "layers", "replicas", "params")
SPECS = {"fastdp_ms": ".3g", "dp_algo_ms": ".3g", "ratio": ".3f"}


def _cell(r: dict, field: str) -> str:
    if field in LAUNCH_MODES.values():
        return f"{_fmt(r.get(field + '_ms'))} ({_fmt(r.get(field + '_x_floor'))})"
    if field in RAW or field in SPECS:
        return format(r[field], SPECS.get(field, ""))
    return _fmt(r.get(field))


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
    for key, (header, fields) in MARKDOWN.items():
        if head.get(key):
            rules = "|".join("---" if f in TEXT else "---:" for f in fields.split())
            lines += [f"| {header} |", f"|{rules}|"]
            lines += [
                "| " + " | ".join(_cell(r, f) for f in fields.split()) + " |" for r in head[key]
            ]
            lines.append("")
    if head.get("not_ok"):
        lines += ["Not ok in this run: " + "; ".join(head["not_ok"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m fastdp.bench.report RESULTS.json: Markdown headline
    with open(sys.argv[1]) as f:
        print(headline_markdown(json.load(f)))
