"""``python -m fastdp.doctor``: prove this machine's fastdp paths, one line per check.

The first thing to run on a new machine. Every extension path (scatter from pageable, pinned and
device memory; gather to a device and to the CPU; coalesced broadcast and reduce; the persistent
replica refresh) is run on a small matrix of inputs (every dtype incl. bf16/bool/complex,
non-contiguous, channels_last, 0/1/odd sizes, dims 0/1/-1) and compared bit for bit with torch's
own path; then the P2P matrix, NCCL across all visible GPUs, and a 3-step training parity of
FastDataParallel against ``nn.DataParallel`` and the plain module, on ``[0, 0]`` and on all GPUs.
Without a GPU the CPU checks run and the GPU ones SKIP saying why.

Prints a table (PASS / FAIL / SKIP and why) and exits 1 on any FAIL, naming the environment switch
that avoids the failing path (``FASTDP_P2P=0``, ``FASTDP_DISABLE_EXT=1``). ``--json FILE`` writes
the same as ``fastdp.doctor.doctor()`` returns.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from fastdp import _doctor_checks
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


def doctor(only: str | None = None) -> dict[str, Any]:
    """Runs every check (or those whose name contains ``only``); returns the report as a dict.

    ``{"ok": bool, "seconds": float, "info": fastdp.info(), "checks": [{"name", "status",
    "why", "avoid", "seconds"}, ...]}``; ``avoid`` is the switch that avoids a FAILed path.
    """
    start = time.perf_counter()
    checks = []
    for name, check, avoid in _doctor_checks.plan():
        if only and only not in name:
            continue
        t0 = time.perf_counter()
        status, why = _run(check)
        checks.append({"name": name, "status": status, "why": why,
                       "avoid": avoid if status == FAIL else None,
                       "seconds": round(time.perf_counter() - t0, 3)})
    return {"ok": all(c["status"] != FAIL for c in checks),
            "seconds": round(time.perf_counter() - start, 3), "info": _jsonable(info()),
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
    if counts[SKIP] and not i["gpus"]:
        lines.append("no CUDA GPU visible: the GPU checks were skipped")
    for c in report["checks"]:
        if c["status"] == FAIL:
            lines.append(f"FAILED {c['name']}: set {c['avoid']} to avoid this path "
                         "(and please report it with the --json output)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdp.doctor", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("-k", metavar="TEXT", help="only the checks whose name contains TEXT")
    args = p.parse_args(argv)
    report = doctor(args.k)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
