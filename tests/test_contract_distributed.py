"""``fastdp.wrap`` and ``fastdp.shard_batch``: one script, FastDataParallel or torchrun/DDP (5)."""

import os
import socket
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from models import ROOT
from torch import nn
from torch.testing import assert_close

import fastdp
from fastdp import distributed

HERE = Path(__file__).resolve().parent
Batch = namedtuple("Batch", "x meta")


@pytest.fixture
def single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_wrap_is_fastdataparallel_in_one_process(single_process):
    model = fastdp.wrap(nn.Linear(3, 2), device_ids=["cpu"] * 2, balance=[1, 2])
    assert isinstance(model, fastdp.FastDataParallel) and model.balance == [1.0, 2.0]


def test_wrap_ignores_ddp_only_keywords_in_one_process(single_process):
    model = fastdp.wrap(
        nn.Linear(3, 2),
        device_ids=["cpu"] * 2,
        find_unused_parameters=True,
        broadcast_buffers=False,
    )
    assert isinstance(model, fastdp.FastDataParallel)


def test_wrap_rejects_unknown_keywords(single_process):
    with pytest.raises(TypeError, match="unexpected keyword argument.*'device_idz'"):
        fastdp.wrap(nn.Linear(3, 2), device_idz=[0])


def test_world_size_one_stays_single_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert isinstance(fastdp.wrap(nn.Linear(3, 2)), fastdp.FastDataParallel)


def test_shard_batch_is_identity_in_one_process(single_process):
    batch = (torch.randn(10, 3), {"y": torch.arange(10)})
    assert fastdp.shard_batch(batch) is batch


@pytest.mark.parametrize("size,world", [(10, 3), (16, 2), (3, 8), (7, 4)])
def test_shards_are_fastdataparallel_chunks(size, world):
    x = torch.arange(size * 2).view(size, 2)
    shards = [distributed._shard(x, r, world, 0, None) for r in range(world)]
    chunks = list(torch.chunk(x, world))
    chunks += [x[:0]] * (world - len(chunks))  # ranks past the last chunk get no rows
    for s, c in zip(shards, chunks):
        assert torch.equal(s, c)


def test_shard_nested_batch_and_pass_non_tensors():
    batch = Batch({"a": torch.arange(6), "b": [torch.arange(12).view(6, 2)]}, "tag")
    got = distributed._shard(batch, 1, 2, 0, None)
    assert isinstance(got, Batch) and got.meta == "tag"
    assert torch.equal(got.x["a"], torch.arange(3, 6))
    assert torch.equal(got.x["b"][0], torch.arange(6, 12).view(3, 2))


def test_shard_batch_under_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    x = torch.arange(8)
    assert torch.equal(fastdp.shard_batch(x), torch.arange(4, 8))
    assert torch.equal(fastdp.shard_batch(x.view(2, 4), dim=1), x.view(2, 4)[:, 2:])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run of this test, also on GPU machines
    return env


@pytest.mark.parametrize("optimizer", ["plain", "zero"])
def test_torchrun_ddp_matches_single_process_fastdataparallel(tmp_path, optimizer):
    """One script both ways; with ``fastdp.ZeroRedundancyOptimizer`` it is fastdp's class in one
    process and torch's under torchrun (gloo), with the same trajectory."""
    script = str(HERE / "_distributed_train.py")
    extra = ["zero"] if optimizer == "zero" else []
    single, multi = tmp_path / "single.pt", tmp_path / "ddp.pt"
    runs = [
        subprocess.Popen(
            [sys.executable, script, str(single), *extra],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(_free_port()),
                script,
                str(multi),
                *extra,
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        ),
    ]
    for p in runs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in runs:
                q.kill()
            pytest.fail("training run timed out")
        assert p.returncode == 0, out.decode()[-3000:]
    a, b = torch.load(single), torch.load(multi)
    assert a["wrapper"] == "FastDataParallel" and b["wrapper"] == "DistributedDataParallel"
    if optimizer == "zero":
        assert a["optimizer"] == "fastdp.zero_optimizer.ZeroRedundancyOptimizer"
        assert b["optimizer"] == (
            "torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer"
        )
    assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]))
    assert list(a["state"]) == list(b["state"])
    for k in a["state"]:
        assert_close(a["state"][k], b["state"][k], msg=k)
    assert a["losses"][-1] < a["losses"][0]  # it did train
