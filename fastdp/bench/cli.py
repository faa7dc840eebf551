"""``python -m fastdp bench``: fastdp vs nn.DataParallel vs the bare module, on this machine.

Writes a table to stdout, ``results.json``, ``table.txt`` and PNG plots under ``--out``; the
progress bar and notes go to stderr. See ``bench/README.md`` for what each suite measures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

from fastdp.bench import (
    machine,
    plots,
    report,
    suite_compile,
    suite_generate,
    suite_zero,
    suites_cpu,
    suites_gpu,
)
from fastdp.bench.runner import Settings, Task, run_tasks, threads

CPU_SUITES = (
    "passthrough",
    "cpu-replicas",
    "overhead",
    "replicate",
    "module-build",
    "zero",
    "generate",
)
GPU_SUITES = ("gpu-comm", "gpu-replicate", "gpu-steps", "overhead-cuda")
MULTI_SUITES = ("multigpu-comm", "multigpu-replicate", "multigpu-steps")
OPT_SUITES = ("compile",)  # only on request: compiling takes minutes
ALL_SUITES = CPU_SUITES + GPU_SUITES + MULTI_SUITES + OPT_SUITES

_SUITE_TASKS: dict[str, Callable[[Settings], list[Task]]] = {
    "passthrough": suites_cpu.passthrough,
    "cpu-replicas": suites_cpu.cpu_replicas,
    "overhead": suites_cpu.overhead_tasks,
    "replicate": suites_cpu.replicate_tasks,
    "module-build": suites_cpu.module_build_tasks,
    "overhead-cuda": lambda s: suites_cpu.overhead_tasks(s, device="cuda"),
    "gpu-comm": lambda s: suites_gpu.comm_tasks(s, multi=False),
    "gpu-replicate": lambda s: suites_gpu.replicate_gpu_tasks(s, multi=False),
    "gpu-steps": lambda s: suites_gpu.step_tasks(s, multi=False),
    "multigpu-comm": lambda s: suites_gpu.comm_tasks(s, multi=True),
    "multigpu-replicate": lambda s: suites_gpu.replicate_gpu_tasks(s, multi=True),
    "multigpu-steps": lambda s: suites_gpu.step_tasks(s, multi=True),
    "compile": suite_compile.compile_tasks,
    "zero": suite_zero.zero_tasks,
    "generate": suite_generate.generate_tasks,
}


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def why_not(suite: str) -> str | None:
    """Why ``suite`` cannot run on this machine, or None."""
    gpus = _gpus()
    if suites_gpu.DRY_RUN and suite in GPU_SUITES + MULTI_SUITES and suite != "overhead-cuda":
        return None
    if suite == "passthrough" and gpus:
        return "needs a machine without CUDA (FastDataParallel(m) takes every GPU there)"
    if suite in GPU_SUITES and gpus < 1:
        return "needs a CUDA GPU"
    if suite in MULTI_SUITES and gpus < 2:
        return f"needs 2 or more CUDA GPUs (found {gpus})"
    return None


def auto_suites() -> list[str]:
    if _gpus() == 0:
        return list(CPU_SUITES)
    chosen = list(GPU_SUITES) + ["overhead", "replicate", "module-build", "zero", "generate"]
    return chosen + (list(MULTI_SUITES) if _gpus() >= 2 else [])


def settings(profile: str, repeats: int | None, replicas: tuple[int, ...]) -> Settings:
    base = {
        "tiny": dict(repeats=2, warmup=1, min_repeat_s=0.0, max_total_s=0.2),
        "quick": dict(repeats=5, warmup=1, min_repeat_s=0.005, max_total_s=0.4),
    }.get(profile, dict(repeats=10, warmup=1, min_repeat_s=0.02, max_total_s=3.0))
    if repeats is not None:  # asked for: exactly that many, not capped by the profile's time
        base.update(repeats=repeats, max_total_s=None)
    return Settings(profile=profile, replicas=replicas, **base)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastdp bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few repeats (CPU run < 60 s; CI smoke test)",
    )
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the pytest smoke
    # Runs the GPU suites' code on CPU devices (meaningless figures): exercises it without a GPU.
    p.add_argument("--gpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--out", default=os.path.join("bench", "out"), help="output directory (default: bench/out)"
    )
    p.add_argument(
        "--suite",
        nargs="+",
        default=["auto"],
        choices=("auto", "all", *ALL_SUITES),
        metavar="SUITE",
        help=f"auto (by hardware), all, or any of: {', '.join(ALL_SUITES)}",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repeats per configuration, all of them (default: the profile's, "
        "cut short after a few seconds per configuration)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=None,
        help="replica counts for the step suites (default: 1 2 4; --quick: 1 4)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for the whole run (default 1: CPU replicas are "
        "threads themselves; more oversubscribes the cores)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the suites; returns the JSON document it wrote (also for in-process tests)."""
    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    suites_gpu.DRY_RUN = args.gpu_dry_run
    try:
        with threads(args.threads):
            return _run(args, argv, t_start)
    finally:
        suites_gpu.DRY_RUN = False


