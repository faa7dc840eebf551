"""Property-based tests of the scatter and gather (hypothesis; inputs drawn as
tests/property_inputs.py says).

Properties (each over CPU replica sets of 1-8 devices):

* ``test_scatter_gather_roundtrip``: for random input trees (nested tuple/list/dict/OrderedDict/
  namedtuple; tensor leaves of random shapes, dtypes incl. bool/int64/float16/bfloat16/complex64,
  layouts contiguous/transposed/sliced/expanded/channels_last; non-tensor leaves), batch sizes
  0-64 and dims 0, 1, 2, -1, -2: ``gather(scatter(x))`` returns ``x`` bit for bit (non-tensor leaves
  come back as DataParallel's per-replica list), also through ``scatter_kwargs``.
* ``test_scatter_chunks_match_torch_chunk``: every leaf's chunks are ``torch.chunk``'s (sizes,
  bits), as many replicas as the leaf with the fewest chunks has (DataParallel's ``zip``), with a
  warning when others lose rows.
* ``test_backends_bit_identical``: the ``ext`` and ``torch`` backends give bit-identical scattered
  chunks, gathered outputs and gradients.

Examples: ``FASTDP_HYPOTHESIS_EXAMPLES`` per property (default 2000), derandomized (a fixed seed per
test), no example database. For a deeper run: ``FASTDP_HYPOTHESIS_EXAMPLES=50000 pytest
tests/test_scatter_properties.py tests/test_replicas_broadcast_properties.py
tests/test_reduce_properties.py``. Tensors are small so the default run takes about a minute.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from property_inputs import (
    DIMS,
    PROPERTY,
    Pair,
    TensorSpec,
    Triple,
    assert_same,
    bits,
    build,
    channels_last_by_torch,
    expected_gather,
    leaves,
    materialize,
    spec_trees,
    tensor_specs,
)

from fastdp import _backend
from fastdp.scatter_gather import gather, scatter, scatter_kwargs

# ------------------------------------------------------------------------------- properties


@PROPERTY
@example(  # channels_last-contiguous by strides, contiguous by torch's rule
    tree=TensorSpec(4, (1, 2, 1, 2), torch.bool, "transposed", 0),
    n=1,
    batch=1,
    dim=0,
    via_kwargs=False,
)
@given(
    tree=spec_trees,
    n=st.integers(1, 8),
    batch=st.integers(0, 64),
    dim=st.sampled_from(DIMS),
    via_kwargs=st.booleans(),
)
def test_scatter_gather_roundtrip(tree, n, batch, dim, via_kwargs):
    x = build(tree, batch, dim)
    devices = [torch.device("cpu")] * n
    if via_kwargs:
        args, kwargs = (x,), {"k": x, "other": "s"}
        sc_args, sc_kwargs = scatter_kwargs(args, kwargs, devices, dim)
        assert len(sc_args) == len(sc_kwargs)
        if not sc_args:  # nothing to scatter at all
            return
        n_out = len(sc_args)
        assert_same(gather(list(sc_args), "cpu", dim), expected_gather(args, n_out))
        assert_same(gather(list(sc_kwargs), "cpu", dim), expected_gather(kwargs, n_out))
        return
    parts = scatter(x, devices, dim)
    n_out = len(parts)
    assert 1 <= n_out <= n
    if leaves(x):
        assert n_out == len(torch.chunk(leaves(x)[0], n, dim))
    else:
        assert n_out == n
    out = gather(list(parts), "cpu", dim)
    assert_same(out, expected_gather(x, n_out))
    if dim in (0, -4):
        for src, got in zip(leaves(x), leaves(out)):
            chunks = torch.chunk(src, n, dim)
            if all(channels_last_by_torch(c) for c in chunks):
                assert got.is_contiguous(memory_format=torch.channels_last)


@PROPERTY
@given(
    specs=st.lists(tensor_specs, min_size=1, max_size=3),
    batches=st.lists(st.integers(0, 64), min_size=3, max_size=3),
    same_batch=st.booleans(),
    n=st.integers(1, 8),
    dim=st.sampled_from(DIMS),
)
def test_scatter_chunks_match_torch_chunk(specs, batches, same_batch, n, dim):
    if same_batch:
        batches = [batches[0]] * 3
    xs = [materialize(s, b, dim) for s, b in zip(specs, batches)]
    ref = [torch.chunk(x, n, dim) for x in xs]
    k = min(len(r) for r in ref)  # DataParallel's zip: the fewest chunks, extra ones dropped
    # The warning is for lost rows: an empty leaf's surplus empty chunks lose nothing.
    lost = any(sum(c.size(dim) for c in r[:k]) != x.size(dim) for r, x in zip(ref, xs))
    if lost:
        with pytest.warns(UserWarning, match="split into different numbers of chunks"):
            parts = scatter(tuple(xs), [torch.device("cpu")] * n, dim)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*different numbers of chunks")
            parts = scatter(tuple(xs), [torch.device("cpu")] * n, dim)
    assert len(parts) == k
    for r, part in enumerate(parts):
        for i, chunk in enumerate(part):
            assert chunk.shape == ref[i][r].shape
            assert torch.equal(bits(chunk), bits(ref[i][r]))


def _step(x, devices, dim, grad_seed):
    """Scatter, gather and a backward of ``x``; everything that comes out, detached."""
    parts = scatter(x, devices, dim)
    out = gather(list(parts), "cpu", dim)
    srcs = [t for t in leaves(x) if t.requires_grad]
    grads = []
    outs = [t for t in leaves(out) if t.requires_grad]
    if srcs:
        g = torch.Generator().manual_seed(grad_seed)
        gouts = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, srcs, gouts, allow_unused=True)
    return [leaves(p) for p in parts], out, list(grads)


@pytest.mark.skipif(not _backend.loaded(), reason="fastdp._C is not built")
@PROPERTY
@given(
    tree=spec_trees,
    n=st.integers(1, 8),
    batch=st.integers(0, 64),
    dim=st.sampled_from(DIMS),
    grad_seed=st.integers(0, 2**31 - 1),
)
def test_backends_bit_identical(tree, n, batch, dim, grad_seed):
    results = []
    for use_ext in (True, False):
        x = build(tree, batch, dim)
        x = _with_grad(x)
        with _backend.use_extension(use_ext):
            results.append(_step(x, [torch.device("cpu")] * n, dim, grad_seed))
    (p_ext, o_ext, g_ext), (p_torch, o_torch, g_torch) = results
    assert_same(p_ext, p_torch, "chunks")
    assert_same(o_ext, o_torch, "gathered")
    assert len(g_ext) == len(g_torch)
    for a, b in zip(g_ext, g_torch):
        assert_same(a, b, "grad")


def _with_grad(tree: Any) -> Any:
    """Floating-point leaves as fresh leaves that require grad (same values)."""
    if isinstance(tree, torch.Tensor):
        if tree.dtype in (torch.float32, torch.float64):
            return tree.detach().clone().requires_grad_()
        return tree
    if isinstance(tree, (Pair, Triple)):
        return type(tree)(*[_with_grad(v) for v in tree])
    if isinstance(tree, (list, tuple)):
        return type(tree)(_with_grad(v) for v in tree)
    if isinstance(tree, dict):
        return type(tree)((k, _with_grad(v)) for k, v in tree.items())
    return tree
