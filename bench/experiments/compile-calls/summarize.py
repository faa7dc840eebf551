"""x compiled floor per commit and mode: mean and every run (recompiles over 20 steady steps)."""

import glob
import json
import statistics


def main() -> None:
    runs: dict[tuple[str, str, str], list[tuple[float, int]]] = {}
    for d in sorted(
        glob.glob("*-[0-9]*"), key=lambda d: (d.rsplit("-", 1)[0], int(d.rsplit("-", 1)[1]))
    ):
        commit = d.rsplit("-", 1)[0]
        for r in json.load(open(f"{d}/results.json"))["records"]:
            if r.get("mode") in ("fastdp_compiled", "fastdp_wrapper") and r.get("status") == "ok":
                key = (r["workload"], r["mode"], commit)
                runs.setdefault(key, []).append(
                    (r["ratios"]["vs_floor"], r.get("recompiles_20_steps"))
                )
    print("| workload | mode | commit | mean | runs | recompiles |")
    print("|---|---|---|---:|---|---|")
    for (w, m, c), v in sorted(runs.items()):
        ratios = [x[0] for x in v]
        cells = ", ".join(f"{x:.3f}" for x in ratios)
        recompiles = sorted({x[1] for x in v})
        print(f"| {w} | {m} | {c} | {statistics.mean(ratios):.3f} | {cells} | {recompiles} |")


if __name__ == "__main__":
    main()
