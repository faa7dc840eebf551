"""NOTE [ Streams of a reduce across devices ] (fastdp/_transports.py) on the CPU, with CUDA's
streams and events faked; the GPU test is in tests/test_gpu_pool_and_streams.py."""

from __future__ import annotations

import torch

from fastdp import _transports
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
        [FakeGrad("cuda:2"), FakeGrad("cuda:2", torch.sparse_coo)],
    ]
    _transports.transport_for([dest]).order_reads(rows, dest)
    on_dest = streams[dest]
    for d in (1, 2):
        (event,) = streams[torch.device("cuda", d)].waited  # one wait per device
        assert event.on is on_dest
    assert on_dest.waited == [] and all(g.read_on == [] for g in rows[0])
    assert [g.read_on for g in rows[1]] == [[streams[torch.device("cuda", 1)]]] * 2
    assert rows[2][0].read_on == [streams[torch.device("cuda", 2)]] and rows[2][1].read_on == []


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
