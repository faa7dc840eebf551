"""Instruction count per step under callgrind: mlp100 on 4 CPU replicas, launch="inline".

Run from a checkout (its fastdp is imported), twice per commit, and take (I(12) - I(2)) / 10:

    valgrind --tool=callgrind --callgrind-out-file=cg.12 python instructions.py ext 12
    valgrind --tool=callgrind --callgrind-out-file=cg.2 python instructions.py ext 2

``noext`` instead of ``ext`` runs without the extension (``fastdp._backend.set_enabled(False)``).
"""

import sys

import torch

import fastdp
from fastdp import _backend
from fastdp.bench import modes
from fastdp.bench import workloads as wl


def main(mode: str, steps: int) -> None:
    torch.set_num_threads(1)
    w = wl.catalogue("cpu")["mlp100"]
    model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
    if mode == "noext":
        _backend.set_enabled(False)
    step = modes.train_step(fastdp.FastDataParallel(model, ["cpu"] * 4, launch="inline"), args)
    for _ in range(3 + steps):
        step()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
