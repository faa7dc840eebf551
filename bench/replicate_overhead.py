#!/usr/bin/env python
"""Steady-state ``replicate()`` cost, fastdp vs DataParallel's algorithm, side by side (issue 4).

    python bench/replicate_overhead.py                       # 10..1000 layers, 4 CPU replicas
    python bench/replicate_overhead.py --layers 1000 --replicas 4 --repeats 20 --json out.json
    python bench/replicate_overhead.py --with-overhead       # + host time and calls per step

Model: ``nn.Sequential`` of ``Linear(32, 32)`` in training mode, grad enabled. ``fastdp`` is
``FastDataParallel(model, ['cpu'] * n).replicate(model, device_ids)`` after warm-up calls (its
steady state); ``dp_algo`` is ``fastdp.replicate.replicate(model, devices)``, torch's
``replicate`` algorithm (fresh replicas on every call). Both are checked first (each replica
computes what the model computes), then timed interleaved in the same process; the ratio is
fastdp / dp_algo of the medians. The same code runs as ``python -m fastdp.bench --suite
replicate``.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastdp.bench import machine, report, suites_cpu  # noqa: E402
from fastdp.bench.cli import settings  # noqa: E402
from fastdp.bench.runner import run_tasks  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, nargs="+", default=[10, 30, 100, 300, 1000])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--with-overhead",
        action="store_true",
        help="also the overhead suite (host time and Python calls per step)",
    )
    p.add_argument("--json", default=None, help="write the records and metadata here")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    s = settings("cpu", args.repeats, (args.replicas,))
    tasks = suites_cpu.replicate_tasks(s, layers=args.layers, n=args.replicas)
    if args.with_overhead:
        tasks += suites_cpu.overhead_tasks(s, n=args.replicas)
    records = run_tasks(tasks)
    report.add_ratios(records)
    print(report.format_tables(records))
    for row in report.headline(records).get("replicate_cpu", []):
        print(
            f"replicate {row['layers']:>5} layers x {row['replicas']} CPU replicas: "
            f"fastdp {row['fastdp_ms']:.3f} ms, DataParallel's algorithm "
            f"{row['dp_algo_ms']:.3f} ms, ratio {row['ratio']:.3f}"
        )
    if args.json:
        meta = machine.describe(sys.argv[1:])
        meta["command"] = "python bench/replicate_overhead.py " + " ".join(sys.argv[1:])
        report.write_json(args.json, meta, records)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
