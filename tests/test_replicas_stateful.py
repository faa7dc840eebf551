"""Stateful test of persistent replicas (hypothesis ``RuleBasedStateMachine``).

Random interleavings of training steps, no-grad forwards, steps in which one replica raises, and
model changes: in-place parameter edits, ``load_state_dict`` with and without ``assign``, submodule
replacement, plain attributes, forward hooks added and removed, train/eval, dtype changes,
``requires_grad`` toggles, ``.data`` swaps, new buffers. A twin of the model receives the same
changes and plays DataParallel's semantics by hand: each chunk through the twin, buffers updated by
chunk 0 only, gradients summed. After every step the wrapper's outputs, parameter gradients and
buffers must equal the twin's; then the twin takes the model's exact values (the two sum chunk
gradients in different orders, and rounding must not accumulate across steps and dtype changes).
It runs with CPU replicas aliasing the originals' storage (the default on one device) and with
copies refreshed every step (``FASTDP_CPU_DISTINCT=1``: the distinct-GPU path).
``test_state_machine_catches_stale_replicas`` runs the machine against a cache that never
invalidates, or never refreshes, and requires it to fail.

``FASTDP_STATEFUL_EXAMPLES`` sets the number of programs (default 60, derandomized), each up to
``FASTDP_STATEFUL_STEPS`` rules (default 25). 1,500 programs passed on both backends (3 min).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from fastdp import FastDataParallel
from fastdp._replica_set import ReplicaSet

# NOTE [ Tests under each launch strategy ]; each also with the extension allowed and forced off
pytestmark = pytest.mark.usefixtures("launch", "backend")

N = 3
# Batch sizes whose torch.chunk pieces on N replicas all have >= 2 rows (BatchNorm in training).
BATCHES = [b for b in range(2 * N, 25) if min(c.numel() for c in torch.empty(b).chunk(N)) >= 2]
FAIL = 1e6
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-9, atol=1e-10)}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.ReLU()
        self.lin2 = nn.Linear(8, 4)
        self.scale = 1.0

    def forward(self, x):
        if x[0, 0] == FAIL:  # a chunk marked to fail (the failing_step rule)
            raise ValueError("replica asked to fail")
        out = self.lin2(self.act(self.bn(self.lin1(x)))) * self.scale
        if "extra" in self._buffers:  # registered by a rule
            out = out + self.extra[:4]
        return out


def dtype_of(m: nn.Module) -> torch.dtype:
    return m.lin2.weight.dtype


def chunked_reference(twin: Net, x: torch.Tensor) -> torch.Tensor:
    """DataParallel's forward by hand: chunk i through the twin; only chunk 0's buffer updates
    stay (replica 0 aliases the original buffers, the others update copies)."""
    chunks = x.chunk(N)
    outs = [twin(chunks[0])]
    kept = {k: v.clone() for k, v in twin.named_buffers()}
    outs += [twin(c) for c in chunks[1:]]
    return torch.cat(outs), kept


def restore_buffers(twin: Net, kept: dict) -> None:
    with torch.no_grad():
        for k, v in twin.named_buffers():
            if k in kept:
                v.copy_(kept[k])


class PersistentReplicas(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16))
    def build(self, seed):
        torch.manual_seed(seed)
        self.model = Net()
        self.twin = copy.deepcopy(self.model)
        self.fdp = FastDataParallel(self.model, ["cpu"] * N)
        self.hooks: list = []
        self.gen = torch.Generator().manual_seed(seed)
        self.steps = 0

    def both(self, change):
        change(self.model)
        change(self.twin)

    # ------------------------------------------------------------------------------ steps

    @rule(b=st.sampled_from(BATCHES), lr=st.sampled_from([0.0, 0.1]), set_to_none=st.booleans())
    def train_step(self, b, lr, set_to_none):
        dt = dtype_of(self.model)
        x = torch.randn(b, 6, generator=self.gen).to(dt)
        self.model.zero_grad(set_to_none=set_to_none)
        self.twin.zero_grad(set_to_none=set_to_none)
        out = self.fdp(x)
        ref, kept = chunked_reference(self.twin, x)
        w = torch.randn(out.shape, generator=self.gen).to(dt)
        (out * w).sum().backward()
        (ref * w).sum().backward()
        restore_buffers(self.twin, kept)
        torch.testing.assert_close(out, ref, **TOL[dt])
        for (name, p), q in zip(self.model.named_parameters(), self.twin.parameters()):
            if q.grad is None:
                assert p.grad is None or not p.grad.any(), name
            else:
                torch.testing.assert_close(p.grad, q.grad, **TOL[dt], msg=name)
        if lr:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
        self.sync_twin()
        self.steps += 1

    def sync_twin(self):
        """Give the twin the model's exact values: rounding differences between summing chunk
        gradients in two orders must not accumulate (each step is checked from equal states)."""
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self.twin.parameters()):
                q.copy_(p)
            for b, c in zip(self.model.buffers(), self.twin.buffers()):
                c.copy_(b)

    @rule(b=st.sampled_from(BATCHES))
    def no_grad_forward(self, b):
        x = torch.randn(b, 6, generator=self.gen).to(dtype_of(self.model))
        with torch.no_grad():
            out = self.fdp(x)
            ref, kept = chunked_reference(self.twin, x)
        restore_buffers(self.twin, kept)
        torch.testing.assert_close(out, ref, **TOL[dtype_of(self.model)])
        self.sync_twin()

    @rule(b=st.sampled_from(BATCHES), k=st.integers(0, N - 1), grad=st.booleans())
    def failing_step(self, b, k, grad):
        """Replica k raises; the others run (replica 0's buffer updates reach the module)."""
        x = torch.randn(b, 6, generator=self.gen).to(dtype_of(self.model))
        chunks = x.chunk(N)
        chunks[k][0, 0] = FAIL
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=f"replica {k}"):
            self.fdp(x)
        if k != 0:
            with torch.no_grad():
                self.twin(chunks[0])
        self.sync_twin_parameters_only()

    def sync_twin_parameters_only(self):
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self.twin.parameters()):
                assert torch.equal(p, q)  # a failed step must not touch the parameters

    # ---------------------------------------------------------------------------- changes

    @rule(factor=st.sampled_from([-1.0, 0.5, 2.0]))
    def inplace_edit(self, factor):
        def change(m):
            with torch.no_grad():
                m.lin1.weight.mul_(factor)
                m.bn.running_mean.add_(factor)

        self.both(change)

    @rule(seed=st.integers(0, 2**16), assign=st.booleans())
    def load_state_dict(self, seed, assign):
        torch.manual_seed(seed)
        sd = Net().to(dtype_of(self.model)).state_dict()
        if "extra" in dict(self.model.named_buffers()):
            sd["extra"] = torch.full((8,), float(seed % 7), dtype=dtype_of(self.model))
        self.both(lambda m: m.load_state_dict(copy.deepcopy(sd), assign=assign))

    @rule(seed=st.integers(0, 2**16), which=st.sampled_from(["lin1", "lin2"]))
    def replace_submodule(self, seed, which):
        def change(m):
            torch.manual_seed(seed)
            setattr(m, which, nn.Linear(*getattr(m, which).weight.shape[::-1]).to(dtype_of(m)))

        self.both(change)

    @rule(scale=st.sampled_from([0.5, 1.0, 3.0]))
    def plain_attribute(self, scale):
        self.both(lambda m: setattr(m, "scale", scale))

    @rule(k=st.sampled_from([-1.0, 2.0]))
    def add_hook(self, k):
        hooks = [
            m.lin1.register_forward_hook(lambda mod, i, o, k=k: o * k)
            for m in (self.model, self.twin)
        ]
        self.hooks.append(hooks)

    @precondition(lambda self: self.hooks)
    @rule()
    def remove_hook(self):
        for h in self.hooks.pop():
            h.remove()

    @rule(training=st.booleans())
    def train_eval(self, training):
        self.both(lambda m: m.train(training))

    @rule(dtype=st.sampled_from([torch.float32, torch.float64]))
    def change_dtype(self, dtype):
        self.both(lambda m: m.to(dtype))

    @rule(flag=st.booleans())
    def requires_grad_toggle(self, flag):
        self.both(lambda m: m.lin1.weight.requires_grad_(flag))

    @rule(seed=st.integers(0, 2**16))
    def data_swap(self, seed):
        def change(m):
            g = torch.Generator().manual_seed(seed)
            m.lin2.bias.data = torch.randn(4, generator=g).to(dtype_of(m))

        self.both(change)

    @precondition(lambda self: "extra" not in dict(self.model.named_buffers()))
    @rule()
    def register_buffer(self):
        self.both(lambda m: m.register_buffer("extra", torch.arange(8, dtype=dtype_of(m))))

    # -------------------------------------------------------------------------- invariants

    @invariant()
    def buffers_match(self):
        if not hasattr(self, "model"):
            return
        for (name, b), c in zip(self.model.named_buffers(), self.twin.buffers()):
            torch.testing.assert_close(b, c, **TOL.get(b.dtype, {}), msg=name)

    def teardown(self):
        if hasattr(self, "fdp"):
            del self.fdp


