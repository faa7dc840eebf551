"""The quick check's probe driver: every probe of PLAN in a fresh process with its own timeout.

python tests/gpu_quick/run_probes.py --all --json FILE [--budget S] [--plan zero]
python tests/gpu_quick/run_probes.py --one NAME      one probe here; one PROBE_JSON line
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import probes_copy  # noqa: F401  (registers its probes)
import probes_pool  # noqa: F401
import probes_steps  # noqa: F401
import probes_zero  # noqa: F401
from common import PROBES, _err, _torch

PLAN = [  # most telling first: a cut run keeps these
    "env",
    "pinned_order",
    "host_alloc_reuse",
    "gather_capture_global_warm",
    "gather_capture_relaxed_warm",
    "capture_scatter_paths",
    "pool_steady",
    "pool_threads",
    "copy_shapes_perf",
    "inplace_sums",
    "gather_capture_global_cold",
    "pitch_limit",
    "steps_mini",
    "side_stream_step",
    "scatter_streams",
]
assert sorted(PLAN) == sorted(n for n, p in PROBES.items() if p["in_all"])
PLANS = {"quick": PLAN, "zero": ["zero_steps"]}  # zero: the quick check's zero stage


def run_one(name):
    torch = _torch()
    if not torch.cuda.is_available():
        rec = {"status": "skip", "why": "no CUDA device"}
    else:
        try:
            rec = PROBES[name]["fn"]()
        except Exception as e:  # noqa: BLE001
            rec = {"status": "error", "error": _err(e), "trace": traceback.format_exc()[-2000:]}
    rec = {"probe": name, **rec}
    print("PROBE_JSON " + json.dumps(rec, default=str), flush=True)
    return 0 if rec["status"] in ("ok", "skip") else 1


def run_all(path, budget, plan=PLAN):
    """Each probe of `plan` in its own process; without a GPU (the dry run) only the first, which
    proves the plumbing, and the rest are recorded as skipped."""
    t_end = time.time() + budget
    recs = []
    gpu = _torch().cuda.is_available()
    for name in plan:
        spec = PROBES[name]
        left = t_end - time.time()
        if left < 10 or (not gpu and name != plan[0]):
            why = "out of time" if gpu else "no CUDA device (dry run)"
            recs.append({"probe": name, "status": "skip", "why": why})
            continue
        env = dict(os.environ, **spec["env"])
        t0 = time.time()
        print(f"\n=== probe {name} (timeout {min(spec['timeout'], int(left))} s) ===", flush=True)
        try:
            r = subprocess.run(
                [sys.executable, __file__, "--one", name],
                env=env,
                capture_output=True,
                text=True,
                timeout=min(spec["timeout"], left),
            )
            out, err, rc = r.stdout, r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = "timeout"
        sys.stdout.write(out)
        if err.strip():
            sys.stdout.write("--- stderr (tail) ---\n" + err[-3000:] + "\n")
        found = [
            json.loads(line[len("PROBE_JSON ") :])
            for line in out.splitlines()
            if line.startswith("PROBE_JSON ")
        ]
        rec = (
            found[-1]
            if found
            else {
                "probe": name,
                "status": "crash" if rc != "timeout" else "timeout",
                "rc": rc,
                "stderr_tail": err[-1500:],
            }
        )
        rec["seconds"] = round(time.time() - t0, 1)
        recs.append(rec)
        with open(path, "w") as f:  # rewritten after every probe: a cut run keeps what it has
            json.dump(recs, f, indent=1, default=str)
    with open(path, "w") as f:
        json.dump(recs, f, indent=1, default=str)
    print("\n=== probe verdicts ===")
    for r in recs:
        print(f"  {r['status']:<9} {r['probe']:<28} {r.get('seconds', '')}s")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--one")
    ap.add_argument("--json", default="probes.json")
    ap.add_argument("--budget", type=float, default=150)
    ap.add_argument("--plan", choices=sorted(PLANS), default="quick")
    a = ap.parse_args()
    sys.exit(run_one(a.one) if a.one else run_all(a.json, a.budget, PLANS[a.plan]))
