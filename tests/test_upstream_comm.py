"""torch's DataParallel-related ``TestCudaComm`` tests, ported to fastdp.comm and scatter_gather.

Source: ``test/test_cuda_multigpu.py::TestCudaComm`` in pytorch/pytorch (broadcast, scatter, gather,
reduce_add contracts; namedtuple scatter/gather; memory format). Upstream needs two GPUs for all of
them; here each runs on two CPU replicas (``cpu2``) in CI and on two replicas sharing ``cuda:0``
(``cuda00``) when a GPU is present, on both backends (``ext``/``torch``). What needs two distinct
GPUs, or an API fastdp does not have, is kept and skipped with the reason.

Mapping (upstream ``TestCudaComm.<name>`` -> ours):

=======================================  =========================================================
upstream                                 ours (and how it differs)
=======================================  =========================================================
test_broadcast_cpu / test_broadcast_gpu  test_broadcast (through ``broadcast_coalesced`` of one
                                         tensor: fastdp.comm has no ``broadcast``);
                                         test_broadcast_out_and_errors (skipped: no
                                         ``broadcast(out=)`` in fastdp.comm)
test_broadcast_coalesced                 test_broadcast_coalesced[mixed] (sparse + dense)
test_broadcast_coalesced_dense_only      test_broadcast_coalesced[dense_only]
test_broadcast_coalesced_empty_tensors   test_broadcast_coalesced[empty]
test_reduce_add                          test_reduce_add (through ``reduce_add_coalesced``)
test_reduce_add_coalesced                test_reduce_add_coalesced[mixed]
test_reduce_add_coalesced_dense_only     test_reduce_add_coalesced[dense_only]
test_scatter_cpu / _cpu_dim /            test_scatter[dim0/dim1/neg_dim/sizes] (CPU source);
_cpu_neg_dim / _cpu_sizes                errors: test_scatter_errors; out=: test_scatter_out
test_scatter_gpu / _gpu_dim /            the same with a CUDA source (cuda00 only):
_gpu_neg_dim / _gpu_sizes                test_scatter_gpu_source[...]
test_gather / _dim / _neg_dim            test_gather[dim0/dim1/neg_dim]; errors: test_gather_errors;
                                         out=: test_gather_out (CUDA: torch serves ``out=``);
                                         tensors on two devices under ``torch.cuda.device(1)``:
                                         test_gather_two_gpus (skipped without two GPUs)
test_memory_format_scatter_gather        test_memory_format_scatter_gather
test_scatter_namedtuple                  test_scatter_namedtuple
test_gather_namedtuple                   test_gather_namedtuple
=======================================  =========================================================

Adaptations: upstream's "on the same device the chunk is a view" check compares ``data_ptr``; with
two replicas on one device the second chunk is a view at an offset, so storage identity is checked.
fastdp's gather accepts CPU inputs (CPU replicas), so upstream's "Expected all input tensors to be
CUDA tensors" has no counterpart; size mismatches raise ``torch.cat``'s RuntimeError.

Counts: 22 upstream tests, all ported. 17 run on CPU replicas in CI; 5 have a CUDA source and run
only on the GPU (``test_broadcast_gpu`` and the four ``test_scatter_gpu*``); every one also runs on
cuda00. Kept but skipped: ``broadcast(out=)`` and its errors (no such API in fastdp.comm) and the
two-GPU gather under ``torch.cuda.device(1)``.

Regressions from porting (fixed in fastdp.comm): ``gather(())`` raised IndexError; ``scatter``
without devices or with a chunk_sizes/devices length mismatch raised ValueError instead of torch's
RuntimeError; ``scatter`` lacked ``out=``.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch

from fastdp import comm
from fastdp import scatter_gather as sg
from fastdp.testing import home

pytestmark = pytest.mark.usefixtures("backend")  # with the extension allowed and forced off

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
needs_2gpus = pytest.mark.skipif(
    not (HAS_CUDA and torch.cuda.device_count() >= 2), reason="needs two distinct GPUs"
)


def equal(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _sparse(size, nnz, dtype, dev, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randint(s, (nnz,), generator=g) for s in size])
    vals = (
        torch.randn(nnz, generator=g).to(dtype)
        if dtype.is_floating_point
        else (torch.randint(-9, 9, (nnz,), generator=g, dtype=dtype))
    )
    return torch.sparse_coo_tensor(idx, vals, size, device=dev, check_invariants=True)


def _tensor_sets(dev):
    n = 5
    dense = [
        torch.randn(n).long().to(dev),
        torch.randn(n, device=dev),
        torch.randn(n).long().to(dev),
        torch.randn(n).long().to(dev),
        torch.randn(n * 2).int().to(dev),  # int is 2x shorter
        torch.randn(n, device=dev),
    ]
    mixed = [
        _sparse((2, 3), 1, torch.float64, dev, 0),
        torch.randn(n).long().to(dev),
        torch.randn(n, device=dev),
        _sparse((2, 3), 10, torch.float64, dev, 1),
        _sparse((2, 3), 5, torch.float64, dev, 2),
        _sparse((3, 3), 7, torch.int64, dev, 3),
        _sparse((2, 3), 2, torch.float32, dev, 4),
        torch.randn(n).long().to(dev),
        torch.randn(n).long().to(dev),
        _sparse((2, 7), 3, torch.int64, dev, 5),
        torch.randn(n * 2).int().to(dev),
        torch.randn(n, device=dev),
    ]
    empty = [
        torch.tensor([]).byte().to(dev),
        torch.randn(5, device=dev),
        torch.randn(5, device=dev).double(),
    ]
    return {
        "mixed": (mixed, n * 8 * 5 // 2),
        "dense_only": (dense, n * 8 * 5 // 2),
        "empty": (empty, 256),
    }


def _same_kind(a, b):
    assert (a.dtype, a.layout, a.device, type(a)) == (b.dtype, b.layout, b.device, type(b))


def _dense_view(t):
    return t.coalesce() if t.is_sparse else t


# ---------------------------------------------------------------------------------- broadcast


def test_broadcast(devices):
    dev = home(devices)
    inp = torch.randn(5, 5, device=dev)
    results = [r[0] for r in comm.broadcast_coalesced([inp], devices)]
    assert len(results) == 2
    for t in results:
        assert t.device == dev
        equal(t, inp)
    assert results[0].data_ptr() == inp.data_ptr()  # no copy onto the source device
    assert results[1].data_ptr() != inp.data_ptr()


def test_broadcast_out_and_errors():
    pytest.skip(
        "fastdp.comm has no broadcast(tensor, devices, out=); DataParallel only uses "
        "broadcast_coalesced, which is covered by test_broadcast_coalesced"
    )


@pytest.mark.parametrize("kind", ["mixed", "dense_only", "empty"])
def test_broadcast_coalesced(devices, kind):
    tensors, buffer_size = _tensor_sets(home(devices))[kind]
    result = comm.broadcast_coalesced(tensors, devices, buffer_size=buffer_size)
    assert len(result) == 2
    for inp, out0, out1 in zip(tensors, result[0], result[1]):
        assert out0 is inp  # tensors on devices[0] are returned as they are
        _same_kind(out1, inp)
        equal(_dense_view(out1), _dense_view(inp))
    # The copies have their own version counters, as torch/csrc/cuda/comm.cpp says in
    # torch's NOTE [ Version Counter in comm.*_coalesced ].
    snapshot = [t.clone() for t in tensors]
    for t in result[1]:
        v = t._version
        t.zero_()
        assert t._version == v + 1
    for t, s in zip(tensors, snapshot):
        equal(_dense_view(t), _dense_view(s))


# --------------------------------------------------------------------------------- reduce_add


def test_reduce_add(devices):
    dev = home(devices)
    x, y = torch.randn(5, 5), torch.randn(5, 5)
    result = comm.reduce_add_coalesced([[x.to(dev)], [y.to(dev)]])[0]
    assert result.device == dev
    torch.testing.assert_close(result.cpu(), x + y)


@pytest.mark.parametrize("kind", ["mixed", "dense_only"])
def test_reduce_add_coalesced(devices, kind):
    tensors, buffer_size = _tensor_sets(home(devices))[kind]
    dup = [tensors, [t.clone() for t in tensors]]
    result = comm.reduce_add_coalesced(dup, buffer_size=buffer_size)
    assert len(result) == len(tensors)
    for r, t in zip(result, tensors):
        _same_kind(r, t)
        equal(_dense_view(r), _dense_view(t * 2))
    # Outputs are new tensors: bumping their version leaves the inputs alone.
    snapshot = [t.clone() for t in tensors]
    for r in result:
        assert all(r is not t for t in tensors)
        v = r._version
        r.zero_()
        assert r._version == v + 1
    for t, s in zip(tensors, snapshot):
        equal(_dense_view(t), _dense_view(s))


# ------------------------------------------------------------------------------------ scatter

SCATTER_CASES = {
    "dim0": ((4, 4), None, 0),
    "dim1": ((4, 4), None, 1),
    "neg_dim": ((4, 4), None, -2),
    "sizes": ((6, 4), (2, 4), 0),
}


def _check_scatter(inp, devices, chunk_sizes, dim):
    ref = chunk_sizes or (inp.size(dim) // 2,) * 2
    result = comm.scatter(inp, devices, chunk_sizes, dim)
    assert len(result) == 2
    start = 0
    for i, r in enumerate(result):
        end = start + ref[i]
        equal(r, inp.narrow(dim, start, end - start).to(r.device))
        start = end
        if r.device == inp.device:  # a chunk that stays on the source device is a view
            assert r.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
    return result


@pytest.mark.parametrize("case", list(SCATTER_CASES))
def test_scatter(devices, case):
    shape, chunk_sizes, dim = SCATTER_CASES[case]
    _check_scatter(torch.randn(*shape), devices, chunk_sizes, dim)


@needs_cuda
@pytest.mark.parametrize("case", list(SCATTER_CASES))
def test_scatter_gpu_source(case):
    shape, chunk_sizes, dim = SCATTER_CASES[case]
    _check_scatter(torch.randn(*shape).cuda(), [0, 0], chunk_sizes, dim)


@pytest.mark.parametrize("case", list(SCATTER_CASES))
def test_scatter_errors(devices, case):  # regression: these were ValueErrors
    shape, chunk_sizes, dim = SCATTER_CASES[case]
    inp = torch.randn(*shape)
    if chunk_sizes is not None:
        with pytest.raises(
            RuntimeError, match="Expected devices and chunk_sizes to be of same length"
        ):
            comm.scatter(
                inp, [devices[0]] * (len(chunk_sizes) + 1), dim=dim, chunk_sizes=chunk_sizes
            )
    with pytest.raises(RuntimeError, match="Expected at least one device to scatter to"):
        comm.scatter(inp, (), dim=dim)


@needs_cuda
@pytest.mark.parametrize("case", list(SCATTER_CASES))
def test_scatter_out(case):
    """``out=`` (CUDA outputs only, as in torch) and its error messages."""
    shape, chunk_sizes, dim = SCATTER_CASES[case]
    inp = torch.randn(*shape).cuda()
    ref = chunk_sizes or (inp.size(dim) // 2,) * 2
    out = [torch.empty_like(t) for t in comm.scatter(inp, [0, 0], chunk_sizes, dim)]
    result = comm.scatter(inp, dim=dim, out=out)
    start = 0
    for r, o, n in zip(result, out, ref):
        assert r is o
        equal(r, inp.narrow(dim, start, n))
        start += n
    with pytest.raises(RuntimeError, match="'devices' must not be specified"):
        comm.scatter(inp, (0, 0), dim=dim, out=out)
    with pytest.raises(RuntimeError, match="Expected at least one output tensor to scatter to"):
        comm.scatter(inp, dim=dim, out=[])
    with pytest.raises(RuntimeError, match="Expected all output tensors to be CUDA tensors"):
        comm.scatter(inp, dim=dim, out=[out[0].cpu()] + out[1:])
    with pytest.raises(RuntimeError, match="Output tensor at index 0 has incorrect shape"):
        comm.scatter(inp, dim=dim, out=[out[0].unsqueeze(0)] + out[1:])
    with pytest.raises(RuntimeError, match="Total size for output tensors along scatter dim"):
        comm.scatter(inp, dim=dim, out=[out[0].narrow(dim, 1, out[0].size(dim) - 1)] + out[1:])


# ------------------------------------------------------------------------------------- gather

GATHER_DIMS = {"dim0": 0, "dim1": 1, "neg_dim": -1}


def _check_gathered(result, x, y, dim, expected_device):
    size = list(x.shape)
    size[dim] += y.size(dim)
    assert result.device == expected_device
    assert result.shape == torch.Size(size)
    equal(result.narrow(dim, 0, x.size(dim)), x.to(expected_device))
    equal(result.narrow(dim, x.size(dim), y.size(dim)), y.to(expected_device))


@pytest.mark.parametrize("case", list(GATHER_DIMS))
def test_gather(devices, case):
    dim, dev = GATHER_DIMS[case], home(devices)
    x = torch.randn(2, 5, device=dev)
    y = torch.randn(2, 5, device=dev)
    for destination in [None, dev, torch.device("cpu")]:
        expected = dev if destination is None else destination
        _check_gathered(comm.gather((x, y), dim, destination=destination), x, y, dim, expected)


@pytest.mark.parametrize("case", list(GATHER_DIMS))
def test_gather_errors(devices, case):
    dim, dev = GATHER_DIMS[case], home(devices)
    x = torch.randn(2, 5, device=dev)
    y = torch.randn(2, 5, device=dev)
    with pytest.raises(RuntimeError, match="Expected at least one tensor to gather from"):
        comm.gather(())  # regression: was an IndexError
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        comm.gather((x, y.unsqueeze(0)), dim)
    with pytest.raises(RuntimeError):
        comm.gather((x, y[:, 1:]) if dim in (0, -2) else (x, y[1:, :]), dim=dim)


@needs_cuda
@pytest.mark.parametrize("case", list(GATHER_DIMS))
def test_gather_out(case):
    dim = GATHER_DIMS[case]
    x = torch.randn(2, 5, device=0)
    y = torch.randn(2, 5, device=0)
    size = list(x.shape)
    size[dim] += y.size(dim)
    for dev in (torch.device("cuda", 0), torch.device("cpu")):
        out = torch.empty(size, device=dev)
        result = comm.gather((x, y), dim, out=out)
        assert result is out
        _check_gathered(result, x, y, dim, dev)
    with pytest.raises(RuntimeError, match="'destination' must not be specified"):
        comm.gather((x, y), dim, destination="cpu", out=torch.empty(size, device="cpu"))


@needs_2gpus
@pytest.mark.parametrize("case", list(GATHER_DIMS))
def test_gather_two_gpus(case):
    """Inputs on two GPUs; ``destination=None`` is the current device (cuda:1 here)."""
    dim = GATHER_DIMS[case]
    x = torch.randn(2, 5, device=0)
    y = torch.randn(2, 5, device=1)
    destinations = [None, torch.device("cuda:0"), torch.device("cpu")]
    if torch.cuda.device_count() > 2:
        destinations.append(torch.device("cuda:2"))
    with torch.cuda.device(1):
        for destination in destinations:
            expected = torch.device("cuda", 1) if destination is None else destination
            _check_gathered(comm.gather((x, y), dim, destination=destination), x, y, dim, expected)


# ------------------------------------------------------------- memory format and namedtuples


def test_memory_format_scatter_gather(devices):
    nhwc = torch.randn(10, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    results = comm.scatter(nhwc, devices, None, 0)
    for r in results:
        assert not r.is_contiguous()
        assert r.is_contiguous(memory_format=torch.channels_last)
    gathered = comm.gather(results)
    assert gathered.is_contiguous(memory_format=torch.channels_last)
    equal(gathered.cpu(), nhwc)
    # The same through the autograd-aware scatter_gather layer.
    parts = sg.scatter(nhwc, devices)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in parts)
    assert sg.gather(parts, home(devices)).is_contiguous(memory_format=torch.channels_last)


class _TypedPair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


_PlainPair = collections.namedtuple("NamedTuple", ("a", "b"))


@pytest.mark.parametrize("cls", [_PlainPair, _TypedPair], ids=["collections", "typing"])
def test_scatter_namedtuple(devices, cls):
    n, dev = len(devices), home(devices)
    a = torch.rand(n * 2, device=dev)
    b = torch.rand(n * 2, device=dev)
    out = sg.scatter(cls(a, b), devices)
    assert len(out) == n
    for i, x in enumerate(out):
        assert isinstance(x, cls) and x._fields == ("a", "b")
        equal(x.a, a[2 * i : 2 * i + 2])
        equal(x.b, b[2 * i : 2 * i + 2])


@pytest.mark.parametrize("cls", [_PlainPair, _TypedPair], ids=["collections", "typing"])
def test_gather_namedtuple(devices, cls):
    n, dev = len(devices), home(devices)
    outputs = [cls(torch.rand(n * 2, device=dev), torch.rand(n * 2, device=dev)) for _ in range(2)]
    for target in ("cpu", dev):
        out = sg.gather(outputs, target)
        assert isinstance(out, cls)
        for i, x in enumerate(out):
            assert isinstance(x, torch.Tensor)
            equal(x, torch.cat((outputs[0][i].to(target), outputs[1][i].to(target))))
