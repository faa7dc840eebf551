"""Persistent replicas give what DataParallel's fresh replicas give, step after step.

Each scenario is one way persistence used to differ from ``persistent=False`` (DataParallel's
algorithm: replicas built afresh every step): what a forward does to a replica (``.data =``,
hooks, reassigned buffers and submodules, in-place writes), how backward is called
(``autograd.grad``, ``backward(inputs=...)``, two backwards in a step), ``no_sync()`` with hooks
or with originals edited between micro-steps, two threads calling one wrapper, and saving the
replicas. Every test runs in both storage modes (CPU replicas aliasing the originals, and with
storage of their own) and under every launch strategy; the differential oracle
(tests/test_replicas_oracle.py) draws such programs at random.
"""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn

from fastdp import FastDataParallel
from fastdp.testing import grads_of

pytestmark = pytest.mark.usefixtures("launch", "storage", "backend")

TINY = 1e-6  # bucket_cap_mb: one tensor per bucket


def _pair(net: nn.Module, n: int = 2, **kw) -> tuple[FastDataParallel, FastDataParallel]:
    """The persistent wrapper and DataParallel's algorithm, each over its own copy of ``net``."""
    return (
        FastDataParallel(copy.deepcopy(net), ["cpu"] * n, **kw),
        FastDataParallel(copy.deepcopy(net), ["cpu"] * n, persistent=False, **kw),
    )


def _assert_same(a: FastDataParallel, b: FastDataParallel) -> None:
    ga, gb = grads_of(a.module), grads_of(b.module)
    assert {k: v is None for k, v in ga.items()} == {k: v is None for k, v in gb.items()}
    for k, v in ga.items():
        if v is not None:
            torch.testing.assert_close(v, gb[k], msg=k)
    for (k, x), y in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        torch.testing.assert_close(x, y, msg=k)


def _train(
    pair,
    steps: int,
    batch: int = 8,
    width: int = 4,
    lr: float = 0.1,
    loss=lambda out: out.pow(2).sum(),
) -> None:
    """``steps`` SGD steps on both wrappers; outputs, gradients and states must agree."""
    opts = [torch.optim.SGD(w.parameters(), lr=lr) for w in pair]
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(batch, width, dtype=torch.float64)
        outs = []
        for w, opt in zip(pair, opts):
            opt.zero_grad(set_to_none=True)
            out = w(x)
            loss(out).backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1])
        _assert_same(*pair)
        for opt in opts:
            opt.step()


# --- what a forward does to its replica ------------------------------------------------------


class MaxNorm(nn.Module):
    """braindecode's max-norm layers: the weight renormalised through ``.data`` in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x):
        self.lin.weight.data = torch.renorm(self.lin.weight.data, 2, 0, 0.5)
        return self.lin(x)


def test_data_assignment_in_forward_is_not_kept():
    _train(_pair(MaxNorm()), steps=3)


class HookInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x):
        self.lin.weight.register_hook(lambda g: g * 0.5)
        return self.lin(x)


def test_hook_registered_in_forward_runs_once_per_step():
    _train(_pair(HookInForward()), steps=4)


class Reassigns(nn.Module):
    """A buffer, a parameter and a submodule reassigned inside forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.act = nn.Identity()

    def forward(self, x):
        self.count = self.count + 1
        out = self.act(self.lin(x)) + self.count
        self.act = nn.Tanh()
        self.extra = nn.Parameter(torch.ones((), dtype=torch.float64))
        return out


class HookAndReassign(Reassigns):
    def forward(self, x):
        self.lin.weight.register_hook(lambda g: g * 0.5)
        return super().forward(x)


def test_hook_and_reassignment_in_one_forward():
    """Restoring the replicas' dicts must not hide the hook from the tensor check."""
    _train(_pair(HookAndReassign()), steps=3)


def test_buffers_parameters_and_submodules_reassigned_in_forward_are_not_kept():
    _train(_pair(Reassigns()), steps=3)


class Stat(nn.Module):
    """A frozen statistics parameter updated in place by forward."""

    def __init__(self):
        super().__init__()
        self.stat = nn.Parameter(torch.zeros(4, dtype=torch.float64), requires_grad=False)
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x):
        with torch.no_grad():
            self.stat.mul_(0.5).add_(x.mean(0))
        return self.lin(x) + self.stat


def test_in_place_parameter_write_in_forward(storage):
    """Distinct storage: each replica writes its own copy, replica 0's write reaches the original
    (distinct GPUs' semantics). Aliasing CPU replicas share the original's storage: each
    replica's write lands on it (documented; FASTDP_CPU_DISTINCT=1 opts out) and fastdp warns."""
    x = torch.arange(32, dtype=torch.float64).view(8, 4)
    fast, fresh = _pair(Stat(), launch="inline")
    fresh(x)
    if storage == "distinct":
        fast(x)
        torch.testing.assert_close(fast.module.stat, fresh.module.stat)
        return
    with pytest.warns(UserWarning, match="FASTDP_CPU_DISTINCT"):
        fast(x)
    assert not torch.equal(fast.module.stat, fresh.module.stat)