def _note(msg: str) -> None:
    print(f"fastdp.bench: {msg}", file=sys.stderr)


def _tasks(args: argparse.Namespace) -> tuple[list[str], dict[str, str], list[Task], dict]:
    """The suites that run here, those skipped (with why), their tasks, and the profiles."""
    wanted = list(dict.fromkeys(args.suite))
    if "auto" in wanted or "all" in wanted:
        wanted = auto_suites() if "auto" in wanted else list(ALL_SUITES)
    skipped = {s: why for s in wanted if (why := why_not(s))}
    for s, why in skipped.items():
        _note(f"suite {s} skipped: {why}")
    suites = [s for s in wanted if s not in skipped]
    small = "tiny" if args.tiny else "quick" if args.quick else None
    profiles = {"cpu": small or "cpu", "gpu": small or ("quick" if args.gpu_dry_run else "gpu")}
    replicas = tuple(args.replicas or ((1, 4) if args.quick else (1, 2, 4)))
    tasks: list[Task] = []
    for s in suites:
        profile = profiles["gpu" if s in GPU_SUITES + MULTI_SUITES else "cpu"]
        tasks += _SUITE_TASKS[s](settings(profile, args.repeats, replicas))
    return suites, skipped, tasks, {**profiles, "replicas": list(replicas)}


def _run(args: argparse.Namespace, argv: list[str], t_start: float) -> dict:
    suites, skipped, tasks, profiles = _tasks(args)
    meta = machine.describe(argv)
    load = machine.load_average()
    if load is not None and load > 0.5 * (os.cpu_count() or 1):
        _note(
            f"the machine is busy (load average {load:.1f} on {os.cpu_count()} cores): "
            "timings will be noisy; the JSON records the load."
        )
    meta.update(suites=suites, skipped_suites=skipped, profiles=profiles)
    meta.update(gpu_dry_run=args.gpu_dry_run, threads=args.threads, tasks=len(tasks))
    os.makedirs(args.out, exist_ok=True)
    partial = os.path.join(args.out, "records.partial.jsonl")
    with open(partial, "w") as f:  # one line per record as tasks finish; removed once complete
        f.write(json.dumps({"meta": meta}, default=str) + "\n")

    def sink(recs: list[dict]) -> None:
        with open(partial, "a") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in recs)

    records = run_tasks(tasks, progress=not args.no_progress, sink=sink)
    report.add_ratios(records)
    text = report.header(meta) + "\n" + report.format_tables(records)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    pngs: list[str] = []
    if not args.no_plots and plots.available():
        pngs = plots.write_all(records, args.out)
    elif not args.no_plots:
        _note("matplotlib is not installed; no plots (pip install matplotlib).")
    meta.update(plots=[os.path.basename(p) for p in pngs], wall_s=time.perf_counter() - t_start)
    meta.update(load_average={"start": load, "end": machine.load_average()})
    json_path = os.path.join(args.out, "results.json")
    report.write_json(json_path, meta, records)
    os.remove(partial)
    print(f"\nwrote {', '.join([json_path, os.path.join(args.out, 'table.txt'), *pngs])}")
    print(f"wall time {meta['wall_s']:.1f} s")
    return dict(schema=report.SCHEMA, meta=meta, records=records, plots=pngs, json=json_path)
