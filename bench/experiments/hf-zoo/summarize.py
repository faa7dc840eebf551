"""Summarise a zoo run's JUnit XML (pytest --junitxml) into summary.json and summary.txt.

Usage: python summarize.py RUN.xml [RUN.xml ...] [--wall SECONDS]; both files are written into
the folder of the first XML (the run's folder under ``bench/results/``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import xml.etree.ElementTree as ET


def _case(tc: ET.Element) -> dict:
    m = re.match(r".*\[x(\d+)-(.+)\]$", tc.get("name", ""))
    out = {"replicas": int(m.group(1)), "arch": m.group(2), "time_s": float(tc.get("time", 0))}
    for kind in ("failure", "error", "skipped"):
        el = tc.find(kind)
        if el is not None:
            msg = el.get("message", "") or (el.text or "")
            out["outcome"], out["message"] = kind, msg.replace("Skipped: ", "", 1)
            return out
    out["outcome"] = "passed"
    return out


def _group(message: str) -> str:
    """A skip reason without the class name and numbers: one group per cause."""
    text = re.sub(r"^(harness cannot build|plain) \S+", r"\1 <class>", message)
    text = re.sub(r"(?<![A-Za-z_])\d+", "N", text)
    return text[:140]


def _first_line(message: str) -> str:
    """An assertion's step and first mismatch, or an exception's first line."""
    lines = message.strip().splitlines() or [""]
    if lines[0].startswith("AssertionError: step") and len(lines) > 1:
        return f"{lines[0][len('AssertionError: ') :]} {lines[1].strip()}"[:300]
    return lines[0][:300]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("xml", nargs="+")
    ap.add_argument("--wall", type=float, default=None, help="the run's wall time in seconds")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(args.xml[0]))
    cases = [_case(tc) for x in args.xml for tc in ET.parse(x).getroot().iter("testcase")]
    summary = {"wall_s": args.wall, "by_replicas": {}}
    lines = []
    for n in sorted({c["replicas"] for c in cases}):
        mine = [c for c in cases if c["replicas"] == n]
        unbuilt = [c for c in mine if c.get("message", "").startswith("harness cannot build")]
        chunk_skips = [c for c in mine if c["outcome"] == "skipped" and c not in unbuilt]
        failed = [c for c in mine if c["outcome"] in ("failure", "error")]
        passed = [c for c in mine if c["outcome"] == "passed"]
        groups = collections.Counter(_group(c["message"]) for c in unbuilt + chunk_skips)
        summary["by_replicas"][n] = {
            "architectures": len(mine),
            "built": len(mine) - len(unbuilt),
            "compared": len(passed) + len(failed),
            "passed": len(passed),
            "failed": len(failed),
            "skipped": len(unbuilt) + len(chunk_skips),
            "test_time_s": round(sum(c["time_s"] for c in mine), 1),
            "skip_reasons": dict(groups.most_common()),
            "failures": {c["arch"]: _first_line(c["message"]) for c in failed},
            "skips": {c["arch"]: c["message"][:300] for c in unbuilt + chunk_skips},
        }
        s = summary["by_replicas"][n]
        lines.append(
            f"{n} replicas: {s['architectures']} architectures, {s['built']} built, "
            f"{s['compared']} compared, {s['passed']} passed, {s['failed']} failed, "
            f"{s['skipped']} skipped; tests {s['test_time_s']} s"
        )
        lines += [f"  FAIL {a}: {m}" for a, m in s["failures"].items()]
        lines += [f"  skip x{k}: {r}" for r, k in groups.most_common()]
    if args.wall is not None:
        lines.append(f"wall time {args.wall:.0f} s")
    with open(os.path.join(here, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    with open(os.path.join(here, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
