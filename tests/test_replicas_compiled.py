"""Compiled replicas: every replica stays compiled, and backwards compile on the caller's thread.

Dynamo guards on each input's device, so replicas on k GPUs fill k cache entries of one code
object per variant. On the CPU every replica has the same device; here each replica instead gets
its own value of an int attribute the forward reads (dynamo guards on its value): the same
entry-per-replica growth, so a recompile limit that would drop replicas to eager on 9+ GPUs does
so here on 9+ replicas. AOT autograd compiles a backward lazily, on its first call: on GPUs, on
several autograd threads at once. Backwards must be compiled by the forward, on the caller's
thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import fastdp
from fastdp import _torch_private
from fastdp.testing import HAS_CUDA

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Empty caches and dynamo's default limits (the fix raises them process-wide)."""
    dynamo.reset()
    with dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        yield
    dynamo.reset()


class Tagged(nn.Module):
    """Each replica reads its own ``tag``: one dynamo cache entry per replica, as per GPU."""

    made = 0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.tag = 0

    def forward(self, x):
        return self.lin(x) * self.tag

    def _replicate_for_data_parallel(self):
        r = super()._replicate_for_data_parallel()
        Tagged.made += 1
        r.tag = Tagged.made
        return r


def _entries() -> int:
    return len(_debug_get_cache_entry_list(Tagged.forward.__code__))


@pytest.mark.parametrize("n", [10, 16])
def test_every_replica_keeps_compiled_entries_for_train_eval_and_partial_batches(n, caplog):
    net = Tagged()
    net.compile(backend="eager")
    dp = fastdp.FastDataParallel(net, ["cpu"] * n)
    caplog.set_level("WARNING", logger="torch._dynamo")
    dp(torch.randn(4 * n, 8)).sum().backward()
    assert _entries() == n  # one per replica: before the fix, 8 and the rest eager
    net.eval()
    with torch.no_grad():
        dp(torch.randn(4 * n, 8))
    dp(torch.randn(4 * n - 2, 8))  # a partial last batch: a smaller last chunk
    assert _entries() > 2 * n  # eval and the new shapes compiled for every replica
    assert dynamo.config.recompile_limit == 8 * n
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]


def test_the_budget_never_lowers_a_limit_and_follows_the_users_changes():
    from fastdp._compiled import budget_for

    budget_for(4)
    assert dynamo.config.recompile_limit == 32
    assert dynamo.config.accumulated_recompile_limit == 1024
    budget_for(2)  # never lowers
    assert dynamo.config.recompile_limit == 32
    dynamo.config.recompile_limit = 3  # the user's new value is the base from now on
    budget_for(2)
    assert dynamo.config.recompile_limit == 6


def _recording_backend(calls: list):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm, example_inputs):
        return make_boxed_func(gm.forward)

    def bw(gm, example_inputs):
        calls.append(threading.get_ident())
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw)


@pytest.mark.parametrize("form", ["torch.compile", "wrapper.compile"])
def test_backward_is_compiled_by_the_forward_on_the_callers_thread(form, monkeypatch):
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")  # replicas as on distinct devices
    calls: list = []
    net, ref = Tagged(), Tagged()
    net.tag = ref.tag = 1
    Tagged.made = 0
    backend = _recording_backend(calls)
    if form == "torch.compile":
        dp = fastdp.FastDataParallel(torch.compile(net, backend=backend), ["cpu"] * 2)
    else:
        dp = fastdp.FastDataParallel(net, ["cpu"] * 2)
        dp.compile(backend=backend)
    x = torch.randn(6, 8)
    out = dp(x)
    assert calls and set(calls) == {threading.get_ident()}  # compiled already, here
    out.sum().backward()
    ref_out = torch.cat([ref.lin(c) * t for c, t in zip(x.chunk(2), (1, 2))])
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(net.lin.weight.grad, ref.lin.weight.grad)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_replicas_on_every_gpu_stay_compiled_through_eval_and_partial_batches(caplog):
    n = torch.cuda.device_count()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)).cuda()
    calls: list = []
    dp = fastdp.FastDataParallel(torch.compile(net, backend=_recording_backend(calls)))
    caplog.set_level("WARNING", logger="torch._dynamo")
    dp(torch.randn(4 * n, 8, device="cuda")).sum().backward()
    net.eval()
    with torch.no_grad():
        dp(torch.randn(4 * n, 8, device="cuda"))
    dp(torch.randn(4 * n - 2, 8, device="cuda"))
    assert set(calls) == {threading.get_ident()}
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]


def test_replicas_on_one_device_compile_their_backward_lazily(monkeypatch):
    """``backward_with_forward`` (fastdp/_compiled.py): replicas sharing the originals' device have
    one autograd thread, so functorch's lazy backward compile stays (no per-step flag)."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "0")
    calls: list = []
    net = Tagged()
    dp = fastdp.FastDataParallel(torch.compile(net, backend=_recording_backend(calls)), ["cpu"] * 2)
    out = dp(torch.randn(6, 8))
    assert calls == []
    out.sum().backward()
    assert calls and set(calls) == {threading.get_ident()}


def test_the_backward_lowering_flag_is_restored_after_each_step(monkeypatch):
    """``backward_with_forward`` (fastdp/_compiled.py): the user's value of functorch's flag is back
    after every step (its effect inside: the test above), and True set by the user stays."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")
    cfg = _torch_private.functorch_config()
    name = "force_non_lazy_backward_lowering"
    dp = fastdp.FastDataParallel(torch.compile(nn.Linear(8, 4), backend="eager"), ["cpu"] * 2)
    before = getattr(cfg, name)
    dp(torch.randn(4, 8)).sum().backward()
    assert getattr(cfg, name) == before
    setattr(cfg, name, True)
    try:
        dp(torch.randn(4, 8)).sum().backward()
        assert getattr(cfg, name) is True
    finally:
        setattr(cfg, name, before)
