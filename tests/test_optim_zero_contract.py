"""``ZeroRedundancyOptimizer``'s contract beyond exactness: optimizer state split by bytes
(``memory_stats``), one copy per direction (``copy_stats``), owners stepping at once under
``"threads"``, errors that say what to do."""

import threading

import pytest
import torch
from torch import nn
from zero_helpers import Twin

import fastdp
from fastdp._zero_shards import move


def _state_bytes(opt):
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


@pytest.mark.parametrize("arch", ["transformer", "cnn_bn"])
def test_state_bytes_split_by_replica_index(distinct, arch):
    """4 CPU replicas with storage of their own: each index holds total/4 within one largest
    tensor's state, index 0 at most 0.30x the unsharded optimizer's; master copies only off 0."""
    twin = Twin(arch, "adamw_foreach")
    twin.train(2)
    stats = twin.zero.memory_stats()
    assert list(stats) == [f"cpu#{i}" for i in range(4)]
    per = [stats[f"cpu#{i}"]["optimizer_state"] for i in range(4)]
    total = _state_bytes(twin.plain)
    assert sum(per) == total
    largest = max(
        sum(v.numel() * v.element_size() for v in st.values()) for st in twin.plain.state.values()
    )
    assert all(abs(b - total / 4) <= largest for b in per), (per, total, largest)
    assert per[0] <= 0.30 * total, (per, total)
    masters = [stats[f"cpu#{i}"]["master_copies"] for i in range(4)]
    assert masters[0] == 0 and all(m > 0 for m in masters[1:])


def test_one_copy_per_direction_per_owner_per_step(distinct):
    """Owners stepping master copies cross devices once per direction per step (values in,
    gradients in, values out), however many tensors they own; owner 0 copies nothing."""
    twin = Twin("transformer", "adamw_foreach")
    owned = [sum(twin.zero.owner_of(p) == i for p in twin.nets[0].parameters()) for i in range(4)]
    assert max(owned[1:]) > 1, owned
    twin.train(3)
    twin.assert_same()
    stats = twin.zero.copy_stats()
    assert stats["cpu#0"] == {"values_in": 0, "grads_in": 0, "values_out": 0}
    for i in range(1, 4):
        assert stats[f"cpu#{i}"] == {"values_in": 3, "grads_in": 3, "values_out": 3}, stats


def test_the_flat_copy_keeps_every_dtype_and_layout_bit_for_bit():
    src = [
        torch.randn(3, 5).t(),
        torch.tensor(True),
        torch.zeros(0, 4),
        torch.randn(7, dtype=torch.float64),
        torch.randint(0, 9, (5,), dtype=torch.int8),
        torch.randn(4, dtype=torch.complex64).conj(),
        torch.randn(2, 3, dtype=torch.bfloat16),
        torch.randn(4, 4)[:, ::2],
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.tensor(2.5),
    ]
    dst = [torch.empty_like(s) for s in src]
    dst[0] = torch.empty(5, 3)
    move(src, dst)
    for s, d in zip(src, dst):
        assert torch.equal(d.resolve_conj(), s.resolve_conj())


def test_alias_storage_needs_no_master_copies():
    twin = Twin("mlp", "sgd_momentum")
    twin.train(1)
    assert all(s["master_copies"] == 0 for s in twin.zero.memory_stats().values())


class _Meeting(torch.optim.SGD):
    """SGD whose step waits until every owner's step has started: it returns only if the owners
    step at once."""

    barrier: threading.Barrier
    threads: set

    def step(self, closure=None):
        _Meeting.threads.add(threading.current_thread().name)
        _Meeting.barrier.wait(timeout=20)
        return super().step(closure)


def test_threads_step_every_owner_at_once_one_worker_each():
    _Meeting.barrier, _Meeting.threads = threading.Barrier(4), set()
    model = fastdp.FastDataParallel(nn.Linear(64, 64), ["cpu"] * 4, launch="threads")
    big = nn.Linear(64, 64)
    model.module.extra = big  # four tensors of which two large: every owner gets one
    opt = fastdp.ZeroRedundancyOptimizer(model.parameters(), _Meeting, launch="threads", lr=0.1)
    model(torch.randn(8, 64)).sum().backward()
    big.weight.grad = torch.ones_like(big.weight)
    opt.step()
    assert len(_Meeting.threads) == 4 and threading.current_thread().name not in _Meeting.threads


