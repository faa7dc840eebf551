"""``ZeroRedundancyOptimizer`` equals the unsharded optimizer bit for bit on CPU replicas: the
parameters, buffers and gradients of the model and the optimizer's state dict, after five steps,
for each optimizer and model, both storage modes and every launch strategy; and torch's layout
both ways (a checkpoint of one loads into the other)."""

import copy
import io

import pytest
import torch
from zero_helpers import OPTIMIZERS, Twin, assert_state_dicts_equal

import fastdp
from fastdp.testing import DEVICE_KINDS

LAUNCHES = ["threads", "inline", "auto"]
# An accelerator's replicas: sharing cuda:0, or the test device's distinct devices
# (FASTDP_TEST_ACCEL=1, asynchronous).
ACCELERATORS = DEVICE_KINDS[1:]


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("arch", ["mlp", "transformer", "cnn_bn"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_five_steps_equal_the_unsharded_optimizer(storage, opt, arch, launch):
    twin = Twin(arch, opt, launch=launch)
    twin.train(5)
    twin.assert_same()
    owners = {twin.zero.owner_of(p) for p in twin.nets[0].parameters()}
    assert len(owners) >= 3  # contiguous runs: one dominant tensor may leave one index empty


@pytest.mark.parametrize("kind", ACCELERATORS)
@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("arch", ["mlp", "cnn_bn"])
def test_five_steps_on_an_accelerator_equal_the_unsharded_optimizer(kind, arch, launch):
    twin = Twin(arch, "adamw_foreach", launch=launch, kind=kind)
    twin.train(5)
    twin.assert_same()


@pytest.mark.parametrize("kind", ACCELERATORS)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_no_sync_micro_steps_on_an_accelerator(kind, launch):
    twin = Twin("transformer", "adamw_single", launch=launch, kind=kind)
    for _ in range(2):
        for o in twin.opts:
            o.zero_grad()
        x = twin.batch()
        for m in twin.models:
            with m.no_sync():
                m(x).sum().backward()
        twin.backward()
        for o in twin.opts:
            o.step()
    twin.assert_same()


@pytest.mark.parametrize("kind", ACCELERATORS)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_owners_step_on_the_callers_side_stream(kind, launch):
    """Gradients written by non-blocking copies still queued on the caller's side stream (on
    the test device: asynchronous mode) are what every owner steps with, on its worker too."""
    twin = Twin("mlp", "sgd_momentum", launch=launch, kind=kind)
    twin.backward()
    side = torch.Stream(device=twin.device)
    params = [p for net in twin.nets for p in net.parameters()]
    pinned = [p.grad.cpu().pin_memory() for p in params]
    with side:
        for p, g in zip(params, pinned):
            p.grad = g.to(twin.device, non_blocking=True)
        for o in twin.opts:
            o.step()
    torch.accelerator.synchronize()
    twin.assert_same()
    assert all(torch.isfinite(p).all() for p in twin.nets[0].parameters())


class Lion(torch.optim.Optimizer):
    """A user optimizer, per parameter (sign of an interpolated momentum)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.add_(m.mul(b1).add(p.grad, alpha=1 - b1).sign(), alpha=-g["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


OTHER_CLASSES = {
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "rmsprop_foreach": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "foreach": True}),
    "lion": (Lion, {"lr": 1e-3}),
}


@pytest.mark.parametrize("kind", sorted(OTHER_CLASSES))
def test_other_per_parameter_optimizers_equal_too(storage, kind):
    twin = Twin("mlp", OTHER_CLASSES[kind])
    twin.train(5)
    twin.assert_same()


@pytest.mark.parametrize("opt", ["adamw_foreach", "sgd_momentum"])
def test_checkpoint_from_the_sharded_optimizer_loads_into_a_plain_one(storage, opt):
    twin = Twin("transformer", opt)
    twin.train(3)
    buf = io.BytesIO()
    torch.save(twin.zero.state_dict(), buf)
    buf.seek(0)
    cls, kw = OPTIMIZERS[opt]
    twin.plain = cls(twin.models[1].parameters(), **kw)  # a fresh plain optimizer
    twin.plain.load_state_dict(torch.load(buf))
    twin.opts = [twin.zero, twin.plain]
    twin.train(3)
    twin.assert_same()


@pytest.mark.parametrize("opt", ["adamw_foreach", "sgd_momentum"])
def test_checkpoint_from_a_plain_optimizer_loads_into_the_sharded_one(storage, opt):
    twin = Twin("cnn_bn", opt)
    twin.train(3)
    cls, kw = OPTIMIZERS[opt]
    twin.zero = fastdp.ZeroRedundancyOptimizer(twin.models[0].parameters(), cls, **kw)
    twin.zero.load_state_dict(copy.deepcopy(twin.plain.state_dict()))  # a checkpoint: no aliases
    twin.opts = [twin.zero, twin.plain]
    assert_state_dicts_equal(twin.zero.state_dict(), twin.plain.state_dict())
    twin.train(3)
    twin.assert_same()


def test_state_dict_loads_into_itself_and_reads_through_state(storage):
    twin = Twin("mlp", "adam")
    twin.train(2)
    sd = twin.zero.state_dict()
    twin.zero.load_state_dict(sd)
    assert_state_dicts_equal(twin.zero.state_dict(), sd)
    zero, plain = twin.zero, twin.plain
    assert len(zero.state) == len(plain.state)
    for p, q in zip(twin.nets[0].parameters(), twin.nets[1].parameters()):
        assert torch.equal(zero.state[p]["exp_avg"], plain.state[q]["exp_avg"])
    zero.consolidate_state_dict()  # torch's call before state_dict(): nothing to gather here
    assert_state_dicts_equal(zero.state_dict(), plain.state_dict())


def test_load_state_dict_rejects_another_layout():
    twin = Twin("mlp", "adam")
    sd = twin.plain.state_dict()
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match="doesn't match the size"):
        twin.zero.load_state_dict(sd)
    sd["param_groups"].append(sd["param_groups"][0])
    with pytest.raises(ValueError, match="different number of parameter groups"):
        twin.zero.load_state_dict(sd)
