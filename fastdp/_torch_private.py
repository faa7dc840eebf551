"""Every private torch API fastdp reaches, in one place.

Each is used where torch offers no public way; each has a fallback that keeps results right (only
slower or less informative) when a torch release drops it, and
tests/test_contract_torch_private.py fails loudly when one is gone or behaves differently, so a
change is seen in CI, not by a user.
Dynamo's modules are read from ``sys.modules`` (never imported here: 2 s): a module can only be
compiled once they are imported.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch._utils import ExceptionWrapper  # torch.nn.parallel's own replica error wrapper

__all__ = [
    "ExceptionWrapper",
    "record_function",
    "log_api_usage_once",
    "set_sequence_nr",
    "current_graph_task_id",
    "queue_engine_callback",
    "dynamo_module",
    "functorch_config",
    "dynamo_context_of",
    "enclosing_dynamo_context",
    "disable_dynamo",
    "untraced",
    "in_compiled_autograd",
]

MAX_SEQUENCE_NR = 2**64 - 1

# The profiler's label of a step, as DataParallel's record_function; the C++ context manager
# inductor uses costs ~0.5 us where record_function costs ~11 (it builds a Python object and
# calls a dispatcher op even when no profiler runs).
record_function = getattr(
    getattr(torch._C, "_profiler", None),
    "_RecordFunctionFast",
    torch.autograd.profiler.record_function,
)


def log_api_usage_once(name: str) -> None:
    """torch's usage logging, as nn.DataParallel's constructor does."""
    log = getattr(torch._C, "_log_api_usage_once", None)
    if log is not None:
        log(name)


def set_sequence_nr(node: Any, nr: int = MAX_SEQUENCE_NR) -> bool:
    """Give an autograd node the earliest turn among ready nodes (the engine runs the highest
    sequence number first); False when this torch cannot (the node then runs in its turn)."""
    if not hasattr(node, "_set_sequence_nr"):
        return False
    node._set_sequence_nr(nr)
    return True


def current_graph_task_id() -> int:
    """The running backward's id (-1 outside one; None where this torch cannot say: then every
    bucket node of a set is taken for one backward until the next refresh)."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return None if fn is None else fn()


def tree_leaves(obj: Any) -> list[Any]:
    """``obj``'s leaves as torch's pytree flattens it (the containers it knows, ``ModelOutput``
    among them once transformers registered it; anything else is a leaf)."""
    return torch.utils._pytree.tree_leaves(obj)


def queue_engine_callback(fn: Any) -> None:
    """Run ``fn`` when the running backward finishes (DDP's reducer does the same)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def dynamo_module(name: str) -> Any:
    """``torch._dynamo.<name>`` if dynamo is imported, else None."""
    return sys.modules.get(f"torch._dynamo.{name}")


def functorch_config() -> Any:
    return sys.modules.get("torch._functorch.config")


def dynamo_context_of(fn: Any) -> Any:
    """The ``_TorchDynamoContext`` a function ``torch.compile`` returned closes over, or None."""
    ef = dynamo_module("eval_frame")
    code = getattr(fn, "__code__", None)
    if ef is None or code is None or "self" not in code.co_freevars:
        return None
    ctx = fn.__closure__[code.co_freevars.index("self")].cell_contents
    return ctx if isinstance(ctx, ef._TorchDynamoContext) else None


def enclosing_dynamo_context() -> Any:
    """The dynamo context of the innermost ``torch.compile``'d call on this thread's stack, or
    None: what compiled a caller that dynamo handed back to eager at a disabled frame (the frame
    of eval_frame's ``compile_wrapper`` holds it as ``self``)."""
    ef = dynamo_module("eval_frame")
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


def in_compiled_autograd() -> bool:
    """Whether compiled autograd runs the current backward (its graph takes every gradient a
    Python node's backward returns for a tensor, so such a node must return tensors, not None)."""
    ca = dynamo_module("compiled_autograd")
    return ca is not None and bool(ca.in_compiled_autograd_region)


def untraced(fn: Any) -> Any:
    """``fn`` run eagerly even where dynamo traces its caller (compiled autograd traces a Python
    Function's backward): a graph break there. Costs one dict lookup while dynamo is not
    imported, and never imports it."""
    disabled = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return (disabled if "torch._dynamo" in sys.modules else fn)(*args, **kwargs)

    return call


def disable_dynamo(fn: Any) -> Any:
    """``fn`` as a frame dynamo never traces (one clean graph break), without importing dynamo."""
    return torch._disable_dynamo(fn)
