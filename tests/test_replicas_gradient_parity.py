"""Gradients of persistent replicas equal DataParallel's (``persistent=False``: fresh replicas
every step) and the plain module's on the same chunks, where the reduction could differ: an
in-place sum into a gradient whose memory another node still reads, sparse gradients that only
some replicas produce, and compiled autograd running the bucket nodes."""

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp.testing import grads_of

# NOTE [ Tests under each launch strategy ] in tests/conftest.py; every test also runs in both
# storage modes and on both backends (the C++ bucket node and the Python one).
pytestmark = pytest.mark.usefixtures("launch", "storage", "backend")


class ViewBias(nn.Module):
    """``p`` is 1 MiB, so it fills the first bucket alone; its gradient is a view of the one
    ``lin``'s backward reads after the bucket node ran."""

    def __init__(self, k: int = 3, d: int = 2**17) -> None:
        super().__init__()
        self.d = d
        self.lin = nn.Linear(k, d)
        self.p = nn.Parameter(torch.randn(2 * d) * 0.1)

    def forward(self, x):
        return self.lin(x) + self.p.view(2, self.d)


class ViewResidual(nn.Module):
    """A bias used through a view: with 1-row chunks its gradient views the sum's gradient."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.d = d
        self.lin = nn.Linear(d, d)
        self.p = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, h):
        return h + torch.tanh(self.lin(h) + self.p.view(1, self.d))


class SkippedEmbedding(nn.Module):
    """A sparse embedding that a replica uses only where its chunk of ``use`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.lin = nn.Linear(4, 1)

    def forward(self, idx, use):
        h = self.lin.weight.new_zeros(idx.shape[0], 4)
        if bool(use[0]):
            h = h + self.emb(idx)
        return self.lin(h)


def _square_sum(out):
    return (out**2).sum()  # a gradient of the output's own memory (no expanded ones)


def _wrapped_grads(model, inputs, n, steps=2, **kw):
    """``.grad`` after the last of ``steps`` steps (the persistent nodes serve steps 2 on)."""
    dp = FastDataParallel(model, device_ids=["cpu"] * n, **kw)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        _square_sum(dp(*inputs)).backward()
    return grads_of(model)


def _chunked_grads(model, inputs, n):
    """The plain module on DataParallel's chunks, the losses summed: the reference arithmetic."""
    model.zero_grad(set_to_none=True)
    chunks = zip(*(torch.chunk(x, n) for x in inputs))
    _square_sum(torch.cat([model(*c) for c in chunks])).backward()
    return grads_of(model)


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        if want[k] is None:
            assert got[k] is None, k
        else:
            assert got[k].layout == want[k].layout, k
            assert_close(got[k].to_dense(), want[k].to_dense(), msg=k)


def test_view_of_a_parameter_alone_in_a_bucket_leaves_other_gradients_unsummed():
    torch.manual_seed(0)
    model, x = ViewBias(), torch.randn(8, 3)
    want = _wrapped_grads(model, [x], 4, persistent=False)
    _assert_same(_wrapped_grads(model, [x], 4), want)
    _assert_same(_chunked_grads(model, [x], 4), want)


@pytest.mark.parametrize("cap_mb", [1e-6, 25.0], ids=["bucket_per_tensor", "one_bucket"])
def test_bias_through_a_view_with_one_row_chunks_gets_dataparallels_gradients(cap_mb):
    torch.manual_seed(0)
    model, x = ViewResidual(), torch.randn(2, 16)
    want = _wrapped_grads(model, [x], 2, persistent=False)
    _assert_same(_wrapped_grads(model, [x], 2, bucket_cap_mb=cap_mb), want)
    _assert_same(_chunked_grads(model, [x], 2), want)


def _sums_out_of_place(model, inputs, n, **kw):
    """``comm_stats()["sums_out_of_place"]`` of a second step (the persistent nodes), and the
    gradients, which must be DataParallel's either way."""
    dp = FastDataParallel(model, device_ids=["cpu"] * n, **kw)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        _square_sum(dp(*inputs)).backward()
    _assert_same(grads_of(model), _wrapped_grads(model, inputs, n, persistent=False))
    return dp.comm_stats()["sums_out_of_place"]


@pytest.mark.parametrize(
    "cap_mb, shared", [(1e-6, 1), (25.0, 0)], ids=["bucket_per_tensor", "one_bucket"]
)
def test_gradients_nothing_else_reads_are_summed_in_place(backend, cap_mb, shared):
    """NOTE [ Summing in place ] in csrc/bucket_reduce.cpp: a Linear's weight and bias gradients
    are views of their backward's fresh results, read by no one else: the bucket node sums into
    them (an out-of-place sum per gradient costs an allocation and a dispatch). ``p``'s gradient
    views one that ``lin``'s backward still reads when ``p`` has a bucket of its own (out of
    place, that gradient only); in one bucket with ``lin``, the node runs after that read."""
    if backend == "torch":
        pytest.skip("the count is the C++ bucket node's")
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
    assert _sums_out_of_place(mlp, [torch.randn(8, 8)], 4, bucket_cap_mb=cap_mb) == 0
    view = ViewResidual()
    assert _sums_out_of_place(view, [torch.randn(2, 16)], 2, bucket_cap_mb=cap_mb) == shared


def test_autograd_grad_through_a_view_with_one_row_chunks_gets_dataparallels_gradients():
    torch.manual_seed(0)
    model, x0 = ViewResidual(), torch.randn(2, 16)
    model.lin.requires_grad_(False)  # one bucket: p's gradient and x's share memory
    results = []
    for persistent in (False, True):
        dp = FastDataParallel(model, device_ids=["cpu"] * 2, persistent=persistent)
        for _ in range(2):
            x = x0.clone().requires_grad_()
            got = torch.autograd.grad(_square_sum(dp(x)), [model.p, x])
        results.append(got)
    for want, got in zip(*results):
        assert_close(got, want)


@pytest.mark.parametrize(
    "use",
    [[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]],
    ids=["second_skips", "first_skips", "none_skips"],
)
@pytest.mark.parametrize("persistent", [True, False])
def test_sparse_embedding_that_a_replica_skips_is_summed_as_dataparallel_does(use, persistent):
    torch.manual_seed(0)
    model = SkippedEmbedding()
    inputs = [torch.tensor([1, 2, 3, 2]), torch.tensor(use)]
    got = _wrapped_grads(model, inputs, 2, persistent=persistent)
    want = _chunked_grads(model, inputs, 2)
    # comm.reduce_add_coalesced: all sparse stays sparse; a replica's dense zeros make it dense
    assert got["emb.weight"].layout == (torch.sparse_coo if all(use) else torch.strided)
    assert_close(got["emb.weight"].to_dense(), want["emb.weight"].to_dense())
    assert_close(got["lin.weight"], want["lin.weight"])
    assert_close(got["lin.bias"], want["lin.bias"])


@pytest.mark.parametrize("cap_mb", [25.0, 1e-6], ids=["one_bucket", "bucket_per_tensor"])
def test_compiled_autograd_step_gives_dataparallels_gradients(cap_mb):
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)  # a frozen source in a bucket
    x = torch.randn(6, 4)
    results = []
    for persistent in (False, True):
        dp = FastDataParallel(
            model, device_ids=["cpu"] * 3, persistent=persistent, bucket_cap_mb=cap_mb
        )
        for _ in range(3):  # the persistent nodes serve steps 2 and 3 again
            model.zero_grad(set_to_none=True)
            loss = _square_sum(dp(x))
            with ca._enable(torch.compile(backend="eager")):
                loss.backward()
        results.append(grads_of(model))
    _assert_same(results[1], results[0])
