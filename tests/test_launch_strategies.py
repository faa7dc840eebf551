"""Launch strategies (the docstring of fastdp/_launch.py) and the caller's streams.

The end-to-end suites run under each strategy (NOTE [ Tests under each launch strategy ]); this
file tests what is specific to choosing one: the keyword and FASTDP_LAUNCH, the rule that forces
threads, ``auto``'s schedule and record, the streams replicas run on, and the per-step signature.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import fastdp._replica_set as replica_set
from fastdp import FastDataParallel
from fastdp._launch import Auto
from fastdp.parallel_apply import parallel_apply
from fastdp.testing import onlyCUDA

CPU3 = ["cpu"] * 3


class ThreadProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.threads: list[int] = []

    def forward(self, x):
        self.threads.append(threading.get_ident())
        return self.lin(x)


@pytest.mark.parametrize("launch", ["threads", "inline"])
def test_forced_strategy_runs_where_it_says(launch):
    m = ThreadProbe()
    fdp = FastDataParallel(m, device_ids=CPU3, launch=launch)
    out = fdp(torch.randn(6, 4))
    assert fdp.last_launch == launch and fdp.launch_report() == []
    caller = {threading.get_ident()}
    assert (set(m.threads) == caller) == (launch == "inline")
    assert out.shape == (6, 4)


def test_keyword_overrides_env_and_env_sets_default(monkeypatch):
    monkeypatch.setenv("FASTDP_LAUNCH", "inline")
    assert FastDataParallel(nn.Linear(2, 2), device_ids=CPU3).launch == "inline"
    assert FastDataParallel(nn.Linear(2, 2), device_ids=CPU3, launch="threads").launch == "threads"
    monkeypatch.delenv("FASTDP_LAUNCH")
    assert FastDataParallel(nn.Linear(2, 2), device_ids=CPU3).launch == "auto"


def test_unknown_strategy_is_rejected(monkeypatch):
    with pytest.raises(ValueError, match="launch must be one of"):
        FastDataParallel(nn.Linear(2, 2), device_ids=CPU3, launch="processes")
    monkeypatch.setenv("FASTDP_LAUNCH", "fibers")
    with pytest.raises(ValueError, match="from FASTDP_LAUNCH"):
        FastDataParallel(nn.Linear(2, 2), device_ids=CPU3)


@pytest.mark.parametrize("persistent", [True, False])
def test_sync_batchnorm_forces_threads(monkeypatch, persistent):
    """Run in turn, replica 0 would wait at the rendezvous for replicas not yet started."""
    monkeypatch.setenv("FASTDP_SYNC_TIMEOUT", "5")  # a regression fails in 5 s, never hangs
    net = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    ref = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ref.load_state_dict(net.state_dict())
    fdp = FastDataParallel(net, device_ids=CPU3, launch="inline", persistent=persistent)
    x = torch.randn(9, 4)
    assert_close(fdp(x), ref(x))  # statistics over the whole batch: the replicas met
    assert fdp.last_launch == "threads"
    net.eval()
    fdp(x)
    assert fdp.last_launch == "threads"  # eval: SyncBatchNorm armed all the same (one place)


class Callback(nn.Linear):
    """A module with DataParallelWithCallback's hook: its copies may talk during forward."""

    def __data_parallel_replicate__(self, ctx, copy_id):
        pass


def test_replication_callbacks_force_threads():
    fdp = FastDataParallel(nn.Sequential(Callback(4, 4)), device_ids=CPU3, launch="inline")
    fdp(torch.randn(6, 4))
    assert fdp.last_launch == "threads"


def test_inline_errors_name_the_replica_and_still_run_every_replica():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen: list[int] = []

        def forward(self, x):
            k = int(x[0, 0])
            self.seen.append(k)
            if k in (1, 2):
                raise KeyError(f"chunk {k}")
            return self.lin(x)

    m = Bad()
    fdp = FastDataParallel(m, device_ids=CPU3, launch="inline")
    x = torch.arange(3.0).repeat_interleave(2)[:, None].expand(6, 4).contiguous()
    with pytest.raises(KeyError, match="Caught KeyError in replica 1 on device cpu"):
        fdp(x)
    assert m.seen == [0, 1, 2]  # as on threads: every replica ran, the first error is raised


def test_auto_times_both_then_keeps_the_faster():
    auto = Auto()
    key = (("cpu",), (1,), True)
    ran = []
    fake = {"threads": 2.0, "inline": 1.0}
    for _ in range(2 * Auto.WARMUP + 2 * Auto.TRIALS):
        s, timed = auto.pick(key)
        ran.append((s, timed))
        if timed:
            auto.record(key, s, fake[s])
    assert ran[:2] == [("threads", False), ("inline", False)]
    assert ran[2:] == [("threads", True), ("inline", True)] * Auto.TRIALS
    assert auto.pick(key) == ("inline", False)
    (rec,) = auto.report()
    assert rec["choice"] == "inline" and rec["threads_ms"] == 2000.0 and rec["inline_ms"] == 1000.0


def test_auto_rechecks_after_recheck_steps(monkeypatch):
    monkeypatch.setattr(Auto, "RECHECK", 20)
    auto = Auto()
    key = ("k",)
    fake = {"threads": 2.0, "inline": 1.0}
    picks = []
    for _ in range(60):
        s, timed = auto.pick(key)
        picks.append(s)
        if timed:
            auto.record(key, s, fake[s])
        if auto.entries[key].trials == 1:
            fake = {"threads": 1.0, "inline": 2.0}  # the machine changed after the first trial
    assert picks[10] == "inline" and picks[-1] == "threads"
    assert auto.entries[key].trials >= 2


