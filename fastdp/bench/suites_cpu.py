"""The CPU suites: ``passthrough``, ``cpu-replicas``, ``overhead`` (also ``overhead-cuda``),
``replicate`` and ``module-build``; what each measures is in bench/README.md, *Suites*.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time

import torch
from torch import nn

import fastdp
import fastdp.bench.workloads as wl
from fastdp.bench import modes, timing
from fastdp.bench.runner import (
    Settings,
    Task,
    check_mode,
    guarded,
    last_only,
    record_launch,
    time_into,
    time_modes,
)

# What each profile runs: workloads (the sizes come from workloads.catalogue(profile)), and for
# ``replicate`` layer counts.
RUNS = {
    "tiny": {
        "passthrough": "mlp10",
        "cpu-replicas": "mlp10 mlp10-dict16 wide8",
        "overhead": "mlp10 mlp100",
        "replicate": "10 100",
    },
    "quick": {
        "passthrough": "mlp10",
        "cpu-replicas": "mlp100 resnet50 transformer12 lstm mlp10-dict16 wide8",
        "overhead": "mlp10 mlp100 resnet50 transformer12",
        "replicate": "10 100 1000",
    },
    "cpu": {
        "passthrough": "mlp10 mlp100",
        "cpu-replicas": "mlp100 mlp1000 resnet50 transformer12 lstm mlp10-dict16 wide8",
        "overhead": "mlp10 mlp100 mlp1000 resnet50 transformer12",
        "replicate": "10 30 100 300 1000",
    },
}
WIDE_REPLICAS = (2,)  # the compute-bound workload: 2 CPU replicas, one per core


def what_runs(profile: str, suite: str) -> list:
    names = RUNS.get(profile, RUNS["cpu"])[suite].split()
    return [int(k) for k in names] if suite == "replicate" else names


_TORCH_DP_CPU = (
    "nn.DataParallel has no CPU replicas: without CUDA it ignores device_ids and "
    "calls the module directly"
)


def passthrough(s: Settings) -> list[Task]:
    if torch.cuda.is_available():  # FastDataParallel(m) would take every GPU: not a pass-through
        return []
    cat = wl.catalogue(s.profile)
    names = what_runs(s.profile, "passthrough")

    def run(w: wl.Workload, step: str) -> list[dict]:
        model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
        recs = time_modes(
            s,
            suite="passthrough",
            w=w,
            model=model,
            args=args,
            step=step,
            mode_list=("bare", "torch_dp", "fastdp", "fastdp_noext"),
        )
        bare = recs[0].get("time_ms", {}).get("median_ms")
        for r in recs[1:]:
            if bare is not None and "time_ms" in r:
                r["overhead_us"] = (r["time_ms"]["median_ms"] - bare) * 1e3
        return recs

    return [
        Task("passthrough", f"{n} {step}", lambda w=cat[n], st=step: run(w, st))
        for n in names
        for step in ("forward", "train")
    ]


def cpu_replicas(s: Settings) -> list[Task]:
    """Per workload and replica count: bare, fastdp, fastdp_noext, dp_algo timed interleaved."""
    cat = wl.catalogue(s.profile)

    @last_only
    def model_and_args(w: wl.Workload) -> tuple:
        return wl.build(w, "cpu"), wl.make_inputs(w, "cpu")

    def run(w: wl.Workload, n: int) -> list[dict]:
        model, args = model_and_args(w)
        recs = time_modes(
            s,
            suite="cpu-replicas",
            w=w,
            model=model,
            args=args,
            devices=["cpu"] * n,
            mode_list=("bare", "floor", *modes.WRAPPERS[1:]),
        )
        torch_dp = dict(suite="cpu-replicas", workload=w.name, input=w.input_kind, mode="torch_dp")
        torch_dp.update(replicas=n, devices=["cpu"] * n, step="train")
        return [*recs, {**torch_dp, "status": "unsupported", "error": _TORCH_DP_CPU}]

    return [
        Task("cpu-replicas", f"{name} x{n}", lambda w=cat[name], n=n: run(w, n))
        for name in what_runs(s.profile, "cpu-replicas")
        for n in (WIDE_REPLICAS if name == "wide8" else s.replicas)
    ]


def _areas() -> dict[str, str]:
    fdp = os.path.dirname(os.path.abspath(fastdp.__file__))
    par = os.path.dirname(os.path.abspath(torch.nn.parallel.__file__))
    return {
        "fastdp": fdp + os.sep,
        "torch.nn.parallel": par + os.sep,
        "_exclude": os.path.join(fdp, "bench") + os.sep,
    }


def overhead_tasks(
    s: Settings, device: str = "cpu", n: int = 4, per_replica: int = 2
) -> list[Task]:
    """Host time and Python calls per step of the wrapper itself: the step minus the bare module
    on the same ``n`` chunks in turn (``model_chunks``), ``per_replica`` samples each (2: BatchNorm
    needs more than one value per channel). Counted with the hook on, then timed interleaved with
    fresh wrappers and the hook off."""
    cat = wl.catalogue(s.profile)
    names = what_runs(s.profile, "overhead")
    cuda = device == "cuda"
    dev = "cuda:0" if cuda else "cpu"
    ids = 0 if cuda else "cpu"
    runs = [(m, n) for m in ("fastdp", "fastdp_threads", "fastdp_inline", "dp_algo")]
    runs += [("torch_dp", n), ("torch_dp", 1)] if cuda else []
    suite = "overhead-cuda" if cuda else "overhead"
    sync = timing.cuda_sync([dev]) if cuda else None

    def run(w: wl.Workload) -> list[dict]:
        model = wl.build(w, dev)
        args = wl.make_inputs(w, dev, batch=n * per_replica)
        base = dict(suite=suite, workload=w.name, input=w.input_kind, batch=n * per_replica)
        base.update(layers=w.layers, params=len(list(model.parameters())))
        base.update(modules=len(list(model.modules())))
        refs = {k: _model_step(model, args, k) for k in sorted({k for _, k in runs})}
        keys = [("model_chunks", k) for k in refs] + runs
        recs = {(m, k): {**base, "mode": m, "replicas": k, "devices": [dev] * k} for m, k in keys}
        codes = timing.forward_codes(model)
        for k, fn in refs.items():
            guarded(recs[("model_chunks", k)], lambda r, fn=fn: _count(r, fn, codes))
        model.zero_grad(set_to_none=True)
        for m, k in runs:
            guarded(
                recs[(m, k)],
                lambda r, m=m, k=k: _count_wrapper(r, s, m, model, args, [ids] * k, dev),
            )
        model.zero_grad(set_to_none=True)
        _time_together(s, recs, refs, model, args, ids, sync)
        _subtract_model(recs)
        return list(recs.values())

    return [Task(suite, name, lambda w=cat[name]: run(w)) for name in names]


def _subtract_model(recs: dict) -> None:
    """Each wrapper's ``overhead_ms`` and ``wrapper_calls_per_step``: its step minus the model
    step (``model_chunks``) of the same replica count, in time and in calls outside the model."""
    for (m, k), r in recs.items():
        ref = recs[("model_chunks", k)]
        if m != "model_chunks" and "time_ms" in r and "time_ms" in ref:
            r["overhead_ms"] = r["time_ms"]["median_ms"] - ref["time_ms"]["median_ms"]
        if m != "model_chunks" and "calls" in r and "calls" in ref:
            r["wrapper_calls_per_step"] = r["calls"]["outside"] - ref["calls"]["outside"]


def _model_step(model, args: tuple, k: int):
    chunks = modes.chunk_inputs(args, k)

    def model_step() -> None:
        wl.loss_of(modes.concat_outputs([model(*c) for c in chunks])).backward()

    return model_step


COUNT_WARMUP, COUNT_STEPS = 2, 2  # counts barely vary (thread synchronisation can add a few)


def _count(r: dict, step, codes: set) -> None:
    with timing.CallCounter(_areas(), codes) as cc:
        _record_counts(r, cc, step)


def _record_counts(r: dict, cc: timing.CallCounter, step) -> None:
    """The calls of ``step`` after its uncounted warm-up steps."""
    for _ in range(COUNT_WARMUP):
        step()
    r["calls"] = cc.counted(step, steps=COUNT_STEPS)
    r["calls_per_step"] = r["calls"]["total"]
    r["calls_in"] = cc.area_counts()
    r["top_functions"] = cc.top()


def _count_wrapper(r: dict, s: Settings, mode: str, model, args, devices: list, dev: str) -> None:
    """Checks, then counts a wrapper's step. The counter is entered before the wrapper exists so
    that any thread the wrapper starts carries the hook."""
    codes = timing.forward_codes(model)
    with timing.CallCounter(_areas(), codes) as cc, modes.wrapped(mode, model, devices) as call:
        if s.check:
            check_mode(r, s, mode, model, call, args, len(devices), dev)
        step = modes.in_mode(mode, modes.train_step(call, args))
        modes.settle(call, step)  # auto: counted once its trials are over
        _record_counts(r, cc, step)
    model.zero_grad(set_to_none=True)


def _time_together(s: Settings, recs: dict, refs: dict, model, args, ids, sync) -> None:
    """Times every run that counted without error, interleaved, with fresh wrappers."""
    ok = [k for k in refs if recs[("model_chunks", k)].get("status") == "ok"]
    fns = {("model_chunks", k): refs[k] for k in ok}
    calls = {}
    with contextlib.ExitStack() as stack:
        for (m, k), r in recs.items():
            if m != "model_chunks" and r.get("status") in ("ok", "check_failed"):
                call = calls[(m, k)] = stack.enter_context(modes.wrapped(m, model, [ids] * k))
                fns[(m, k)] = modes.in_mode(m, modes.train_step(call, args))
                modes.settle(call, fns[(m, k)])
        time_into(s, fns, recs, sync)
        record_launch(recs, calls)
    model.zero_grad(set_to_none=True)


def consume_graph(replicas: list) -> None:
    """Back-propagates through one replica tensor, so the graph ``replicate()`` built is consumed
    as a training step's backward would consume it (fastdp's persistent replicas reuse their
    tensors only once the previous step's backward has run)."""
    for m in replicas[-1].modules():
        found = list(m._parameters.values()) + list(getattr(m, "_former_parameters", {}).values())
        for t in found:
            if t is not None and t.grad_fn is not None:
                t.sum().backward()
                return


