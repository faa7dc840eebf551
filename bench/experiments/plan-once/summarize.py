"""Least time per case and version from ab.sh's output: ``python summarize.py runs.txt``."""

import json
import sys


def main() -> None:
    best: dict[str, dict[str, list[float]]] = {}
    for line in open(sys.argv[1]):
        version, js = line.split(" ", 1)
        for case, t in json.loads(js).items():
            best.setdefault(case, {}).setdefault(version, []).append(t)
    print("| case | before (us) | after (us) | after / before |\n|---|---:|---:|---:|")
    for case, d in best.items():
        b, a = min(d["before"]), min(d["after"])
        print(f"| {case} | {b:.2f} | {a:.2f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
