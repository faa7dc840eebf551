"""``FastDataParallel.no_sync()``: DDP's accumulation API (see NOTE [ no_sync ]).

Reference: the plain module on the same chunks in turn, accumulating ``.grad`` over the
micro-batches (gradients of BatchNorm in training mode depend on the chunking, so the chunks are
the reference's inputs too). DataParallel gives unused parameters zero gradients where the plain
module leaves None: compared as zeros.
"""

import copy

import pytest
import torch
from torch import nn

import fastdp
from fastdp.testing import ACCEL, home, replica_ids

SIZES = (8, 8, 8, 5)  # uneven last micro-batch


class Net(nn.Module):
    def __init__(self, bn=True):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16) if bn else nn.Identity()
        self.fc2 = nn.Linear(16, 3)
        self.unused = nn.Linear(3, 3)  # never called: DataParallel gives it zero gradients
        self.scale = 1.0

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) * self.scale


def _grad(p):
    return torch.zeros_like(p) if p.grad is None else p.grad


def _assert_grads_equal(net, ref):
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_grad(p), _grad(q), msg=name)


def _setup(n=2, bn=True, kind="cpu"):
    """The module, its reference copy (both on the first replica's device) and the wrapper."""
    torch.manual_seed(0)
    ids = replica_ids(kind, n)
    net = Net(bn).to(home(ids))
    ref = copy.deepcopy(net)
    return net, ref, fastdp.FastDataParallel(net, device_ids=ids)


def _ref_step(ref, x, n=2):
    for c in x.chunk(n):
        ref(c).pow(2).sum().backward()


ON_ACCEL = pytest.mark.skipif(not ACCEL, reason="FASTDP_TEST_ACCEL=1")


@pytest.fixture(params=["alias", "copy", pytest.param("fdpaccel", marks=ON_ACCEL)])
def replica_storage(request, monkeypatch):
    """Replicas aliasing the originals' storage (CPU), holding copies (as on another GPU), or on
    the test device's distinct devices; the device kind to build them on."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "0" if request.param == "alias" else "1")
    return "fdpaccel" if request.param == "fdpaccel" else "cpu"


def test_no_sync_equals_plain_accumulation_with_optimizer_steps(backend, replica_storage):
    net, ref, dp = _setup(kind=replica_storage)
    dev = home(replica_ids(replica_storage, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.005, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.005, momentum=0.9)
    torch.manual_seed(1)
    for _cycle in range(3):
        batches = [torch.randn(b, 8).to(dev) for b in SIZES]
        for i, x in enumerate(batches):
            if i < len(batches) - 1:
                with dp.no_sync():
                    dp(x).pow(2).sum().backward()
                for p in net.parameters():  # nothing reaches the originals inside no_sync
                    assert p.grad is None
            else:
                dp(x).pow(2).sum().backward()
            _ref_step(ref, x)
        _assert_grads_equal(net, ref)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def _count_refresh_backwards(dp, counter):
    """Pre-hooks on the refresh nodes of ``dp``'s replica sets: each run is one reduction."""
    for rs in dp._replica_sets.values():
        node = rs.for_tests().tensors[1][0].grad_fn
        if node is not None and not any(n is node for n in counter["seen"]):
            counter["seen"].append(node)  # kept alive: ids of freed nodes are reused
            node.register_prehook(lambda grads: counter.__setitem__("runs", counter["runs"] + 1))


@pytest.mark.parametrize("use_no_sync", [False, True])
def test_no_sync_saves_one_reduction_per_micro_step(backend, use_no_sync):
    net, ref, dp = _setup()
    counter = {"runs": 0, "seen": []}
    torch.manual_seed(1)
    cycles = 2
    for _cycle in range(cycles):
        for i, b in enumerate(SIZES):
            x = torch.randn(b, 8)
            if use_no_sync and i < len(SIZES) - 1:
                with dp.no_sync():
                    out = dp(x)
            else:
                out = dp(x)
            _count_refresh_backwards(dp, counter)
            out.pow(2).sum().backward()
            _ref_step(ref, x)
        _assert_grads_equal(net, ref)
        net.zero_grad()
        ref.zero_grad()
    saved = (len(SIZES) - 1) * cycles if use_no_sync else 0
    assert counter["runs"] == len(SIZES) * cycles - saved
    assert dp.no_sync_stats == {"micro_steps": saved, "folds": cycles if use_no_sync else 0}


def test_no_sync_replica_leaves_persist_and_two_forwards_before_backward(replica_storage):
    # BatchNorm and forwards that renew the set: tests/test_reduce_no_sync_lifecycle.py
    net, ref, dp = _setup(bn=False, kind=replica_storage)
    torch.manual_seed(1)
    xs = [torch.randn(8, 8).to(home(replica_ids(replica_storage, 1))) for _ in range(3)]
    with dp.no_sync():
        outs = [dp(x) for x in xs[:2]]  # two forwards, then one backward: no refresh in between
        leaves = [
            t for rs in dp._replica_sets.values() for row in rs.for_tests().leaves for t in row
        ]
        sum(o.pow(2).sum() for o in outs).backward()
    again = [t for rs in dp._replica_sets.values() for row in rs.for_tests().leaves for t in row]
    assert all(a is b for a, b in zip(leaves, again))  # the pending gradients' holders stayed
    dp(xs[2]).pow(2).sum().backward()
    for x in xs:
        _ref_step(ref, x)
    _assert_grads_equal(net, ref)


