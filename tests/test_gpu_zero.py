"""On GPUs: ``ZeroRedundancyOptimizer`` against the unsharded optimizer on the same wrapper
configuration (float tolerance: CUDA kernels may differ in order), with repeated ids on one GPU
and with owners on distinct GPUs (master copies, cross-device copies on the caller's streams)."""

import copy

import pytest
import torch
from models import ARCHS
from torch.testing import assert_close

import fastdp
from fastdp.testing import onlyCUDA, onlyMultiGPU

pytestmark = onlyCUDA


def _train(ids, arch, opt_cls, kw, steps=5, launch=None):
    factory, make_input, _ = ARCHS[arch]
    torch.manual_seed(0)
    nets = [factory().cuda()]
    nets.append(copy.deepcopy(nets[0]))
    models = [fastdp.FastDataParallel(n, device_ids=ids) for n in nets]
    opts = [
        fastdp.ZeroRedundancyOptimizer(models[0].parameters(), opt_cls, launch=launch, **kw),
        opt_cls(models[1].parameters(), **kw),
    ]
    for _ in range(steps):
        x = make_input(8).cuda()
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for (k, p), q in zip(nets[0].named_parameters(), nets[1].parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    return opts


@pytest.mark.parametrize("arch", ["mlp", "transformer"])
@pytest.mark.parametrize("foreach", [False, True])
def test_repeated_ids_on_one_gpu(arch, foreach):
    opts = _train([0, 0], arch, torch.optim.AdamW, {"lr": 1e-2, "foreach": foreach})
    stats = opts[0].memory_stats()
    assert set(stats) == {"cuda:0#0", "cuda:0#1"}
    assert all(s["master_copies"] == 0 for s in stats.values())


@onlyMultiGPU
@pytest.mark.parametrize("arch", ["mlp", "transformer"])
def test_owners_on_distinct_gpus(arch):
    ids = list(range(torch.cuda.device_count()))
    opts = _train(ids, arch, torch.optim.AdamW, {"lr": 1e-2, "fused": True})
    stats = opts[0].memory_stats()
    assert stats["cuda:0"]["master_copies"] == 0
    assert all(stats[f"cuda:{i}"]["optimizer_state"] > 0 for i in ids)
    zero = opts[0]
    for p in zero.param_groups[0]["params"]:
        devices = {v.device for v in zero.state[p].values() if v.dim() > 0}
        assert devices == {torch.device("cuda", ids[zero.owner_of(p)])}


@pytest.mark.parametrize("launch", ["threads", "inline"])
def test_caller_on_a_side_stream(launch):
    """The owners copy and step on the caller's current streams, also from worker threads."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        opts = _train([0, 0], "mlp", torch.optim.AdamW, {"lr": 1e-2}, launch=launch)
    stats = opts[0].memory_stats()  # _train compared the parameters with the unsharded run's
    assert stats["cuda:0#0"]["optimizer_state"] > 0 and stats["cuda:0#1"]["optimizer_state"] > 0
