"""``python -m fastdp.doctor``: prove this machine's fastdp paths, one line per check.

The first thing to run on a new machine. Every extension path (scatter from pageable, pinned and
device memory; gather to a device and to the CPU; coalesced broadcast and reduce; the persistent
replica refresh) is run on a small matrix of inputs (every dtype incl. bf16/bool/complex,
non-contiguous, channels_last, 0/1/odd sizes, dims 0/1/-1) and compared bit for bit with torch's
own path; the ``kernels ...`` checks call the extension's copy kernels directly on every visible
GPU at real sizes (every dtype, float8 included, at 2^20 + 3 elements, 1M-element strided and
channels_last views, 40 MiB buffers; a 1 MiB pinned pool; a side stream: fastdp/_doctor_kernels.py;
``--quick`` shrinks them); then the P2P matrix, NCCL across all visible GPUs, and a 3-step
training parity of FastDataParallel against ``nn.DataParallel`` and the plain module, on
``[0, 0]`` and on all GPUs. Without a GPU the CPU checks run and the GPU ones SKIP saying why.

Prints a table (PASS / FAIL / SKIP and why) and exits 1 on any FAIL, naming the environment switch
that avoids the failing path (``FASTDP_P2P=0``, ``FASTDP_DISABLE_EXT=1``). ``--json FILE`` writes
the same as ``fastdp.doctor.doctor()`` returns.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from fastdp import _doctor_checks, _doctor_kernels
from fastdp._doctor_cases import Mismatch, Skip
from fastdp._info import info

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


def _run(check) -> tuple[str, str]:
    try:
        return PASS, check()
    except Skip as e:
        return SKIP, str(e)
    except Mismatch as e:
        return FAIL, str(e)
    except Exception as e:  # a crash in a path is a failure of that path, not of the doctor
        return FAIL, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def doctor(only: str | Sequence[str] | None = None, quick: bool = False) -> dict[str, Any]:
    """Runs every check (or those whose name contains ``only``, or one of them); returns the
    report as a dict.

    ``{"ok": bool, "seconds": float, "quick": bool, "kernel_cases": [label, ...], "info":
    fastdp.info(), "checks": [{"name", "status", "why", "avoid", "seconds"}, ...]}``; ``avoid``
    is the switch that avoids a FAILed path; ``kernel_cases`` name the dtype, shape and layout
    of every input the ``kernels ...`` checks run (``quick``: their small sizes).
    """
    start = time.perf_counter()
    checks = []
    wanted = [only] if isinstance(only, str) else list(only or ())
    for name, check, avoid in _doctor_checks.plan(quick):
        if wanted and not any(w in name for w in wanted):
            continue
        t0 = time.perf_counter()
        status, why = _run(check)
        checks.append({"name": name, "status": status, "why": why,
                       "avoid": avoid if status == FAIL else None,
                       "seconds": round(time.perf_counter() - t0, 3)})
    return {"ok": all(c["status"] != FAIL for c in checks),
            "seconds": round(time.perf_counter() - start, 3), "quick": quick,
            "kernel_cases": _doctor_kernels.labels(quick), "info": _jsonable(info()),
            "checks": checks}


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))


def format_report(report: dict[str, Any]) -> str:
    i = report["info"]
    build = ("extension not loaded" if not i["extension_loaded"] else
             f"CUDA {i['build_cuda_version']} build ({i['arch_list']})" if i["built_with_cuda"]
             else "CPU-only build")
    lines = [f"fastdp doctor: fastdp {i['version']}, torch {i['torch']}, {build}, "
             f"{len(i['gpus'])} GPU(s) {', '.join(sorted(set(i['gpus'])))}".rstrip()]
    width = max((len(c["name"]) for c in report["checks"]), default=10)
    for c in report["checks"]:
        lines.append(f"  {c['status']}  {c['name']:<{width}}  {c['why']}")
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in (PASS, FAIL, SKIP)}
    lines.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped "
                 f"in {report['seconds']:.1f} s")
    if any(c["name"].startswith("kernels") for c in report["checks"]):
        cases = report["kernel_cases"]
        lines.append(f"kernel cases ({len(cases)}{', quick' if report['quick'] else ''}): "
                     + "; ".join(cases))
    if counts[SKIP] and not i["gpus"]:
        lines.append("no CUDA GPU visible: the GPU checks were skipped")
    for c in report["checks"]:
        if c["status"] == FAIL:
            lines.append(f"FAILED {c['name']}: set {c['avoid']} to avoid this path "
                         "(and please report it with the --json output)")
    return "\n".join(lines)


def _estimate() -> str:
    """The run time by the case sizes (an estimate from sizes, not a measurement)."""
    full, quick = _doctor_kernels.nbytes() / 2**20, _doctor_kernels.nbytes(True) / 2**20
    return (f"Kernel cases: {len(_doctor_kernels.labels())} inputs of {full:.0f} MiB in all "
            f"({quick:.1f} MiB with --quick). Each GPU check moves them about twice each way "
            "(fastdp, then torch) and compares the bytes; with ~10 GB/s host<->GPU and the "
            "inputs generated on the host per check (the larger cost, ~1 s), expect about "
            "15 s plus 3 s per GPU on an H100 machine, under 60 s up to 8 GPUs; --quick: a few "
            "seconds. Not yet measured on a GPU.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdp.doctor", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=_estimate())
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("-k", metavar="TEXT", action="append",
                   help="only the checks whose name contains TEXT (repeat: any of them)")
    p.add_argument("--quick", action="store_true",
                   help="the kernel checks on small cases (a few seconds; the sanitizer's runs)")
    args = p.parse_args(argv)
    report = doctor(args.k, quick=args.quick)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
