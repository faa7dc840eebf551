"""fastdp on the test device (tests/accel): three devices of an accelerator that is not CUDA, in
asynchronous mode, against the plain module on ``torch.chunk`` chunks. Its own process:
``python -m pytest tests/accel``."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn

import accel
from fastdp import FastDataParallel

NAME = accel.enable(3)  # at import: before the process's first backward


@pytest.fixture(autouse=True)
def asynchronous():
    accel.enable(3, asynchronous=True)
    yield
    accel.enable(3, asynchronous=False)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def chunk_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> None:
    loss = sum(
        nn.functional.mse_loss(model(c), t, reduction="sum") for c, t in zip(x.chunk(n), y.chunk(n))
    )
    loss.backward()


IDS = {
    "ints": [0, 1, 2],
    "mixed": [0, 0, 1],
    "strings": [f"{NAME}:0", f"{NAME}:1", f"{NAME}:2"],
    "devices": [torch.device(NAME, 2), torch.device(NAME, 0), torch.device(NAME, 1)],
}


@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_a_training_step_on_three_devices_equals_the_chunks(launch, ids):
    ref, model = mlp(), mlp()
    home = torch.device(NAME, ids[0]) if isinstance(ids[0], int) else torch.device(ids[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "CUDA is not available; the module runs directly"
        dp = FastDataParallel(model.to(home), device_ids=ids)
    assert dp.device_ids == [torch.device(i).index if not isinstance(i, int) else i for i in ids]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        x, y = torch.randn(6, 6), torch.randn(6, 2)
        out = dp(x.to(home))
        assert out.device == home
        nn.functional.mse_loss(out, y.to(home), reduction="sum").backward()
        chunk_step(ref, x, y, 3)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.device == home
            torch.testing.assert_close(p.grad.cpu(), q.grad)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())


def test_ids_default_to_every_device_and_name_the_current_one():
    dp = FastDataParallel(mlp().to(f"{NAME}:0"))
    assert dp.device_ids == [0, 1, 2] and dp.output_device == 0
    torch.accelerator.set_device_index(1)
    try:
        dp = FastDataParallel(mlp().to(f"{NAME}:1"), device_ids=[NAME, 2])
    finally:
        torch.accelerator.set_device_index(0)
    assert dp.device_ids == [1, 2]
    with pytest.raises(ValueError, match="mixes CPU and FDPACCEL"):
        FastDataParallel(mlp(), device_ids=["cpu", 0])


class CurrentDevice(nn.Module):
    """Allocates on "the current device" and records it, as much user code does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.accelerator.current_device_index())
        return self.lin(x) + torch.ones(2, device=NAME)


def test_every_replica_runs_inside_its_device(launch):
    model = CurrentDevice().to(f"{NAME}:0")
    dp = FastDataParallel(model, device_ids=[2, 0, 1])
    model.seen = seen = []  # a list the replicas share (their dicts copy the reference)
    dp.module.to(f"{NAME}:2")
    out = dp(torch.randn(6, 6, device=f"{NAME}:2"))
    out.sum().backward()
    assert sorted(seen) == [0, 1, 2] and torch.accelerator.current_device_index() == 0
    assert model.lin.weight.grad.device == torch.device(NAME, 2)


def test_the_callers_side_stream_reaches_every_replica(launch):
    """Replicas sharing device 0 run on the caller's side stream, which holds a non-blocking copy
    still queued (asynchronous mode): on the default stream they would read NaN."""
    model = mlp()
    dp = FastDataParallel(copy.deepcopy(model).to(f"{NAME}:0"), device_ids=[0, 0, 0])
    x = torch.randn(6, 6).pin_memory()
    with torch.Stream(device=torch.device(NAME, 0)):
        got = dp(x.to(f"{NAME}:0", non_blocking=True)).cpu()
    torch.testing.assert_close(got, model(x))


@pytest.mark.parametrize("persistent", [True, False])
def test_a_method_bound_in_the_instance_dict_runs_with_each_replicas_weights(launch, persistent):
    """A forward bound to the master in its ``__dict__`` (accelerate's convert_outputs_to_fp32)
    is rebound to each replica: the replica on device k computes with its own weights."""
    ref, model = mlp(), mlp().to(f"{NAME}:0")
    model.forward = types.MethodType(type(model).forward, model)
    model[0].forward = model[0].forward  # a child's, bound to the child
    dp = FastDataParallel(model, device_ids=[0, 1, 2], persistent=persistent)
    for _ in range(2):  # a persistent set's second step starts from its restored dicts
        x, y = torch.randn(6, 6), torch.randn(6, 2)
        out = dp(x.to(f"{NAME}:0"))
        nn.functional.mse_loss(out, y.to(out.device), reduction="sum").backward()
        chunk_step(ref, x, y, 3)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad)
    assert model.forward.__self__ is model and model[0].forward.__self__ is model[0]


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return head(self.lin(x))


def test_a_module_argument_reaches_every_replica_as_itself(launch):
    torch.manual_seed(0)
    model, head = Scaled(), nn.Linear(2, 2)
    ref = copy.deepcopy(model)
    seen = []
    head.register_forward_pre_hook(lambda m, args: seen.append(m))
    dp = FastDataParallel(model.to(f"{NAME}:0"), device_ids=[0, 0, 0])
    x = torch.randn(6, 6)
    got = dp(x.to(f"{NAME}:0"), head.to(f"{NAME}:0")).cpu()
    assert len(seen) == 3 and all(m is head for m in seen)
    torch.testing.assert_close(got, head.cpu()(ref.lin(x)))
