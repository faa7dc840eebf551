"""What the property tests of scatter, gather, broadcast and reduce draw (hypothesis): random
input trees (nested tuple/list/dict/OrderedDict/namedtuple; tensor leaves of random shapes, dtypes,
layouts contiguous/transposed/sliced/expanded/channels_last; non-tensor leaves), flat tensor lists,
and the bit-exact comparisons. ``FASTDP_HYPOTHESIS_EXAMPLES`` sets the examples per property
(``PROPERTY``; default 2000), derandomized, with no example database."""

from __future__ import annotations

import os
from collections import OrderedDict, namedtuple
from typing import Any, NamedTuple

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch._prims_common import suggest_memory_format

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


def channels_last_by_torch(t: torch.Tensor) -> bool:
    """Whether torch's own gather and ``cat`` keep ``t`` channels_last: its suggested memory
    format (``comm.gather``'s rule). Strides alone are ambiguous where sizes are 1: a (1, 2, 1, 2)
    tensor with strides (1, 1, 2, 2) is channels_last-contiguous, yet torch suggests (and
    DataParallel's gather gives) the contiguous format."""
    return (
        t.dim() == 4 and not t.is_contiguous() and suggest_memory_format(t) == torch.channels_last
    )


def flat_specs():
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


def numeric(spec: TensorSpec) -> torch.Tensor:
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
