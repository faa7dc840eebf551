"""The replication engine (fastdp/_buckets.py) and the one reducer (fastdp/_reducer.py).

Distinct-device behaviour runs on CPU replicas with ``FASTDP_CPU_DISTINCT=1`` (own storage,
refreshed and reduced through the CPU transport): the logic the CUDA transport shares. The
two-GPU variants at the end skip without two GPUs.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import fastdp._reducer
from fastdp import FastDataParallel, _backend, _buckets, _transports, comm
from fastdp.testing import DTYPES, onlyMultiGPU


@pytest.fixture
def distinct(monkeypatch):
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")


def _mlp(layers: int, width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _rs(fdp: FastDataParallel) -> Any:
    return next(iter(fdp._replica_sets.values())).for_tests()


# ---- bucket assignment -----------------------------------------------------------------------


def test_buckets_fill_in_reverse_order_per_dtype_with_a_small_first_bucket():
    mb = 2**20
    ts = [torch.empty(mb // 4) for _ in range(6)] + [torch.empty(8, dtype=torch.float64)]
    buckets = _buckets.assign_buckets(ts, 2.5 * mb)
    assert buckets[0] == [5]  # 1 MiB first bucket: the last float tensor alone
    assert buckets[1] == [4, 3, 2]  # then up to the cap (closed once it reaches 2.5 MiB)
    assert sorted(buckets[2:]) == [[1, 0], [6]]  # float64 never shares a flat with float32
    assert sorted(i for b in buckets for i in b) == list(range(7))


def test_sparse_tensors_get_buckets_of_their_own():
    ts = [torch.ones(3), torch.eye(3).to_sparse(), torch.ones(2)]
    buckets = _buckets.assign_buckets(ts, 2**20)
    assert [1] in buckets and sorted(i for b in buckets for i in b) == [0, 1, 2]


@pytest.mark.parametrize("layers,most", [(10, 1), (100, 1), (1000, 3)])
def test_calls_per_step_follow_bytes_not_tensors(distinct, layers, most):
    model = _mlp(layers)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 4)
    x = torch.randn(8, 32)
    for _ in range(2):
        fdp(x).sum().backward()
        stats = fdp.comm_stats()
        assert 1 <= stats["buckets"] <= most
        assert stats["broadcasts"] == stats["buckets"] == stats["reduces"]
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert stats["bytes_broadcast"] == stats["bytes_reduced"] == nbytes


def test_comm_stats_are_zeroed_by_each_forward(distinct):
    fdp = FastDataParallel(_mlp(3), device_ids=["cpu"] * 2)
    fdp(torch.randn(4, 32)).sum().backward()
    assert fdp.comm_stats()["reduces"] == 1
    fdp(torch.randn(4, 32))
    assert fdp.comm_stats()["reduces"] == 0 and fdp.comm_stats()["broadcasts"] == 1


def test_bucket_cap_mb_must_be_positive():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        FastDataParallel(_mlp(1), device_ids=["cpu"] * 2, bucket_cap_mb=0)


# ---- early reduction -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["distinct", "alias"])
@pytest.mark.parametrize("launch", ["threads", "inline"])
def test_buckets_reduce_while_earlier_layers_are_still_in_backward(monkeypatch, mode, launch):
    """CPU replicas share one autograd ready queue, which runs the highest sequence number
    first. Forwards on threads interleave, so every replica's layer 0 runs after the last
    layers' bucket reduced; forwards in turn give replica 0 the lowest numbers, so the other
    replicas' whole backwards run first, and the buckets reduce during replica 0's (on GPUs each
    device has its own queue and the order does not matter)."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1" if mode == "distinct" else "0")
    model = _mlp(6, width=256)  # 257 KiB per layer: a 1 MiB cap gives >= 3 buckets
    fdp = FastDataParallel(model, device_ids=["cpu"] * 4, bucket_cap_mb=0.5, launch=launch)
    seen = []
    model[0].register_full_backward_pre_hook(lambda m, g: seen.append(fdp.comm_stats()["reduces"]))
    fdp(torch.randn(8, 256, requires_grad=True)).sum().backward()
    stats = fdp.comm_stats()
    assert stats["buckets"] >= 3 and stats["reduces"] == stats["buckets"]
    assert len(seen) == 4  # bucket(s) of the last layers reduced before replica 0's layer 0 ran
    assert (min(seen) if launch == "threads" else seen[-1]) >= 1
    assert seen[-1] < stats["buckets"]  # ...and layer 0's own bucket after it


