"""The pure-torch path's per-step checks switched off, one process: ``python noext_checks.py
mlp100 <variant>`` from a checkout, variant ``plain``, ``notaint`` (no held-tensor check),
``nosnap`` (no replica-dict check) or ``notaint-nosnap``. Prints ``fastdp_noext``'s overhead
over the floor (4 CPU replicas, 15 rounds of 10 steps, medians). A measurement only: without
the checks the replicas can differ from fresh ones (issue findings 2-4)."""

import contextlib
import sys
import time

import torch

import fastdp._replica_set as replica_set
import fastdp._snapshots as snapshots
from fastdp.bench import modes
from fastdp.bench import workloads as wl


def main(name: str, variant: str) -> None:
    torch.set_num_threads(1)
    if "notaint" in variant:
        replica_set.ReplicaSet._tainted = lambda self: False
    if "nosnap" in variant:
        snapshots.ReplicaAttrs.undo_forward_writes = lambda self: False
    w = wl.catalogue("cpu")[name]
    torch.manual_seed(0)
    model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
    with contextlib.ExitStack() as stack:
        steps = {}
        for mode in ("floor", "fastdp_noext"):
            obj = stack.enter_context(modes.wrapped(mode, model, ["cpu"] * 4))
            steps[mode] = modes.in_mode(mode, modes.train_step(obj, args))
            for _ in range(5):
                steps[mode]()
        times: dict[str, list[float]] = {m: [] for m in steps}
        for _ in range(15):
            for m, step in steps.items():
                t = time.perf_counter()
                for _ in range(10):
                    step()
                times[m].append((time.perf_counter() - t) / 10)
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    over = (med["fastdp_noext"] - med["floor"]) * 1e3
    print(
        f"{name} {variant} noext x{med['fastdp_noext'] / med['floor']:.3f} "
        f"overhead {over:.2f}ms floor {med['floor'] * 1e3:.2f}ms"
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