@pytest.mark.parametrize("launch,wrapper_launch", [("inline", "threads"), (None, "threads")])
@pytest.mark.parametrize("storage_", ["alias", "distinct"])
def test_owners_sharing_a_device_step_in_turn_on_the_caller(
    monkeypatch, launch, wrapper_launch, storage_
):
    """``"inline"``, and by default owners on one device (CPU replicas, whatever the storage):
    concurrency there would only contend for the device."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1" if storage_ == "distinct" else "0")
    _Meeting.barrier, _Meeting.threads = threading.Barrier(1), set()
    model = fastdp.FastDataParallel(nn.Linear(6, 4), ["cpu"] * 2, launch=wrapper_launch)
    opt = fastdp.ZeroRedundancyOptimizer(model.parameters(), _Meeting, launch=launch, lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert _Meeting.threads == {threading.current_thread().name}


class _Failing(torch.optim.SGD):
    def step(self, closure=None):
        if any(p.shape == (4,) for g in self.param_groups for p in g["params"]):
            raise RuntimeError("owner failed")
        return super().step(closure)


@pytest.mark.parametrize("launch", ["threads", "inline"])
def test_an_owner_raising_raises_on_the_caller(launch):
    model = fastdp.FastDataParallel(nn.Linear(6, 4), ["cpu"] * 2)
    opt = fastdp.ZeroRedundancyOptimizer(model.parameters(), _Failing, launch=launch, lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="owner failed"):
        opt.step()


def test_devices_override_and_a_wrapper_free_module():
    net = nn.Linear(6, 4)
    with pytest.raises(ValueError, match="belong to no FastDataParallel.*devices="):
        fastdp.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    opt = fastdp.ZeroRedundancyOptimizer(
        net.parameters(), torch.optim.SGD, devices=["cpu"] * 2, lr=0.1
    )
    assert sorted(opt.owner_of(p) for p in net.parameters()) == [0, 1]


def test_one_device_wrapper_is_one_owner():
    model = fastdp.FastDataParallel(nn.Linear(6, 4), ["cpu"])
    opt = fastdp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    assert {opt.owner_of(p) for p in model.parameters()} == {0}


def test_lbfgs_is_refused_by_name():
    model = fastdp.FastDataParallel(nn.Linear(6, 4), ["cpu"] * 2)
    with pytest.raises(ValueError, match="LBFGS reads every parameter"):
        fastdp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"process_group": object()}, "no process group"),
        ({"overlap_with_ddp": True}, "overlap_with_ddp"),
        ({"launch": "fast"}, "launch must be"),
    ],
)
def test_torch_arguments_without_meaning_in_one_process_are_refused(kwargs, match):
    model = fastdp.FastDataParallel(nn.Linear(6, 4), ["cpu"] * 2)
    with pytest.raises(ValueError, match=match):
        fastdp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, **kwargs)


def test_not_an_optimizer_class():
    model = fastdp.FastDataParallel(nn.Linear(6, 4), ["cpu"] * 2)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        fastdp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD(model.parameters()))


def test_a_parameter_reshaped_after_building_is_an_error(distinct):
    model = fastdp.FastDataParallel(nn.Linear(6, 4), ["cpu"] * 2)
    opt = fastdp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    shard1 = [p for p in model.parameters() if opt.owner_of(p) == 1][0]
    shard1.data = torch.zeros(3, *shard1.shape)
    shard1.grad = torch.zeros_like(shard1)
    with pytest.raises(RuntimeError, match="build the optimizer again"):
        opt.step()


def test_is_an_optimizer_for_schedulers_and_scalers():
    model = fastdp.FastDataParallel(nn.Linear(6, 4), ["cpu"] * 2)
    opt = fastdp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults == torch.optim.AdamW(nn.Linear(1, 1).parameters(), lr=0.1).defaults
    assert "AdamW" in repr(opt) and "2 owners" in repr(opt)
