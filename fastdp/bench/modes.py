"""The modes compared side by side (``MODES``; each is described in bench/README.md, *Modes*),
the training step they run and the correctness check. A step is forward, loss (mean of squares of
every output) and backward; gradients accumulate (no ``zero_grad``, no optimizer step).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

import fastdp
from fastdp import _backend
from fastdp._launch import Auto
from fastdp.bench.workloads import loss_of, map_tensors, tensors_of
from fastdp.replicate import replicate

WRAPPERS = ("torch_dp", "fastdp", "fastdp_threads", "fastdp_inline", "fastdp_noext", "dp_algo")
MODES = ("bare", "floor", *WRAPPERS)
LAUNCH_MODES = {
    "fastdp": "auto",
    "fastdp_threads": "threads",
    "fastdp_inline": "inline",
    "fastdp_noext": "auto",
    "dp_algo": "threads",
}  # dp_algo: DataParallel's threads


def fresh_replicate(module: nn.Module, devices: Sequence, detach: bool = False) -> list:
    """DataParallel's algorithm: ``fastdp.replicate.replicate``, fresh replicas every call."""
    return replicate(module, devices, detach)


@functools.cache
def dp_algorithm_class() -> type:
    """``FastDataParallel`` with DataParallel's replicate: fresh replicas every call."""

    class DPAlgorithm(fastdp.FastDataParallel):
        def replicate(self, module, device_ids):
            return fresh_replicate(module, device_ids, not torch.is_grad_enabled())

    DPAlgorithm.__qualname__ = DPAlgorithm.__name__ = "DPAlgorithm"
    return DPAlgorithm


@contextlib.contextmanager
def wrapped(mode: str, model: nn.Module, devices: Sequence | None) -> Iterator[Callable]:
    """Yields the callable of ``mode`` around ``model``, for the ``with`` block only.

    ``devices=None`` constructs the wrapper without ``device_ids`` (its default devices). Run
    everything that uses it (forward *and* backward) under ``mode_context(mode)``.
    """
    kw = {} if devices is None else {"device_ids": list(devices)}
    if mode in LAUNCH_MODES:  # explicit, so that FASTDP_LAUNCH in the environment cannot sway it
        kw["launch"] = LAUNCH_MODES[mode]
    if mode == "bare":
        yield model
    elif mode == "floor":
        yield functools.partial(chunked_call, model, 1 if devices is None else len(devices))
    elif mode == "torch_dp":
        yield nn.DataParallel(model, **kw)
    elif mode in ("fastdp", "fastdp_threads", "fastdp_inline", "fastdp_noext"):
        yield fastdp.FastDataParallel(model, **kw)
    elif mode == "dp_algo":
        yield dp_algorithm_class()(model, **kw)
    else:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def mode_context(mode: str) -> contextlib.AbstractContextManager:
    """``fastdp_noext``: the extension disabled (``fastdp._backend.use_extension(False)``)."""
    return _backend.use_extension(False) if mode == "fastdp_noext" else contextlib.nullcontext()


def in_mode(mode: str, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run under ``mode_context(mode)`` on every call (backward included), so that
    interleaved timing of several modes gives each its own backend setting."""
    if mode != "fastdp_noext":
        return fn

    def step() -> None:
        prev = _backend.set_enabled(False)
        try:
            fn()
        finally:
            _backend.set_enabled(prev)

    return step


def train_step(call: Callable, args: tuple) -> Callable[[], None]:
    def step() -> None:
        loss_of(call(*args)).backward()

    return step


def forward_step(call: Callable, args: tuple) -> Callable[[], None]:
    def step() -> None:
        with torch.no_grad():
            call(*args)

    return step


def chunk_inputs(args: tuple, n: int, dim: int = 0) -> list[tuple]:
    """DataParallel's split of ``args`` into at most ``n`` chunks (``torch.chunk`` per tensor)."""
    leaves = tensors_of(args)
    if not leaves or n <= 1:
        return [args]
    k = len(leaves[0].chunk(n, dim))
    return [map_tensors(args, lambda t, i=i: t.chunk(n, dim)[i]) for i in range(k)]


def concat_outputs(outs: list, dim: int = 0):
    """Concatenates per-chunk outputs the way DataParallel gathers them (same nesting)."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs, dim) if len(outs) > 1 else first
    if isinstance(first, (tuple, list)):
        return type(first)(concat_outputs(list(x), dim) for x in zip(*outs))
    if isinstance(first, dict):
        return {k: concat_outputs([o[k] for o in outs], dim) for k in first}
    return first


def chunked_reference(model: nn.Module, args: tuple, n: int, device: torch.device | str):
    """The bare module on each of DataParallel's chunks in turn, outputs concatenated: the same
    outputs and gradients DataParallel semantics promise, BatchNorm's per-replica batch
    statistics included (for models without batch statistics it equals the whole batch)."""
    return chunked_call(model, n, *map_tensors(args, lambda t: t.to(device)))


def chunked_call(model: nn.Module, n: int, *args):
    """The ``floor`` mode: ``model`` on DataParallel's ``n`` chunks of ``args`` in turn."""
    return concat_outputs([model(*c) for c in chunk_inputs(args, n)])


def settle(call: Callable, step: Callable[[], None]) -> None:
    """Runs ``step`` until an ``auto`` wrapper has picked a strategy for this configuration (its
    trial steps, untimed: the step a long run makes), at most 4 + 2 x its trial length."""
    report = getattr(call, "launch_report", None)
    if report is None or getattr(call, "launch", None) != "auto":
        return
    for _ in range(4 + 2 * (Auto.WARMUP + Auto.TRIALS)):
        if report() and all(r["choice"] for r in report()):
            return
        step()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for p in model.parameters()
    ]


def _max_rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(got, ref):
        b = b.detach().float()
        a = a.detach().to(b.device).float()
        if a.shape != b.shape:
            return float("inf")
        if a.numel() == 0:
            continue
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
        worst = max(worst, err)
    return worst


def check(
    model: nn.Module, call: Callable, args: tuple, n: int, device: torch.device | str, rtol: float
) -> dict:
    """Compares outputs and gradients of ``call`` with ``chunked_reference`` (max over tensors of
    max|got - ref| / max|ref|, which must stay <= ``rtol``). Leaves the gradients at None."""
    model.zero_grad(set_to_none=True)
    ref_out = chunked_reference(model, args, n, device)
    loss_of(ref_out).backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    out = call(*args)
    loss_of(out).backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    got_t, ref_t = tensors_of(out), tensors_of(ref_out)
    if len(got_t) != len(ref_t):
        return {"ok": False, "why": f"{len(got_t)} output tensors, expected {len(ref_t)}"}
    out_err = _max_rel_err(got_t, ref_t)
    grad_err = _max_rel_err(grads, ref_grads)
    ok = out_err <= rtol and grad_err <= rtol
    res = {"ok": ok, "out_rel_err": out_err, "grad_rel_err": grad_err, "rtol": rtol}
    if not ok:
        res["why"] = f"outputs rel err {out_err:.3g}, grads rel err {grad_err:.3g} > {rtol:g}"
    return res
