"""In-process A/B of the scatter: the scatter_gather.py of an earlier tree (loaded as a module of
its own, over today's planner) against today's, alternated batch by batch; thread CPU time, the
least batch mean per call in microseconds. ``step`` cases are the wrapper's plan and scatter
(``_plan`` then the scatter seam) on 4 CPU replicas; ``forward+backward mlp`` a whole step of a
4-layer 32-wide MLP on a [16, 32] batch, two wrappers of one module, the earlier one's ``_plan``
and scatter step swapped for the earlier scatter's.

    PYTHONPATH=<today's tree> python in_process.py <earlier tree>/fastdp/scatter_gather.py [rounds]
"""

import sys
import time
import types

import torch

import fastdp
from fastdp import _planner
from fastdp import scatter_gather as sg


def main() -> None:
    torch.set_num_threads(1)
    shim = types.ModuleType("fastdp._planner_then")  # the earlier tree's planner names
    shim.chunk_sizes_for = _planner.chunk_sizes_for
    shim.dropped = _planner.dropped
    shim.plan_chunks = _planner.splits_for
    sys.modules["fastdp._planner_then"] = shim
    src = (
        open(sys.argv[1])
        .read()
        .replace("from fastdp._planner import", "from fastdp._planner_then import")
    )
    old = types.ModuleType("scatter_gather_then")
    exec(compile(src, "scatter_gather_then.py", "exec"), old.__dict__)

    CPU4 = [torch.device("cpu")] * 4
    one = torch.randn(16, 32)
    d16 = {f"k{i}": torch.randn(16, 32) for i in range(16)}
    dp = fastdp.FastDataParallel(torch.nn.Linear(32, 32), ["cpu"] * 4, launch="inline")

    def old_step(inputs: tuple, kwargs: dict) -> object:
        plan = _planner.make_plan(dp, inputs, kwargs, None, dp._check_device_cached(), False)
        devices = dp._devices if plan.ids is dp.device_ids else plan.ids  # the seam's _devs
        return old.scatter_kwargs(inputs, kwargs, devices, 0, None, dp._rows_dropped)

    def new_step(inputs: tuple, kwargs: dict) -> object:
        return dp._scatter_step(dp._plan(inputs, kwargs, None), inputs, kwargs)

    kw = {"m": one, "f": True}
    mlp = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    new_dp = fastdp.FastDataParallel(mlp, ["cpu"] * 4, launch="inline")
    old_dp = fastdp.FastDataParallel(mlp, ["cpu"] * 4, launch="inline")
    old_dp.__dict__["_plan"] = lambda inputs, kwargs, ctx: _planner.make_plan(
        old_dp, inputs, kwargs, ctx, old_dp._check_device_cached(), False
    )
    old_dp.__dict__["_scatter_step"] = lambda plan, inputs, kwargs: old.scatter_kwargs(
        inputs, kwargs, old_dp._devices, 0, None, old_dp._rows_dropped
    )

    def fwd_bwd(wrapper: fastdp.FastDataParallel) -> None:
        wrapper(one).sum().backward()

    cases = {
        "scatter_kwargs one": (
            lambda: old.scatter_kwargs((one,), None, CPU4),
            lambda: sg.scatter_kwargs((one,), None, CPU4),
            4000,
        ),
        "scatter one": (lambda: old.scatter(one, CPU4), lambda: sg.scatter(one, CPU4), 4000),
        "scatter dict16": (lambda: old.scatter(d16, CPU4), lambda: sg.scatter(d16, CPU4), 1000),
        "step one": (lambda: old_step((one,), {}), lambda: new_step((one,), {}), 4000),
        "step dict16": (lambda: old_step((d16,), {}), lambda: new_step((d16,), {}), 1000),
        "step tensor+kwargs": (lambda: old_step((one,), kw), lambda: new_step((one,), kw), 3000),
        "forward+backward mlp": (lambda: fwd_bwd(old_dp), lambda: fwd_bwd(new_dp), 200),
    }
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    best: dict[tuple[str, str], float] = {}
    for _ in range(rounds):
        for name, (then, now, n) in cases.items():
            for tag, f in (("then", then), ("now", now)):
                m = n // 10
                t = time.thread_time()
                for _ in range(m):
                    f()
                us = (time.thread_time() - t) / m * 1e6
                best[(name, tag)] = min(best.get((name, tag), 1e9), us)
    print("| case | before (us) | after (us) | after / before |\n|---|---:|---:|---:|")
    for name in cases:
        b, a = best[(name, "then")], best[(name, "now")]
        print(f"| {name} | {b:.2f} | {a:.2f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
