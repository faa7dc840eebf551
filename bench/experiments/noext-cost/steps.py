"""``python steps.py <workload> <steps>``: that many steps of fastdp without the extension
(4 CPU replicas, ``launch="inline"``, the suite's step: no ``zero_grad``), nothing else; for
callgrind (``callgrind_run.sh``)."""

import sys

import torch

from fastdp import FastDataParallel, _backend
from fastdp.bench import workloads as wl


def main(name: str, steps: int) -> None:
    torch.set_num_threads(1)
    _backend.set_enabled(False)
    w = wl.catalogue("cpu")[name]
    model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
    fdp = FastDataParallel(model, ["cpu"] * 4, launch="inline")
    for _ in range(steps):
        wl.loss_of(fdp(*args)).backward()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
