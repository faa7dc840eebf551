"""Python calls into fastdp/scatter_gather.py, fastdp/_planner.py and fastdp/_tree.py (by
function name, comprehensions included) during one FastDataParallel forward on 4 CPU replicas
(inline launch, after warm-up), per input case. Prints JSON.

    PYTHONPATH=<tree> python count.py
"""

import collections
import json
import sys

import torch

import fastdp


def main() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, *a: object, **k: object) -> torch.Tensor:
            ts = []
            for v in list(a) + list(k.values()):
                if isinstance(v, torch.Tensor):
                    ts.append(v)
                elif isinstance(v, dict):
                    ts += list(v.values())
            return sum(t.sum() for t in ts).view(1).expand(ts[0].shape[0]) * self.w

    def d16() -> dict:
        return {f"k{i}": torch.randn(16, 32) for i in range(16)}

    cases = {
        "one tensor": ((torch.randn(16, 32),), {}),
        "dict16 (kwargs)": ((), {"d": d16()}),
        "dict16 (positional)": ((d16(),), {}),
        "tensor + kwargs": ((torch.randn(16, 32),), {"mask": torch.randn(16, 4), "flag": True}),
    }
    FILES = ("scatter_gather.py", "_planner.py", "_tree.py")
    out = {}
    for name, (a, k) in cases.items():
        dp = fastdp.FastDataParallel(M(), ["cpu"] * 4, launch="inline")
        for _ in range(3):
            dp(*a, **k)
        calls: collections.Counter = collections.Counter()

        def prof(
            frame: object, event: str, arg: object, calls: collections.Counter = calls
        ) -> None:
            if event == "call":
                f = frame.f_code.co_filename
                for n in FILES:
                    if f.endswith("fastdp/" + n):
                        calls[f"{n[:-3]}.{frame.f_code.co_name}"] += 1

        sys.setprofile(prof)
        dp(*a, **k)
        sys.setprofile(None)
        out[name] = dict(sorted(calls.items()))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