# --- how backward is called --------------------------------------------------------------------


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.unused = nn.Linear(4, 4).double()
        self.head = nn.Linear(4, 4).double()

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)))


class FrozenScale(nn.Module):
    """A frozen scale the graph saves; the trainable parameters inside a reentrant checkpoint
    (``checkpointed``) or unused (the gradient asked of the input): the outer graph reaches
    no bucket node."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed
        self.scale = nn.Parameter(torch.randn(4, dtype=torch.float64), requires_grad=False)
        self.inner = nn.Linear(4, 4).double()

    def forward(self, x):
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(
                lambda t: torch.tanh(self.inner(t)), x.detach().requires_grad_(), use_reentrant=True
            )
            x = x + h
        return x * self.scale.reshape(1, 4).expand(x.shape[0], 4)


@pytest.mark.parametrize("checkpointed", [True, False], ids=["checkpoint", "input-grad"])
def test_two_forwards_whose_graph_reaches_no_bucket_node(checkpointed):
    """Two forwards before one backward: the first forward's graph saved the frozen scale of
    each replica, through no bucket node. The second forward must not refresh those tensors
    in place (storage of their own: a version error, or stale values)."""
    pair = _pair(FrozenScale(checkpointed), bucket_cap_mb=TINY)
    torch.manual_seed(1)
    xs = [torch.randn(6, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    grads = []
    for w in pair:
        w(xs[0]).sum().backward()  # a step of its own first: the nodes exist and ran
        a, b = w(xs[0]), w(xs[1] * 2)
        grads.append(torch.autograd.grad(a.pow(2).sum() + b.pow(2).sum(), xs))
        a, b = w(xs[0]), w(xs[1])
        (a.pow(2).sum() + b.sum()).backward()
    torch.testing.assert_close(grads[0], grads[1])
    _assert_same(*pair)


@pytest.mark.parametrize("cap", [TINY, 25.0], ids=["buckets", "one-bucket"])
def test_autograd_grad_matches_fresh_replicas(cap):
    x = torch.randn(6, 4, dtype=torch.float64)
    pair = _pair(Three(), bucket_cap_mb=cap)
    results = []
    for w in pair:
        params = [w.module.a.weight, w.module.head.bias]
        results.append(torch.autograd.grad(w(x).pow(2).sum(), params))
        assert all(p.grad is None for p in w.module.parameters())
    for g, h in zip(*results):
        torch.testing.assert_close(g, h)


@pytest.mark.parametrize("cap", [TINY, 25.0], ids=["buckets", "one-bucket"])
@pytest.mark.parametrize("which", [["a.weight"], ["a.weight", "unused.weight", "head.weight"]])
def test_backward_inputs_touches_only_the_inputs(cap, which):
    x = torch.randn(6, 4, dtype=torch.float64)
    pair = _pair(Three(), bucket_cap_mb=cap)
    for w in pair:
        named = dict(w.module.named_parameters())
        w(x).pow(2).sum().backward(inputs=[named[k] for k in which])
    _assert_same(*pair)
    assert pair[0].module.a.bias.grad is None
    if "unused.weight" in which:  # DataParallel's zeros for an unused input
        assert torch.count_nonzero(pair[0].module.unused.weight.grad) == 0


@pytest.mark.parametrize("cap", [TINY, 25.0], ids=["buckets", "one-bucket"])
def test_grad_then_backward_in_one_step(cap):
    """A second backward of the same step zero-fills the unreached buckets as the first would."""
    x = torch.randn(6, 4, dtype=torch.float64)
    pair = _pair(Three(), bucket_cap_mb=cap)
    for w in pair:
        loss = w(x).pow(2).sum()
        torch.autograd.grad(loss, [w.module.head.bias], retain_graph=True)
        loss.backward()
    _assert_same(*pair)
    assert pair[0].module.unused.weight.grad is not None


# --- no_sync ----------------------------------------------------------------------------------


def _micro_steps(w: FastDataParallel, xs, between=None) -> None:
    with w.no_sync():
        for i, x in enumerate(xs[:-1]):
            w(x).pow(2).sum().backward()
            if between is not None:
                between(w.module, i)
    w(xs[-1]).pow(2).sum().backward()


def _clamp_grad(t: torch.Tensor) -> None:
    t.grad.clamp_(-1.0, 1.0)


@pytest.mark.parametrize("kind", ["tensor-hook", "post-accumulate-hook"])
def test_no_sync_runs_hooks_on_the_originals_per_micro_step(kind):
    torch.manual_seed(0)
    xs = [torch.randn(6, 4, dtype=torch.float64) for _ in range(3)]
    pair = _pair(Three())
    for w in pair:
        p = w.module.a.weight
        if kind == "tensor-hook":
            p.register_hook(lambda g: g * 0.5)
        else:
            p.register_post_accumulate_grad_hook(_clamp_grad)
        _micro_steps(w, xs)
    _assert_same(*pair)


@pytest.mark.parametrize("edit", ["mul_", "load_state_dict"])
def test_no_sync_sees_originals_edited_between_micro_steps(edit):
    torch.manual_seed(0)
    xs = [torch.randn(6, 4, dtype=torch.float64) for _ in range(3)]
    state = Three().state_dict()

    def between(m, i):
        with torch.no_grad():
            if edit == "mul_":
                m.a.weight.mul_(0.5)
            else:
                m.load_state_dict({k: v * (i + 2) for k, v in state.items()})

    pair = _pair(Three())
    for w in pair:
        _micro_steps(w, xs, between)
    _assert_same(*pair)


# --- concurrency and saving -------------------------------------------------------------------


class Remembers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x):
        self.last = x.sum()
        return self.lin(x) * self.last


def test_two_threads_calling_one_wrapper_get_their_own_results():
    torch.manual_seed(0)
    net = Remembers()
    fast = FastDataParallel(net, ["cpu"] * 2)
    xs = [torch.randn(4, 4, dtype=torch.float64) for _ in range(8)]
    with torch.no_grad():
        expected = [torch.cat([net(c) for c in x.chunk(2)]) for x in xs]
    got: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def worker(k):
        try:
            with torch.no_grad():
                for _ in range(25):
                    for i, x in enumerate(xs):
                        got[k].append((i, fast(x)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in (0, 1):
        for i, out in got[k]:
            torch.testing.assert_close(out, expected[i])


def test_saving_the_replicas():
    """torch's own DataParallel suite saves replicas (test_save_replica_module)."""
    fast = FastDataParallel(Three(), ["cpu"] * 2)
    replicas = fast.replicate(fast.module, fast.device_ids)
    buf = io.BytesIO()
    torch.save(replicas, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is list and len(loaded) == 2


# --- memory and layouts -----------------------------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3).double().to(memory_format=torch.channels_last)
        self.bn = nn.BatchNorm2d(8).double()
        self.layouts: list[bool] = []  # a list the replicas share: what each forward saw

    def forward(self, x):
        self.layouts.append(self.conv.weight.is_contiguous(memory_format=torch.channels_last))
        return self.bn(self.conv(x))


def test_channels_last_parameters_stay_channels_last_on_replicas():
    pair = _pair(ConvNet())
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    for _ in range(2):
        outs = [w(x) for w in pair]
        for out in outs:
            out.pow(2).sum().backward()
        torch.testing.assert_close(outs[0], outs[1])
    _assert_same(*pair)
    assert pair[0].module.layouts == [True] * 4


def _param_and_buffer_bytes(m: nn.Module) -> tuple[int, int]:
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return size(m.parameters()), size(m.buffers())


def test_memory_is_reported_and_bounded(storage):
    """No staging where every replica is on the source device; replica sets of other device
    tuples (a partial last batch) are bounded: the last two are kept."""
    net = ConvNet()
    fast = FastDataParallel(net, ["cpu"] * 4)
    params, buffers = _param_and_buffer_bytes(net)
    per_copy = buffers + (params if storage == "distinct" else 0)
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    for batch, copies in [(8, 3), (6, 3 + 2), (2, 2 + 1), (8, 1 + 3)]:  # 4, 3, 2, 4 replicas
        fast(x[:batch]).sum().backward()
        assert fast.memory_stats()["cpu"] == {"replicas": copies * per_copy, "staging": 0}


def test_no_grad_data_assignment_reaches_the_originals_as_in_dataparallel():
    """Under no_grad DataParallel's replica 0 holds the original tensors themselves."""
    pair = _pair(MaxNorm())
    x = torch.randn(4, 4, dtype=torch.float64)
    with torch.no_grad():
        outs = [w(x) for w in pair]
    torch.testing.assert_close(outs[0], outs[1])
    _assert_same(*pair)
    _train(pair, steps=2)


def test_zero_grad_keeping_tensors_after_no_sync_micro_steps():
    pair = _pair(Three())
    x = torch.randn(6, 4, dtype=torch.float64)
    for w in pair:
        with w.no_sync():
            w(x).pow(2).sum().backward()
        w.zero_grad(set_to_none=False)
    _assert_same(*pair)
    assert torch.count_nonzero(pair[0].module.a.weight.grad) == 0