def test_every_reduction_goes_through_reduce_add(monkeypatch, distinct):
    """The one reducer: ``reduce_add``, or (extension loaded) the bucket node's native sum of
    same-device rows, its C++ twin (NOTE [ Early reduction ]; parity: the next test)."""
    calls = []
    real = fastdp._reducer.reduce_add
    real_ran = fastdp._reducer.BucketLink.ran

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    def native(self, local, fresh):
        if local:
            calls.append("native")
        return real_ran(self, local, fresh)

    monkeypatch.setattr(fastdp._reducer, "reduce_add", counting)  # nodes and no_sync's fold
    monkeypatch.setattr(fastdp._reducer.BucketLink, "ran", native)
    monkeypatch.setattr(comm, "reduce_add", counting)
    x = torch.randn(8, 32)
    for persistent in (True, False):  # bucket nodes; persistent=False's Broadcast backward
        fdp = FastDataParallel(_mlp(2), device_ids=["cpu"] * 2, persistent=persistent)
        calls.clear()
        fdp(x).sum().backward()
        assert calls, persistent
    fdp = FastDataParallel(_mlp(2), device_ids=["cpu"] * 2)  # no_sync's fold
    with fdp.no_sync():
        fdp(x).sum().backward()
    calls.clear()
    fdp(x)
    assert calls


@pytest.mark.skipif(not _backend.loaded(), reason="fastdp._C is not built")
@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_native_bucket_node_sums_as_reduce_add_does(n):
    """The extension's bucket node against the Python one: bit-identical gradients, in row
    order, frozen sources left alone, unused outputs as zeros."""
    torch.manual_seed(0)
    src = [
        torch.randn(3, 4, requires_grad=True),
        torch.randn(5, requires_grad=False),
        torch.randn(2, 2, dtype=torch.float64, requires_grad=True),
    ]
    grads = {}
    for native in (True, False):
        for s in src:
            s.grad = None
        rows = [[s.detach().clone() for s in src] for _ in range(n)]
        r = fastdp._reducer
        link = r.BucketLink(
            0, src, torch.device("cpu"), _transports.new_stats(), r.Pending(), r.BucketGroup([src])
        )
        with torch.enable_grad():
            fastdp._reducer.link_bucket(link, rows, src, native=native)
        outs = [rows[j][k] * (j + 1.5) for j in range(n) for k in (0, 2)]  # row 0's k=1 unused
        torch.autograd.backward([o.sum() for o in outs])
        grads[native] = [None if s.grad is None else s.grad.clone() for s in src]
        assert link.stats["reduces"] == (n > 1) and not link.pending.value
    assert grads[True][1] is None and grads[False][1] is None
    for a, b in zip(grads[True], grads[False]):
        if a is not None:
            assert torch.equal(a, b)


