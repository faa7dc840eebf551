"""fastdp's cross-device paths on the test device (tests/accel) in asynchronous mode: the
accelerator transport (broadcast, reduce, the ordered reads of a reduce), ``comm.gather``, the
caller's streams and autocast reaching the replicas, persistent replicas after an optimizer step,
gradients made by queued copies, the device of a replica without tensor inputs.
Its own process: ``python -m pytest tests/accel``."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch
from torch import nn

import accel
from fastdp import FastDataParallel, comm
from fastdp._reducer import reduce_add
from fastdp._transports import transport_for

NAME = accel.enable(3)  # at import: before the process's first backward


@pytest.fixture(autouse=True)
def asynchronous():
    accel.enable(3, asynchronous=True)
    yield
    accel.enable(3, asynchronous=False)


def dev(i: int) -> torch.device:
    return torch.device(NAME, i)


def pending_copy(values: torch.Tensor, device: torch.device, stream: torch.Stream) -> torch.Tensor:
    """Fresh memory (NaN) on ``device`` that a copy of ``values`` queued on ``stream`` fills."""
    out = torch.empty(values.shape, device=device)
    with stream:
        out.copy_(values.pin_memory(), non_blocking=True)
    assert accel.pending(device.index, stream.stream_id) == 1
    return out


def in_thread(fn):
    """``fn()`` on a new thread: default streams, as in an autograd device thread."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join()
    return out["v"]


def test_an_accelerator_has_its_own_transport():
    assert transport_for([dev(0), dev(1)]).name == "accelerator"
    assert transport_for([torch.device("cpu")]).name == "cpu"


def test_reduce_reads_other_devices_after_the_destinations_stream():
    """A bucket node's view (NOTE [ Streams of a reduce across devices ]): its stream on the
    destination waited for every gradient; the gradients on devices 1 and 2 are read on this
    thread's default streams there, which only ``order_reads``' event orders after it. Read
    directly: in ``reduce_add`` the test device's synchronous kernels on the destination (replica
    0's pack) drain the node's stream first, which a GPU's queued kernels would not."""
    values = [torch.full((4,), float(k + 1)) for k in range(3)]
    side = [torch.Stream(device=dev(k)) for k in range(3)]
    grads = [pending_copy(v, dev(k), s) for k, (v, s) in enumerate(zip(values, side))]
    node = torch.Stream(device=dev(0))
    for s in side:
        node.wait_stream(s)

    def reduce_on_the_node_stream():
        with node:
            transport_for([dev(0)]).order_reads([[g] for g in grads], dev(0))
            remote = [torch.cat([g.reshape(-1)]) for g in grads[1:]]  # read on devices 1, 2
            return [r.cpu() for r in remote]

    for got, want in zip(in_thread(reduce_on_the_node_stream), values[1:]):
        torch.testing.assert_close(got, want)  # NaN if the default streams did not wait


def test_broadcast_and_reduce_are_ordered_with_queued_copies():
    src = pending_copy(torch.arange(6.0), dev(0), torch.accelerator.current_stream(0))
    t = transport_for([dev(0)])
    dsts = [torch.empty(6, device=dev(k)) for k in (1, 2, 0)]
    t.broadcast(src, dsts)
    assert all(torch.equal(d.cpu(), torch.arange(6.0)) for d in dsts)
    got = reduce_add([[d] for d in [src, *dsts]], dev(2))[0]
    assert got.device == dev(2) and torch.equal(got.cpu(), 4 * torch.arange(6.0))


def test_reads_are_held_until_their_streams_pass_them():
    """The test device has no ``record_stream``: ``order_reads`` holds what it ordered until a
    later call of the same thread finds its streams past the reads (``_release_held``)."""
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::record_stream", "PrivateUse1")

    def reduce_twice():
        g = torch.ones(3, device=dev(1))
        ref = weakref.ref(g)
        reduce_add([[torch.ones(3, device=dev(0))], [g]], dev(0))
        del g
        gc.collect()
        held = ref() is not None
        for _ in range(2):  # the first records the events, the second finds them passed
            reduce_add([[torch.ones(3, device=dev(0))], [torch.ones(3, device=dev(1))]], dev(0))
        return held, ref() is None

    assert in_thread(reduce_twice) == (True, True)

    def reduce_once():
        g = torch.ones(3, device=dev(1))
        reduce_add([[torch.ones(3, device=dev(0))], [g]], dev(0))
        return weakref.ref(g)

    ref = in_thread(reduce_once)  # a thread that ended: its reads are released by another's calls
    assert ref() is not None
    for _ in range(2):
        reduce_add([[torch.ones(3, device=dev(0))], [torch.ones(3, device=dev(1))]], dev(0))
    assert ref() is None


