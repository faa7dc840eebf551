"""The README's figures, generated from a committed results file:
``python -m fastdp.bench.headline RESULTS.json --replicas 4`` prints a Markdown table of the
fastdp training step per workload against ``nn.DataParallel``, DataParallel's algorithm and the
chunked floor (tests/test_docs.py checks that the README's tables are this output)."""

from __future__ import annotations

import argparse
import json

from fastdp.bench.report import STEP_SUITES, by_mode, med


def _speedup(other: dict | None, fd: dict) -> str:
    return f"{med(other) / med(fd):.2f}x" if other and med(other) is not None else "n/a"


def device_line(doc: dict, replicas: int) -> str:
    """Where the table's figures were measured, in one line."""
    m = doc["meta"]["machine"]
    gpus = m["gpu"]["names"]
    rec = next(r for r in doc["records"] if r.get("replicas") == replicas and r.get("devices"))
    where = f"{replicas} replicas on {', '.join(dict.fromkeys(rec['devices']))}"
    hw = gpus[0] if gpus else f"{m['cpu']}, {m['cores']} cores, no GPU"
    return f"{hw}; {where}; torch {doc['meta']['torch']}"


def table(doc: dict, replicas: int) -> str:
    """One row per workload (inputs already on the device): fastdp's step and its speed-ups,
    medians of the same run."""

    def workload(r: dict) -> str | None:
        step = r.get("suite") in STEP_SUITES[1:] and r.get("input") in ("tensor", "dict16")
        ok = step and r.get("replicas") == replicas and med(r) is not None
        return r["workload"] if ok else None

    lines = [
        "| workload | fastdp step (ms) | speed-up over nn.DataParallel | speed-up over "
        "DataParallel's algorithm | fastdp / floor |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, g in by_mode(doc["records"], workload).items():
        fd = g.get("fastdp")
        if not fd:
            continue
        floor = g.get("floor")
        x_floor = f"{med(fd) / med(floor):.2f}x" if floor and med(floor) else "n/a"
        lines.append(
            f"| {name} | {med(fd):.3g} | {_speedup(g.get('torch_dp'), fd)} | "
            f"{_speedup(g.get('dp_algo'), fd)} | {x_floor} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fastdp.bench.headline", description=__doc__)
    p.add_argument("results", help="a results.json written by python -m fastdp bench")
    p.add_argument("--replicas", type=int, default=4)
    args = p.parse_args(argv)
    with open(args.results) as f:
        doc = json.load(f)
    print(f"{device_line(doc, args.replicas)}\n\n{table(doc, args.replicas)}")


if __name__ == "__main__":
    main()