class _SharedGrads(nn.Module):
    """Gradients the bucket node must not sum into: one tensor sent to two parameters (``a + b``),
    an expanded one (``p.sum()``), next to ordinary fresh ones (``lin``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.a, self.b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
        self.p = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.lin(x) @ (self.a + self.b) + self.p.sum()


def _two_steps_per_node(make, x: torch.Tensor, n: int, accumulate: bool) -> dict:
    """The parameters' gradients after two steps on ``n`` CPU replicas (the second reuses the
    nodes), keyed by ``native``: the C++ bucket node (True) or the Python one (False)."""
    grads = {}
    for native in (True, False):
        torch.manual_seed(1)
        m = make()
        with _backend.use_extension(native):
            fdp = FastDataParallel(m, ["cpu"] * n)
            for _ in range(2):
                if not accumulate:
                    m.zero_grad(set_to_none=True)
                fdp(x).square().sum().backward()
        grads[native] = {k: v.grad.clone() for k, v in m.named_parameters()}
    return grads


@pytest.mark.skipif(not _backend.loaded(), reason="fastdp._C is not built")
@pytest.mark.parametrize("n", [2, 4])
def test_the_native_node_sums_in_place_only_into_gradients_it_owns(n):
    """The C++ node sums into row 0's gradients where it is their sole owner (AccumulateGrad's
    rule); shared and expanded gradients take the out-of-place sum. Bit-identical to the Python
    node either way, and to the plain module on the same chunks."""
    torch.manual_seed(0)
    x = torch.randn(4 * n, 4)
    grads = _two_steps_per_node(_SharedGrads, x, n, accumulate=False)
    torch.manual_seed(1)
    ref = _SharedGrads()
    for c in x.chunk(n):
        ref(c).square().sum().backward()
    for k, g in grads[True].items():
        assert torch.equal(g, grads[False][k]), k
        assert_close(g, dict(ref.named_parameters())[k].grad, msg=k)


class _MixedGrads(nn.Module):
    """Gradients of every CPU sum path: float and double (the plain loop), half and bfloat16
    (add_), and one parameter whose gradient is contiguous on some replicas and permuted on
    others (strides differ: add_). Column 0 of the input says which."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 3, 2, 2))
        self.d = nn.Parameter(torch.randn(5, dtype=torch.float64))
        self.h = nn.Parameter(torch.randn(7).half())
        self.bf = nn.Parameter(torch.randn(7).bfloat16())

    def forward(self, x):
        w = self.w if x[0, 0] > 0 else self.w.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        out = (x[:, 1:] @ w.reshape(2, 12)[:, :4].T).sum(1)
        out = out + (x[:, 1:2].double() * self.d).sum(1).float()
        return (
            out
            + (x[:, 2:3].half() * self.h).sum(1).float()
            + (x[:, 3:4].bfloat16() * self.bf).sum(1).float()
        )


@pytest.mark.skipif(not _backend.loaded(), reason="fastdp._C is not built")
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_native_nodes_cpu_sum_matches_the_python_node_for_every_dtype_and_layout(n):
    """csrc/bucket_reduce.cpp's CPU sum (a plain loop where dtype and strides allow, add_
    elsewhere) is bit-identical to the Python node's _foreach_add, over two steps."""
    x = torch.randn(3 * n, 5)
    x[:, 0] = torch.arange(3 * n).div(3, rounding_mode="floor").remainder(2) * 2 - 1
    grads = _two_steps_per_node(_MixedGrads, x, n, accumulate=True)
    for k, g in grads[True].items():
        assert torch.equal(g, grads[False][k]), k


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
    model = _mlp(3)
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
    model = _mlp(2)
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
    model = _mlp(3)
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


# ---- fastdp.comm on the engine ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_coalesced_is_bit_exact_in_small_buckets(dtype):
    ts = [torch.testing.make_tensor(s, dtype=dtype, device="cpu") for s in [(3, 4), (5,), (2, 2)]]
    ts.append(torch.testing.make_tensor((4, 3), dtype=dtype, device="cpu").t())  # strided
    out = comm.broadcast_coalesced(ts, ["cpu"] * 3, buffer_size=16)
    assert out[0] == ts
    for row in out[1:]:
        for a, b in zip(row, ts):
            assert a.data_ptr() != b.data_ptr() and a.shape == b.shape
            assert torch.equal(a, b)
            a.add_(1) if dtype != torch.bool else a.logical_not_()
    assert all(not torch.equal(a, b) for a, b in zip(out[1], ts))  # own storage


