"""``no_sync()`` micro-steps whose replica tensors change under them, and backward orders that
reach a bucket node more than once: persistent replicas must give what ``persistent=False``
(DataParallel's fresh replicas, reduced every step) gives, in both storage modes and under every
launch strategy. See NOTE [ no_sync ] in ``fastdp/_no_sync.py``.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastdp

D = 4


def _pair(net, n=2, **kw):
    """The persistent wrapper, DataParallel's algorithm, and the plain module, on copies of
    ``net``; ``kw``: the wrappers' settings."""
    fresh, plain = copy.deepcopy(net), copy.deepcopy(net)
    return (
        fastdp.FastDataParallel(net, ["cpu"] * n, **kw),
        fastdp.FastDataParallel(fresh, ["cpu"] * n, persistent=False, **kw),
        plain,
    )


def _assert_same(a, b, what=""):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        g, h = p.grad, q.grad
        assert (g is None) == (h is None), f"{what}.grad of {name}: {g} vs {h}"
        if g is not None:
            torch.testing.assert_close(g.to_dense(), h.to_dense(), msg=f"{what}.grad of {name}")
        torch.testing.assert_close(p.detach(), q.detach(), msg=f"{what}{name}")
    for (name, x), y in zip(a.named_buffers(), b.buffers()):
        torch.testing.assert_close(x, y, msg=f"{what}buffer {name}")


def _halve(g):
    return g * 0.5


