"""x floor of ``fastdp`` and ``fastdp_noext`` for one workload, 4 CPU replicas, one process.

Run from a checkout (its fastdp is imported): ``python ratio.py mlp100``. The floor and both
wrappers are timed interleaved, 15 rounds of 10 steps; medians and minima.
"""

import contextlib
import sys
import time

import torch

from fastdp.bench import modes
from fastdp.bench import workloads as wl

MODES = ("floor", "fastdp", "fastdp_noext")


def main(name: str, rounds: int = 15) -> None:
    torch.set_num_threads(1)
    w = wl.catalogue("cpu")[name]
    torch.manual_seed(0)
    model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
    with contextlib.ExitStack() as stack:
        steps = {}
        for mode in MODES:
            obj = stack.enter_context(modes.wrapped(mode, model, ["cpu"] * 4))
            steps[mode] = modes.in_mode(mode, modes.train_step(obj, args))
            for _ in range(5):
                steps[mode]()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(rounds):
            for m, step in steps.items():
                t = time.perf_counter()
                for _ in range(10):
                    step()
                times[m].append((time.perf_counter() - t) / 10)
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    low = {m: min(v) for m, v in times.items()}
    print(
        name,
        " ".join(
            f"{m}: med x{med[m] / med['floor']:.3f} min x{low[m] / low['floor']:.3f}"
            for m in MODES[1:]
        ),
        f"floor {med['floor'] * 1e3:.2f}ms",
    )


if __name__ == "__main__":
    main(sys.argv[1])