def test_gather_defaults_to_the_current_device():
    parts = [torch.full((2,), float(k), device=dev(k)) for k in (1, 2)]
    torch.accelerator.set_device_index(2)
    try:
        out = comm.gather(parts)
    finally:
        torch.accelerator.set_device_index(0)
    assert out.device == dev(2) and torch.equal(out.cpu(), torch.tensor([1.0, 1, 2, 2]))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


class side_streams:
    """Enter a new stream on each of ``devices`` (the caller's side streams), as
    ``torch.accelerator.set_stream`` does for one; restores the previous ones."""

    def __init__(self, devices):
        self.devices = sorted(set(devices))

    def __enter__(self):
        self.prev = [torch.accelerator.current_stream(d) for d in self.devices]
        for d in self.devices:
            torch.accelerator.set_stream(torch.Stream(device=dev(d)))
        torch.accelerator.set_device_index(0)

    def __exit__(self, *exc):
        for s in self.prev:
            torch.accelerator.set_stream(s)
        torch.accelerator.set_device_index(0)


IDS = {"distinct": [0, 1, 2], "mixed": [0, 0, 1]}


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_steps_on_side_streams_equal_the_chunks(launch, ids, persistent):
    """Training steps under the caller's side streams on every device: the input chunks copied to
    devices 1 and 2 are queued on them, persistent replicas refreshed after each optimizer step."""
    ref, model = mlp(), mlp().to(dev(0))
    dp = FastDataParallel(model, device_ids=ids, persistent=persistent)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(6, 6), torch.randn(6, 2)
        with side_streams(ids):
            out = dp(x.to(dev(0)))
            nn.functional.mse_loss(out, y.to(dev(0)), reduction="sum").backward()
            opt.step(), opt.zero_grad()
            got = out.detach().cpu()
        want = torch.cat([ref(c) for c in x.chunk(len(ids))])
        torch.testing.assert_close(got, want.detach())
        nn.functional.mse_loss(want, y, reduction="sum").backward()
        ref_opt.step(), ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())


def test_replicas_run_under_the_callers_autocast(launch):
    ref, model = mlp(), mlp().to(dev(0))
    dp = FastDataParallel(model, device_ids=[0, 1, 2])
    x = torch.randn(6, 6)
    with torch.autocast(NAME, dtype=torch.bfloat16):
        out = dp(x.to(dev(0)))
    assert out.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.cat([copy.deepcopy(ref)(c) for c in x.chunk(3)])
    torch.testing.assert_close(out.cpu(), want)


class Double(nn.Module):
    """Computes in float64: the backward of each cast is a copy, queued on its stream."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight.to(torch.float64)
        return (x.to(torch.float64) @ w.t()).float() + self.lin.bias


@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_gradients_made_by_queued_copies_reach_the_input_and_parameters(launch, ids):
    torch.manual_seed(0)
    ref = Double()
    model = copy.deepcopy(ref).to(dev(0))
    dp = FastDataParallel(model, device_ids=ids)
    x = torch.randn(6, 6)
    xd = x.to(dev(0)).requires_grad_()
    with side_streams(ids):
        dp(xd).sum().backward()
        grads = [xd.grad.cpu()] + [p.grad.cpu() for p in model.parameters()]
    xr = x.clone().requires_grad_()
    torch.cat([ref(c) for c in xr.chunk(len(ids))]).sum().backward()
    for got, want in zip(grads, [xr.grad] + [p.grad for p in ref.parameters()]):
        torch.testing.assert_close(got, want)


class Allocates(nn.Module):
    """Takes no tensor input: allocates on the current device and records it."""

    def forward(self) -> torch.Tensor:
        return torch.ones(2, device=NAME) * torch.accelerator.current_device_index()


def test_a_replica_without_tensor_inputs_runs_on_the_current_device(launch):
    from fastdp.parallel_apply import parallel_apply

    torch.accelerator.set_device_index(2)
    try:
        out = parallel_apply([Allocates(), Allocates()], [(), ()], launch=launch)
    finally:
        torch.accelerator.set_device_index(0)
    assert [o.device for o in out] == [dev(2), dev(2)]
    assert all(torch.equal(o.cpu(), torch.full((2,), 2.0)) for o in out)
