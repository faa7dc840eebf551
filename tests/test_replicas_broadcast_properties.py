"""Property: ``comm.broadcast_coalesced`` and a refreshed ``_buckets.Layout`` (the replicas'
refresh) copy random tensor lists (dtypes, layouts, empty tensors) onto 1-4 CPU devices, with
bucket sizes from 1 byte, bit for bit into storage of their own; device 0's are the inputs
(hypothesis; inputs drawn as tests/property_inputs.py says)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from property_inputs import PROPERTY, assert_same, flat_specs, materialize


@PROPERTY
@given(specs=flat_specs(), n=st.integers(1, 4), buffer_size=st.integers(1, 4096))
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
