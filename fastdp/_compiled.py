"""``torch.compile`` on replicas: compiled modules copied safely, every replica running compiled.

NOTE [ Compiled replicas ]
A module is compiled in one of two ways, and neither survives DataParallel's shallow copy:

* ``torch.compile(m, ...)`` returns an ``OptimizedModule`` that holds ``m`` as ``_orig_mod`` and
  forwards every attribute write it does not own to ``m``. ``Module._replicate_for_data_parallel``
  writes ``_parameters``/``_buffers``/``_modules`` on the copy, so those writes land on ``m``
  itself: ``m._modules`` becomes ``{'_orig_mod': m}`` and the next call recurses forever (the
  RecursionError of issue 13; ``nn.DataParallel`` fails the same way). ``replicate_module``
  copies the ``__dict__`` directly instead, and the copy's ``forward`` (bound to the original
  ``m``) is rebuilt around the replica's own ``_orig_mod`` by ``OptimizedModule._initialize``.
* ``m.compile(...)`` stores ``torch.compile(m._call_impl)`` in ``m._compiled_call_impl``, a
  function closed over the *original* ``m``: a copy would run the original module (original
  device, original tensors, gradients bypassing the reduce). The replica gets the same dynamo
  context applied to its own ``_call_impl``.

Both re-wrap with the user's own ``_TorchDynamoContext`` (the object ``torch.compile`` built), so
``mode``, ``backend``, ``options``, ``dynamic``, ``fullgraph`` and ``recompile_limit`` are exactly
the user's, and one backend instance serves every replica. Dynamo caches compiled code on code
objects, guarded on the module's type and attributes, with parameters as graph inputs: replicas
of one module pass each other's guards, so a replica set compiles once in all (replicas' plain
tensors differ from ``nn.Parameter`` originals, so calling the original compiled module elsewhere
is a second entry). Replicas run in order (NOTE below), so replica 0 compiles and the others hit
its entry; a partial batch recompiles once for all replicas (dynamo's automatic dynamic shapes),
as the plain compiled module on the chunks in turn does. A rebuilt
replica set (see NOTE [ Replica invalidation ]) is re-wrapped from the *current* originals, and
dynamo's guards reject code specialised on an attribute that changed, so no stale compiled code
runs.

``compile_root`` compiles a replica root with a context given to the wrapper
(``FastDataParallel.compile`` or ``torch.compile(FastDataParallel(m))``): see NOTE [ Compiling
the wrapper ] in ``fastdp/data_parallel.py``.

Nothing here imports ``torch._dynamo`` (2 s): a module can only be compiled once it is imported.
The private torch APIs this needs live in ``fastdp/_torch_private.py``.
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
    """Point ``r``'s compiled entry at ``r`` itself (after its children were set); see NOTE."""
    if is_optimized(orig):
        r._initialize()  # forward = ctx(r._orig_mod.__call__), as OptimizedModule.__init__
        r.__dict__["_torchdynamo_orig_callable"] = r._orig_mod.forward
        return
    impl = orig.__dict__.get("_compiled_call_impl")
    if impl is None:
        return
    ctx = context_of_function(impl)
    if ctx is None:  # set by hand to something else: cannot be re-aimed, so run the replica eager
        _warn_once(f"fastdp: {type(orig).__name__}._compiled_call_impl is not a torch.compile "
                   "function; its replicas run eager. Use torch.compile(module) instead.")
    r.__dict__["_compiled_call_impl"] = None if ctx is None else ctx(r._call_impl)


def compile_root(r: Module, ctx: Any) -> Module:
    """Replica root ``r`` compiled with the wrapper's context, as ``torch.compile(r)`` would
    (``OptimizedModule``: ``r.compile()``'s form compiles nothing for ``torch.nn``'s own classes,
    whose frames dynamo skips); ``r`` itself if compiled already (the module's options win)."""
    return r if ctx is None or is_compiled(r) else ctx(r)


# NOTE [ Compiled replicas run in order ]
# A replica set running compiled code on two or more replicas runs them in order on the caller's
# thread every step, whatever ``launch`` says (``ReplicaSet.in_order``; the inline strategy):
# dynamo's cache lookup and guard evaluation are not thread-safe (pytorch #118260, #123177).
# Compiled replicas on worker threads failed guards at random ("Unexpected recompilation:
# runtime guards failed even though they passed during recompilation-reason analysis"): two
# spurious recompiles in a suite run under load. In order, replica 0 compiles and the
# others hit its entry, exactly as the plain compiled module on the chunks in turn; kernels stay
# asynchronous, so distinct GPUs still overlap. The cost: CPU replicas of a compute-bound model
# no longer overlap on threads. Exception: replicas that meet inside a forward (SyncBatchNorm,
# replication callbacks) must run at once and stay on threads. Backward is autograd's: on CPU
# in the caller's thread; on distinct GPUs each device's thread runs its replica's compiled
# backward, compiled already by its forward (NOTE [ Backward compiled with the forward ]).


