"""Gradients through the parameters' gradients (``create_graph=True``): the bucket reduce must be
recorded for every replica, so gradient penalties and Hessian-vector products equal the plain
module's on the same chunks, for any number of replicas, dtype, storage mode and backend, on CPU
replicas and on replicas sharing cuda:0 (skipped without a GPU)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp.testing import device_of, replica_ids, withCUDA

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
TOL = {torch.float32: {}, torch.float64: {}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _model(dtype: torch.dtype, kind: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device_of(kind), dtype)


def _data(dtype: torch.dtype, seed: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    return x.to(device_of(kind), dtype), y.to(device_of(kind), dtype)


def _chunked(module: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    """The plain module on ``torch.chunk``'s chunks in turn: DataParallel's arithmetic."""
    return torch.cat([module(c) for c in x.chunk(n)])


def _penalty(module: nn.Module, out: torch.Tensor, y: torch.Tensor):
    """A gradient-norm penalty's backward through ``create_graph``'s gradients of ``module``:
    the gradients and the parameters' ``.grad`` after it."""
    params = list(module.parameters())
    gs = torch.autograd.grad(F.mse_loss(out, y), params, create_graph=True)
    sum(g.float().pow(2).sum() for g in gs).backward()
    return [g.detach() for g in gs], [p.grad.clone() for p in params]


def _hvp(module: nn.Module, out: torch.Tensor, y: torch.Tensor, v: list[torch.Tensor]):
    """The Hessian of the loss over ``module``'s parameters times ``v``."""
    params = list(module.parameters())
    gs = torch.autograd.grad(F.mse_loss(out, y), params, create_graph=True)
    return torch.autograd.grad(gs, params, grad_outputs=v)


@withCUDA
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_gradient_penalty_equals_the_chunked_module(n, dtype, kind, storage, backend):
    model = _model(dtype, kind)
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, replica_ids(kind, n))
    for step in range(2):  # the second step on persistent replicas and nodes
        x, y = _data(dtype, step, kind)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        gs, grads = _penalty(model, fdp(x), y)
        gs_ref, grads_ref = _penalty(ref, _chunked(ref, x, n), y)
        assert_close(gs, gs_ref, **TOL[dtype])
        assert_close(grads, grads_ref, **TOL[dtype])


@withCUDA
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_hessian_vector_product_equals_the_chunked_module(n, dtype, kind, storage, backend):
    model = _model(dtype, kind)
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, replica_ids(kind, n))
    gen = torch.Generator().manual_seed(7)
    v = [torch.randn(p.shape, generator=gen).to(p) for p in model.parameters()]
    for step in range(2):
        x, y = _data(dtype, step, kind)
        hv = _hvp(model, fdp(x), y, v)
        assert_close(hv, _hvp(ref, _chunked(ref, x, n), y, v), **TOL[dtype])
