"""Checkpoint interop: ``module.``-prefixed / bare keys, ``fastdp.unwrap``, DDP, FSDP2 (point 4),
checkpoints saved through ``torch.compile``."""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fastdp
from fastdp import FastDataParallel
from fastdp._state_dict import _strip


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _assert_same(a, b):
    sa, sb = fastdp.unwrap(a).state_dict(), fastdp.unwrap(b).state_dict()
    assert list(sa) == list(sb)
    for k in sa:  # on the CPU: DataParallel(m) and FastDataParallel(m) move m to cuda:0 on 1 GPU
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group (DDP and FSDP2 need one); destroyed after this module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


def test_state_dict_keys_keep_the_module_prefix():
    assert all(k.startswith("module.") for k in fastdp.FastDataParallel(_net(0)).state_dict())


@pytest.mark.parametrize("source", ["fastdp", "bare", "data_parallel", "nested_wrappers"])
def test_load_state_dict_accepts_prefixed_and_bare_keys(source):
    src = _net(1)
    wrapped = {
        "fastdp": lambda: fastdp.FastDataParallel(src, ["cpu"] * 2),
        "bare": lambda: src,
        "data_parallel": lambda: nn.DataParallel(src),
        "nested_wrappers": lambda: nn.DataParallel(fastdp.FastDataParallel(src)),
    }[source]()
    dst = fastdp.FastDataParallel(_net(2), ["cpu"] * 2)
    result = dst.load_state_dict(_roundtrip(wrapped.state_dict()))
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_same(dst, src)


def test_bare_checkpoint_from_unwrap_loads_into_plain_model_and_back():
    fdp = fastdp.FastDataParallel(_net(3), ["cpu"] * 3)
    bare = _roundtrip(fastdp.unwrap(fdp).state_dict())
    assert not any(k.startswith("module.") for k in bare)
    plain = _net(4)
    plain.load_state_dict(bare)  # torch's own loader, strict
    _assert_same(plain, fdp)


def test_metadata_follows_the_stripped_keys():
    sd = fastdp.FastDataParallel(_net(0)).state_dict()
    assert set(_strip(sd, 1)._metadata) == set(_net(0).state_dict()._metadata)


def test_unwrap_peels_every_wrapper(process_group):
    net = _net(0)
    assert fastdp.unwrap(net) is net
    assert fastdp.unwrap(fastdp.FastDataParallel(net)) is net
    assert fastdp.unwrap(nn.DataParallel(net)) is net
    assert fastdp.unwrap(nn.DataParallel(fastdp.FastDataParallel(net, ["cpu"] * 2))) is net
    assert fastdp.unwrap(DistributedDataParallel(net)) is net


def test_ddp_checkpoints_are_interchangeable(process_group):
    ddp = DistributedDataParallel(_net(5))
    fdp = fastdp.FastDataParallel(_net(6), ["cpu"] * 2)
    fdp.load_state_dict(_roundtrip(ddp.state_dict()))  # DDP's "module." keys
    _assert_same(fdp, ddp)
    other = DistributedDataParallel(_net(7))
    other.load_state_dict(_roundtrip(fdp.state_dict()))  # and back, with torch's own loader
    _assert_same(other, fdp)


def test_fsdp2_checkpoints_are_interchangeable(process_group):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sharded = _net(8)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
    fdp = fastdp.FastDataParallel(_net(9), ["cpu"] * 2)
    fdp.load_state_dict(get_model_state_dict(sharded, options=full))  # FSDP2 -> fastdp
    want = get_model_state_dict(sharded, options=full)
    got = fastdp.unwrap(fdp).state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in got)

    fresh = _net(10)
    fully_shard(fresh, mesh=init_device_mesh("cpu", (1,)))
    set_model_state_dict(fresh, fastdp.unwrap(fdp).state_dict(), options=full)  # fastdp -> FSDP2
    back = get_model_state_dict(fresh, options=full)
    assert all(torch.equal(back[k], got[k]) for k in got)


def test_unexpected_key_error_names_the_nearest_expected_key():
    sd = _net(0).state_dict()
    sd["3.weigth"] = sd.pop("3.weight")
    fdp = fastdp.FastDataParallel(_net(1), ["cpu"] * 2)
    with pytest.raises(RuntimeError) as e:
        fdp.load_state_dict(sd)
    msg = str(e.value)
    assert "Unexpected key(s)" in msg and '"3.weigth"' in msg
    assert "nearest expected: '3.weight'" in msg
    assert 'Missing key(s) in state_dict: "3.weight"' in msg


def test_missing_key_error_in_prefixed_form_names_nearest_checkpoint_key():
    sd = fastdp.FastDataParallel(_net(0)).state_dict()
    sd["module.1.runing_mean"] = sd.pop("module.1.running_mean")
    with pytest.raises(RuntimeError, match=r"nearest in the checkpoint: 'module.1.runing_mean'"):
        fastdp.FastDataParallel(_net(1)).load_state_dict(sd)


def test_non_strict_returns_prefixed_incompatible_keys():
    sd = _net(0).state_dict()
    del sd["0.bias"]
    sd["extra"] = torch.zeros(1)
    res = fastdp.FastDataParallel(_net(1)).load_state_dict(sd, strict=False)
    assert res.missing_keys == ["module.0.bias"] and res.unexpected_keys == ["module.extra"]


def test_shape_mismatch_still_raises():
    sd = _net(0).state_dict()
    sd["0.weight"] = torch.zeros(8, 5)
    with pytest.raises(RuntimeError, match="size mismatch for 0.weight"):
        fastdp.FastDataParallel(_net(1)).load_state_dict(sd)


def test_inner_module_named_module_is_not_confused():
    class Holder(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.module = _net(seed)

    src = Holder(11)
    dst = fastdp.FastDataParallel(Holder(12))
    dst.load_state_dict(src.state_dict())  # bare keys that start with "module."
    _assert_same(dst, src)
    dst2 = fastdp.FastDataParallel(Holder(13))
    dst2.load_state_dict(fastdp.FastDataParallel(src).state_dict())
    _assert_same(dst2, src)


def test_checkpoints_saved_through_torch_compile_load_and_unwrap():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    compiled = torch.compile(FastDataParallel(m, device_ids=["cpu"] * 2))
    sd = compiled.state_dict()
    assert all(k.startswith("_orig_mod.module.") for k in sd)
    fresh = FastDataParallel(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), device_ids=["cpu"] * 2
    )
    fresh.load_state_dict(sd)
    for a, b in zip(fresh.parameters(), m.parameters()):
        assert torch.equal(a, b)
    assert fastdp.unwrap(compiled) is m
    inner = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    inner.load_state_dict(fastdp.unwrap(compiled).state_dict())
