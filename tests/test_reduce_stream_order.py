"""The streams and NCCL calls of a reduce on the CPU, CUDA's streams, events and NCCL calls
faked: NOTE [ Streams of a reduce across devices ] and ``NCCL_LOCK`` in
fastdp/_transports.py, the nodes relinked on a stream change in
``Reducer.prepare_for_backward``. The GPU tests are in tests/test_gpu_pool_and_streams.py."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import fastdp._reducer
import fastdp.sync_batchnorm
from fastdp import FastDataParallel, _backend, _transports
from fastdp._reducer import reduce_add


class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device, self.waited = device, []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class FakeEvent:
    def __init__(self) -> None:
        self.on = None

    def record(self, stream) -> None:
        self.on = stream


class FakeGrad:
    def __init__(self, device: str, layout=torch.strided) -> None:
        self.device, self.layout, self.read_on = torch.device(device), layout, []

    def record_stream(self, stream) -> None:
        self.read_on.append(stream)


class FakeSparse(FakeGrad):
    """A sparse COO gradient: its blocks are its indices' and values'."""

    def __init__(self, device: str) -> None:
        super().__init__(device, torch.sparse_coo)
        self.indices, self.values = FakeGrad(device), FakeGrad(device)

    def record_stream(self, stream) -> None:
        raise AssertionError("torch cannot record a stream on a sparse tensor")

    def _indices(self) -> FakeGrad:
        return self.indices

    def _values(self) -> FakeGrad:
        return self.values


def test_replicas_on_other_gpus_are_read_after_the_destinations_stream(monkeypatch) -> None:
    streams: dict[torch.device, FakeStream] = {}

    def current_stream(device=None):
        return streams.setdefault(torch.device(device), FakeStream(torch.device(device)))

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    dest = torch.device("cuda", 0)
    rows = [
        [FakeGrad("cuda:0"), FakeGrad("cuda:0")],
        [FakeGrad("cuda:1"), FakeGrad("cuda:1")],
        [FakeGrad("cuda:2"), FakeSparse("cuda:2")],
    ]
    _transports.transport_for([dest]).order_reads(rows, dest)
    on_dest = streams[dest]
    for d in (1, 2):
        (event,) = streams[torch.device("cuda", d)].waited  # one wait per device
        assert event.on is on_dest
    assert on_dest.waited == [] and all(g.read_on == [] for g in rows[0])
    assert [g.read_on for g in rows[1]] == [[streams[torch.device("cuda", 1)]]] * 2
    on_2 = [streams[torch.device("cuda", 2)]]
    assert rows[2][0].read_on == on_2  # a sparse gradient: its indices and values, as torch's
    assert rows[2][1].indices.read_on == on_2 and rows[2][1].values.read_on == on_2


def test_replicas_all_on_the_destination_need_no_event(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", lambda: (_ for _ in ()).throw(AssertionError))
    dest = torch.device("cuda", 0)
    _transports.transport_for([dest]).order_reads([[FakeGrad("cuda:0")]] * 2, dest)


def test_reduce_add_orders_the_reads_before_it_reduces(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(
        _transports._CpuTransport, "order_reads", staticmethod(lambda rows, d: seen.append(d))
    )
    out = reduce_add([[torch.ones(2)], [torch.ones(2)]], torch.device("cpu"))
    assert seen == [torch.device("cpu")] and torch.equal(out[0], torch.full((2,), 2.0))


class FakeFlat:
    """A flat as the CUDA transport's reduce sees it (no GPU here)."""

    def __init__(self, device: str) -> None:
        self.device, self.layout, self.dtype = torch.device(device), torch.strided, torch.float32


