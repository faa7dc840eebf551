"""Persistent replicas see every kind of change between steps: each scenario steps, changes the
model, steps again and compares outputs and gradients with the plain module on the whole batch.
``test_scenarios_fail_without_*`` re-run them against a cache that never invalidates (or never
refreshes) and require a mismatch: the tests can fail. What the replica set watches to see them:
tests/test_replicas_invalidation.py.
"""

import pytest
import torch
from models import ScaledMLP
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp._replica_set import ReplicaSet
from fastdp.testing import output_and_grads

pytestmark = pytest.mark.usefixtures("launch")  # NOTE [ Tests under each launch strategy ]

N = 3


def _new_lin1(m):
    m.lin1 = nn.Linear(6, 8)


def _append(m):
    m.lin2 = nn.Sequential(m.lin2, nn.Tanh())


def _new_param(m):
    m.lin1.weight = nn.Parameter(torch.randn(8, 6))


def _data_swap(m):
    m.lin1.weight.data = torch.randn(8, 6)


def _double(m):
    m.double()


def _eval_mode(m):
    m.eval()  # dropout must be off in every replica


def _hook_added(m):
    m._hook = m.lin2.register_forward_hook(lambda mod, i, o: o * 2)


def _attribute(m):
    m.scale = 3.0


def _state_dict(m):
    torch.manual_seed(7)
    m.load_state_dict(ScaledMLP().state_dict())


def _state_dict_assign(m):
    torch.manual_seed(8)
    m.load_state_dict(ScaledMLP().state_dict(), assign=True)


def _register_buffer(m):
    m.lin1.register_buffer("unused", torch.ones(2))
    m.scale = 0.5


def _inplace(m):
    with torch.no_grad():
        m.lin1.weight.mul_(-2)


def _requires_grad(m):
    m.lin1.weight.requires_grad_(False)


# name -> (change, what must catch it: "invalidation" or "refresh")
SCENARIOS = {
    "replace_submodule": (_new_lin1, "invalidation"),
    "module_tree": (_append, "invalidation"),
    "parameter_identity": (_new_param, "invalidation"),
    "parameter_data_swap": (_data_swap, "invalidation"),
    "dtype_double": (_double, "invalidation"),
    "eval_mode": (_eval_mode, "invalidation"),
    "hook_added": (_hook_added, None),  # replicas share the hook dicts: no rebuild needed
    "plain_attribute": (_attribute, "invalidation"),
    "load_state_dict": (_state_dict, "refresh"),
    "load_state_dict_assign": (_state_dict_assign, "invalidation"),
    "register_buffer_and_attribute": (_register_buffer, "invalidation"),
    "inplace_update": (_inplace, "refresh"),
    "requires_grad": (_requires_grad, None),  # autograd's needs_input_grad handles it
}


def run_scenario(name):
    """Returns (fastdp outputs, grads) and (plain outputs, grads) after the change."""
    change, _ = SCENARIOS[name]
    torch.manual_seed(0)
    model = ScaledMLP(dropout=name == "eval_mode")
    fdp = FastDataParallel(model, device_ids=["cpu"] * N)
    x = torch.randn(9, 6)
    output_and_grads(fdp, x)
    output_and_grads(fdp, x)  # the cache is warm
    change(model)
    xx = x.to(next(model.parameters()).dtype)
    out, grads = output_and_grads(fdp, xx)
    model.zero_grad(set_to_none=True)
    ref = model(xx)
    ref.sum().backward()
    return (out, grads), (ref.detach(), {n: p.grad for n, p in model.named_parameters()})


def _matches(a, b):
    try:
        assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
        assert a[1].keys() == b[1].keys()
        for k in a[1]:
            if a[1][k] is None or b[1][k] is None:
                assert a[1][k] is None and b[1][k] is None, k
            else:
                assert_close(a[1][k], b[1][k], rtol=1e-5, atol=1e-6)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_change_between_steps_is_seen(backend, name):
    got, ref = run_scenario(name)
    assert _matches(got, ref)


def _fails(name):
    try:
        got, ref = run_scenario(name)
    except Exception:
        return True  # a stale replica that raises also counts as caught
    return not _matches(got, ref)


def test_scenarios_fail_without_invalidation(monkeypatch):
    monkeypatch.setattr(ReplicaSet, "valid", lambda self, verified=None: True)
    caught = [n for n, (_, by) in SCENARIOS.items() if by == "invalidation"]
    assert all(_fails(n) for n in caught), [n for n in caught if not _fails(n)]


def test_scenarios_fail_without_refresh(monkeypatch):
    """On the torch path, where the copy is a patchable Python method (the extension's copy is
    inside its C++ refresh, exercised by every other test)."""
    from fastdp import _backend

    monkeypatch.setattr(_backend, "_enabled", False)
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")  # copies, as on other devices
    monkeypatch.setattr(ReplicaSet, "_copy_sources", lambda self: None)
    caught = [n for n, (_, by) in SCENARIOS.items() if by == "refresh"]
    assert all(_fails(n) for n in caught)


@pytest.mark.parametrize("alias", [True, False])
def test_copy_path_matches_alias_path(backend, monkeypatch, alias):
    """Replicas on another device hold copies; on one machine the copy path is forced."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "0" if alias else "1")
    for name in ("inplace_update", "load_state_dict", "parameter_data_swap"):
        got, ref = run_scenario(name)
        assert _matches(got, ref), name
