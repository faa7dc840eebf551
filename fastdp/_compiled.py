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
is a second entry). A partial batch recompiles once for all replicas (dynamo's automatic dynamic
shapes), as the plain compiled module does. A rebuilt replica set (see NOTE [ Replica
invalidation ]) is re-wrapped from the *current* originals, and dynamo's guards reject code
specialised on an attribute that changed, so no stale compiled code runs.

``compile_root`` compiles a replica root with a context given to the wrapper
(``FastDataParallel.compile`` or ``torch.compile(FastDataParallel(m))``): see NOTE [ Compiling
the wrapper ] in ``fastdp/data_parallel.py``.

Nothing here imports ``torch._dynamo`` (2 s): a module can only be compiled once it is imported.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Module
from torch.utils._pytree import tree_leaves


def _eval_frame() -> Any:
    return sys.modules.get("torch._dynamo.eval_frame")


def is_optimized(m: Module) -> bool:
    """Whether ``m`` is ``torch.compile(module)``'s ``OptimizedModule``."""
    ef = _eval_frame()
    return ef is not None and isinstance(m, ef.OptimizedModule)


def is_compiled(m: Module) -> bool:
    """Whether calling ``m`` runs compiled code (either form)."""
    return is_optimized(m) or m.__dict__.get("_compiled_call_impl") is not None


def context_of_function(fn: Any) -> Any:
    """The ``_TorchDynamoContext`` of a function ``torch.compile`` returned, or None."""
    ef = _eval_frame()
    code = getattr(fn, "__code__", None)
    if ef is None or code is None or "self" not in code.co_freevars:
        return None
    ctx = fn.__closure__[code.co_freevars.index("self")].cell_contents
    return ctx if isinstance(ctx, ef._TorchDynamoContext) else None


def context_of(m: Module) -> Any:
    """The dynamo context that compiled ``m`` (``torch.compile(m)`` or ``m.compile()``), or None."""
    if is_optimized(m):
        return m.dynamo_ctx
    return context_of_function(m.__dict__.get("_compiled_call_impl"))


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


def finish_replica(orig: Module, r: Module, gate: FirstCallGate | None = None) -> None:
    """Point ``r``'s compiled entry at ``r`` itself (after its children were set), through
    ``gate`` when given; see NOTE [ Compiled replicas ]."""
    if is_optimized(orig):
        r._initialize()  # forward = ctx(r._orig_mod.__call__), as OptimizedModule.__init__
        r.__dict__["_torchdynamo_orig_callable"] = r._orig_mod.forward
        if gate is not None:
            r.__dict__["forward"] = gate.wrap(r.__dict__["forward"])
        return
    impl = orig.__dict__.get("_compiled_call_impl")
    if impl is None:
        return
    ctx = context_of_function(impl)
    if ctx is None:  # set by hand to something else: cannot be re-aimed, so run the replica eager
        _warn_once(f"fastdp: {type(orig).__name__}._compiled_call_impl is not a torch.compile "
                   "function; its replicas run eager. Use torch.compile(module) instead.")
    _set_compiled_call(r, None if ctx is None else ctx(r._call_impl), gate)


def compile_root(r: Module, ctx: Any, gate: FirstCallGate | None = None) -> Module:
    """Replica root ``r`` compiled with the wrapper's context, as ``torch.compile(r)`` would
    (``OptimizedModule``: ``r.compile()``'s form compiles nothing for ``torch.nn``'s own classes,
    whose frames dynamo skips); ``r`` itself if compiled already (the module's options win)."""
    if ctx is None or is_compiled(r):
        return r
    om = ctx(r)
    if gate is not None:
        om.__dict__["forward"] = gate.wrap(om.__dict__["forward"])
    return om


def _set_compiled_call(r: Module, fn: Callable | None, gate: FirstCallGate | None) -> None:
    r.__dict__["_compiled_call_impl"] = fn if fn is None or gate is None else gate.wrap(fn)


class FirstCallGate:
    """Serialises the replicas of one compiled module on inputs they have not seen yet.

    Dynamo looks its cache up before taking its compile lock, so replicas that miss together on
    their worker threads compile the same code once each. Through the gate the first call with
    a new input key (grad mode; per leaf shape, dtype, device, requires_grad; plain values) runs
    alone: the others then hit the entry it made, and a set compiles once in all, as the plain
    module on the chunks in turn would. Keys seen (or more than ``limit`` of them: dynamic
    shapes) go straight through. Never used where replicas meet inside a forward (SyncBatchNorm,
    replication callbacks): holding the gate there would deadlock.
    """

    limit = 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set = set()

    def wrap(self, fn: Callable) -> Callable:
        def gated(*args: Any, **kwargs: Any) -> Any:
            if len(self._seen) >= self.limit:
                return fn(*args, **kwargs)
            key = _input_key(args, kwargs)
            if key in self._seen:
                return fn(*args, **kwargs)
            with self._lock:
                out = fn(*args, **kwargs)
                self._seen.add(key)
            return out

        gated.__wrapped__ = fn
        return gated


_PLAIN = (int, float, bool, str, type(None))


def _input_key(args: tuple, kwargs: dict) -> tuple:
    return (torch.is_grad_enabled(), tuple(
        (x.shape, x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor)
        else x if isinstance(x, _PLAIN) else type(x) for x in tree_leaves((args, kwargs))))


def enclosing_context() -> Any:
    """The dynamo context of the innermost ``torch.compile``'d call on this thread's stack, or
    None: what compiled a caller that dynamo handed back to eager at a disabled frame."""
    ef = _eval_frame()
    if ef is None:
        return None
    f, name = sys._getframe(1), ef.__file__
    while f is not None:
        code = f.f_code
        if code.co_name == "compile_wrapper" and code.co_filename == name:
            ctx = f.f_locals.get("self")
            return ctx if isinstance(ctx, ef._TorchDynamoContext) else None
        f = f.f_back
    return None


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