def _check_replicas(r: dict, replicate, model: nn.Module, x: torch.Tensor, n: int) -> None:
    """Every replica ``replicate()`` makes computes what the module computes; then the Python
    calls of one steady-state call (``calls_per_call``, ``top_functions``)."""
    reps = replicate()
    want = model(x)
    err = max((rep(x) - want).abs().max().item() for rep in reps)
    ok = len(reps) == n and err <= 1e-6 * max(1.0, want.abs().max().item())
    r["check"] = {"ok": ok, "max_abs_err": err, "replicas": len(reps)}
    if not r["check"]["ok"]:
        r["status"] = "check_failed"
    consume_graph(reps)
    held: list = []
    with timing.CallCounter() as cc:  # the replicate() call alone, steady state
        r["calls_per_call"] = cc.counted(lambda: held.append(replicate()))["total"]
        r["top_functions"] = cc.top()
    consume_graph(held.pop())


def replicate_tasks(s: Settings, layers: list[int] | None = None, n: int = 4) -> list[Task]:
    """Steady-state ``replicate()`` on ``n`` CPU replicas, ``FastDataParallel.replicate`` vs
    DataParallel's algorithm, in training mode with grad enabled; each timed call followed,
    untimed, by a backward through the replicas (``consume_graph``)."""
    layers = layers or what_runs(s.profile, "replicate")

    def run(k: int) -> list[dict]:
        torch.manual_seed(0)
        model = wl.mlp(k).train()
        x = torch.randn(2, 32)
        base = dict(suite="replicate", workload=f"mlp{k}", layers=k, replicas=n)
        base.update(devices=["cpu"] * n, params=2 * k, modules=k + 1)
        fdp = fastdp.FastDataParallel(model, device_ids=["cpu"] * n)
        ids = fdp.device_ids
        impls = {
            "fastdp": lambda: fdp.replicate(fdp.module, ids),
            "dp_algo": lambda: modes.fresh_replicate(model, ids, not torch.is_grad_enabled()),
        }
        recs = {m: {**base, "mode": m} for m in impls}
        for m, fn in impls.items():
            guarded(recs[m], lambda r, fn=fn: _check_replicas(r, fn, model, x, n))
        model.zero_grad(set_to_none=True)
        ok = [m for m, r in recs.items() if r["status"] in ("ok", "check_failed")]
        time_into(s, {m: (impls[m], consume_graph) for m in ok}, recs)
        model.zero_grad(set_to_none=True)
        return list(recs.values())

    return [Task("replicate", f"{k} layers", lambda k=k: run(k)) for k in layers]


