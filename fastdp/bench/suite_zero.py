"""The ``zero`` suite: a training step (forward, backward, AdamW step) with
``fastdp.ZeroRedundancyOptimizer`` against the same step with the unsharded AdamW, on 4 CPU
replicas in both storage modes and on the GPUs present; modes, workloads and recorded fields in
bench/README.md, *Suites*.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

import fastdp
import fastdp.bench.workloads as wl
from fastdp.bench import modes, timing
from fastdp.bench.runner import Settings, Task, guarded, time_into

WORKLOADS = {"tiny": ("mlp10",), "quick": ("mlp100", "transformer12")}
CPU_WORKLOADS = ("mlp1000", "transformer12")
# mode -> the mode its time is divided by (ratios.vs_floor / ratios.vs_unsharded)
VS_FLOOR = {"unsharded": "floor", "zero": "floor"}
VS_UNSHARDED = {"zero": "unsharded", "zero_opt_step": "unsharded_opt_step"}


def zero_tasks(s: Settings) -> list[Task]:
    n = max(s.replicas) if max(s.replicas) > 1 else 4
    names = WORKLOADS.get(s.profile, CPU_WORKLOADS)
    runs = [
        (name, "cpu", storage, ["cpu"] * n) for name in names for storage in ("alias", "distinct")
    ]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 1:
        gpus = torch.cuda.device_count()
        ids = list(range(gpus)) if gpus > 1 else [0] * n
        runs += [(name, "cuda", "gpu", ids) for name in names]
    return [
        Task("zero", f"{name} {storage} x{len(ids)}", lambda r=r: _run(s, *r))
        for r in runs
        for name, _, storage, ids in [r]
    ]


@contextlib.contextmanager
def _storage(storage: str) -> Iterator[None]:
    """``FASTDP_CPU_DISTINCT`` for the task (read when replica sets and owners are built)."""
    old = os.environ.get("FASTDP_CPU_DISTINCT")
    os.environ["FASTDP_CPU_DISTINCT"] = "1" if storage == "distinct" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["FASTDP_CPU_DISTINCT"]
        else:
            os.environ["FASTDP_CPU_DISTINCT"] = old


def _adamw(params: object, zero: bool) -> torch.optim.Optimizer:
    if zero:
        return fastdp.ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-4)
    return torch.optim.AdamW(params, lr=1e-4)


def _step(call: Callable, opt: torch.optim.Optimizer, args: tuple) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad()
        wl.loss_of(call(*args)).backward()
        opt.step()

    return step


def _run(s: Settings, name: str, kind: str, storage: str, ids: list) -> list[dict]:
    w = wl.catalogue(s.profile)[name]
    dev = "cpu" if kind == "cpu" else "cuda:0"
    base = {
        "suite": "zero",
        "workload": name,
        "input": w.input_kind,
        "replicas": len(ids),
        "storage": storage,
        "devices": [
            str(torch.device(i) if kind == "cpu" else torch.device("cuda", i)) for i in ids
        ],
        "step": "train + AdamW step",
    }
    recs = {m: {**base, "mode": m} for m in ("floor", "unsharded", "zero")}
    recs.update({m: {**base, "mode": m} for m in ("unsharded_opt_step", "zero_opt_step")})
    steps: dict[str, Callable[[], None]] = {}
    with _storage(storage):
        args = wl.make_inputs(w, dev)
        bare = wl.build(w, dev)
        chunks = modes.chunk_inputs(args, len(ids))
        floor_opt = _adamw(bare.parameters(), False)
        steps["floor"] = _step(
            lambda: modes.concat_outputs([bare(*c) for c in chunks]), floor_opt, ()
        )
        wrappers = {
            m: fastdp.FastDataParallel(wl.build(w, dev), device_ids=ids)
            for m in ("unsharded", "zero")
        }
        opts = {m: _adamw(wrappers[m].parameters(), m == "zero") for m in wrappers}
        for m in wrappers:
            steps[m] = _step(wrappers[m], opts[m], args)

        def check(r: dict) -> None:
            _check_and_count(r, recs, wrappers, opts, args)

        guarded(recs["zero"], check)
        for m in wrappers:
            steps[f"{m}_opt_step"] = opts[m].step
        time_into(s, steps, recs, timing.cuda_sync(base["devices"]))
    _ratios(recs)
    return list(recs.values())


def _check_and_count(r: dict, recs: dict, wrappers: dict, opts: dict, args: tuple) -> None:
    """Two steps of each from the same weights must agree (bit for bit on CPU replicas); then the
    bytes: optimizer state per replica index, and what one step copies for it."""
    for _ in range(2):
        for m in ("unsharded", "zero"):
            _step(wrappers[m], opts[m], args)()
    exact = all(
        torch.equal(p, q)
        for p, q in zip(
            wrappers["zero"].module.parameters(), wrappers["unsharded"].module.parameters()
        )
    )
    r["check"] = {"parameters_equal_unsharded": exact}
    on_cpu = wrappers["zero"].device_ids[0] == torch.device("cpu")
    if on_cpu and not exact:
        r.update(status="check_failed", error="parameters differ from the unsharded AdamW's")
    stats = opts["zero"].memory_stats()
    state = [v["optimizer_state"] for v in stats.values()]
    total = sum(
        t.numel() * t.element_size()
        for st in opts["unsharded"].state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    comm = wrappers["unsharded"].comm_stats()
    masters = sum(v["master_copies"] for v in stats.values())
    r.update(
        optimizer_bytes=state,
        unsharded_optimizer_bytes=total,
        index0_share=state[0] / total if total else None,
        # masters: values and gradients in, values out (every parameter has a gradient here)
        zero_copy_bytes_per_step=3 * masters,
        reduce_refresh_bytes_per_step=comm.get("bytes_reduced", 0) + comm.get("bytes_broadcast", 0),
    )
    recs["unsharded"]["optimizer_bytes"] = [total]


def _ratios(recs: dict[str, dict]) -> None:
    def med(m: str) -> float | None:
        return (recs[m].get("time_ms") or {}).get("median_ms")

    for m, r in recs.items():
        rat = {}
        for key, table in (("vs_floor", VS_FLOOR), ("vs_unsharded", VS_UNSHARDED)):
            if m in table and med(m) and med(table[m]):
                rat[key] = med(m) / med(table[m])
        if rat:
            r["ratios"] = rat