PersistentReplicas.TestCase.settings = settings(
    max_examples=int(os.environ.get("FASTDP_STATEFUL_EXAMPLES", "60")),
    stateful_step_count=int(os.environ.get("FASTDP_STATEFUL_STEPS", "25")),
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copied"])
def test_persistent_replicas_state_machine(monkeypatch, alias):
    """``aliased``: CPU replicas share the originals' storage (the default on one device);
    ``copied``: every replica has its own tensors, refreshed each step (the distinct-GPU path)."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "0" if alias else "1")
    PersistentReplicas.TestCase().runTest()


class Sabotaged(PersistentReplicas):
    """The same machine against a broken cache; it must find a failing program."""


Sabotaged.TestCase.settings = settings(
    PersistentReplicas.TestCase.settings, max_examples=200, phases=[Phase.generate]
)


@pytest.mark.parametrize("sabotage", ["never_invalidate", "never_refresh"])
def test_state_machine_catches_stale_replicas(monkeypatch, sabotage):
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")  # copies that must be refreshed
    if sabotage == "never_invalidate":
        monkeypatch.setattr(ReplicaSet, "valid", lambda self, verified=None: True)
    else:
        monkeypatch.setattr(
            ReplicaSet,
            "refresh",
            lambda self, no_sync=False, verified=None: list(self.for_tests().replicas),
        )
    with pytest.raises(Exception):  # noqa: B017  (an assertion or an error from a stale replica)
        Sabotaged.TestCase().runTest()
