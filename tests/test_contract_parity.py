"""FastDataParallel on 1-8 CPU replicas equals the plain module on the whole batch.

Outputs, input gradients and parameter gradients are compared for real architectures. With
BatchNorm in training mode each replica normalises its own chunk (as in DataParallel), so the
reference there is the plain module applied chunk by chunk.
"""

import copy

import pytest
import torch
from models import ARCHS, build
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp.testing import clone_inputs, device_of, grads_of, replica_ids, withCUDA

pytestmark = pytest.mark.usefixtures("launch")  # NOTE [ Tests under each launch strategy ]


def _reference(model, x, n, chunked):
    model.zero_grad(set_to_none=True)
    if chunked:
        out = torch.cat([model(c) for c in x.chunk(n)])
    else:
        out = model(x)
    out.sum().backward()
    return out, x.grad, grads_of(model)


@withCUDA
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_outputs_and_grads_match_plain_module(backend, kind, arch, n):
    model, make_input, has_bn = build(arch)
    dev = device_of(kind)
    model.to(dev)
    ref = copy.deepcopy(model)
    x = make_input(19).to(dev).requires_grad_()
    (x_ref,) = clone_inputs([x])

    fdp = FastDataParallel(model, device_ids=replica_ids(kind, n))
    out = fdp(x)
    out.sum().backward()
    ref_out, ref_xgrad, ref_grads = _reference(ref, x_ref, n, chunked=has_bn and n > 1)

    tol = dict(rtol=1e-4, atol=1e-5)
    assert out.device == dev and out.shape == ref_out.shape
    assert_close(out, ref_out, **tol)
    assert_close(x.grad, ref_xgrad, **tol)
    for name, g in grads_of(model).items():
        assert_close(g, ref_grads[name], **tol, msg=name)


@pytest.mark.parametrize("arch", ["mlp", "cnn_bn"])
def test_eval_mode_matches_whole_batch(backend, arch):
    model, make_input, _ = build(arch)
    model.eval()
    x = make_input(10)
    with torch.no_grad():
        ref = model(x)
        out = FastDataParallel(model, device_ids=["cpu"] * 3)(x)
    assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_training_loop_matches_plain_module(backend):
    model, make_input, _ = build("mlp")
    ref = copy.deepcopy(model)
    fdp = FastDataParallel(model, device_ids=["cpu"] * 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(10):
        x = make_input(13 + step)
        for m, o in ((fdp, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
