"""Distinct replicas (``FASTDP_CPU_DISTINCT=1``: own storage, refreshed and reduced through the
CPU transport, the logic the CUDA transport shares) train as the plain module does on the same
chunks; the two-GPU variants at the end skip without two GPUs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from models import linear_stack
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp.testing import onlyMultiGPU


def _rs(fdp: FastDataParallel) -> Any:
    return next(iter(fdp._replica_sets.values())).for_tests()


# ---- parity of distinct replicas with the plain module on the same chunks ---------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3, dtype=torch.float64)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.emb(x))).double())


def _chunks_reference(ref: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    """The plain module on the chunks in turn; chunks after the first run on copies of the
    buffers taken before the step (BatchNorm's running stats follow chunk 0 only, as
    DataParallel's replica 0)."""
    before = {k: b.clone() for k, b in ref.named_buffers()}
    outs = []
    for i, c in enumerate(x.chunk(n)):
        if i == 0:
            outs.append(ref(c))
        else:
            copies = {k: b.clone() for k, b in before.items()}
            outs.append(torch.func.functional_call(ref, copies, (c,), strict=False))
    return torch.cat(outs)


@pytest.mark.parametrize("cap", [25.0, 1e-4])  # one bucket per dtype / one per tensor
def test_distinct_replicas_train_like_the_plain_module(distinct, backend, cap):
    torch.manual_seed(3)
    model = _Net()
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 4, bucket_cap_mb=cap)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    for step, batch in enumerate([16, 16, 12, 6, 16]):  # 6 rows: 3 replicas (2 rows each)
        x = torch.randn(batch, 6)
        out = fdp(x)
        want = _chunks_reference(ref, x, 4)
        assert_close(out, want, rtol=1e-5, atol=1e-5)
        out.sum().backward()
        want.sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if name.startswith("unused"):
                assert p.grad is None or not p.grad.any()
                continue
            # float32 layers feed the float64 head: float32's tolerance throughout
            assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=f"{name} at step {step}")
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            assert_close(b, c, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if step == 2:  # edit the model between steps: the set is rebuilt
            model.emb.weight = nn.Parameter(model.emb.weight.detach().clone() * 0.5)
            ref.emb.weight = nn.Parameter(ref.emb.weight.detach().clone() * 0.5)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)


def test_distinct_replicas_have_their_own_storage_in_buckets(distinct):
    model = linear_stack(3)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 3)
    fdp(torch.randn(6, 32)).sum().backward()
    rs = _rs(fdp)
    flats = rs.layout.flats[1]
    assert len(flats) == 1
    ptrs = {t.untyped_storage().data_ptr() for t in rs.tensors[1]}
    assert ptrs == {flats[0].untyped_storage().data_ptr()}
    assert all(t.data_ptr() != s.data_ptr() for t, s in zip(rs.tensors[1], rs.sources))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # an optimizer's in-place update reaches the copies
    fdp(torch.randn(6, 32))
    assert torch.equal(rs.tensors[2][0], model[0].weight)
    assert torch.equal(rs.layout.flats[2][0][:32], model[-1].bias)  # reverse order: last first


def test_double_backward_through_distinct_replicas(distinct, backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 2)
    x = torch.randn(6, 4)
    (g,) = torch.autograd.grad(fdp(x).sum(), model[0].weight, create_graph=True)
    (g_ref,) = torch.autograd.grad(ref(x).sum(), ref[0].weight, create_graph=True)
    assert_close(g, g_ref)
    g.pow(2).sum().backward()
    g_ref.pow(2).sum().backward()
    assert_close(model[2].weight.grad, ref[2].weight.grad)


def test_hooks_on_the_originals_see_the_total_once(distinct):
    model = linear_stack(2)
    seen = []
    model[0].weight.register_hook(lambda g: seen.append(g.clone()))
    fdp = FastDataParallel(model, device_ids=["cpu"] * 4)
    fdp(torch.randn(8, 32)).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], model[0].weight.grad)


def test_sparse_gradients_are_reduced(distinct, backend):
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=True)
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 2)
    idx = torch.tensor([[1, 2], [2, 3], [7, 7], [1, 9]])
    fdp(idx).sum().backward()
    ref(idx).sum().backward()
    assert_close(model.weight.grad.to_dense(), ref.weight.grad.to_dense())


def test_no_sync_accumulates_on_distinct_replicas(distinct, backend):
    torch.manual_seed(0)
    model = linear_stack(3)
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 4)
    xs = [torch.randn(8, 32) for _ in range(3)]
    with fdp.no_sync():
        for x in xs[:2]:
            fdp(x).sum().backward()
    assert fdp.comm_stats()["reduces"] == 0
    assert all(p.grad is None for p in model.parameters())
    fdp(xs[2]).sum().backward()
    for x in xs:
        ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)


# ---- two distinct GPUs (skip here) -------------------------------------------------------------


@onlyMultiGPU
def test_two_gpu_refresh_and_reduce_match_the_plain_module():
    torch.manual_seed(0)
    model = linear_stack(4).cuda(0)
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=[0, 1], bucket_cap_mb=0.001)
    x = torch.randn(8, 32, device="cuda:0")
    out = fdp(x)
    want = torch.cat([ref(c) for c in x.chunk(2)])
    assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)
    stats = fdp.comm_stats()
    assert stats["broadcasts"] == stats["reduces"] == stats["buckets"] > 1


@onlyMultiGPU
def test_two_gpu_buckets_reduce_before_backward_ends():
    model = linear_stack(6, width=256).cuda(0)
    fdp = FastDataParallel(model, device_ids=[0, 1], bucket_cap_mb=0.5)
    seen = []
    model[0].register_full_backward_pre_hook(lambda m, g: seen.append(fdp.comm_stats()["reduces"]))
    fdp(torch.randn(8, 256, device="cuda:0")).sum().backward()
    assert seen and min(seen) >= 1
