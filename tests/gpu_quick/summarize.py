"""The quick check's summary: probe verdicts, the doctor, pytest, the key bench rows.

  python tests/gpu_quick/summarize.py OUTDIR      prints the lines; writes OUTDIR/bench.json

Bench rows are fastdp against torch on the same machine (x torch: ratio of medians) and the
plain copy (x limit); ``prev x`` is the same ratio in bench/results/gpu-h100-2026-11-24-shared-gpu.
broadcast_coalesced onto [0]*n compares against torch's aliasing rows (torch returns the source
itself for every replica on its device): a ratio there is not a gap.
"""

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREV = os.path.join(ROOT, "bench", "results", "gpu-h100-2026-11-24-shared-gpu")


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def med(rec):
    return ((rec or {}).get("time_ms") or {}).get("median_ms")


def ratio(a, b):
    return med(a) / med(b) if med(a) and med(b) else None


def comm_rows(doc):
    rows = {}
    for r in (doc or {}).get("records", []):
        if r.get("suite") in ("gpu-comm", "multigpu-comm"):
            rows[(r["op"], r["bytes"], r.get("threads"), r["mode"])] = r
    return rows


def probe_lines(probes):
    out = ["== probes (details: probes.json, probes.log)"]
    for p in probes:
        name, extra = p.get("probe", "?"), ""
        if name == "pinned_order":
            extra = f"fastdp not right: {p.get('fastdp_not_right')}"
        elif name.startswith("gather_capture"):
            extra = f"captured={p.get('captured')} {str(p.get('capture_error', ''))[:80]}"
        elif name == "copy_shapes_perf":
            extra = f"worst x torch {p.get('worst_x_torch')}"
        elif name == "zero_steps" and "cases" in p:
            extra = f"wrong: {p.get('wrong')} not bit-exact: {p.get('not_bit_exact')}"
        elif name == "env":
            extra = f"{p.get('device')} torch {p.get('torch')}"
        elif "error" in p:
            extra = str(p["error"])[:120]
        out.append(f"  {p.get('status', '?'):<9} {name:<28} {extra}")
        for r in p.get("rows", []) if name == "copy_shapes_perf" else []:
            out.append(
                f"    {r.get('case', ''):<56} fastdp {r.get('fastdp_ms')} torch "
                f"{r.get('torch_ms')} limit {r.get('h2d_limit_ms')} ms {r.get('error', '')}"
            )
        for r in p.get("cases", []) if name == "pinned_order" else []:
            out.append(f"    {r['case']:<44} fastdp {r.get('fastdp')}  torch {r.get('torch')}")
        for r in p.get("cases", []) if name == "zero_steps" else []:
            out.append(
                f"    {r['case']:<44} bit-exact {r.get('bit_exact')} max diff "
                f"{r.get('max_abs_diff')} {r.get('error', '')}"
            )
    return out


def test_lines(path, title="pytest"):
    try:
        txt = open(path, errors="replace").read()
    except OSError:
        return []
    out = [f"== {title}"]
    for m in re.finditer(r"^=* ?(\d+ (passed|failed|skipped|error)[^=]*)=*$", txt, re.M):
        out.append("  " + m.group(1).strip())
    for name in sorted(set(failed_ids(txt)))[:40]:
        out.append("  FAILED " + name)
    return out


# A failed test's id in pytest -v's progress lines (plain, and xdist's "[gw3] [ 10%] FAILED id")
# and in the -rfE summary ("FAILED id - message"), so a stage killed before its summary keeps them.
FAILED_LINE = re.compile(
    r"^(?:(?P<a>\S+::.+?) (?:FAILED|ERROR)(?: +\[ *\d+%\])?"
    r"|(?:\[gw\d+\] \[ *\d+%\] )?(?:FAILED|ERROR) (?P<b>\S+::.+?)(?: - .*)?)$",
    re.M,
)


def failed_ids(txt):
    return [m.group("a") or m.group("b") for m in FAILED_LINE.finditer(txt)]


def bench_lines(comm, steps):
    out = []
    now, prev = comm_rows(comm), comm_rows(load(os.path.join(PREV, "gpu-comm", "results.json")))
    if now:
        out.append("== gpu-comm: fastdp vs torch (x torch, prev x: 2026-11-24 H100), x limit")
    for (op, nbytes, thr, mode), r in sorted(now.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if mode == "fastdp":
            t = now.get((op, nbytes, thr, "torch"))
            pf, pt = prev.get((op, nbytes, thr, "fastdp")), prev.get((op, nbytes, thr, "torch"))
            alias = " (torch aliases on its own device)" if op == "broadcast_coalesced" else ""
            out.append(
                f"  {op:<20}{nbytes:>11} {med(r) or 0:>9.4f} ms x torch {ratio(r, t) or 0:5.2f}"
                f" prev x {ratio(pf, pt) or 0:5.2f} x limit {r.get('frac_of_limit') or 0:5.3f}"
                f" {(r.get('check') or {}).get('ok')} {r.get('status')}{alias}"
            )
        elif r.get("kind") == "limit":
            out.append(f"  limit {op:<14}{nbytes:>11} {med(r) or 0:>9.4f} ms")
    for r in (comm or {}).get("records", []):
        if r.get("suite") in ("gpu-replicate", "multigpu-replicate"):
            out.append(f"  replicate {r.get('workload')} {r.get('mode')}: {med(r)} ms")
    if steps:
        out.append("== gpu-steps: ratios of medians against the floor and nn.DataParallel")
    for r in (steps or {}).get("records", []):
        if str(r.get("mode", "")).startswith("fastdp") or r.get("mode") == "torch_dp":
            rat = r.get("ratios") or {}
            out.append(
                f"  {r.get('workload', ''):<13}{r.get('input', ''):<20}x{r.get('replicas')}"
                f" {r.get('mode', ''):<15}{med(r) or 0:>9.2f} ms x floor"
                f" {rat.get('vs_floor', 0):.3f} x torch_dp {rat.get('vs_torch_dp', 0):.3f}"
                f" {r.get('status')}"
            )
    return out


def main(outdir):
    probes = [load(os.path.join(outdir, f)) or [] for f in ("probes.json", "zero-probes.json")]
    lines = probe_lines(probes[0] + probes[1])
    doc = load(os.path.join(outdir, "doctor.json"))
    if doc:
        n = {s: sum(c["status"] == s for c in doc["checks"]) for s in ("PASS", "FAIL", "SKIP")}
        lines.append(f"== doctor: {n}")
        lines += [f"  FAIL {c['name']}: {c.get('why', '')[:160]}" for c in doc["checks"]
                  if c["status"] == "FAIL"]  # fmt: skip
    lines += test_lines(os.path.join(outdir, "tests.log"))
    lines += test_lines(os.path.join(outdir, "zero.log"), "pytest (zero stage)")
    comm = load(os.path.join(outdir, "bench-comm", "results.json"))
    steps = load(os.path.join(outdir, "bench-steps", "results.json"))
    lines += bench_lines(comm, steps)
    with open(os.path.join(outdir, "bench.json"), "w") as f:
        json.dump({"comm": comm, "steps": steps}, f, default=str)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
