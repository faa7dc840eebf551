"""Shared by the ``test_optim_zero_*`` files: a model trained twice, with the sharded optimizer
and with the same optimizer class unsharded, on identical wrappers (same kernels, same chunks),
so that every comparison can be bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from models import ARCHS

import fastdp
from fastdp.testing import device_of, replica_ids

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    "adamw_single": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}),
}


class Twin:
    """One architecture wrapped twice: ``zero`` (ZeroRedundancyOptimizer) and ``plain``."""

    def __init__(
        self,
        arch: str,
        opt: str | tuple[type[torch.optim.Optimizer], dict[str, Any]],
        n: int = 4,
        launch: str | None = None,
        persistent: bool = True,
        seed: int = 0,
        params: Callable[[torch.nn.Module], Any] = lambda m: m.parameters(),
        kind: str = "cpu",
    ) -> None:
        factory, self.make_input, _ = ARCHS[arch]
        torch.manual_seed(seed)
        self.device = device_of(kind)
        net = factory().to(self.device)
        self.nets = [net, copy.deepcopy(net)]
        self.models = [
            fastdp.FastDataParallel(m, replica_ids(kind, n), launch=launch, persistent=persistent)
            for m in self.nets
        ]
        cls, kw = OPTIMIZERS[opt] if isinstance(opt, str) else opt
        # the owners on worker threads too where the wrapper's replicas are (on CPU replicas
        # they otherwise step in turn: one device)
        zero_launch = "threads" if launch == "threads" else None
        self.zero = fastdp.ZeroRedundancyOptimizer(
            params(self.models[0]), cls, launch=zero_launch, **kw
        )
        self.plain = cls(params(self.models[1]), **kw)
        self.opts = [self.zero, self.plain]
        self.gen = torch.Generator().manual_seed(seed + 1)

    def batch(self, b: int = 8) -> torch.Tensor:
        state = torch.get_rng_state()
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=self.gen)))
        x = self.make_input(b)
        torch.set_rng_state(state)
        return x.to(self.device)

    def backward(self, b: int = 8, x: torch.Tensor | None = None) -> None:
        """One forward and backward of the same batch through both models."""
        x = self.batch(b) if x is None else x
        for m in self.models:
            m(x).square().mean().backward()

    def train(self, steps: int, b: int = 8, between: Callable[[Any], None] | None = None) -> None:
        """zero_grad, forward, backward, ``between(twin)``, step; ``steps`` times."""
        for _ in range(steps):
            for o in self.opts:
                o.zero_grad()
            self.backward(b)
            if between is not None:
                between(self)
            for o in self.opts:
                o.step()

    def assert_same(self) -> None:
        """Parameters, buffers, gradients and the optimizer state dicts equal, bit for bit."""
        a, b = (m.state_dict() for m in self.nets)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        for (k, p), q in zip(self.nets[0].named_parameters(), self.nets[1].parameters()):
            assert (p.grad is None) == (q.grad is None), k
            assert p.grad is None or torch.equal(p.grad, q.grad), k
        assert_state_dicts_equal(self.zero.state_dict(), self.plain.state_dict())


def assert_state_dicts_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        assert sa.keys() == sb.keys(), i
        for k in sa:
            if isinstance(sb[k], torch.Tensor):
                assert torch.equal(sa[k].to(sb[k].device), sb[k]), (i, k)
            else:
                assert sa[k] == sb[k], (i, k)