def test_broadcast_coalesced_needs_a_device():
    with pytest.raises(RuntimeError, match="at least one device"):
        comm.broadcast_coalesced([torch.ones(2)], [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
def test_reduce_add_coalesced_sums_in_list_order(dtype):
    rows = [
        [torch.testing.make_tensor(s, dtype=dtype, device="cpu") for s in [(3, 3), (7,)]]
        for _ in range(3)
    ]
    got = comm.reduce_add_coalesced(rows, "cpu", buffer_size=8)
    for k in range(2):
        assert torch.equal(got[k], rows[0][k] + rows[1][k] + rows[2][k])
        assert all(got[k].data_ptr() != r[k].data_ptr() for r in rows)


def test_reduce_add_coalesced_handles_sparse_tensors():
    a, b = torch.eye(3).to_sparse(), (2 * torch.eye(3)).to_sparse()
    (got,) = comm.reduce_add_coalesced([[a], [b]])
    assert torch.equal(got.to_dense(), 3 * torch.eye(3))


# ---- two distinct GPUs (skip here) -------------------------------------------------------------


@onlyMultiGPU
def test_two_gpu_refresh_and_reduce_match_the_plain_module():
    torch.manual_seed(0)
    model = _mlp(4).cuda(0)
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
    model = _mlp(6, width=256).cuda(0)
    fdp = FastDataParallel(model, device_ids=[0, 1], bucket_cap_mb=0.5)
    seen = []
    model[0].register_full_backward_pre_hook(lambda m, g: seen.append(fdp.comm_stats()["reduces"]))
    fdp(torch.randn(8, 256, device="cuda:0")).sum().backward()
    assert seen and min(seen) >= 1


class _UnusedFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(256, 256)  # registered first: the last bucket, alone
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 256)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("mode", ["distinct", "alias"])
def test_a_bucket_of_unused_parameters_gets_zeros_as_in_dataparallel(monkeypatch, backend, mode):
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1" if mode == "distinct" else "0")
    model = _UnusedFirst()
    fdp = FastDataParallel(model, device_ids=["cpu"] * 2, bucket_cap_mb=0.2)
    fdp(torch.randn(4, 256)).sum().backward()
    # one reduce node per bucket; the unused bucket's node never runs (NOTE [ Unreached buckets ])
    assert fdp.comm_stats()["buckets"] == 3 and fdp.comm_stats()["reduces"] == 2
    assert torch.equal(model.unused.weight.grad, torch.zeros(256, 256))
    assert model.a.weight.grad is not None
    model.zero_grad()
    torch.autograd.grad(fdp(torch.randn(4, 256)).sum(), [model.a.weight])
    assert model.unused.weight.grad is None and model.a.weight.grad is None  # nothing accumulated


@pytest.mark.parametrize("mode", ["distinct", "alias"])
def test_buckets_reduce_while_backward_runs(monkeypatch, backend, mode):
    """Each bucket's node runs once its gradients exist (NOTE [ Early reduction ]), with or
    without the extension: the last layers' bucket is summed before the first layer's backward
    ends in the last replica the engine visits. One node for all would run only at the end,
    keeping every replica's gradients alive until then (the heap trimming of
    bench/results/cpu-2core-2026-11-26-final)."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1" if mode == "distinct" else "0")
    model = _mlp(6, width=256)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 2, bucket_cap_mb=0.5)
    seen = []
    model[0].register_full_backward_pre_hook(lambda m, g: seen.append(fdp.comm_stats()["reduces"]))
    fdp(torch.randn(8, 256)).sum().backward()
    assert fdp.comm_stats()["buckets"] > 2 and len(seen) == 2
    assert seen[-1] >= 1 and fdp.comm_stats()["reduces"] == fdp.comm_stats()["buckets"]


@pytest.mark.parametrize("mode", ["distinct", "alias"])
def test_autograd_grad_of_a_whole_unused_bucket(monkeypatch, backend, mode):
    """Without the extension the unreached-bucket anchor gives DataParallel's zeros to
    ``autograd.grad`` too; the extension's engine callback leaves it None (README, *Persistent
    replicas*: the difference kept). Nothing accumulates into ``.grad`` either way."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1" if mode == "distinct" else "0")
    x = torch.randn(4, 256)
    got, net = [], _UnusedFirst()
    for persistent in (True, False):
        model = copy.deepcopy(net)
        fdp = FastDataParallel(model, ["cpu"] * 2, bucket_cap_mb=0.2, persistent=persistent)
        params = [model.unused.weight, model.a.weight]
        got.append(torch.autograd.grad(fdp(x).sum(), params, allow_unused=True))
        assert all(p.grad is None for p in model.parameters())
    (unused, a), (fresh_unused, fresh_a) = got
    assert_close(a, fresh_a)
    assert torch.equal(fresh_unused, torch.zeros(256, 256))
    if backend == "ext":
        assert unused is None
    else:
        assert torch.equal(unused, fresh_unused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["distinct", "alias"])
