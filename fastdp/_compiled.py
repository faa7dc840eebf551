"""``torch.compile`` on replicas: compiled modules copied safely, every replica running compiled.

``compile_root`` compiles a replica root with the context given to the wrapper
(``FastDataParallel.compile`` or ``torch.compile(FastDataParallel(m))``; see
NOTE [ Compiling the wrapper ] below). Nothing here imports ``torch._dynamo`` (2 s): a module can
only be compiled once it is imported. The private torch APIs used live in ``_torch_private.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn import Module

from fastdp import _torch_private


def _eval_frame() -> Any:
    return _torch_private.dynamo_module("eval_frame")


def is_optimized(m: Module) -> bool:
    """Whether ``m`` is ``torch.compile(module)``'s ``OptimizedModule``."""
    ef = _eval_frame()
    return ef is not None and isinstance(m, ef.OptimizedModule)


def is_compiled(m: Module) -> bool:
    """Whether calling ``m`` runs compiled code (either form)."""
    return is_optimized(m) or m.__dict__.get("_compiled_call_impl") is not None


context_of_function = _torch_private.dynamo_context_of


# NOTE [ Compiled replicas ]
# Neither compiled form survives DataParallel's shallow copy. ``torch.compile(m)``'s
# ``OptimizedModule`` forwards attribute writes to ``m``, so ``_replicate_for_data_parallel`` would
# set ``m._modules = {'_orig_mod': m}`` (endless recursion): ``replicate_module`` copies the
# ``__dict__`` instead and ``finish_replica`` rebuilds ``forward`` around the replica's own
# ``_orig_mod``. ``m.compile()``'s ``_compiled_call_impl`` closes over the original ``m``, so the
# replica gets the same dynamo context around its own ``_call_impl``. Both reuse the user's context
# (same options, one backend instance); dynamo guards on type and attributes, with parameters as
# inputs, so replicas on one device share entries; a rebuilt set (NOTE [ Replica invalidation ])
# is re-wrapped from the current originals, whose changed attributes fail stale code's guards.
def replicate_module(m: Module) -> Module:
    """``m._replicate_for_data_parallel()`` with empty ``_former_parameters``, safe for
    ``OptimizedModule`` (whose own ``__setattr__`` would write into the original inner module)."""
    if not is_optimized(m):
        r = m._replicate_for_data_parallel()
        r.__dict__["_former_parameters"] = OrderedDict()
        return r
    r = object.__new__(type(m))
    d = dict(m.__dict__)
    d["_parameters"] = {}
    d["_buffers"] = dict(d["_buffers"])
    d["_modules"] = dict(d["_modules"])
    d["_is_replica"] = True
    d["_former_parameters"] = OrderedDict()
    object.__setattr__(r, "__dict__", d)
    return r


def finish_replica(orig: Module, r: Module) -> None:
    """Aim ``r``'s compiled entry at ``r`` itself (NOTE [ Compiled replicas ]); call once its
    children are set."""
    if is_optimized(orig):
        r._initialize()  # forward = ctx(r._orig_mod.__call__), as OptimizedModule.__init__
        r.__dict__["_torchdynamo_orig_callable"] = r._orig_mod.forward
        return
    impl = orig.__dict__.get("_compiled_call_impl")
    if impl is None:
        return
    ctx = context_of_function(impl)
    if ctx is None:  # set by hand to something else: cannot be re-aimed, so run the replica eager
        _warn_once(
            f"fastdp: {type(orig).__name__}._compiled_call_impl is not a torch.compile "
            "function; its replicas run eager. Use torch.compile(module) instead."
        )
    r.__dict__["_compiled_call_impl"] = None if ctx is None else ctx(r._call_impl)


def compile_root(r: Module, ctx: Any) -> Module:
    """Replica root ``r`` compiled with the wrapper's context, as ``torch.compile(r)`` would
    (``OptimizedModule``: ``r.compile()``'s form compiles nothing for ``torch.nn``'s own classes,
    whose frames dynamo skips); ``r`` itself if compiled already (the module's options win)."""
    return r if ctx is None or is_compiled(r) else ctx(r)


# NOTE [ Compiled replicas run in order ]
# A set running compiled code on two or more replicas runs them in turn on the caller's thread,
# whatever ``launch`` says (``Order.IN_TURN``), unless they must meet
# (NOTE [ Replicas that must run at once ]): dynamo's cache lookup and guards are not thread-safe
# (pytorch #118260, #123177), and CUDA graph trees (``mode="reduce-overhead"``) are per thread and
# device, so shared code on worker threads would race on one tree; in order, each device has one
# tree whose path is recorded once. So too each backward is compiled with its forward
# (``backward_with_forward``): across GPUs the backwards run on each device's autograd thread, and
# inductor's compile is not thread-safe. Replicas compile in turn and reuse entries on one device;
# kernels stay asynchronous, so distinct GPUs still overlap, but CPU replicas do not.