# NOTE [ CUDA graphs on replicas ]
# mode="reduce-overhead" (and "max-autotune", backend="cudagraphs") replays CUDA graphs through
# torch/_inductor/cudagraph_trees.py, whose rules decide how replicas may run:
# * A tree manager (one memory pool, one recording state machine, no lock) exists per *thread*
#   and device: ``get_container`` reads thread-local state, and autograd's device threads get
#   the caller's containers through the TLS stash (so a backward uses the tree of the thread
#   that called ``backward``). A compiled function binds the manager of the thread that first
#   ran it. Replicas share one compiled entry (NOTE [ Compiled replicas ]), so replicas on
#   worker threads would drive one tree from several threads at once (a race), and record
#   their forwards in a tree other than the one their backward replays in.
#   Compiled sets run their replicas *in order on the caller's thread* every step (NOTE
#   [ Compiled replicas run in order ], the inline launch strategy): one tree per device,
#   forwards and backwards in it, kernels still asynchronous (distinct GPUs overlap).
# * Within a step each replica's forward is a node of its own in the tree's path (the earlier
#   replicas' outputs await their backward, so the next call cannot reuse their memory); the
#   order is fixed, so the path is recorded once and replayed.
# * Static inputs: inputs not marked static are copied into the graph's own buffers on every
#   replay, i.e. all parameters of every replica, every step. Persistent replica tensors keep
#   their addresses across steps, so they are marked static (``mark_static``,
#   ``_dynamo_static_input_type = "unguarded"``: a changed address re-records the graph instead
#   of failing a guard): after ``_renew`` or a rebuild the tree re-records once. no_sync's leaves
#   share the persistent storage, hence the addresses.
# Unverified on a GPU so far (tests/test_compile.py::test_reduce_overhead_* skip without one).


# NOTE [ One compile budget per device ]
# Dynamo guards on each tensor input's device, so replicas that share one cache entry on one
# device (NOTE [ Compiled replicas ]) need one entry per device across GPUs: k devices fill k
# entries of the code object's cache per variant (train, eval, no_grad, a partial batch), and
# at ``recompile_limit`` (default 8) dynamo runs new variants eager with a warning. The cache
# is per code object, so a budget per device is a limit scaled by the replicas:
# ``budget_for(n)`` raises ``recompile_limit`` (and ``accumulated_recompile_limit``) to the
# user's own value times ``n``, never lowers them, and starts again from a value the user set
# since. One compiled callable per device would not help: dynamo's cache is on the code object,
# not on the callable. The CPU test gives each replica its own guarded attribute instead.
_budget: dict[str, int] = {}


def budget_for(num_replicas: int) -> None:
    """Scale dynamo's recompile limits to ``num_replicas`` (NOTE [ One compile budget per
    device ]); a no-op before ``torch._dynamo`` is imported (nothing is compiled then)."""
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


# NOTE [ Backward compiled with the forward ]
# AOT autograd compiles a backward lazily, on its first call. Compiled replicas run forward in
# order on the caller's thread (NOTE below), but across GPUs their backwards run on each
# device's autograd thread: lazy compiles of one step would run concurrently, and inductor's
# compile is not thread-safe. ``backward_with_forward()`` sets functorch's
# ``force_non_lazy_backward_lowering`` around the in-order forwards, so every backward a
# replica's forward compiles is compiled right there, in turn, on the caller's thread
# (a forward that never runs backward pays for its compile: the price of no lock in backward).
@contextmanager
def backward_with_forward() -> Iterator[None]:
    cfg = _torch_private.functorch_config()
    if cfg is None or not hasattr(cfg, "force_non_lazy_backward_lowering"):
        yield
        return
    with cfg.patch(force_non_lazy_backward_lowering=True):
        yield


def mark_static(tensors: Any) -> None:
    """Mark persistent replica tensors as static graph inputs (see NOTE above)."""
    for row in tensors:
        for t in row:
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
# ``torch.compile(FastDataParallel(m))`` makes dynamo trace the wrapper's forward: planning,
# scatter, threads and gather are host code it cannot capture (one graph break and warning per
# fastdp op, slower than eager), and the replicas' forwards run on worker threads, where the
# caller's compile context does not reach. So ``forward`` hands itself back to eager at once
# (``torch.compiler.is_compiling()`` is true only while dynamo traces it; the disabled function
# is one clean graph break, no warning) and compiles the module *inside* every replica instead,
# with the context of the innermost ``torch.compile`` on the stack: the user's own options. The
# replica sets are keyed by that context, so the compiled and the plain wrapper can alternate.
# ``FastDataParallel.compile(**options)`` does the same without dynamo ever seeing the wrapper,
# and is the form for ``fullgraph=True``: a wrapper step is never one graph, so
# ``torch.compile(FastDataParallel(m), fullgraph=True)`` fails at the disabled function, whose
# name in dynamo's error says which form to use. A module compiled already keeps its own options.
def _forward_from_compile(fdp: Any, inputs: tuple, kwargs: dict) -> Any:
    ctx = fdp._compile_ctx if fdp._compile_ctx is not None else enclosing_context()
    return fdp._forward(inputs, kwargs, ctx)


_forward_from_compile.__qualname__ = (
    "FastDataParallel.forward [fastdp's host orchestration is not traced; for fullgraph=True "
    "call model.compile(fullgraph=True) on the FastDataParallel, or wrap "
    "torch.compile(module, fullgraph=True)]")
untraced_forward = _torch_private.disable_dynamo(_forward_from_compile)
