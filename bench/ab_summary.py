"""x floor of fastdp (auto, extension) and fastdp_noext per workload, per run, from the
``results.json`` of each run folder ``<base|new>-<commit>-<run>/`` of an A/B results folder.

    python bench/ab_summary.py [FOLDER]     # FOLDER: default the current directory

Prints a Markdown table: one column per run, then the mean of the ``base`` and ``new`` runs (the
``ratios.md`` of the A/B folders under ``bench/results/``).
"""

import glob
import json
import os
import statistics
import sys


def main(folder: str = ".") -> None:
    os.chdir(folder)
    runs = sorted(glob.glob("*-[0-9]/results.json"), key=lambda p: (p.split("-")[-1], p))
    rows = {}
    for path in runs:
        with open(path) as f:
            recs = json.load(f)["records"]
        floor = {r["workload"]: r["time_ms"]["median_ms"] for r in recs if r["mode"] == "floor"}
        for r in recs:
            if r["mode"] in ("fastdp", "fastdp_noext") and r["workload"] in floor:
                ratio = r["time_ms"]["median_ms"] / floor[r["workload"]]
                rows.setdefault((r["workload"], r["mode"]), {})[path.split("/")[0]] = ratio
    names = [p.split("/")[0] for p in runs]
    print("| workload | mode | " + " | ".join(names) + " | base mean | new mean |")
    print("|---|---|" + "---:|" * (len(names) + 2))
    for (w, m), v in rows.items():
        base = statistics.mean(x for k, x in v.items() if k.startswith("base"))
        new = statistics.mean(x for k, x in v.items() if k.startswith("new"))
        cells = " | ".join(f"{v[n]:.3f}" for n in names)
        print(f"| {w} | {m} | {cells} | {base:.3f} | {new:.3f} |")


if __name__ == "__main__":
    main(*sys.argv[1:2])
