"""One workload on 4 CPU replicas in one process: the committed code against each new per-step
piece switched off (input-chunk aliases; the post-accumulate-hook scan), alternated round by
round; prints the median step (ms) per variant.

    python in_process.py [workload=mlp100] [rounds=15]
"""

import statistics
import sys
import time

import torch

import fastdp
import fastdp._reducer as reducer
import fastdp.scatter_gather as sg
from fastdp.bench.workloads import build, catalogue


def no_alias() -> None:
    sg._own_counters = lambda leaves, chunks: list(chunks)


def no_hook_scan() -> None:
    reducer._POST_HOOKS = lambda source: None


def main() -> None:
    torch.set_num_threads(1)
    original = (sg._own_counters, reducer._POST_HOOKS)
    name = sys.argv[1] if len(sys.argv) > 1 else "mlp100"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    w = catalogue("cpu")[name]
    model = build(w, "cpu")
    dp = fastdp.FastDataParallel(model, device_ids=["cpu"] * 4)
    x = w.inputs(w.batch, "cpu")

    def step() -> None:
        out = dp(*x)
        out.float().sum().backward()
        model.zero_grad()

    variants = {"main": lambda: None, "no_alias": no_alias, "no_hook_scan": no_hook_scan}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(5):
        step()
    for _ in range(rounds):
        for k, switch in variants.items():
            sg._own_counters, reducer._POST_HOOKS = original
            switch()
            for _ in range(2):
                step()
            t = time.perf_counter()
            for _ in range(5):
                step()
            times[k].append((time.perf_counter() - t) / 5 * 1e3)
    sg._own_counters, reducer._POST_HOOKS = original
    for k, v in times.items():
        print(f"{name} {k}: median {statistics.median(v):.3f} ms")


if __name__ == "__main__":
    main()