def module_build_tasks(s: Settings, layers: int = 1000) -> list[Task]:
    """Building ``nn.Sequential(Linear(32, 32) x layers)`` with no wrapper and while a persistent
    wrapper is alive (bench/README.md). ``nn_module_untouched``: ``nn.Module``'s attributes are
    the ones it had before the first wrapper of the run and none is fastdp's (other libraries add
    their own, e.g. transformers' ``smart_apply``, which says nothing about fastdp)."""
    before = dict(vars(nn.Module))

    def fastdps(f: object) -> bool:
        while f is not None:
            if getattr(f, "__module__", None) and f.__module__.startswith("fastdp"):
                return True
            f = getattr(f, "__wrapped__", None)
        return False

    def untouched() -> bool:
        now = vars(nn.Module)
        same = now.keys() == before.keys() and all(now[k] is before[k] for k in before)
        return same and not any(fastdps(f) for f in now.values() if callable(f))

    def run() -> list[dict]:
        base = {"suite": "module-build", "workload": f"mlp{layers}", "layers": layers}
        recs = {m: {**base, "mode": m} for m in ("without", "with")}
        ms: dict[str, list[float]] = {m: [] for m in recs}
        clean = untouched()
        names = list(recs)
        for r in range(s.warmup + s.repeats):
            for mode in names[r % 2 :] + names[: r % 2]:
                alive = None
                if mode == "with":
                    alive = fastdp.FastDataParallel(wl.mlp(2), device_ids=["cpu"] * 2)
                    alive(torch.randn(4, 32)).sum().backward()
                    clean = clean and untouched()
                gc.collect()
                t0 = time.perf_counter()
                model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])
                dt = time.perf_counter() - t0
                del model, alive
                if r >= s.warmup:
                    ms[mode].append(dt * 1e3)
        for mode, r in recs.items():
            st = timing.Stats.of(ms[mode], repeats=s.repeats, inner=1, warmup=s.warmup)
            r.update(status="ok", time_ms=st.as_dict(), nn_module_untouched=clean)
        return list(recs.values())

    return [Task("module-build", f"mlp{layers}", run)]
