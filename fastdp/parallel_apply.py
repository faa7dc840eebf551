"""``parallel_apply``: DataParallel's seam that runs the replicas, each under the caller's
thread-local state, on threads or in turn inline.

The launch strategies and the rule that picks one live in ``fastdp/_launch.py``; the replica
runners (state, errors, Ctrl-C) in ``fastdp/_runners.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import Module
from torch.nn.parallel.parallel_apply import get_a_var

from fastdp import _launch
from fastdp._devices import accelerator_type, as_device
from fastdp.sync_batchnorm import replicas_meet

__all__ = ["parallel_apply"]


def _infer_device(inp: Any) -> torch.device:
    """A replica's device when none is given: its first tensor input's, as torch's get_a_var."""
    t = get_a_var(inp)
    if t is not None:
        return t.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    acc = accelerator_type()
    if acc is not None:
        return torch.device(acc, torch.accelerator.current_device_index())
    return torch.device("cpu")


def parallel_apply(
    modules: Sequence[Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[Any] | None = None,
    *,
    launch: str | None = None,
    method: str | None = None,
) -> list[Any]:
    """Apply ``modules[i]`` to ``inputs[i]`` (and ``kwargs_tup[i]``) on ``devices[i]`` in parallel.

    Without ``devices``, each replica runs on the device of its first tensor input (the current
    device of the accelerator, else the CPU, when it has none), as
    ``torch.nn.parallel.parallel_apply`` infers.
    ``launch``: ``"threads"`` (one thread per replica, as torch's) or ``"inline"`` (in turn on this
    thread); default ``FASTDP_LAUNCH``, else threads (``"auto"`` needs the state a
    ``FastDataParallel`` keeps between steps, so here it means threads). Replicas that must run at
    once (SyncBatchNorm under ``prepare_replicas``, replication callbacks) always run on threads.
    ``method``: call each module's method of that name instead (``getattr(modules[i], method)``).
    """
    devs = [_infer_device(x) for x in inputs] if devices is None else map(as_device, devices)
    return _launch.launch(
        modules,
        inputs,
        kwargs_tup,
        list(devs),
        name=launch,
        together=replicas_meet(modules),
        method=method,
    )
