"""CPU time (user+sys, getrusage) per step: the chunked floor and fastdp without the extension
(4 CPU replicas, inline), alternating blocks of 5 steps; medians of 10 blocks each.

Run from a checkout (its fastdp is imported): ``python cpu_ratio.py mlp1000 <label>``.
"""

import resource
import statistics
import sys

import torch

from fastdp import FastDataParallel, _backend
from fastdp.bench import workloads as wl


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(name: str, label: str) -> None:
    torch.set_num_threads(1)
    _backend.set_enabled(False)
    w = wl.catalogue("cpu")[name]
    model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
    fdp = FastDataParallel(model, ["cpu"] * 4, launch="inline")

    def floor() -> None:
        for c in args[0].chunk(4):
            wl.loss_of(model(c)).backward()

    def wrapped() -> None:
        wl.loss_of(fdp(*args)).backward()

    for f in (floor, wrapped, floor, wrapped):
        f()
    res: dict[str, list[float]] = {"floor": [], "noext": []}
    for _ in range(10):
        for key, f in (("floor", floor), ("noext", wrapped)):
            c0 = cpu()
            for _ in range(5):
                f()
            res[key].append((cpu() - c0) / 5 * 1e3)
    fl, ne = statistics.median(res["floor"]), statistics.median(res["noext"])
    print(f"{label} {name} cpu ms/step floor {fl:.1f} noext {ne:.1f} x{ne / fl:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