# Dynamo guards on each tensor input's device, so replicas that share one cache entry on one
# device (NOTE [ Compiled replicas ]) need one entry per device across GPUs, per variant (train,
# eval, no_grad, a partial batch); past ``recompile_limit`` dynamo runs new variants eager with a
# warning. The cache is per code object (one compiled callable per device would not help), so
# ``budget_for(n)`` raises ``recompile_limit`` and ``accumulated_recompile_limit`` to the user's
# own value times ``n``, never lowers them, and starts again from a value the user set since.
_budget: dict[str, int] = {}


def budget_for(num_replicas: int) -> None:
    """Scale dynamo's recompile limits to ``num_replicas`` (one budget per device: see the
    comment above); a no-op before ``torch._dynamo`` is imported."""
    cfg = _torch_private.dynamo_module("config")
    if cfg is None or num_replicas <= 1:
        return
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        now = getattr(cfg, name)
        if now != _budget.get(name + ".set"):  # first sight, or the user set it since
            _budget[name] = now
        want = max(now, _budget[name] * num_replicas)
        if want != now:
            setattr(cfg, name, want)
        _budget[name + ".set"] = want


# AOT autograd compiles a backward lazily, on its first call; ``backward_with_forward()`` sets
# functorch's ``force_non_lazy_backward_lowering`` around the in-order forwards, so each backward
# is compiled with its forward on the caller's thread (NOTE [ Compiled replicas run in order ]; a
# forward never run backward still pays for its backward's compile: the price of no lock in
# backward). Only for sets with copy replicas (replicas on other devices, or CPU replicas under
# FASTDP_CPU_DISTINCT=1): replicas sharing the originals' device have one autograd thread, so lazy
# is safe there. Set and restored as ``cfg.patch`` does (prior value back), without the class
# ``patch`` builds per call, and not at all where it is on already.
@contextmanager
def backward_with_forward() -> Iterator[None]:
    cfg = _torch_private.functorch_config()
    name = "force_non_lazy_backward_lowering"
    prior = getattr(cfg, name, None) if cfg is not None else None
    if prior is None or prior is True:
        yield
        return
    setattr(cfg, name, True)
    try:
        yield
    finally:
        setattr(cfg, name, prior)


# CUDA graph trees (torch/_inductor/cudagraph_trees.py) keep one manager per thread and device: a
# compiled function binds the manager of the thread that first ran it, and a backward replays in
# the tree of the thread that called ``backward``; in order, a device's tree records one node per
# replica's forward, in a fixed order, once.
def mark_static(tensors: Any) -> None:
    """Mark persistent replica tensors as static graph inputs: they keep their addresses, so a
    CUDA graph replay does not copy them ("unguarded": a changed address, after a renewal or a
    rebuild, re-records once; NOTE [ Compiled replicas run in order ])."""
    for rep in tensors:
        for t in rep:
            t._dynamo_static_input_type = "unguarded"


enclosing_context = _torch_private.enclosing_dynamo_context


def context_from_options(**options: Any) -> Any:
    """The dynamo context ``torch.compile(fn, **options)`` builds (None with ``disable=True``)."""
    return context_of_function(torch.compile(_identity, **options))


def _identity(x: Any) -> Any:
    return x


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    import warnings

    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=4)


# NOTE [ Compiling the wrapper ]
# Dynamo cannot capture a wrapper step (planning, scatter, threads and gather are host code: a
# graph break and warning per fastdp op, slower than eager), and the caller's compile context does
# not reach replicas on worker threads. So under ``torch.compile(FastDataParallel(m))``, ``forward``
# hands itself back to eager (``untraced_forward``: one clean graph break, no warning) and compiles
# the module inside every replica with the innermost ``torch.compile``'s context, the user's
# options; replica sets are keyed by it, so compiled and plain calls can alternate.
# ``FastDataParallel.compile(**options)`` does the same unseen by dynamo and is the form for
# ``fullgraph=True``, which fails at the disabled function, whose name says which form to use.
# A module compiled already keeps its own options.
def _forward_from_compile(fdp: Any, inputs: tuple, kwargs: dict) -> Any:
    ctx = fdp._compile_ctx if fdp._compile_ctx is not None else enclosing_context()
    return fdp._forward(inputs, kwargs, ctx)


_forward_from_compile.__qualname__ = (
    "FastDataParallel.forward [fastdp's host orchestration is not traced; for fullgraph=True "
    "call model.compile(fullgraph=True) on the FastDataParallel, or wrap "
    "torch.compile(module, fullgraph=True)]"
)
untraced_forward = _torch_private.disable_dynamo(_forward_from_compile)