class Renewing(nn.Module):
    """A forward that makes a persistent replica set renew its tensors: ``.data =`` (max-norm),
    a hook registered in forward, or (replicas with copies) an in-place write to a frozen
    parameter."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)
        self.ema = nn.Parameter(torch.zeros(D), requires_grad=False)
        self.double()

    def forward(self, x):
        if self.how == "data_assign":
            with torch.no_grad():
                self.lin.weight.data = torch.renorm(self.lin.weight.data, 2, 0, 0.5)
        elif self.how == "hook" and torch.is_grad_enabled():
            self.lin.weight.register_hook(_halve)
        elif self.how == "frozen_write" and self.training:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(0.5 * x.mean(0))
        return self.head(torch.tanh(self.lin(x + self.ema)))


def _two_forwards_then_synced(wrappers, xs):
    """Under no_sync, two forwards and one backward of their sum (a GAN's D(real) + D(fake));
    then a synced step. Returns the outputs."""
    outs = []
    for dp in wrappers:
        with dp.no_sync():
            a, b = dp(xs[0]), dp(xs[1])
            (a.pow(2).sum() + b.sum()).backward()
        c = dp(xs[2])
        c.pow(2).sum().backward()
        outs.append((a, b, c))
    return outs


@pytest.mark.usefixtures("launch", "backend")
@pytest.mark.parametrize("how", ["data_assign", "hook", "frozen_write"])
def test_no_sync_two_forwards_keep_the_first_forwards_gradients(storage, how):
    if how == "frozen_write" and storage == "alias":
        pytest.skip("shared storage applies the write once per replica (README)")
    dp, fresh, _ = _pair(Renewing(how))
    torch.manual_seed(1)
    xs = [torch.randn(6, D, dtype=torch.float64) for _ in range(3)]
    outs = _two_forwards_then_synced([dp, fresh], xs)
    for o, r in zip(*outs):
        torch.testing.assert_close(o, r)
    _assert_same(dp.module, fresh.module)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.head = nn.Linear(D, 2)
        self.double()

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.lin(x))))


@pytest.mark.usefixtures("launch", "backend")
@pytest.mark.parametrize("training", [True, False])
def test_no_sync_two_forwards_with_batchnorm(storage, training):
    dp, fresh, _ = _pair(Normed())
    dp.train(training)
    fresh.train(training)
    torch.manual_seed(1)
    xs = [torch.randn(6, D, dtype=torch.float64) for _ in range(3)]
    outs = _two_forwards_then_synced([dp, fresh], xs)
    for o, r in zip(*outs):
        torch.testing.assert_close(o, r)
    _assert_same(dp.module, fresh.module)


@pytest.mark.usefixtures("launch", "backend")
@pytest.mark.parametrize("edit", ["clamp", "mul"])
def test_no_sync_sees_data_edits_between_micro_steps(storage, edit):
    """WGAN's weight clipping (``p.data.clamp_``) between micro-steps: ``.data`` edits do not
    bump the parameters' version counters, yet the next micro-step must see them."""
    net = Normed()
    dp, fresh, _ = _pair(net)
    torch.manual_seed(1)
    xs = [torch.randn(6, D, dtype=torch.float64) for _ in range(3)]
    for dp_ in (dp, fresh):
        outs = []
        for i, x in enumerate(xs):
            with dp_.no_sync() if i < 2 else torch.enable_grad():
                out = dp_(x)
                out.pow(2).sum().backward()
            outs.append(out)
            for p in dp_.module.parameters():
                if edit == "clamp":
                    p.data.clamp_(-0.2, 0.2)
                else:
                    p.data.mul_(0.5)
        dp_.outs = outs
    for o, r in zip(dp.outs, fresh.outs):
        torch.testing.assert_close(o, r)
    _assert_same(dp.module, fresh.module)


class Sparse(nn.Module):
    """An ``Embedding(sparse=True)`` that a replica skips when its chunk's first index is -1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, D, sparse=True)
        self.lin = nn.Linear(D, 2)
        self.double()

    def forward(self, x, idx):
        if not bool((idx < 0).any()):
            x = x + self.emb(idx)
        return self.lin(x)


@pytest.mark.usefixtures("launch", "backend")
def test_no_sync_folds_into_a_sparse_grad(storage):
    """A synced step where every replica used the embedding leaves its ``.grad`` sparse; a
    micro-step where one replica skips it gives a dense pending total to fold into it."""
    dp, fresh, _ = _pair(Sparse())
    torch.manual_seed(1)
    x = [torch.randn(6, D, dtype=torch.float64) for _ in range(3)]
    idx = [torch.randint(0, 10, (6,)) for _ in range(3)]
    idx[1][3] = -1  # the second replica skips the embedding
    for dp_ in (dp, fresh):
        dp_(x[0], idx[0]).pow(2).sum().backward()
        assert dp_.module.emb.weight.grad.is_sparse
        with dp_.no_sync():
            dp_(x[1], idx[1]).pow(2).sum().backward()
        dp_(x[2], idx[2]).pow(2).sum().backward()
    _assert_same(dp.module, fresh.module)


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)
        self.double()

    def forward(self, x):
        h = checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=True)
        return self.head(h)


@pytest.mark.usefixtures("backend")
def test_post_accumulate_hook_with_reentrant_checkpoint(storage, launch):
    """Each replica's recompute is a nested backward that reaches the bucket node (which holds
    ``lin`` inside the checkpoint and ``head`` outside) again: a post-accumulate-grad hook on
    ``head`` (per-parameter clipping, optimizer-in-backward) must act once on its total, as with
    the plain module (and DataParallel's ``Broadcast`` when it runs last: NOTE [ Early
    reduction ])."""
    dp, fresh, plain = _pair(Checkpointed())
    torch.manual_seed(1)
    x = torch.randn(6, D, dtype=torch.float64, requires_grad=True)
    dp(x).sum().backward()  # a first step: the launch's threads have run forwards before
    fresh(x).sum().backward()

    def halve_in_place(p):
        p.grad.mul_(0.5)

    for m in (dp.module, fresh.module, plain):
        for p in m.head.parameters():
            p.register_post_accumulate_grad_hook(halve_in_place)
    for _ in range(2):
        for m in (dp, fresh, plain):
            m.zero_grad()
            m(x).pow(2).sum().backward()
        _assert_same(dp.module, plain)
        if launch == "inline":  # on threads, Broadcast's turn depends on their counters
            _assert_same(fresh.module, plain)


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("forwards", [1, 2])
@pytest.mark.parametrize("hooked", ["lin", "lin.bias", "head", ""])
def test_post_accumulate_hook_inside_a_reentrant_checkpoint(storage, forwards, hooked):
    """A post-accumulate-grad hook on parameters inside the checkpoint (``lin``), a bucket per
    tensor: DataParallel's ``Broadcast`` accumulates each replica's part in its nested backward,
    then zeros in the outer one (the checkpointed bucket is unreached there); the hook sees
    each. One or two forwards before one backward; inline (on threads DataParallel's turn
    depends on the workers' sequence numbers)."""
    dp, fresh, _ = _pair(Checkpointed(), bucket_cap_mb=1e-6, launch="inline")
    torch.manual_seed(1)
    x = torch.randn(6, D, dtype=torch.float64, requires_grad=True)
    for m in (dp, fresh):
        m(x).sum().backward()

    def halve_in_place(p):
        p.grad.mul_(0.5)

    for m in (dp, fresh):
        for name, p in m.module.named_parameters():
            if name.startswith(hooked):
                p.register_post_accumulate_grad_hook(halve_in_place)
    for step in range(3):
        for m in (dp, fresh):
            if step != 1:  # one step accumulates onto the last
                m.zero_grad()
            sum(m(x + k).pow(2).sum() for k in range(forwards)).backward()
        _assert_same(dp.module, fresh.module, f"step {step}: ")


@pytest.mark.usefixtures("launch", "backend")
def test_no_sync_forward_whose_backward_follows_a_synced_forward(storage):
    """D(fake) inside ``no_sync()``, D(real) outside, one backward of both: the fold, due at
    the second forward, waits for that backward (the first graph's gradients come with it)."""
    dp, fresh, _ = _pair(Normed())
    torch.manual_seed(1)
    xs = [torch.randn(6, D, dtype=torch.float64) for _ in range(3)]
    for dp_ in (dp, fresh):
        with dp_.no_sync():
            a = dp_(xs[0])
        b = dp_(xs[1])
        (a.pow(2).sum() + b.sum()).backward()
        dp_(xs[2]).sum().backward()
    _assert_same(dp.module, fresh.module)


class FirstUnused(nn.Module):
    """The first parameter is never used (the probe of NOTE [ no_sync ] never fires)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.unused = nn.Linear(D, D)
        self.lin = nn.Linear(D, 2)
        self.double()

    def forward(self, x):
        return self.lin(x)


@pytest.mark.usefixtures("launch", "backend")
def test_no_sync_when_the_first_parameter_is_unused(storage):
    dp, fresh, _ = _pair(FirstUnused())
    torch.manual_seed(1)
    xs = [torch.randn(6, D, dtype=torch.float64) for _ in range(4)]
    for dp_ in (dp, fresh):
        for x in xs[:3]:
            with dp_.no_sync():
                dp_(x).pow(2).sum().backward()
        dp_(xs[3]).sum().backward()
    _assert_same(dp.module, fresh.module)


@pytest.mark.usefixtures("launch", "backend")
def test_frozen_model_two_forwards_with_batchnorm(storage):
    """No source requires grad, so no bucket node tracks the graph; an input that requires
    grad makes one all the same, and it saved the replicas' copies."""
    dp, fresh, plain = _pair(Normed().requires_grad_(False))
    torch.manual_seed(1)
    xs = [torch.randn(6, D, dtype=torch.float64) for _ in range(2)]
    grads = []
    for dp_ in (dp, fresh):
        inputs = [x.clone().requires_grad_() for x in xs]
        a, b = dp_(inputs[0]), dp_(inputs[1])
        (a.pow(2).sum() + b.sum()).backward()
        grads.append([x.grad for x in inputs])
    for g, h in zip(*grads):
        torch.testing.assert_close(g, h)
    _assert_same(dp.module, fresh.module)


def _edit(dp, how):
    with torch.no_grad():
        for p in dp.module.parameters():
            if how == "in_place":  # what an optimizer step does
                p.mul_(0.5)
            else:
                p.data.clamp_(-0.2, 0.2) if how == "clamp" else p.data.mul_(0.5)


@pytest.mark.usefixtures("launch", "backend")
@pytest.mark.parametrize("how", ["mul", "clamp", "in_place"])
def test_no_grad_forward_mid_cycle_then_an_edit(storage, how):
    """A micro-step, a ``no_grad`` forward outside ``no_sync()`` while that micro-step's
    backward is due, the backward, an edit of the parameters (``.data``, in place), the next
    micro-step, then a synced step: the next micro-step sees the edit (copy replicas renew
    their leaves with their tensors: NOTE [ no_sync ])."""
    dp, fresh, _ = _pair(Normed())
    torch.manual_seed(1)
    xs = [torch.randn(6, D, dtype=torch.float64) for _ in range(4)]
    for dp_ in (dp, fresh):
        with dp_.no_sync():
            a = dp_(xs[0])
        with torch.no_grad():
            e = dp_(xs[1])
        a.pow(2).sum().backward()
        _edit(dp_, how)
        with dp_.no_sync():
            b = dp_(xs[2])
            b.pow(2).sum().backward()
        c = dp_(xs[3])
        c.sum().backward()
        dp_.outs = (e, b, c)
    for o, r in zip(dp.outs, fresh.outs):
        torch.testing.assert_close(o, r)
    _assert_same(dp.module, fresh.module)


class DetachedCheckpoint(nn.Module):
    """A reentrant checkpoint on a leaf input of its own (its recompute a nested backward that
    runs after the other parameters' gradients) and a parameter viewed as a row."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ck, self.lin = nn.Linear(D, D), nn.Linear(D, D)
        self.p = nn.Parameter(torch.randn(D))
        self.double()

    def forward(self, x):
        h = x + checkpoint(
            lambda t: torch.tanh(self.ck(t)), x.detach().requires_grad_(), use_reentrant=True
        )
        return h + torch.tanh(self.lin(h) + self.p.view(1, D))


@pytest.mark.usefixtures("launch", "backend")
@pytest.mark.parametrize("between", ["no_grad_outside", "no_grad_inside", "grad_outside"])
@pytest.mark.parametrize("rows", [1, 6])
def test_a_forward_before_a_checkpointed_micro_steps_backward(storage, between, rows):
    """A micro-step through a reentrant checkpoint, another forward before its backward
    (``no_grad``, outside or inside ``no_sync()``; or a synced one, backward with it), then a
    synced step: the checkpoint re-runs the replicas in that backward on the leaves its forward
    used (a ``no_grad`` forward meanwhile runs on fresh replicas), so the outputs, gradients and
    parameters equal ``persistent=False``'s."""
    dp, fresh, _ = _pair(DetachedCheckpoint())
    torch.manual_seed(1)
    xs = [torch.randn(rows, D, dtype=torch.float64) for _ in range(3)]
    for dp_ in (dp, fresh):
        with dp_.no_sync():
            a = dp_(xs[0])
            if between == "no_grad_inside":
                with torch.no_grad():
                    e = dp_(xs[1])
        if between == "no_grad_outside":
            with torch.no_grad():
                e = dp_(xs[1])
        loss = a.pow(2).sum()
        if between == "grad_outside":
            e = dp_(xs[1])
            loss = loss + e.sum()
        loss.backward()
        c = dp_(xs[2])
        c.sum().backward()
        dp_.outs = (a.detach(), e.detach(), c.detach())
    for o, r in zip(dp.outs, fresh.outs):
        torch.testing.assert_close(o, r)
    _assert_same(dp.module, fresh.module)
