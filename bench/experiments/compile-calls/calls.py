"""Python calls of fastdp in one steady step: gelu-mlp64, ``FastDataParallel(torch.compile(m))``,
2 CPU replicas (forward, then backward), counted with ``sys.setprofile``.

Run from a checkout (its fastdp is imported): ``python calls.py``; ``-v`` lists them.
"""

import sys

import torch

from fastdp.bench import workloads as wl
from fastdp.bench.suite_compile import gelu_mlp
from fastdp.data_parallel import FastDataParallel


def main(verbose: bool) -> None:
    torch.set_num_threads(1)
    model, x = gelu_mlp(64).train(), torch.randn(64, 64)
    fdp = FastDataParallel(torch.compile(model), device_ids=["cpu"] * 2)
    for _ in range(20):
        wl.loss_of(fdp(x)).backward()
    seen: list[str] = []

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        name = frame.f_code.co_filename
        if event == "call" and "fastdp" in name and "bench" not in name:
            seen.append(f"{name.split('fastdp/')[-1]}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    y = fdp(x)
    sys.setprofile(None)
    n_forward = len(seen)
    loss = wl.loss_of(y)
    sys.setprofile(profile)
    loss.backward()
    sys.setprofile(None)
    print(f"forward {n_forward} Python calls, backward {len(seen) - n_forward}")
    if verbose:
        print("\n".join(seen))


if __name__ == "__main__":
    main("-v" in sys.argv)
