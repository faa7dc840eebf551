"""What a training loop does around ``ZeroRedundancyOptimizer.step()`` works as with the
unsharded optimizer, bit for bit on CPU replicas (both storage modes): ``.grad`` read and rescaled
before the step (``clip_grad_norm_``, ``GradScaler``), LR schedulers, ``no_sync`` accumulation,
frozen parameters, a group added mid-training, a partial last batch, ``persistent=False``,
compiled replicas, ``zero_grad(set_to_none=False)`` and a closure."""

import pytest
import torch
from torch import nn
from zero_helpers import Twin


@pytest.fixture(params=["threads", "inline", "auto"])
def launch(request):
    """Every test under each launch strategy of the wrapper (the owners follow it)."""
    return request.param


def test_clip_grad_norm_before_the_step(storage, launch):
    norms = []

    def clip(twin):
        norms.append([nn.utils.clip_grad_norm_(n.parameters(), 0.05) for n in twin.nets])

    twin = Twin("transformer", "adamw_foreach", launch=launch)
    twin.train(5, between=clip)
    twin.assert_same()
    assert all(torch.equal(a, b) for a, b in norms) and any(a > 0.05 for a, _ in norms)


def test_grad_scaler_with_cpu_autocast_fp16(storage, launch):
    """torch.amp.GradScaler('cpu') under fp16 autocast: unscale_, then a clip, then its step
    (skipped on both when a gradient is not finite), then update."""
    twin = Twin("mlp", "adam", launch=launch)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    for step in range(6):
        x = twin.batch()
        if step == 3:
            x[0, 0] = float("inf")  # this step's gradients overflow: both scalers skip it
        for m, o, s in zip(twin.models, twin.opts, scalers):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).square().mean()
            s.scale(loss).backward()
            s.unscale_(o)
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            s.step(o)
            s.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert scalers[0].get_scale() < 2.0**10  # the overflow was seen
    twin.assert_same()


def test_lr_scheduler_drives_every_owner(storage, launch):
    twin = Twin("mlp", "sgd_momentum", launch=launch)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.1) for o in twin.opts]

    for _ in range(5):
        twin.train(1)
        for s in scheds:
            s.step()
    assert twin.zero.param_groups[0]["lr"] == twin.plain.param_groups[0]["lr"] < 0.05 / 10
    twin.assert_same()


def test_no_sync_accumulation(storage, launch):
    twin = Twin("transformer", "adamw_single", launch=launch)
    for _ in range(3):
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


def test_frozen_parameter_keeps_its_value_and_gets_no_state(storage, launch):
    twin = Twin("mlp", "adamw_foreach", launch=launch)
    frozen = [n[0].weight for n in twin.nets]
    before = frozen[0].detach().clone()
    for p in frozen:
        p.requires_grad_(False)
    twin.train(4)
    twin.assert_same()
    assert torch.equal(frozen[0], before)
    assert frozen[0] not in twin.zero.state


def test_param_group_added_mid_training(storage, launch):
    twin = Twin("mlp", "adamw_foreach", params=lambda m: m.module[:2].parameters(), launch=launch)
    twin.train(2)
    for net, o in zip(twin.nets, twin.opts):
        o.add_param_group({"params": list(net[2:].parameters()), "lr": 3e-3})
    twin.train(3)
    twin.assert_same()
    added = {twin.zero.owner_of(p) for p in twin.nets[0][2:].parameters()}
    assert len(added) > 1  # the new group is sharded too


def test_partial_last_batch(storage, launch):
    twin = Twin("mlp", "sgd_momentum", launch=launch)
    twin.train(2)
    twin.train(1, b=3)  # three rows on four replicas: three replicas run, four owners step
    twin.train(1, b=5)
    twin.assert_same()


def test_fresh_replicas(storage, launch):
    twin = Twin("transformer", "adam", persistent=False, launch=launch)
    twin.train(4)
    twin.assert_same()


def test_compiled_replicas(storage, launch):
    twin = Twin("mlp", "adamw_foreach", launch=launch)
    for m in twin.models:
        m.compile(backend="eager")
    twin.train(4)
    twin.assert_same()


def test_zero_grad_to_zeros_and_a_closure(storage, launch):
    twin = Twin("mlp", "sgd_momentum", launch=launch)
    x = twin.batch()
    for _ in range(3):
        losses = []
        for m, o in zip(twin.models, twin.opts):
            o.zero_grad(set_to_none=False)

            def closure(m=m):
                loss = m(x).square().mean()
                loss.backward()
                return loss

            losses.append(o.step(closure))
        assert torch.equal(losses[0], losses[1])
    twin.assert_same()


def test_model_state_dict_after_step_holds_the_updated_parameters(storage, launch):
    twin = Twin("cnn_bn", "adam", launch=launch)
    before = {k: v.clone() for k, v in twin.models[0].state_dict().items()}
    twin.train(1)
    after = twin.models[0].state_dict()
    moved = [k for k in before if k.endswith("weight") and not torch.equal(before[k], after[k])]
    assert len(moved) == sum(k.endswith("weight") for k in before)
    assert after.keys() == twin.models[1].state_dict().keys()
    twin.assert_same()


def test_writes_to_the_model_between_steps_reach_the_owners(storage, launch):
    """``load_state_dict`` on the model and writes through ``.data`` (which no version counter
    sees) after the optimizer was built: owners stepping master copies step the new values."""
    twin = Twin("mlp", "adamw_foreach", launch=launch)
    twin.train(2)
    fresh = Twin("mlp", "adam", seed=7).nets[0].state_dict()
    for m in twin.models:
        m.load_state_dict(fresh)
    twin.train(2)

    def clamp(twin):
        for net in twin.nets:
            for p in net.parameters():
                p.data.clamp_(-0.05, 0.05)

    twin.train(2, between=clamp)
    twin.assert_same()


def test_parameters_sharing_memory_step_in_order_on_one_owner(storage, launch):
    """Tied weights loaded with ``assign=True`` become two parameters on one storage: both updates
    must land on the same bytes in parameter order, as with the unsharded optimizer."""
    import copy

    import fastdp

    def tied():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 6))
        net[3].weight = net[0].weight
        net.load_state_dict(copy.deepcopy(net.state_dict()), assign=True)
        assert net[3].weight is not net[0].weight
        assert net[3].weight.data_ptr() == net[0].weight.data_ptr()
        return net

    nets = [tied(), tied()]  # deepcopy would give each parameter storage of its own
    net = nets[0]
    models = [fastdp.FastDataParallel(m, ["cpu"] * 4, launch=launch) for m in nets]
    kw = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    opts = [
        fastdp.ZeroRedundancyOptimizer(models[0].parameters(), torch.optim.SGD, **kw),
        torch.optim.SGD(models[1].parameters(), **kw),
    ]
    for _ in range(4):
        x = torch.randn(8, 6)
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(p, q)
    assert opts[0].owner_of(net[0].weight) == opts[0].owner_of(net[3].weight) == 0
