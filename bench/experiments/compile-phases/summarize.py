"""x compiled floor per run and mode (fastdp_compiled, fastdp_wrapper), from results.json."""

import glob
import json


def main() -> None:
    runs = sorted(glob.glob("*-[0-9]"), key=lambda d: (d.rsplit("-", 1)[1], d))
    rows = {}
    for d in runs:
        for r in json.load(open(f"{d}/results.json"))["records"]:
            if r.get("mode") in ("fastdp_compiled", "fastdp_wrapper") and r.get("status") == "ok":
                rows.setdefault((r["workload"], r["mode"]), {})[d] = (
                    r["ratios"]["vs_floor"],
                    r.get("recompiles_20_steps"),
                )
    print("| workload | mode | " + " | ".join(runs) + " |")
    print("|---|---|" + "---:|" * len(runs))
    for (w, m), per in sorted(rows.items()):
        cells = [f"{per[d][0]:.3f} ({per[d][1]})" if d in per else "-" for d in runs]
        print(f"| {w} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