@pytest.mark.parametrize("change", ["attribute", "new_layer", "eval_train"])
def test_no_sync_model_change_keeps_pending_gradients(backend, change):
    net, ref, dp = _setup()
    torch.manual_seed(1)
    xs = [torch.randn(b, 8) for b in SIZES]
    with dp.no_sync():
        dp(xs[0]).pow(2).sum().backward()
        _ref_step(ref, xs[0])
        if change == "attribute":  # rebuilds the replica set
            net.scale = ref.scale = 2.0
        elif change == "new_layer":
            torch.manual_seed(5)
            net.unused = nn.Linear(3, 3)
            ref.unused = copy.deepcopy(net.unused)
        else:  # back where it was: the replicas still match, so the set is kept
            net.eval()
            net.train()
        before = next(iter(dp._replica_sets.values()))
        dp(xs[1]).pow(2).sum().backward()
        _ref_step(ref, xs[1])
        kept = next(iter(dp._replica_sets.values())) is before
        assert kept == (change == "eval_train")
    dp(xs[2]).pow(2).sum().backward()
    _ref_step(ref, xs[2])
    _assert_grads_equal(net, ref)


@pytest.mark.parametrize("how", ["model", "optimizer_zeroing_existing_grads"])
def test_zero_grad_inside_no_sync_drops_pending_gradients(backend, how):
    net, ref, dp = _setup()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.manual_seed(1)
    xs = [torch.randn(8, 8) for _ in range(3)]
    if how != "model":  # the originals hold gradients from an earlier step: zeroing changes them
        dp(torch.randn(8, 8)).sum().backward()
    with dp.no_sync():
        dp(xs[0]).pow(2).sum().backward()
        if how == "model":
            dp.zero_grad()  # DDP drops the local gradients here too
        else:
            opt.zero_grad(set_to_none=False)
            ref.zero_grad()
        dp(xs[1]).pow(2).sum().backward()
    dp(xs[2]).pow(2).sum().backward()
    for x in xs[1:]:
        _ref_step(ref, x)
    _assert_grads_equal(net, ref)


def test_no_sync_through_wrap_in_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    model = fastdp.wrap(net, device_ids=["cpu"] * 2)
    assert isinstance(model, fastdp.FastDataParallel)
    xs = [torch.randn(b, 8) for b in SIZES]
    for i, x in enumerate(xs):
        if i < len(xs) - 1:
            with model.no_sync():
                model(x).pow(2).sum().backward()
        else:
            model(x).pow(2).sum().backward()
        _ref_step(ref, x)
    _assert_grads_equal(net, ref)
    assert model.no_sync_stats["micro_steps"] == len(xs) - 1


def test_no_sync_without_persistent_replicas_still_accumulates():
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    dp = fastdp.FastDataParallel(net, device_ids=["cpu"] * 2, persistent=False)
    xs = [torch.randn(b, 8) for b in SIZES]
    for x in xs:
        with dp.no_sync():
            dp(x).pow(2).sum().backward()
        _ref_step(ref, x)
    _assert_grads_equal(net, ref)  # reduced every step: correct, nothing saved


class Branch(nn.Module):
    """``branch`` is used by chunks of more than one row only: a one-row chunk's replica skips
    it (DataParallel gives it zeros when no replica used it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.branch = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = self.lin(x)
        return h + self.branch if len(x) > 1 else h


def _assert_same_grads(a, b):
    """``.grad`` of both modules: None where the other's is None, else equal."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}: {p.grad} vs {q.grad}"
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.usefixtures("backend", "storage")  # the fold runs before any launch
@pytest.mark.parametrize("toggle", ["freeze_unused", "freeze_used_then_zero", "unfreeze_unused"])
def test_requires_grad_toggled_between_micro_steps(toggle):
    """A micro-step's reduce gives zeros to every parameter that required grad then and got
    none; what ``requires_grad`` says later does not change that (the fold and
    ``zero_grad(set_to_none=False)`` go by the micro-steps' leaves)."""
    dp = fastdp.FastDataParallel(Branch(), ["cpu"] * 2)
    fresh = fastdp.FastDataParallel(Branch(), ["cpu"] * 2, persistent=False)
    torch.manual_seed(1)
    xs = [torch.randn(b, 4) for b in (1, 4, 4)]
    before = []  # which .grad are None after the fold, before the last backward
    for m in (dp, fresh):
        net = m.module
        if toggle == "unfreeze_unused":
            net.branch.requires_grad_(False)
        with m.no_sync():
            m(xs[0] if toggle != "freeze_used_then_zero" else xs[1]).pow(2).sum().backward()
        net.branch.requires_grad_(toggle == "unfreeze_unused")
        if toggle == "freeze_used_then_zero":
            with m.no_sync():
                m(xs[1]).sum().backward()
            m.zero_grad(set_to_none=False)
        out = m(xs[2])  # the fold, before this step's backward
        before.append([p.grad is None for p in net.parameters()])
        out.pow(2).sum().backward()
    assert before[0] == before[1]
    _assert_same_grads(dp.module, fresh.module)
