"""Property: ``comm.reduce_add_coalesced`` sums random tensor lists (dtypes, layouts, empty
tensors) of 1-4 groups, with bucket sizes from 1 byte, in list order; inputs untouched, outputs
new (hypothesis; inputs drawn as tests/property_inputs.py says)."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from property_inputs import PROPERTY, TensorSpec, assert_same, flat_specs, numeric


@PROPERTY
@given(
    specs=flat_specs(),
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
        [numeric(s._replace(seed=(s.seed + seed * (g + 1)) % 2**31)) for s in specs]
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
