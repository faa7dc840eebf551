"""The cpu-replicas suite's own ``time_modes`` for one workload, 4 CPU replicas, 20 repeats, in a
fresh process: ``x floor`` of ``fastdp`` and ``fastdp_noext``.

Run from a checkout (its fastdp is imported): ``python in_process.py mlp100``.
"""

import sys

import torch

from fastdp.bench import runner
from fastdp.bench import workloads as wl

MODES = ("bare", "floor", "fastdp", "fastdp_threads", "fastdp_inline", "fastdp_noext", "dp_algo")


def main(name: str) -> None:
    torch.set_num_threads(1)
    s = runner.Settings(repeats=20, max_total_s=None)
    w = wl.catalogue("cpu")[name]
    model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
    recs = runner.time_modes(
        s,
        suite="cpu-replicas",
        w=w,
        model=model,
        args=args,
        devices=["cpu"] * 4,
        n=4,
        ref_device="cpu",
        mode_list=MODES,
    )
    med = {r["mode"]: r["time_ms"]["median_ms"] for r in recs if "time_ms" in r}
    print(
        name,
        " ".join(f"{m}: x{med[m] / med['floor']:.3f}" for m in ("fastdp", "fastdp_noext")),
        f"floor {med['floor']:.2f}ms",
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mlp100")
