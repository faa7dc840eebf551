"""Property-based tests of the scatter planner, scatter and gather (hypothesis).

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
* ``test_broadcast_coalesced_copies_bit_exact`` / ``test_reduce_add_coalesced_sums_in_list_order``:
  the replication engine, for random tensor lists (dtypes, layouts, empty tensors) on 1-4 CPU
  devices and bucket sizes from 1 byte: broadcast copies equal their sources bit for bit with
  storage of their own (device 0's are the inputs), a refreshed ``_buckets.Layout`` likewise; sums
  are in list order, inputs untouched, outputs new.

Examples: ``FASTDP_HYPOTHESIS_EXAMPLES`` per property (default 2000), derandomized (a fixed seed per
test), no example database. For a deeper run: ``FASTDP_HYPOTHESIS_EXAMPLES=50000 pytest
tests/test_scatter_properties.py``. Tensors are small so the default run takes about a minute.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict, namedtuple
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch._prims_common import suggest_memory_format

from fastdp import _backend
from fastdp.scatter_gather import gather, scatter, scatter_kwargs
from fastdp.testing import PROPERTY_DTYPES

EXAMPLES = int(os.environ.get("FASTDP_HYPOTHESIS_EXAMPLES", "2000"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

LAYOUTS = ["contiguous", "transposed", "sliced", "expanded", "channels_last"]
DIMS = [0, 1, 2, -1, -2]

Pair = namedtuple("Pair", ["a", "b"])


class Triple(NamedTuple):
    x: Any
    y: Any
    z: Any


# ------------------------------------------------------------------------------- strategies


class TensorSpec(NamedTuple):
    """A tensor leaf to be materialised once the batch size and dim are known."""

    ndim: int
    sizes: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    seed: int


tensor_specs = st.builds(
    TensorSpec,
    ndim=st.integers(1, 4),
    sizes=st.tuples(*[st.integers(0, 3)] * 4),
    dtype=st.sampled_from(PROPERTY_DTYPES),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**31 - 1),
)

non_tensors = st.one_of(
    st.none(),
    st.integers(-5, 5),
    st.booleans(),
    st.text(max_size=3),
    st.floats(allow_nan=False, width=32),
)


def _containers(children):
    keys = st.text(alphabet="abcd", min_size=1, max_size=2)
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(keys, children, max_size=3).map(OrderedDict),
        st.builds(Pair, children, children),
        st.builds(Triple, children, children, children),
    )


spec_trees = st.recursive(
    st.one_of(tensor_specs, tensor_specs, non_tensors), _containers, max_leaves=8
)


def _random_bits(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``numel`` values of ``dtype`` with random bit patterns (NaN payloads, denormals, ...)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g, dtype=torch.uint8).bool()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype)


def materialize(spec: TensorSpec, batch: int, dim: int) -> torch.Tensor:
    ndim = max(spec.ndim, dim + 1 if dim >= 0 else -dim)
    shape = list(spec.sizes[:ndim]) + [2] * (ndim - len(spec.sizes))
    d = dim % ndim
    shape[d] = batch
    layout = spec.layout
    if layout == "channels_last" and ndim != 4:
        layout = "transposed"
    numel = 1
    for s in shape:
        numel *= s
    if layout == "sliced":  # every other element of a twice-as-long last dim
        base = _random_bits(numel * 2, spec.dtype, spec.seed)
        t = base.view(*shape[:-1], shape[-1] * 2)[..., ::2]
    elif layout == "transposed":  # the reversed dim order, permuted back
        base = _random_bits(numel, spec.dtype, spec.seed).view(*reversed(shape))
        t = base.permute(*reversed(range(ndim)))
    elif layout == "expanded":  # stride 0 along one dim
        k = (d + 1) % ndim
        small = list(shape)
        small[k] = 1
        n_small = 1
        for s in small:
            n_small *= s
        t = _random_bits(n_small, spec.dtype, spec.seed).view(small).expand(shape)
    else:
        t = _random_bits(numel, spec.dtype, spec.seed).view(shape)
        if layout == "channels_last":
            t = t.contiguous(memory_format=torch.channels_last)
    assert list(t.shape) == shape
    return t


def build(tree: Any, batch: int, dim: int) -> Any:
    """Replace every TensorSpec in ``tree`` by its tensor."""
    if isinstance(tree, TensorSpec):
        return materialize(tree, batch, dim)
    if isinstance(tree, (Pair, Triple)):
        return type(tree)(*[build(v, batch, dim) for v in tree])
    if isinstance(tree, (list, tuple)):
        return type(tree)(build(v, batch, dim) for v in tree)
    if isinstance(tree, dict):
        return type(tree)((k, build(v, batch, dim)) for k, v in tree.items())
    return tree


def leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in leaves(v)]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in leaves(v)]
    return []


def expected_gather(tree: Any, n: int) -> Any:
    """What gather(scatter(tree)) returns: tensors whole, other leaves as per-replica lists."""
    if isinstance(tree, torch.Tensor) or tree is None:
        return tree
    if isinstance(tree, (Pair, Triple)):
        return type(tree)(*[expected_gather(v, n) for v in tree])
    if isinstance(tree, (list, tuple)):
        return type(tree)(expected_gather(v, n) for v in tree)
    if isinstance(tree, dict):
        return type(tree)((k, expected_gather(v, n)) for k, v in tree.items())
    return [tree] * n


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t``'s values, so that NaNs compare by payload."""
    t = t.detach().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def assert_same(a: Any, b: Any, path: str = "x") -> None:
    """Bit-exact tree equality: same container types, keys, tensor dtype/shape/device/bits."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), path
        assert torch.equal(bits(a), bits(b)), f"{path}: values differ"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    else:
        assert a == b, path


def _channels_last_by_torch(t: torch.Tensor) -> bool:
    """Whether torch's own gather and ``cat`` keep ``t`` channels_last: its suggested memory
    format (``comm.gather``'s rule). Strides alone are ambiguous where sizes are 1: a (1, 2, 1, 2)
    tensor with strides (1, 1, 2, 2) is channels_last-contiguous, yet torch suggests (and
    DataParallel's gather gives) the contiguous format."""
    return (
        t.dim() == 4 and not t.is_contiguous() and suggest_memory_format(t) == torch.channels_last
    )


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
            if all(_channels_last_by_torch(c) for c in chunks):
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


# ------------------------------------------------------------- broadcast and reduce (comm)


def _flat_specs_strategy():
    return st.lists(
        st.builds(
            TensorSpec,
            ndim=st.integers(1, 3),
            sizes=st.tuples(*[st.integers(0, 5)] * 4),
            dtype=st.sampled_from(PROPERTY_DTYPES),
            layout=st.sampled_from(LAYOUTS),
            seed=st.integers(0, 2**31 - 1),
        ),
        max_size=8,
    )


def _numeric(spec: TensorSpec) -> torch.Tensor:
    """A finite tensor (sums of NaN payloads are not specified bit for bit)."""
    t = materialize(spec, spec.sizes[0], 0)
    g = torch.Generator().manual_seed(spec.seed)
    if t.dtype == torch.bool:
        vals = torch.randint(0, 2, t.shape, generator=g).bool()
    elif t.dtype.is_floating_point or t.dtype.is_complex:
        vals = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
    else:
        vals = torch.randint(-50, 50, t.shape, generator=g).to(t.dtype)
    with torch.no_grad():
        t = t.clone() if t.stride() and 0 in t.stride() else t
        t.copy_(vals)
    return t


@PROPERTY
@given(specs=_flat_specs_strategy(), n=st.integers(1, 4), buffer_size=st.integers(1, 4096))
def test_broadcast_coalesced_copies_bit_exact(specs, n, buffer_size):
    from fastdp import _buckets, comm

    tensors = [materialize(s, s.sizes[0], 0) for s in specs]
    devices = [torch.device("cpu")] * n
    out = comm.broadcast_coalesced(tensors, devices, buffer_size)
    assert len(out) == n
    assert all(a is b for a, b in zip(out[0], tensors))  # device 0: the inputs themselves
    for copies in out[1:]:
        for c, t in zip(copies, tensors):
            assert_same(c, t)
            if c.numel():
                assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    layout = _buckets.Layout(tensors, devices, range(1, n), buffer_size)  # the step's refresh
    layout.refresh(tensors, None)
    for j in range(1, n):
        for c, t in zip(layout.per_replica[j], tensors):
            assert_same(c, t)


@PROPERTY
@given(
    specs=_flat_specs_strategy(),
    groups=st.integers(1, 4),
    buffer_size=st.integers(1, 4096),
    seed=st.integers(0, 2**31 - 1),
)
# Regressions: no tensors raised TypeError (destination resolved before the empty check); the
# torch path returned a tuple where the extension returns a list.
@example(specs=[], groups=1, buffer_size=1, seed=0)
@example(
    specs=[TensorSpec(1, (3, 0, 0, 0), torch.float32, "contiguous", 0)],
    groups=2,
    buffer_size=1,
    seed=0,
)
def test_reduce_add_coalesced_sums_in_list_order(specs, groups, buffer_size, seed):
    from fastdp import comm

    inputs = [
        [_numeric(s._replace(seed=(s.seed + seed * (g + 1)) % 2**31)) for s in specs]
        for g in range(groups)
    ]
    snapshot = [[t.clone() for t in grp] for grp in inputs]
    out = comm.reduce_add_coalesced(inputs, None, buffer_size)
    assert_same(inputs, snapshot, "inputs")  # not modified
    assert len(out) == len(specs)
    for r, t in zip(out, inputs[0]):
        assert r is not t and (r.dtype, r.shape) == (t.dtype, t.shape)
    for i, o in enumerate(out):  # summed in list order, as the contract says
        ref = inputs[0][i].clone()
        for grp in inputs[1:]:
            ref = ref + grp[i]
        assert_same(o, ref, f"sum {i}")
