"""Grad mode, inference mode and autocast (with its dtype) reach every replica."""

import threading

import pytest
import torch
from torch import nn

from fastdp import FastDataParallel
from fastdp.testing import device_of, replica_ids, withCUDA

pytestmark = pytest.mark.usefixtures("launch")  # NOTE [ Tests under each launch strategy ]


class StateProbe(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)
        self.states = []
        self.lock = threading.Lock()

    def forward(self, x):
        with self.lock:
            self.states.append(
                {
                    "grad": torch.is_grad_enabled(),
                    "inference": torch.is_inference_mode_enabled(),
                    "autocast": torch.is_autocast_enabled(self.kind),
                    "dtype": torch.get_autocast_dtype(self.kind),
                    "thread": threading.get_ident(),
                }
            )
        return self.lin(x)


def _run(kind, ctx, fdp_box=None):
    m = StateProbe(kind).to(device_of(kind))
    fdp = FastDataParallel(m, device_ids=replica_ids(kind, 3))
    with ctx:
        out = fdp(torch.randn(6, 4, device=device_of(kind)))
    assert len(m.states) == 3
    if fdp_box is not None:
        fdp_box.append(fdp.last_launch)
    return m.states, out


@withCUDA
def test_no_grad_reaches_replicas(backend, kind):
    ran = []
    states, out = _run(kind, torch.no_grad(), ran)
    assert not any(s["grad"] for s in states) and not out.requires_grad
    threads = {s["thread"] for s in states}
    if ran == ["threads"]:
        assert len(threads) > 1  # replicas really ran on worker threads
    else:
        assert threads == {threading.get_ident()}  # inline: in turn on the caller's thread


@withCUDA
def test_inference_mode_reaches_replicas(backend, kind):
    states, out = _run(kind, torch.inference_mode())
    assert all(s["inference"] for s in states) and out.is_inference()


@withCUDA
def test_grad_enabled_by_default(backend, kind):
    states, out = _run(kind, torch.enable_grad())
    assert all(s["grad"] for s in states) and out.requires_grad


@withCUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_dtype_reaches_replicas(backend, kind, dtype):
    # CPU autocast defaults to bf16, so fp16 on CPU is what shows the dtype itself is carried
    states, out = _run(kind, torch.autocast(kind, dtype=dtype))
    assert all(s["autocast"] and s["dtype"] == dtype for s in states)
    assert out.dtype == dtype


@withCUDA
def test_autocast_off_stays_off(backend, kind):
    states, out = _run(kind, torch.autocast(kind, enabled=False))
    assert not any(s["autocast"] for s in states) and out.dtype == torch.float32
