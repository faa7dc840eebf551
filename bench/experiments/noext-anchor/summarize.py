"""x floor of fastdp (auto, extension) and fastdp_noext per workload: each commit's runs and mean,
from <prefix>-<commit>-<run>/results.json in the current directory; run in
``bench/results/cpu-2core-2026-11-26-anchor/``:
``python3 ../../experiments/noext-anchor/summarize.py [prefix]`` (default prefix ``suite``)."""

import glob
import json
import statistics
import sys

ORDER = ["26c9d5f", "2237850", "6f94e83", "06b4c37"]


def main() -> None:
    prefix = sys.argv[1] if len(sys.argv) > 1 else "suite"
    rows: dict = {}
    for path in sorted(glob.glob(f"{prefix}-*-[0-9]/results.json")):
        commit = path.split("/")[0].removeprefix(f"{prefix}-").rsplit("-", 1)[0]
        recs = json.load(open(path))["records"]
        floor = {r["workload"]: r["time_ms"]["median_ms"] for r in recs if r["mode"] == "floor"}
        for r in recs:
            if r["mode"] in ("fastdp", "fastdp_noext") and r["workload"] in floor:
                ratio = r["time_ms"]["median_ms"] / floor[r["workload"]]
                rows.setdefault((r["workload"], r["mode"]), {}).setdefault(commit, []).append(ratio)
    commits = [c for c in ORDER if any(c in v for v in rows.values())]
    print("| workload | mode | " + " | ".join(commits) + " |")
    print("|---|---|" + "---|" * len(commits))
    for (w, m), v in rows.items():
        cells = []
        for c in commits:
            runs = v.get(c, [])
            each = ", ".join(f"{x:.3f}" for x in runs)
            cells.append(f"**{statistics.mean(runs):.3f}** ({each})" if runs else "-")
        print(f"| {w} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
