"""The nn.Module watch behind persistent replicas (NOTE [ Replica invalidation ], NOTE [ Opting
out of the watch ] in fastdp/_watch.py): what it sees, what it costs nobody else, the opt-out."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import torch
import torch.nn as nn

from fastdp import FastDataParallel, _watch


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


def test_writes_to_the_watched_module_are_seen_and_others_cost_no_rebuild():
    m = Scaled()
    dp = FastDataParallel(m, ["cpu"] * 2)
    x = torch.randn(6, 4)
    dp(x)
    gen = _watch.generation()
    other = nn.Linear(2, 2)  # any other module in the process: not watched
    other.extra = 1
    assert _watch.generation() == gen
    m.scale = 3.0  # a plain attribute: seen only through the watch
    assert _watch.generation() > gen
    torch.testing.assert_close(dp(x), _chunked(m, x, 2))


def test_a_dead_module_leaves_the_watch():
    m = Scaled()
    _watch.watch([m])
    i = id(m)
    assert i in _watch._watched
    del m
    gc.collect()
    assert i not in _watch._watched


_OPTED_OUT = """
import torch, torch.nn as nn
from fastdp import FastDataParallel, _watch
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
dp = FastDataParallel(m, ["cpu"] * 2)
x = torch.randn(6, 4)
for step in range(3):
    out = dp(x)
    out.sum().backward()
    want = torch.cat([m(c) for c in x.chunk(2)])
    assert torch.allclose(out, want), step
    m[0] = nn.Linear(4, 8)  # a structural change: seen because replicas are made every step
assert not dp.persistent and not _watch.installed()
assert not hasattr(nn.Module.__setattr__, "__wrapped__")
print("ok")
"""


def test_opting_out_leaves_nn_module_alone_and_replicates_every_step():
    env = {**os.environ, "FASTDP_WATCH_MODULES": "0"}
    r = subprocess.run([sys.executable, "-c", _OPTED_OUT], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_wrapped_methods_take_nn_modules_keywords():
    m = Scaled()
    dp = FastDataParallel(m, ["cpu"] * 2)
    x = torch.randn(6, 4)
    dp(x)
    assert _watch.installed()
    gen = _watch.generation()
    m.register_parameter(name="p", param=nn.Parameter(torch.ones(1)))
    m.add_module(name="extra", module=nn.Identity())
    m.register_module(name="extra2", module=nn.Identity())
    m.register_buffer(name="b", tensor=torch.zeros(1), persistent=False)
    assert _watch.generation() >= gen + 4
    torch.testing.assert_close(dp(x), _chunked(m, x, 2))


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
