"""Test helpers shared by the suite: device lists, CUDA decorators, backend parametrisation."""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from fastdp import _backend
from fastdp._backend import DTYPES  # noqa: F401  (the tests import it from here)

HAS_CUDA = torch.cuda.is_available()
NUM_GPUS = torch.cuda.device_count() if HAS_CUDA else 0

# The test device (tests/accel) under FASTDP_TEST_ACCEL=1: tests/conftest.py enables it for the
# process (three devices, asynchronous) and its kind joins DEVICE_KINDS, replicas on distinct
# devices. Run with ``-k fdpaccel`` (the CPU kinds' tests assume no accelerator).
ACCEL = "fdpaccel" if os.environ.get("FASTDP_TEST_ACCEL") == "1" else None
ACCEL_DEVICES = 3
# Where multi-replica tests run: CPU virtual replicas always, replicas sharing cuda:0 when present.
DEVICE_KINDS = ["cpu"] + (["cuda"] if HAS_CUDA else []) + ([ACCEL] if ACCEL else [])
CPU = torch.device("cpu")
CPU2 = ["cpu", "cpu"]  # device_ids of two CPU replicas
BACKENDS = ["ext", "torch"]
# The dtypes the property-based tests draw from (tests/test_scatter_properties.py).
PROPERTY_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]
# A CUDA GPU and an extension built with CUDA: what the extension's CUDA kernels need.
EXT_CUDA = HAS_CUDA and _backend.build_info().get("built_with_cuda") == "1"

onlyCUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
onlyMultiGPU = pytest.mark.skipif(NUM_GPUS < 2, reason="needs two distinct CUDA GPUs")
withCUDA = pytest.mark.parametrize("kind", DEVICE_KINDS)
onlyCUDAExt = pytest.mark.skipif(not EXT_CUDA, reason="needs a CUDA device and a CUDA build")
onlyMultiGPUExt = pytest.mark.skipif(not EXT_CUDA or NUM_GPUS < 2, reason="needs 2 distinct GPUs")


def replica_ids(kind: str, n: int) -> list[Any]:
    """``n`` replicas of one kind: ``['cpu'] * n``, ``[0] * n`` (replicas sharing cuda:0), or on
    the test device its distinct devices in turn (``[0, 1, 2, 0, ...]``)."""
    if kind == "cpu":
        return ["cpu"] * n
    return [0] * n if kind == "cuda" else [i % ACCEL_DEVICES for i in range(n)]


def home(devices: Sequence[Any]) -> torch.device:
    """The device of ``devices[0]`` (an id list): where the module and the inputs live."""
    d = devices[0]
    return torch.device(ACCEL or "cuda", d) if isinstance(d, int) else torch.device(d)


def device_of(kind: str) -> torch.device:
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, 0)


def worker_threads() -> list[threading.Thread]:
    """The launch's worker threads alive now (``fastdp-worker*``)."""
    return [t for t in threading.enumerate() if t.name.startswith("fastdp-worker")]


def set_backend(name: str) -> bool:
    """Select ``ext`` or ``torch``; returns the previous setting. Skips when ext is not built."""
    if name == "ext" and not _backend.loaded():
        pytest.skip(f"fastdp._C is not loaded: {_backend.load_error()}")
    return _backend.set_enabled(name == "ext")


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()}


def output_and_grads(fdp: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Zero the module's grads, step on ``x`` (backward of the sum); the output and ``.grad``."""
    fdp.module.zero_grad(set_to_none=True)
    out = fdp(x)
    out.sum().backward()
    return out.detach(), {n: p.grad for n, p in fdp.module.named_parameters()}


def run_step(
    module: torch.nn.Module, inputs: Sequence[Any], loss: Callable[[Any], Any] | None = None
) -> tuple[Any, list[torch.Tensor | None], dict[str, torch.Tensor | None]]:
    """Forward, backward of ``loss(out)`` (default: sum of the output); outputs, grads."""
    module.zero_grad(set_to_none=True)
    out = module(*inputs)
    value = loss(out) if loss is not None else out.float().sum()
    value.backward()
    in_grads = [
        x.grad.clone() if isinstance(x, torch.Tensor) and x.grad is not None else None
        for x in inputs
    ]
    return out, in_grads, grads_of(module.module if hasattr(module, "module") else module)


def clone_inputs(inputs: Sequence[Any], device: torch.device | None = None) -> list[Any]:
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            if device is not None:
                y = y.to(device)
            out.append(y.requires_grad_(x.requires_grad))
        else:
            out.append(copy.deepcopy(x))
    return out
