"""Shared by the quick check's probes: the registry, and helpers every probe uses.

Status words a probe returns: ok (the code does what its NOTE says), bug (a review finding
reproduced), perf-risk (a slow path the review predicted), error (an exception nobody predicted),
skip.
"""

import os
import statistics
import time

SLEEP = int(os.environ.get("PROBE_SLEEP_CYCLES", "100000000"))  # ~50 ms of GPU spin at ~2 GHz
CLEAR = r"CUDA graph.*(pin_memory|FASTDP_DISABLE_EXT)"
PROBES = {}


def probe(timeout=45, env=None, in_all=True):
    def deco(fn):
        PROBES[fn.__name__] = dict(fn=fn, env=env or {}, timeout=timeout, in_all=in_all)
        return fn

    return deco


def _torch():
    import torch

    return torch


def _err(e):
    s = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {(s[0] if s else '')[:300]}"
    inner = e.__cause__ or e.__context__  # an error raised while leaving a capture hides the first
    return msg if inner is None else f"{msg} <- {_err(inner)}"


def _sync():
    _torch().cuda.synchronize()


def _stats():
    from fastdp import _backend

    return dict(_backend.ext().pinned_pool_stats())


def _late_pinned(src):
    """A pinned host tensor of src's layout, filled by a non_blocking D2H queued behind a long
    kernel on the current stream: its bytes land ~50 ms after this returns."""
    torch = _torch()
    pinned = torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, pin_memory=True)
    pinned.zero_()
    torch.cuda._sleep(SLEEP)
    pinned.copy_(src, non_blocking=True)
    return pinned


def _same(a, b):
    torch = _torch()
    a, b = a.detach(), b.detach()
    if a.is_complex():
        a, b = a.resolve_conj(), b.resolve_conj()
    return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def _time(fn, reps=10):
    fn()
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    first = time.perf_counter() - t0
    n = reps if first < 0.25 else 2
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
