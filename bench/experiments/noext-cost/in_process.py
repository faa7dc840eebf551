"""CPU time a step (user + system, ``getrusage``) of three designs of the path without the
extension in one process, against the chunked floor: ``anchor`` (as committed), ``noanchor``
(the anchor not linked: inexact, finding 6), ``shortcut`` (the anchor linked, and each bucket
node adds its sums into ``.grad`` itself and gives the engine None: inexact, see the README),
``flat`` (the anchor, and same-device sums made in views of one flat per bucket). Needs a
checkout with ``variants.patch`` applied (module flags ``ANCHOR``, ``SHORTCUT``, ``FLAT``).

Rounds of 3 steps per design in turn; per design, the median over rounds of its round's time
over that round's floor (so the machine's drift cancels).
``python in_process.py mlp1000 25 anchor,noanchor,shortcut``.
"""

import resource
import statistics
import sys

import torch

from fastdp import FastDataParallel, _backend, _reducer
from fastdp.bench import workloads as wl


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(name: str, rounds: int, chosen: list[str]) -> None:
    torch.set_num_threads(1)
    _backend.set_enabled(False)
    w = wl.catalogue("cpu")[name]
    model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
    fdp = FastDataParallel(model, ["cpu"] * 4, launch="inline")
    flags = {
        "anchor": (True, False, False),
        "noanchor": (False, False, False),
        "shortcut": (True, True, False),
        "flat": (True, False, True),
    }
    designs = {"floor": None, **{d: flags[d] for d in chosen}}

    def step(design: str) -> None:
        chosen_flags = designs[design]
        if chosen_flags is None:
            for c in args[0].chunk(4):
                wl.loss_of(model(c)).backward()
            return
        _reducer.ANCHOR, _reducer.SHORTCUT, _reducer.FLAT = chosen_flags
        wl.loss_of(fdp(*args)).backward()

    for d in designs:
        step(d)
        step(d)
    res: dict[str, list[float]] = {d: [] for d in designs}
    for _ in range(rounds):
        for d in designs:
            c0 = cpu()
            for _ in range(3):
                step(d)
            res[d].append(cpu() - c0)
    fl = res["floor"]
    print(
        " ".join(
            f"{d} x{statistics.median([a / b for a, b in zip(r, fl)]):.3f}"
            for d, r in res.items()
            if d != "floor"
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","))