def test_cuda_unused_bucket_matches_the_plain_module(monkeypatch, backend, mode):
    """Unreached buckets on GPU replicas: without the extension the anchor's output and the
    gradient the bucket nodes give it stay on the CPU while the sources are on the GPU."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1" if mode == "distinct" else "0")
    net = _UnusedFirst().cuda()
    model, ref = copy.deepcopy(net), copy.deepcopy(net)
    fdp = FastDataParallel(model, device_ids=[0, 0], bucket_cap_mb=0.2)
    x = torch.randn(4, 256, device="cuda")
    fdp(x).sum().backward()
    sum(ref(c).sum() for c in x.chunk(2)).backward()
    assert torch.equal(model.unused.weight.grad, torch.zeros_like(model.unused.weight))
    for p, q in zip(model.a.parameters(), ref.a.parameters()):
        assert_close(p.grad, q.grad)
    (g,) = torch.autograd.grad(fdp(x).sum(), [model.b.weight])
    assert_close(g, ref.b.weight.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copy_rows_on_one_gpu_match_the_plain_module(monkeypatch):
    """The CUDA transport's copy fallback (flats on the source GPU: NCCL needs distinct ones)."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")
    torch.manual_seed(0)
    model = _mlp(4).cuda()
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=[0, 0, 0], bucket_cap_mb=0.001)
    x = torch.randn(9, 32, device="cuda")
    out = fdp(x)
    want = torch.cat([ref(c) for c in x.chunk(3)])
    assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)
    assert fdp.comm_stats()["broadcasts"] == fdp.comm_stats()["buckets"] > 1


def test_the_cuda_transport_is_torchs_one_call_per_bucket(monkeypatch):
    """GPU review N9: the project's own NCCL communicator cache is gone (a clique per device
    tuple, never freed, a failed init retried on every call); the CUDA transport is
    torch's broadcast(out=)/reduce_add, whose communicators are nn.DataParallel's. It reaches
    them through torch.nn.parallel.comm: ``torch.cuda.comm`` is an attribute only once imported
    (an AttributeError on the first GPU step, found writing this test)."""
    import pathlib

    calls = []
    monkeypatch.setattr(
        _transports.torch_comm, "broadcast", lambda src, out: calls.append(("broadcast", len(out)))
    )
    monkeypatch.setattr(
        _transports.torch_comm,
        "reduce_add",
        lambda flats, dest: calls.append(("reduce", len(flats))) or flats[0],
    )
    src = torch.ones(10)
    _transports._CudaTransport.broadcast(src, [torch.empty(10), torch.empty(10)])

    class OnGpu:  # what the transport reads of a flat on cuda:0 (no GPU here)
        device, layout, dtype = torch.device("cuda", 0), torch.strided, torch.float32

    _transports._CudaTransport.reduce([OnGpu()] * 3, torch.device("cuda", 0))
    assert calls == [("broadcast", 2), ("reduce", 3)]
    assert _transports.transport_for([torch.device("cuda", 0)] * 2) is _transports._CudaTransport
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, fastdp._transports as e; print(e.torch_comm.broadcast.__module__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.strip() == "torch.nn.parallel.comm", r.stderr
    root = pathlib.Path(__file__).resolve().parents[1]
    assert not list(root.glob("csrc/**/nccl*")), "an NCCL communicator of fastdp's own"
    assert not any("ncclCommInit" in f.read_text() for f in root.glob("csrc/**/*.c*"))
