"""What makes persistent replicas stale, seen without touching nn.Module (NOTE [ Replica
invalidation ] in fastdp/_snapshots.py): the dict snapshot's contract on both implementations,
what a step sees, and that nn.Module is left as torch made it."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn as nn

from fastdp import FastDataParallel, _backend
from fastdp._snapshots import _PyDictSnapshot, module_dicts

SNAPSHOTS = [pytest.param(_PyDictSnapshot, id="python")]
if _backend.loaded():
    SNAPSHOTS.append(pytest.param(_backend._ext.DictSnapshot, id="extension"))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.scale = 1.0

    def forward(self, x):
        return self.lin(x) * self.scale


def _chunked(m: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([m(c) for c in x.chunk(n)])


@pytest.mark.parametrize("make", SNAPSHOTS)
def test_a_snapshot_sees_every_rebinding_by_identity_and_nothing_else(make):
    m = Scaled()
    dicts = module_dicts(m.modules())
    snap = make(dicts)
    assert len(snap) == len(dicts) and snap.changed() == []
    m.train()  # the object already bound: no change
    m.lin.weight = m.lin.weight
    m.scale = m.scale
    assert snap.changed() == []
    m.lin.weight.data.mul_(2)  # values are not the snapshot's business
    assert snap.changed() == []
    m.eval()
    assert snap.changed() == [dicts.index(m.__dict__), dicts.index(m.lin.__dict__)]
    snap = make(dicts)
    m.lin.bias = nn.Parameter(m.lin.bias.detach().clone())  # an equal tensor, another object
    assert snap.changed() == [dicts.index(m.lin._parameters)]
    snap = make(dicts)
    m.__dict__["scale"] = 2.0  # behind nn.Module's back: seen too
    del m.lin.bias
    m.lin.register_buffer("b", None)
    assert snap.changed() == sorted(
        {dicts.index(m.__dict__), dicts.index(m.lin._parameters), dicts.index(m.lin._buffers)}
    )
    snap = make(dicts)
    m.add_module("extra", nn.Identity())
    assert snap.changed() == [dicts.index(m._modules)]
    with pytest.raises(TypeError):
        make([{}, [1]])


@pytest.mark.parametrize("make", SNAPSHOTS)
def test_an_empty_dict_filled_and_a_key_swapped_for_another_are_seen(make):
    dicts = [{}, {"a": 1}, {}, {"b": 2, "c": 3}]
    snap = make(dicts)
    dicts[2]["x"] = 0
    del dicts[1]["a"]  # sizes otherwise unchanged: one more in 2, one fewer in 1
    assert snap.changed() == [1, 2]
    snap = make(dicts)
    value = dicts[3].pop("c")
    dicts[3]["d"] = value  # same size, same value object, another key
    assert snap.changed() == [3]
    k1, k2 = torch.zeros(2), torch.zeros(2)  # keys whose == raises (the Python one compares keys)
    tensor_keyed = {k1: value}
    snap = make([tensor_keyed])
    tensor_keyed[k2] = tensor_keyed.pop(k1)
    assert snap.changed() == [0]


@pytest.mark.parametrize("make", SNAPSHOTS)
def test_a_change_undone_is_no_change_and_later_changes_are_still_seen(make):
    """The extension skips dicts whose version tag is unchanged (the dict version fast path in
    csrc/dict_snapshot.cpp): a dict written and put back must compare equal, then keep seeing
    new writes."""
    first, second = object(), object()
    d = {"a": first, "b": 1}
    e = {"c": 2}
    snap = make([d, e])
    for _ in range(3):
        d["a"] = second
        assert snap.changed() == [0]
        d["a"] = first
        assert snap.changed() == []
    del d["a"]
    d["a"] = first  # same entries, another order
    e["c"] = second
    assert snap.changed() == [0, 1]


@pytest.mark.parametrize("make", SNAPSHOTS)
def test_a_snapshot_holds_what_it_saw_so_no_address_is_reused(make):
    """An object freed after the snapshot could give its address to the next one: the snapshot
    keeps it alive, so a different object is always a different pointer."""

    class Box:
        pass

    d = {"v": Box()}
    gone = weakref.ref(d["v"])
    snap = make([d])
    for _ in range(100):
        d["v"] = Box()
        assert snap.changed() == [0]
    assert gone() is not None
    del snap
    gc.collect()
    assert gone() is None


def test_writes_to_the_module_are_seen_however_they_are_made(replica_builds):
    m = Scaled()
    dp = FastDataParallel(m, ["cpu"] * 2)
    x = torch.randn(6, 4)
    dp(x)
    other = nn.Linear(2, 2)  # any other module in the process: nothing to see
    other.extra = 1
    dp(x)
    assert len(replica_builds) == 1
    m.scale = 3.0
    torch.testing.assert_close(dp(x), _chunked(m, x, 2))
    m.__dict__["scale"] = 5.0  # bypassing nn.Module.__setattr__
    torch.testing.assert_close(dp(x), _chunked(m, x, 2))
    assert len(replica_builds) == 3


def test_registrations_by_keyword_are_seen(replica_builds):
    m = Scaled()
    dp = FastDataParallel(m, ["cpu"] * 2)
    x = torch.randn(6, 4)
    dp(x)
    m.register_parameter(name="p", param=nn.Parameter(torch.ones(1)))
    m.add_module(name="extra", module=nn.Identity())
    m.register_module(name="extra2", module=nn.Identity())
    m.register_buffer(name="b", tensor=torch.zeros(1), persistent=False)
    torch.testing.assert_close(dp(x), _chunked(m, x, 2))
    assert len(replica_builds) == 2
    assert {n for n, _ in dp.replicate(m, dp.device_ids)[1].named_buffers()} == {"b"}


def test_rebinding_what_is_bound_costs_no_rebuild_and_real_changes_still_do(replica_builds):
    """``model.train()`` before every step (HF Trainer's training_step) rebinds the same
    ``training`` value: the replicas are built once. eval() and real rebinds are still seen."""
    builds = replica_builds
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    dp = FastDataParallel(m, ["cpu"] * 2)
    x = torch.randn(6, 4)
    for _ in range(4):
        dp.train()
        m[0].weight = m[0].weight  # the same parameter again
        dp(x).sum().backward()
    assert len(builds) == 1
    dp.eval()
    torch.testing.assert_close(dp(x), _chunked(m, x, 2))  # dropout off in every replica
    assert len(builds) == 2
    m[2].weight = nn.Parameter(torch.zeros(2, 4))
    torch.testing.assert_close(dp(x), _chunked(m, x, 2))
    assert len(builds) == 3


_UNTOUCHED = """
import torch, torch.nn as nn
before = dict(vars(nn.Module))
import fastdp
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
dp = fastdp.FastDataParallel(m, ["cpu"] * 2)
x = torch.randn(6, 4)
for step in range(3):
    dp(x).sum().backward()
    with dp.no_sync():
        dp(x).sum().backward()
m[0] = nn.Linear(4, 8)
dp(x).sum().backward()
after = dict(vars(nn.Module))
assert after.keys() == before.keys(), after.keys() ^ before.keys()
assert all(after[k] is before[k] for k in before), [k for k in before if after[k] is not before[k]]
print("ok")
"""


def test_nn_module_is_left_as_torch_made_it():
    """Persistent replicas, no_sync and a rebuild later, every nn.Module attribute is the object
    torch defined (a fresh interpreter: nothing imported fastdp before the record)."""
    r = subprocess.run(
        [sys.executable, "-c", _UNTOUCHED], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.skipif(not _backend.loaded(), reason="needs the built extension fastdp._C")
def test_held_tensor_check_sees_what_the_python_check_sees():
    """``held_changed`` (NOTE [ Tensors a forward changed ]): a moved storage or a live hook is
    a change; a removed hook, an in-place write and another list object with the same tensors
    are not."""
    ext = _backend._ext
    held = [torch.randn(3, requires_grad=True) * 1, torch.randn(5)[2:]]
    ptrs = ext.held_data_ptrs(held)
    assert [int.from_bytes(ptrs[i : i + 8], sys.byteorder) for i in (0, 8)] == [
        t.data_ptr() for t in held
    ]
    assert not ext.held_changed(list(held), ptrs)
    held[1].add_(1)
    assert not ext.held_changed(held, ptrs)
    handle = held[0].register_hook(lambda g: g)
    assert ext.held_changed(held, ptrs)
    handle.remove()
    assert not ext.held_changed(held, ptrs)
    held[1].data = torch.randn(3)
    assert ext.held_changed(held, ptrs)
    assert ext.held_changed(held[:1], ptrs)
    with pytest.raises(TypeError, match="not a tensor"):
        ext.held_changed([held[0], 1], ptrs)
