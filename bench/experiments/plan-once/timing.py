"""Per-call CPU time of one fastdp tree (PYTHONPATH picks it): ``scatter`` of a dict of 16
[16, 32] tensors and of one [16, 32] tensor on ``['cpu'] * 4``, ``scatter_kwargs`` of one tensor,
and a ``FastDataParallel`` forward+backward on 4 CPU replicas (inline launch) of a 4-layer
32-wide MLP on a [16, 32] batch and on a dict of 16 such tensors. Prints JSON: per case, the
least mean over batches of calls (thread CPU time, microseconds).

    PYTHONPATH=<tree> python timing.py [rounds=3]
"""

import json
import sys
import time

import torch

import fastdp
from fastdp.scatter_gather import scatter, scatter_kwargs


def main() -> None:
    torch.set_num_threads(1)
    CPU4 = [torch.device("cpu")] * 4
    d16 = {f"k{i}": torch.randn(16, 32) for i in range(16)}
    one = torch.randn(16, 32)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])

    class DictMLP(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, d: dict) -> torch.Tensor:
            return sum(self.m(v) for v in d.values())

    dp = fastdp.FastDataParallel(mlp, ["cpu"] * 4, launch="inline")
    dpdict = fastdp.FastDataParallel(DictMLP(mlp), ["cpu"] * 4, launch="inline")
    x = torch.randn(16, 32)

    def step() -> None:
        dp(x).sum().backward()

    def step_dict() -> None:
        dpdict(d16).sum().backward()

    cases = {
        "scatter_dict16": (lambda: scatter(d16, CPU4), 2000),
        "scatter_one": (lambda: scatter(one, CPU4), 5000),
        "scatter_kwargs_one": (lambda: scatter_kwargs((one,), None, CPU4), 5000),
        "fdp_fwd_bwd_mlp": (step, 300),
        "fdp_fwd_bwd_dict16": (step_dict, 100),
    }
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    best: dict[str, float] = {}
    for f, _ in cases.values():
        for _ in range(20):
            f()
    for _ in range(rounds):
        for name, (f, n) in cases.items():
            for _ in range(10):  # ten short batches: the least disturbed one counts
                m = max(1, n // 10)
                t = time.thread_time()
                for _ in range(m):
                    f()
                best[name] = min(best.get(name, 1e18), (time.thread_time() - t) / m * 1e6)
    print(json.dumps(best))


if __name__ == "__main__":
    main()
