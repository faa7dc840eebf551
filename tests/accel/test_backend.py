"""The test device (tests/accel) against the semantics of a CUDA machine with three GPUs: devices
and the current device per thread, streams and events, memory per device, the ops of a training
step, and in asynchronous mode the stale read of a missing wait. Its own process:
``python -m pytest tests/accel``."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import accel

NAME = accel.enable(3)  # at import: before the process's first backward


def dev(i: int) -> torch.device:
    return torch.device(NAME, i)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def mode(request):
    """The test in synchronous, then asynchronous mode (synchronous again after it)."""
    accel.enable(3, asynchronous=request.param)
    yield request.param
    accel.enable(3, asynchronous=False)


@pytest.fixture
def asynchronous():
    accel.enable(3, asynchronous=True)
    yield
    accel.enable(3, asynchronous=False)


def in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join()
    return out["v"]


def test_torch_accelerator_answers_for_three_devices():
    assert torch.accelerator.current_accelerator() == torch.device(NAME)
    assert torch.accelerator.is_available() and torch.accelerator.device_count() == 3
    for i in range(3):
        assert torch.empty(2, device=dev(i)).device == dev(i)
        assert torch.empty_strided((2, 3), (1, 2), device=f"{NAME}:{i}").stride() == (1, 2)
    with pytest.raises(RuntimeError, match="invalid device index 3"):
        torch.empty(2, device=dev(3))


def test_current_device_is_per_thread_and_guarded():
    torch.accelerator.set_device_index(1)
    try:
        assert torch.accelerator.current_device_index() == 1
        assert torch.empty(1, device=NAME).device == dev(1)
        assert in_thread(torch.accelerator.current_device_index) == 0  # a new thread: device 0
        with torch.accelerator.device_index(2):
            assert torch.zeros(1, device=NAME).device == dev(2)
        assert torch.accelerator.current_device_index() == 1
    finally:
        torch.accelerator.set_device_index(0)


def test_streams_are_per_thread_and_per_device():
    side = torch.Stream(device=dev(1))
    assert side.device == dev(1) and side != torch.accelerator.current_stream(1)
    before0, before1 = torch.accelerator.current_stream(0), torch.accelerator.current_stream(1)
    torch.accelerator.set_stream(side)
    try:
        assert torch.accelerator.current_stream(1) == side
        assert torch.accelerator.current_stream(0) == before0  # other devices keep theirs
        assert torch.accelerator.current_device_index() == 1  # set_stream enters its device
        assert in_thread(lambda: torch.accelerator.current_stream(1)) == before1
    finally:
        torch.accelerator.set_stream(before1)
        torch.accelerator.set_device_index(0)


def test_events_record_wait_query_synchronize(asynchronous):
    src = torch.arange(6.0).pin_memory()
    dst = torch.empty(6, device=dev(2))
    side = torch.Stream(device=dev(2))
    event = torch.Event(device=dev(2))
    with side:
        dst.copy_(src, non_blocking=True)
        event.record(side)
    assert accel.pending(2, side.stream_id) == 1
    assert event.query() and accel.pending(2, side.stream_id) == 0  # query runs what it needs
    event.synchronize()
    assert torch.equal(dst.cpu(), src)
    timed = [torch.Event(device=dev(2), enable_timing=True) for _ in range(2)]
    for e in timed:
        e.record()
    with pytest.raises(RuntimeError, match="elapsed_time is not supported"):
        timed[0].elapsed_time(timed[1])


def test_copies_round_trip_across_devices(mode):
    x = torch.randn(4, 5)
    on0 = x.to(dev(0), non_blocking=True)
    on2 = on0.t().to(dev(2)).t()  # strided, device to device
    assert on2.device == dev(2)
    assert torch.equal(on2.to(torch.float64).cpu(), x.double())
    back = torch.empty(5, 4).pin_memory()
    back.copy_(on2.t(), non_blocking=True)
    torch.accelerator.synchronize(2)
    assert torch.equal(back, x.t())


def test_memory_is_counted_per_device():
    before = [torch.get_device_module(NAME).memory_allocated(i) for i in range(3)]
    x = torch.empty(256, device=dev(1))
    after = [torch.get_device_module(NAME).memory_allocated(i) for i in range(3)]
    assert after[1] - before[1] == x.nbytes and after[0] == before[0] and after[2] == before[2]
    del x
    assert torch.get_device_module(NAME).memory_allocated(1) == before[1]


def test_an_op_on_two_devices_raises():
    a, b = torch.ones(3, device=dev(0)), torch.ones(3, device=dev(1))
    with pytest.raises(RuntimeError, match="same device"):
        a + b
    assert torch.equal((a + b.to(dev(0))).cpu(), torch.full((3,), 2.0))


def test_foreach_ops_run_per_tensor_on_each_device():
    dst = [torch.zeros(2, device=dev(i)) for i in range(3)]
    torch._foreach_copy_(dst, [torch.full((2,), float(i), device=dev(i)) for i in range(3)])
    doubled = torch._foreach_add(dst, dst)
    assert [d.device for d in doubled] == [dev(0), dev(1), dev(2)]
    assert [d.cpu().tolist() for d in doubled] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]
    with pytest.raises(RuntimeError, match="same device"):
        torch._foreach_add_(dst, [dst[1], dst[0], dst[2]])


def test_views_share_storage():
    x = torch.zeros(4, 6, device=dev(1))
    x.view(6, 4)[0].fill_(1.0)
    x.t()[5, 1:3] = 2.0
    x.reshape(24)[-1] = 3.0
    want = torch.zeros(4, 6)
    want.view(6, 4)[0] = 1.0
    want.t()[5, 1:3] = 2.0
    want.reshape(24)[-1] = 3.0
    assert torch.equal(x.cpu(), want)


def test_a_consumer_without_a_wait_reads_stale_memory(asynchronous):
    src = torch.arange(8.0).pin_memory()
    dst = torch.empty(8, device=dev(0))  # fresh memory is NaN
    side = torch.Stream(device=dev(0))
    with side:
        dst.copy_(src, non_blocking=True)
    assert torch.isnan(dst.cpu()).all()  # the current stream did not wait for the side stream
    torch.accelerator.current_stream(0).wait_stream(side)
    assert torch.equal(dst.cpu(), src)


def test_a_copy_to_another_device_is_ordered_with_its_current_stream_only(asynchronous):
    x = torch.arange(5.0, device=dev(0))
    y = x.to(dev(1))  # queued on device 0's current stream; device 1's current stream waits
    main, side = torch.accelerator.current_stream(1), torch.Stream(device=dev(1))
    with side:
        stale = y.cpu()
        side.wait_stream(main)
        fresh = y.cpu()
    assert torch.isnan(stale).all() and torch.equal(fresh, torch.arange(5.0))


def test_synchronize_drains_every_stream_of_the_device(asynchronous):
    streams = [torch.Stream(device=dev(1)) for _ in range(3)]
    outs = [torch.empty(3, device=dev(1)) for _ in streams]
    for s, out in zip(streams, outs):
        with s:
            out.copy_(torch.ones(3).pin_memory(), non_blocking=True)
    assert all(accel.pending(1, s.stream_id) == 1 for s in streams)
    torch.accelerator.set_device_index(1)
    try:
        torch.accelerator.synchronize()
    finally:
        torch.accelerator.set_device_index(0)
    assert all(accel.pending(1, s.stream_id) == 0 for s in streams)
    assert all(torch.equal(o.cpu(), torch.ones(3)) for o in outs)


def test_backward_runs_on_the_device_of_its_op():
    seen = []
    x = torch.ones(3, device=dev(2), requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(torch.accelerator.current_device_index()))
    y.sum().backward()
    assert seen == [2] and torch.equal(x.grad.cpu(), torch.full((3,), 2.0))


def train(model, batches, step_device):
    """Three SGD steps; returns the parameters on the CPU."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(step_device)), y.to(step_device))
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_training_loop_on_each_device_equals_cpu(mode, index):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    batches = [(torch.randn(5, 6), torch.randn(5, 2)) for _ in range(3)]
    want = train(copy.deepcopy(model), batches, "cpu")
    got = train(copy.deepcopy(model).to(f"{NAME}:{index}"), batches, dev(index))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


