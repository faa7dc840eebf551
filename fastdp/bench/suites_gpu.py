"""The GPU suites: ``gpu-``/``multigpu-`` ``comm``, ``replicate`` and ``steps`` (bench/README.md,
*Suites*). ``DRY_RUN = True`` (the hidden ``--gpu-dry-run``) runs them on CPU devices, so that a
machine without a GPU executes every line of them; its figures mean nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import comm as tcomm

import fastdp
import fastdp.bench.workloads as wl
from fastdp import comm as fcomm
from fastdp.bench import modes, timing
from fastdp.bench.runner import Settings, Task, guarded, last_only, threads, time_into, time_modes
from fastdp.bench.suites_cpu import consume_graph

MiB = 1 << 20
DRY_RUN = False


def gpu_count() -> int:
    return 2 if DRY_RUN else torch.cuda.device_count()


def dev(i: int = 0) -> torch.device:
    return torch.device("cpu") if DRY_RUN else torch.device("cuda", i)


def ids(xs: list[int]) -> list:
    """Device ids as passed to the wrappers (``'cpu'`` in a dry run)."""
    return ["cpu"] * len(xs) if DRY_RUN else list(xs)


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if DRY_RUN else t.pin_memory()


def device_sets(multi: bool, replicas: tuple[int, ...]) -> list[list[int]]:
    """``[0] * n`` for the shared-GPU suites; ``[0..k-1]`` for k = 1, 2, 4, ... and all GPUs."""
    if not multi:
        return [[0] * n for n in replicas]
    count = gpu_count()
    ks = sorted({k for k in (1, 2, 4, 8, 16) if k <= count} | {count})
    return [list(range(k)) for k in ks]


COMM_SIZES = {
    "tiny": [MiB],
    "quick": [MiB, 64 * MiB],
    "gpu": [64 << 10, MiB, 16 * MiB, 64 * MiB, 256 * MiB],
}


def _exact(got, want) -> bool:
    got, want = wl.tensors_of(got), wl.tensors_of(want)
    return len(got) == len(want) and all(
        a.device == b.device and torch.equal(a, b) for a, b in zip(got, want)
    )


def _both(op: str, *args: object) -> dict[str, Callable[[], object]]:
    """``torch.nn.parallel.comm``'s ``op`` and ``fastdp.comm``'s, on the same arguments."""
    return {"torch": lambda: getattr(tcomm, op)(*args), "fastdp": lambda: getattr(fcomm, op)(*args)}


def _comm_ops(x: torch.Tensor, devices: list, devs: list[torch.device]) -> tuple[dict, int]:
    """name -> (kind, {impl: fn}, expected result or None), and the broadcast's tensor count."""
    n = len(devices)
    pinned, pageable = _pin(x.cpu()), x.cpu().clone()
    dst_far = torch.empty_like(x, device=devs[-1])
    dst_h2d = torch.empty_like(x)
    chunks = [c.to(d) for c, d in zip(x.chunk(n), devs)]
    params = list(x.view(-1).split(max(x.numel() // 200, 1024)))
    dst_host = torch.empty_like(pageable)
    same_device = len({str(d) for d in devs}) == 1
    ops = {
        "limit_h2d": ("limit", {"copy": lambda: dst_h2d.copy_(pinned, non_blocking=True)}, None),
        "limit_d2d": ("limit", {"copy": lambda: dst_far.copy_(x, non_blocking=True)}, None),
        "limit_host": ("limit", {"copy": lambda: dst_host.copy_(pageable)}, None),
        "scatter_gpu": ("view" if same_device else "scatter", _both("scatter", x, devices), chunks),
        "scatter_pinned": ("scatter", _both("scatter", pinned, devices), chunks),
        "scatter_pageable": ("scatter", _both("scatter", pageable, devices), chunks),
        "gather": ("gather", _both("gather", chunks, 0, devices[0]), x),
        "broadcast_coalesced": (
            "broadcast",
            _both("broadcast_coalesced", params, devices),
            [[p.to(d) for p in params] for d in devs],
        ),
    }
    return ops, len(params)


# Rows timed once per torch thread count: a pageable scatter is bounded by host memcpy, whose
# speed follows torch's intra-op threads, so its rows and the host-copy limit are timed at each of
# ``PAGEABLE_THREADS`` (``threads`` in each record); every other row at the run's ``--threads``. A
# row that moves no byte (kind ``view``: every chunk stays on its device) is reported in
# microseconds per call (``us_per_call``), never in GB/s.
THREADED_OPS = ("scatter_pageable", "limit_host")
PAGEABLE_THREADS = (1, 8)


def comm_tasks(s: Settings, multi: bool) -> list[Task]:
    suite = "multigpu-comm" if multi else "gpu-comm"
    devices = list(range(gpu_count())) if multi else [0] * 4
    devs = [dev(d) for d in devices]
    sync = timing.cuda_sync(devs)

    def run(size: int) -> list[dict]:
        n = len(devices)
        batch = max(n * 16, 64)
        x = torch.randn(batch, size // 4 // batch, device=devs[0])
        ops, tensors = _comm_ops(x, ids(devices), devs)
        recs: dict[tuple, dict] = {}
        fns: dict[tuple, Callable] = {}
        passes = [(op, None) for op in ops if op not in THREADED_OPS]
        passes += [(op, t) for t in PAGEABLE_THREADS for op in THREADED_OPS]
        for op, n_threads in passes:
            kind, impls, ref = ops[op]
            for impl, fn in impls.items():
                key = (op, impl, n_threads)
                r = dict(suite=suite, op=op, kind=kind, mode=impl, bytes=x.numel() * 4)
                r.update(devices=[str(d) for d in devs], replicas=n)
                r.update(tensors=tensors if kind == "broadcast" else 1)
                r.update(threads=n_threads or torch.get_num_threads())
                recs[key] = guarded(r, lambda r, fn=fn, ref=ref: _check_exact(r, fn, ref))
                if recs[key]["status"] in ("ok", "check_failed"):
                    fns[key] = fn
        time_into(s, {k: f for k, f in fns.items() if k[2] is None}, recs, sync)
        for t in PAGEABLE_THREADS:
            with threads(t):
                time_into(s, {k: f for k, f in fns.items() if k[2] == t}, recs, sync)
        out = list(recs.values())
        _bandwidths(out)
        return out

    sizes = COMM_SIZES.get(s.profile, COMM_SIZES["gpu"])
    return [Task(suite, f"{z >> 10} KiB", lambda z=z: run(z)) for z in sizes]


def _check_exact(r: dict, fn: Callable[[], object], ref: object) -> None:
    """The first call; its result bit-exact against ``ref`` (no check where ``ref`` is None)."""
    got = fn()
    if ref is not None:
        r["check"] = {"ok": _exact(got, ref), "exact": True}
        if not r["check"]["ok"]:
            r["status"] = "check_failed"


def _bandwidths(out: list[dict]) -> None:
    """``us_per_call`` for rows that move no byte, else ``gbps``; beside each row, the copy
    limit of its kind at the run's threads and ``frac_of_limit``."""
    for r in out:
        if "time_ms" in r and r["kind"] == "view":
            r["us_per_call"] = r["time_ms"]["median_ms"] * 1e3
        elif "time_ms" in r:
            r["gbps"] = r["bytes"] / (r["time_ms"]["median_ms"] * 1e-3) / 1e9
    limits = {(r["op"], r["threads"]): r for r in out if r["kind"] == "limit" and "gbps" in r}
    run_threads = torch.get_num_threads()
    for r in out:
        host = r["op"] in ("scatter_pinned", "scatter_pageable")
        lim = limits.get(("limit_h2d" if host else "limit_d2d", run_threads))
        if r["kind"] != "limit" and lim and "gbps" in r:
            r["limit_op"], r["limit_gbps"] = lim["op"], lim["gbps"]
            r["frac_of_limit"] = r["gbps"] / lim["gbps"]


def replicate_gpu_tasks(s: Settings, multi: bool) -> list[Task]:
    """``replicate()`` cost of GPU workloads on 4 replicas of cuda:0 or on every GPU."""
    suite = "multigpu-replicate" if multi else "gpu-replicate"
    devices = list(range(gpu_count())) if multi else [0] * 4
    cat = wl.catalogue(s.profile)
    names = ("mlp100",) if s.profile == "tiny" else ("mlp1000", "resnet50")

    def run(w: wl.Workload) -> list[dict]:
        model = wl.build(w, dev(0))
        fdp = fastdp.FastDataParallel(model, device_ids=ids(devices))
        params = list(model.parameters())
        d = ids(devices)
        impls = {
            "torch": lambda: torch.nn.parallel.replicate(model, d),
            "dp_algo": lambda: modes.fresh_replicate(model, d, False),
            "fastdp": lambda: fdp.replicate(fdp.module, fdp.device_ids),
            "torch_broadcast_coalesced": lambda: tcomm.broadcast_coalesced(params, d),
            "fastdp_comm_broadcast_coalesced": lambda: fcomm.broadcast_coalesced(params, d),
        }
        base = dict(suite=suite, workload=w.name, layers=w.layers, replicas=len(devices))
        base.update(devices=[str(dev(i)) for i in devices], params=len(params))
        base.update(param_bytes=sum(p.numel() * p.element_size() for p in params))
        replicating = ("torch", "dp_algo", "fastdp")  # their graph is consumed after each call

        def first(r: dict, m: str) -> None:
            out = impls[m]()
            if m in replicating:
                consume_graph(out)

        recs = {m: guarded({**base, "mode": m}, lambda r, m=m: first(r, m)) for m in impls}
        ok = [m for m in impls if recs[m]["status"] == "ok"]
        timed = {m: (impls[m], consume_graph) if m in replicating else impls[m] for m in ok}
        time_into(s, timed, recs, timing.cuda_sync(base["devices"]))
        model.zero_grad(set_to_none=True)
        return list(recs.values())

    return [Task(suite, name, lambda w=cat[name]: run(w)) for name in names]


class _MoveThen(nn.Module):
    """The bare module fed from a host batch: the copy to the device is part of its step."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.module, self.device = module, device

    def forward(self, *args):
        return self.module(*wl.map_tensors(args, lambda t: t.to(self.device, non_blocking=True)))


def step_tasks(s: Settings, multi: bool) -> list[Task]:
    suite = "multigpu-steps" if multi else "gpu-steps"
    cat = wl.catalogue(s.profile)
    if s.profile == "tiny":
        combos = [("mlp10", "cuda"), ("mlp10", "cpu-pinned")]
    else:
        on_device = ("mlp1000", "resnet50", "transformer12", "lstm", "mlp10-dict16")
        combos = [(n, "cuda") for n in on_device]
        combos += [(n, w) for n in ("resnet50", "mlp10") for w in ("cpu-pageable", "cpu-pinned")]
        if multi:  # wide8 at the gpu profile: 134M parameters, the refresh/reduce-bound case
            combos.append(("wide8", "cuda"))
    sets = device_sets(multi, s.replicas)
    if s.profile == "gpu":  # step rows: every one of at least 10 repeats, whatever they take
        s = dataclasses.replace(s, repeats=max(s.repeats, 10), max_total_s=None)

    @last_only
    def model_and_args(w: wl.Workload, where: str) -> tuple:
        args = wl.make_inputs(w, dev(0) if where == "cuda" else "cpu")
        return wl.build(w, dev(0)), wl.map_tensors(args, _pin) if where == "cpu-pinned" else args

    def run(w: wl.Workload, where: str, devices: list[int]) -> list[dict]:
        model, args = model_and_args(w, where)
        return time_modes(
            s,
            suite=suite,
            w=w,
            model=model,
            args=args,
            devices=ids(devices),
            input=w.input_kind if where == "cuda" else f"{w.input_kind}:{where}",
            mode_list=("bare", "floor") + modes.WRAPPERS,
            bare_model=None if where == "cuda" else _MoveThen(model, dev(0)),
            distinct_gpus=len(set(devices)),
        )

    return [
        Task(suite, f"{name} {where} {devs}", lambda w=cat[name], x=where, d=devs: run(w, x, d))
        for name, where in combos
        for devs in sets
    ]
