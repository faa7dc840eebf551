"""Wrapper time by stage: gelu-mlp64, ``FastDataParallel(torch.compile(m))``, 2 CPU replicas.

Run from a checkout (its fastdp is imported): ``python phases.py``. Each stage method is wrapped
with ``perf_counter_ns`` (a few us of its own); the replicas' module calls are timed inside the
in-turn runner, and the floor's two module calls inside its own step, for comparison.
"""

import collections
import time

import torch

import fastdp._launch as launch
from fastdp.bench import workloads as wl
from fastdp.bench.suite_compile import gelu_mlp
from fastdp.data_parallel import FastDataParallel

N = 2000
STAGES = ("_start_step", "_plan", "scatter", "_replicate_step", "_launch_step", "_gather_step")
acc: collections.defaultdict[str, float] = collections.defaultdict(float)
calls = [0, 0]


def timed(name: str) -> None:
    f = getattr(FastDataParallel, name)

    def wrapper(*a, **k):
        t = time.perf_counter_ns()
        try:
            return f(*a, **k)
        finally:
            acc[name] += time.perf_counter_ns() - t

    setattr(FastDataParallel, name, wrapper)


def run_in_turn(modules, inputs, kwargs, devices):
    """``fastdp._runners.run_in_turn`` for CPU replicas, each module call timed."""
    out = []
    for i, module in enumerate(modules):
        t = time.perf_counter_ns()
        out.append(module(*inputs[i], **kwargs[i]))
        calls[i] += time.perf_counter_ns() - t
    return out


def main() -> None:
    torch.set_num_threads(1)
    for name in STAGES:
        timed(name)
    launch.run_in_turn = run_in_turn
    torch.manual_seed(0)
    model = gelu_mlp(64).train()
    x = torch.randn(64, 64)
    chunks = list(x.chunk(2))
    cm = torch.compile(model)
    fdp = FastDataParallel(cm, device_ids=["cpu"] * 2)
    floor_calls = [0, 0]

    def step() -> None:
        wl.loss_of(fdp(x)).backward()

    def floor_step() -> None:
        outs = []
        for i, c in enumerate(chunks):
            t = time.perf_counter_ns()
            outs.append(cm(c))
            floor_calls[i] += time.perf_counter_ns() - t
        wl.loss_of(torch.cat(outs)).backward()

    for f in (step, floor_step):
        for _ in range(50):
            f()
    acc.clear()
    calls[:] = floor_calls[:] = [0, 0]
    totals = {}
    for name, f in (("fastdp", step), ("floor", floor_step)):
        t = time.perf_counter_ns()
        for _ in range(N):
            f()
        totals[name] = (time.perf_counter_ns() - t) / N / 1e3
    for name in STAGES:
        print(f"{name:16s} {acc[name] / N / 1e3:8.1f} us")
    print("module calls in the fastdp step:", [round(c / N / 1e3, 1) for c in calls], "us")
    print("module calls in the floor step: ", [round(c / N / 1e3, 1) for c in floor_calls], "us")
    print(f"step: fastdp {totals['fastdp']:.1f} us, floor {totals['floor']:.1f} us")


if __name__ == "__main__":
    main()
