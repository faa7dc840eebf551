"""The one reducer (fastdp/_reducer.py): buckets reduced while backward runs, the native bucket
node against the Python one, buckets of unused parameters, and the CUDA transport.

Distinct-device behaviour runs on CPU replicas with ``FASTDP_CPU_DISTINCT=1`` (own storage,
refreshed and reduced through the CPU transport): the logic the CUDA transport shares. The CUDA
tests skip without a GPU.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from models import linear_stack
from torch.testing import assert_close

import fastdp._reducer
from fastdp import FastDataParallel, _backend, _transports, comm

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
    model = linear_stack(6, width=256)  # 257 KiB per layer: a 1 MiB cap gives >= 3 buckets
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
        fdp = FastDataParallel(linear_stack(2), device_ids=["cpu"] * 2, persistent=persistent)
        calls.clear()
        fdp(x).sum().backward()
        assert calls, persistent
    fdp = FastDataParallel(linear_stack(2), device_ids=["cpu"] * 2)  # no_sync's fold
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
            0,
            src,
            torch.device("cpu"),
            _transports.new_stats(),
            r.ExpectBackward(),
            r.BucketGroup([src]),
        )
        with torch.enable_grad():
            fastdp._reducer.link_bucket(link, rows, src, native=native)
        outs = [rows[j][k] * (j + 1.5) for j in range(n) for k in (0, 2)]  # row 0's k=1 unused
        torch.autograd.backward([o.sum() for o in outs])
        grads[native] = [None if s.grad is None else s.grad.clone() for s in src]
        assert link.stats["reduces"] == (n > 1) and not link.expect_backward.value
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
@pytest.mark.parametrize("kind", ["tensor", "post-accumulate"])
def test_hooks_on_an_unreached_bucket_see_dataparallels_zeros(monkeypatch, backend, mode, kind):
    """DataParallel's Broadcast accumulates zeros into an unused parameter: its tensor hooks and
    post-accumulate hooks run on them once per backward, ``.grad`` kept or not. So do the
    engine's, for a bucket no node of the backward reached."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1" if mode == "distinct" else "0")
    net, calls, grads = _UnusedFirst(), [], []
    for persistent in (True, False):
        model, seen = copy.deepcopy(net), []
        calls.append(seen)
        for p in model.unused.parameters():
            if kind == "tensor":  # a weight decay in a hook: zeros in, not zeros out
                p.register_hook(lambda g, p=p, seen=seen: seen.append(1) or g + 0.1 * p.detach())
            else:
                p.register_post_accumulate_grad_hook(lambda p, seen=seen: seen.append(p.grad.sum()))
        fdp = FastDataParallel(model, ["cpu"] * 2, bucket_cap_mb=0.2, persistent=persistent)
        for k in range(3):
            if k != 1:  # a step that keeps .grad, then one from None
                model.zero_grad()
            fdp(torch.randn(4, 256)).sum().backward()
        grads.append(model.unused.weight.grad)
    assert len(calls[0]) == len(calls[1]) == 6
    assert_close(grads[0], grads[1])


@pytest.mark.parametrize("mode", ["distinct", "alias"])
def test_buckets_reduce_while_backward_runs(monkeypatch, backend, mode):
    """Each bucket's node runs once its gradients exist (NOTE [ Early reduction ]), with or
    without the extension: the last layers' bucket is summed before the first layer's backward
    ends in the last replica the engine visits. One node for all would run only at the end,
    keeping every replica's gradients alive until then (the heap trimming of
    bench/results/cpu-2core-2026-11-26-final)."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1" if mode == "distinct" else "0")
    model = linear_stack(6, width=256)
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
def test_cuda_copy_replicas_on_one_gpu_match_the_plain_module(monkeypatch):
    """The CUDA transport's copy fallback (flats on the source GPU: NCCL needs distinct ones)."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")
    torch.manual_seed(0)
    model = linear_stack(4).cuda()
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