def test_two_threads_nccl_calls_never_overlap(monkeypatch) -> None:
    """``NCCL_LOCK``: broadcasts and reduces of the CUDA transport from two
    threads at once reach torch's NCCL calls (faked) one at a time. Each fake call waits up to
    0.5 s for the other thread's to join it, which only an unserialised caller can."""
    guard, both_in = threading.Lock(), threading.Event()
    inside, most, made = [0], [0], [0]

    def nccl_call(*args, **kwargs):
        with guard:
            made[0] += 1
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] == 2:
                both_in.set()
        both_in.wait(timeout=0.5)
        with guard:
            inside[0] -= 1
        return torch.zeros(1)

    monkeypatch.setattr(_transports.torch_comm, "broadcast", nccl_call)
    monkeypatch.setattr(_transports.torch_comm, "reduce_add", nccl_call)
    cuda = _transports.transport_for([torch.device("cuda", 0)])
    flats = [FakeFlat("cuda:0"), FakeFlat("cuda:1")]
    for calls in (
        [lambda: cuda.broadcast(torch.ones(4), [torch.empty(4)])] * 2,
        [lambda: cuda.reduce(flats, torch.device("cuda", 0))] * 2,
        [lambda: cuda.broadcast(torch.ones(4), [torch.empty(4)]),
         lambda: cuda.reduce(flats, torch.device("cuda", 1))],
    ):  # fmt: skip
        both_in.clear()
        threads = [threading.Thread(target=fn) for fn in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert made[0] == 6 and most[0] == 1


@pytest.mark.skipif(not _backend.loaded(), reason="fastdp._C is not built")
def test_the_nodes_are_linked_afresh_when_the_destinations_stream_changes(monkeypatch) -> None:
    """Nodes follow the current stream (``Reducer.prepare_for_backward``), the current stream
    faked on CPU replicas: the extension's nodes serve every step under one stream, a step under
    another gets new ones, and the gradients stay the plain module's."""
    stream, links = ["default"], []
    link_bucket = fastdp._reducer.link_bucket
    monkeypatch.setattr(fastdp._reducer, "_stream_of", lambda device: stream[0], raising=False)
    monkeypatch.setattr(
        fastdp._reducer, "link_bucket", lambda *a, **k: links.append(1) or link_bucket(*a, **k)
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(net)
    with _backend.use_extension(True):
        dp = FastDataParallel(net, ["cpu"] * 2)
        per_step = []
        for s in ("default", "default", "side", "side", "default"):
            stream[0] = s
            x = torch.randn(6, 4)
            for m, model in ((dp, net), (ref, ref)):
                model.zero_grad(set_to_none=True)
                m(x).square().sum().backward()
            for p, q in zip(net.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            per_step.append(len(links))
    n = per_step[0]  # one link per bucket, made with the replicas in the first step
    assert n > 0 and per_step == [n, n, 2 * n, 2 * n, 3 * n]


class FakeStat(FakeGrad):
    """A replica's SyncBatchNorm statistic: ``.to(dev)`` copies it (torch reads it on the source's
    current stream when the devices differ)."""

    def to(self, device) -> FakeStat:
        return FakeStat(str(device))


def test_sync_batchnorm_records_statistics_on_the_stream_that_reads_them(monkeypatch) -> None:
    """Each replica's statistics are kept alive for the stream that reads them: the destination's
    for its own device, the source device's current stream for another GPU's (the copy's)."""
    streams: dict[torch.device, FakeStream] = {}

    def current_stream(device=None):
        return streams.setdefault(torch.device(device), FakeStream(torch.device(device)))

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    dev = torch.device("cuda", 0)
    payloads = [(FakeStat(f"cuda:{d}"), FakeStat(f"cuda:{d}"), 2, FakeEvent()) for d in (0, 1)]
    held: list = []
    means, _, counts = fastdp.sync_batchnorm._collect(payloads, dev, held)
    assert counts == [2, 2] and all(m.device == dev for m in means)
    for d, (mean, var, _, event) in enumerate(payloads):
        assert streams[dev].waited.count(event) == 1
        reader = streams[torch.device("cuda", d)]
        assert mean.read_on == [reader] and var.read_on == [reader], d
    assert held == []  # CUDA records the streams: nothing held
