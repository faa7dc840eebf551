"""What a new user of the swap-in hits: clear errors for inputs no replica can take, DataParallel's
pass-through for ``device_ids=[]``, checkpoints saved through ``torch.compile``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp import FastDataParallel


class Sum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x, **kw):
        return self.w * 0 + 1.0


@pytest.mark.parametrize(
    "make,kind",
    [
        (lambda: torch.eye(4).to_sparse(), "sparse_coo"),
        (lambda: torch.eye(4).to_sparse_csr(), "sparse_csr"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    ],
)
def test_unsplittable_inputs_get_fastdps_message_naming_the_leaf(make, kind):
    fdp = FastDataParallel(Sum(), device_ids=["cpu"] * 2)
    with pytest.raises(TypeError, match=rf"input kwargs\['feats'\] is a .*{kind}.*whole"):
        fdp(torch.ones(4, 1), feats=make())
    with pytest.raises(TypeError, match=rf"input inputs\[0\] is a .*{kind}"):
        fdp(make())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the pass-through is for CUDA-less machines")
def test_empty_device_ids_without_cuda_run_the_module_as_dataparallel_does():
    m = nn.Linear(3, 2)
    fdp, dp = FastDataParallel(m, device_ids=[]), nn.DataParallel(m, device_ids=[])
    x = torch.randn(4, 3)
    assert fdp.device_ids == dp.device_ids == []
    assert torch.equal(fdp(x), dp(x))


def test_checkpoints_saved_through_torch_compile_load_and_unwrap():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    compiled = torch.compile(FastDataParallel(m, device_ids=["cpu"] * 2))
    sd = compiled.state_dict()
    assert all(k.startswith("_orig_mod.module.") for k in sd)
    fresh = FastDataParallel(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), device_ids=["cpu"] * 2
    )
    fresh.load_state_dict(sd)
    for a, b in zip(fresh.parameters(), m.parameters()):
        assert torch.equal(a, b)
    assert fastdp.unwrap(compiled) is m
    inner = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    inner.load_state_dict(fastdp.unwrap(compiled).state_dict())