def test_auto_keys_by_input_signature_and_records_its_choice():
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    fdp = FastDataParallel(m, device_ids=CPU3, launch="auto")
    steps = 2 * Auto.WARMUP + 2 * Auto.TRIALS
    for _ in range(steps):
        fdp(torch.randn(6, 8)).sum().backward()
    fdp(torch.randn(9, 8))
    report = fdp.launch_report()
    assert len(report) == 2
    assert report[0]["choice"] in ("threads", "inline") and report[1]["choice"] is None
    assert report[0]["devices"] == ["cpu"] * 3 and report[0]["grad"] is True


# NOTE: the streams. CPU-visible: torch.cuda's stream functions are faked with a thread-local
# "current stream", so the test shows which stream each replica enters, without a GPU.
@pytest.fixture
def fake_streams(monkeypatch):
    local = threading.local()

    def current_stream(device=None):
        return getattr(local, "stream", "default")

    @contextlib.contextmanager
    def stream(s):
        prev = getattr(local, "stream", "default")
        local.stream = s
        try:
            yield
        finally:
            local.stream = prev

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    return stream


class StreamProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.streams: list = []

    def forward(self, x):
        self.streams.append(torch.cuda.current_stream(torch.device("cuda", 0)))
        return self.lin(x)


@pytest.mark.parametrize("launch", ["threads", "inline"])
def test_replicas_enter_the_callers_stream_functional(fake_streams, launch):
    m = StreamProbe()
    cuda0 = [torch.device("cuda", 0)] * 2
    with fake_streams("side"):
        parallel_apply([m, m], [(torch.randn(2, 4),)] * 2, None, cuda0, launch=launch)
    assert m.streams == ["side", "side"]


@pytest.mark.parametrize("launch", ["threads", "inline"])
def test_replicas_enter_the_callers_stream_persistent_workers(fake_streams, launch):
    m = StreamProbe()
    fdp = FastDataParallel(m, device_ids=CPU3, launch=launch)
    replicas = fdp.replicate(m, fdp.device_ids)
    cuda0 = [torch.device("cuda", 0)] * 3
    with torch.no_grad(), fake_streams("side"):
        fdp.parallel_apply(replicas, [(torch.randn(2, 4),)] * 3, None, cuda0)
    assert m.streams == ["side"] * 3


@onlyCUDA
@pytest.mark.parametrize("launch", ["threads", "inline", "auto"])
def test_side_stream_forward_matches_plain_module(launch):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).cuda()
    fdp = FastDataParallel(m, device_ids=[0, 0], launch=launch)
    s = torch.cuda.Stream()
    for _ in range(10):  # auto: through its trial steps too
        x = torch.randn(512, 256, device="cuda")
        with torch.no_grad():
            want = m(x)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            y = torch.randn(512, 256, device="cuda")  # made on s: replicas must run on s
            y.copy_(x)
            out = fdp(y).clone()
        torch.cuda.current_stream().wait_stream(s)
        assert_close(out, want)


def test_one_tensor_signature_per_steady_step(monkeypatch):
    data_parallel_mod = sys.modules["fastdp.data_parallel"]  # fastdp.data_parallel: the function
    calls = []
    real = replica_set.tensor_signature

    def counting(ts):
        calls.append(len(ts))
        return real(ts)

    monkeypatch.setattr(replica_set, "tensor_signature", counting)
    monkeypatch.setattr(data_parallel_mod, "tensor_signature", counting)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    fdp = FastDataParallel(m, device_ids=CPU3)
    for _ in range(3):
        fdp(torch.randn(6, 4)).sum().backward()
    calls.clear()
    fdp(torch.randn(6, 4)).sum().backward()
    assert len(calls) == 1
    with torch.no_grad():  # a swap no generation sees: the one signature must catch it
        m[0].weight.data = torch.randn(4, 4)
    x = torch.randn(6, 4)
    assert_close(fdp(x), m(x))


def test_a_new_strategy_is_one_class(monkeypatch):
    """Strategies are objects chosen in one place (fastdp/_launch.py): this one runs the
    replicas last to first on the caller's thread and needs nothing else."""
    from fastdp import _launch

    order = []

    class LastFirst(_launch.Strategy):
        name = "last-first"

        def run(self, modules, inputs, kwargs, devices, pool=None):
            out = [None] * len(modules)
            for i in reversed(range(len(modules))):
                order.append(i)
                out[i] = _launch.INLINE.run(
                    modules[i : i + 1], inputs[i : i + 1], kwargs[i : i + 1], devices[i : i + 1]
                )[0]
            return out

    monkeypatch.setitem(_launch._STRATEGIES, "last-first", LastFirst)
    m = nn.Linear(4, 2)
    fdp = FastDataParallel(m, device_ids=CPU3, launch="last-first")
    x = torch.randn(6, 4)
    assert_close(fdp(x), m(x))
    assert order == [2, 1, 0] and fdp.last_launch == "last-first" and fdp.launch == "last-first"


def test_parallel_apply_module_exports_its_seam_only():
    """``fastdp.parallel_apply`` is DataParallel's seam; the runners stay in ``_runners``."""
    import fastdp._runners as runners
    import fastdp.parallel_apply as module

    assert module.__all__ == ["parallel_apply"]
    aliases = [
        n for n, v in vars(module).items() if getattr(v, "__module__", "") == runners.__name__
    ]
    assert aliases == [] and not hasattr(module, "must_run_concurrently")
