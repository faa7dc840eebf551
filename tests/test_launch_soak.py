"""Soak: many training steps on CPU replicas; memory and threads stay flat after warm-up.

The CI variant runs ``FASTDP_SOAK_STEPS`` steps (default 2000: ~15 s on two cores, both variants).
The long variant is the same test with more steps:

    FASTDP_SOAK_STEPS=10000 PYTHONPATH=. python -m pytest tests/test_launch_soak.py -q -s

Each step is a forward, backward and SGD step of a small MLP with a running-mean buffer (updated in
place, like BatchNorm's), LayerNorm and dropout on 4 CPU replicas, with batch sizes that vary:
epochs of a 250-sample dataset in batches of 32 (a partial last batch of 26), interleaved with
random batches of 1-40 (some smaller than the replica count). After a warm-up (the first 20% of
steps) and at the end it samples resident memory (``VmRSS`` in ``/proc/self/status``), the native
(``Threads``) and Python (the main thread and those the test started) thread counts and the number
of objects the garbage collector tracks; it prints them (``-s``) and requires the thread counts
unchanged, at most 200 new objects and RSS grown by at most ``max(24 MiB, 5%)``. Every 100 steps an
eval-mode forward is checked against the plain module. It runs on the default backend only (the
backends' equivalence is the property tests' subject), with one intra-op thread (the replica threads
fill the cores), in two variants: persistent replicas and worker threads (the default), and fresh
replicas and threads every step (``persistent=False``, DataParallel's way).

Measured on the development machine (2 cores, shared), one intra-op thread, main before the
bucket engine (fastdp/_buckets.py) replaced the C++ refresh node (not re-measured since):

* persistent: 2,000 steps in 3.1 s (~650 steps/s); 10,000 steps in 13.9 s, RSS 318.7 -> 320.8 MiB,
  threads 5 -> 5 (main + 4 workers), native 6 -> 6, gc objects flat; 30,000 steps: RSS 315.4 MiB
  at step 3,000 -> 316.2 MiB at the end (+0.03 MiB per 3,000 steps late), gc objects constant.
* fresh replicas: 2,000 steps in 11.5 s (~175 steps/s); 10,000 steps in 48 s, RSS 322.3 -> 326.5
  MiB; 30,000 steps: RSS 316.6 -> 324.8 MiB in plateaus (allocator arenas of per-step threads),
  gc object count constant, threads flat.
* With torch's default two intra-op threads on a loaded machine, steps were 20x slower (OpenMP
  teams in every replica thread): that is why the soak pins one.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch
from torch import nn

from fastdp import FastDataParallel

STEPS = int(os.environ.get("FASTDP_SOAK_STEPS", "2000"))


class RunningCenter(nn.Module):
    """BatchNorm's buffer traffic (an in-place running mean) without its batch-of-1 error."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - self.mean


def proc_status(field: str) -> int:
    """An integer field of /proc/self/status: ``VmRSS`` (KiB), ``Threads`` (native threads)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def batch_sizes(steps: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    epoch = [32] * 7 + [26]  # 250 samples in batches of 32: a partial last batch
    sizes: list[int] = []
    while len(sizes) < steps:
        sizes += epoch
        sizes += torch.randint(1, 41, (4,), generator=g).tolist()
    return sizes[:steps]


def own_threads(earlier: set[threading.Thread]) -> int:
    """The Python threads alive now that were not alive in ``earlier`` (the main thread counted)."""
    return 1 + sum(t not in earlier for t in threading.enumerate())


@pytest.fixture
def one_intra_op_thread():
    """Replica threads already fill the cores; intra-op threads on top only oversubscribe them."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh_replicas"])
def test_soak_memory_and_threads_flat(one_intra_op_thread, persistent):
    torch.manual_seed(0)
    # Threads alive before the test are not counted: an earlier test's wrapper that the garbage
    # collector frees mid-run stops its workers then, which is no thread of this test's.
    earlier = set(threading.enumerate())
    model = nn.Sequential(
        nn.Linear(16, 32),
        RunningCenter(32),
        nn.LayerNorm(32),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(32, 4),
    )
    fdp = FastDataParallel(model, ["cpu"] * 4, persistent=persistent)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sizes = batch_sizes(STEPS)
    warm = max(1, STEPS // 5)
    rss_warm = threads_warm = None
    start = time.monotonic()
    for step, b in enumerate(sizes):
        x = torch.randn(b, 16)
        opt.zero_grad(set_to_none=True)
        out = fdp(x)
        assert out.shape == (b, 4)
        out.square().mean().backward()
        opt.step()
        if step % 100 == 99:
            model.eval()
            with torch.no_grad():
                torch.testing.assert_close(fdp(x), model(x))
            model.train()
        if step == warm - 1:
            rss_warm, native_warm = proc_status("VmRSS"), proc_status("Threads")
            threads_warm, objects_warm = own_threads(earlier), len(gc.get_objects())
    elapsed = time.monotonic() - start
    del out, x
    gc.collect()
    rss_end, objects_end = proc_status("VmRSS"), len(gc.get_objects())
    threads_end = own_threads(earlier)
    deadline = time.monotonic() + 2.0  # a replica thread can still be exiting natively
    while proc_status("Threads") > native_warm and time.monotonic() < deadline:
        time.sleep(0.01)
    native_end = proc_status("Threads")
    growth = rss_end - rss_warm
    print(
        f"\nsoak: {STEPS} steps in {elapsed:.1f} s ({STEPS / elapsed:.0f} steps/s); "
        f"RSS after warm-up {rss_warm / 1024:.1f} MiB, at the end {rss_end / 1024:.1f} MiB "
        f"({growth / 1024:+.1f} MiB); Python threads {threads_warm} -> {threads_end}; "
        f"native threads {native_warm} -> {native_end}; "
        f"Python objects {objects_warm} -> {objects_end}"
    )
    assert threads_end == threads_warm
    assert objects_end <= objects_warm + 200
    assert native_end <= native_warm
    assert growth <= max(24 * 1024, rss_warm // 20), f"RSS grew by {growth / 1024:.1f} MiB"