class TwoDevices(torch.nn.Module):
    """A model split over devices 0 and 2: its backward crosses devices on autograd's threads."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.a(x.to(self.a.weight.device)))
        return self.b(h.to(self.b.weight.device))


def test_a_model_split_over_two_devices_trains_as_on_cpu(mode):
    torch.manual_seed(0)
    model = TwoDevices()
    batches = [(torch.randn(5, 6), torch.randn(5, 2)) for _ in range(3)]
    want = train(copy.deepcopy(model), batches, "cpu")
    split = copy.deepcopy(model)
    split.a.to(dev(0))
    split.b.to(dev(2))
    got = train(split, batches, dev(2))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


class Layers(torch.nn.Module):
    """The layers whose ops torch routes to a backend's own kernels (convolutions, batch norm's
    running statistics, the fused RNN cells), not to the CPU fallback."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm1d(4)
        self.lstm = torch.nn.LSTM(4, 4, batch_first=True)
        self.gru = torch.nn.GRU(4, 2, batch_first=True)

    def forward(self, x):
        h = self.bn(self.conv(x)).transpose(1, 2)
        return self.gru(self.lstm(h)[0])[0].sum(1)


def test_convolution_batch_norm_and_rnn_layers_train_as_on_cpu(mode):
    torch.manual_seed(0)
    model = Layers().double()
    batches = [(torch.randn(5, 3, 7).double(), torch.randn(5, 2).double()) for _ in range(3)]
    ref = copy.deepcopy(model)
    want = train(ref, batches, "cpu")
    on = copy.deepcopy(model).to(dev(1))
    got = train(on, batches, dev(1))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(on.bn.running_mean.cpu(), ref.bn.running_mean)
