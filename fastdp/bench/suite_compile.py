"""The ``compile`` suite: training steps with ``torch.compile`` on persistent replicas (bench/
README.md, *Suites*). ``torch_dp`` is unsupported: no CPU replicas, and its ``replicate`` writes a
compiled module's copies into the module itself (NOTE [ Compiled replicas ])."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from torch import nn

import fastdp
from fastdp.bench import modes
from fastdp.bench.runner import Settings, Task, check_mode, guarded, time_into

COMPILED = ("floor_compiled", "fastdp_compiled", "fastdp_wrapper", "dp_algo_compiled")
FLOOR = {**dict.fromkeys(COMPILED[1:], "floor_compiled"), "fastdp": "floor"}  # mode -> its floor
_TORCH_DP = (
    "nn.DataParallel has no CPU replicas (without CUDA it calls the module directly), "
    "and its replicate() corrupts a torch.compile'd module (RecursionError)"
)


def gelu_mlp(width: int, depth: int = 4, out: int = 8) -> nn.Sequential:
    """The issue's model: ``depth`` x (Linear(width, width), GELU) + Linear(width, out)."""
    blocks = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*blocks, nn.Linear(width, out))


# name -> (width, batch) per profile: the 64-wide MLP at batch 64, and a wider one
WORKLOADS = {
    "tiny": {"gelu-mlp64": (64, 64)},
    "quick": {"gelu-mlp64": (64, 64), "gelu-mlp256": (256, 256)},
    "cpu": {"gelu-mlp64": (64, 64), "gelu-mlp256": (256, 256), "gelu-mlp512": (512, 512)},
}


def _frames(graphs: bool = False) -> int:
    """Frames dynamo compiled so far (``graphs``: plus the graphs it made)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"] + (counters["stats"]["unique_graphs"] if graphs else 0)


def compile_tasks(s: Settings) -> list[Task]:
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    table = WORKLOADS.get(s.profile, WORKLOADS["cpu"])
    ns = [n for n in s.replicas if n > 1] or [2]
    return [
        Task("compile", f"{name} {kind} x{n}", functools.partial(_run, s, name, wb, kind, n))
        for name, wb in table.items()
        for kind in kinds
        for n in ns
    ]


def _run(s: Settings, name: str, wb: tuple[int, int], kind: str, n: int) -> list[dict]:
    import torch._dynamo

    width, batch = wb
    dev = "cpu" if kind == "cpu" else "cuda:0"
    ids = ["cpu"] * n if kind == "cpu" else [0] * n
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = gelu_mlp(width).to(dev).train()
    torch.manual_seed(1)
    args = (torch.randn(batch, width, device=dev),)
    chunks = modes.chunk_inputs(args, n)
    cm = torch.compile(model)  # torch.compile's defaults: inductor, mode "default"
    base = dict(suite="compile", workload=name, input="tensor", replicas=n)
    base.update(devices=[str(torch.device(dev))] * n, batch=batch, width=width, step="train")
    base.update(compile_options={})
    wrapper = fastdp.FastDataParallel(model, device_ids=ids)
    wrapper.compile()
    calls: dict[str, tuple[Callable, nn.Module | None]] = {
        "floor_compiled": (_on_chunks(cm, chunks), None),
        "fastdp_compiled": (fastdp.FastDataParallel(cm, device_ids=ids), cm),
        "fastdp_wrapper": (wrapper, cm),
        "dp_algo_compiled": (modes.dp_algorithm_class()(cm, device_ids=ids), cm),
        "floor": (_on_chunks(model, chunks), None),
        "fastdp": (fastdp.FastDataParallel(model, device_ids=ids), model),
    }
    recs = {m: {**base, "mode": m} for m in calls}
    steps: dict[str, Callable[[], None]] = {}
    for m, (call, ref) in calls.items():

        def setup(r: dict, m: str = m, call: Callable = call, ref: nn.Module | None = ref) -> None:
            steps[m] = _settle(r, s, m, call, ref, args, n, dev)

        guarded(recs[m], setup)
    model.zero_grad(set_to_none=True)
    time_into(s, steps, recs)
    model.zero_grad(set_to_none=True)
    _ratios(recs)
    out = list(recs.values())
    out.append({**base, "mode": "torch_dp", "status": "unsupported", "error": _TORCH_DP})
    torch._dynamo.reset()
    return out


def _settle(r: dict, s: Settings, m: str, call: Callable, ref, args: tuple, n: int, dev: str):
    """The first step (timed, frames counted for a compiled mode), the check of a wrapper against
    its module on the chunks, then recompiles over 20 steady steps; returns the step."""
    step = modes.train_step(call, () if ref is None else args)
    before, t0 = _frames(), time.perf_counter()
    step()
    if m in COMPILED:
        r["first_step_s"] = time.perf_counter() - t0
        r["frames_first_step"] = _frames() - before
    if ref is not None and s.check:
        check_mode(r, s, m, ref, call, args, n, dev)
    for _ in range(3):
        step()
    before = _frames(graphs=True)
    for _ in range(20):
        step()
    r["recompiles_20_steps"] = _frames(graphs=True) - before
    return step


def _on_chunks(module: Callable, chunks: list[tuple]) -> Callable:
    """The module on the chunks in turn, outputs concatenated (the floor of a wrapper)."""
    return lambda: modes.concat_outputs([module(*c) for c in chunks])


def _ratios(recs: dict[str, dict]) -> None:
    def med(m: str) -> float | None:
        return (recs.get(m, {}).get("time_ms") or {}).get("median_ms")

    for m, r in recs.items():
        t = med(m)
        if t is None:
            continue
        rat = {}
        if m in FLOOR and med(FLOOR[m]):
            rat["vs_floor"] = t / med(FLOOR[m])
        if m != "fastdp" and med("fastdp"):
            rat["vs_fastdp_eager"] = t / med("fastdp")
        r["ratios"] = rat
