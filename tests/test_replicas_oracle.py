"""Differential oracle: persistent replicas give what fresh replicas give, step after step.

A hypothesis state machine draws a model from a grammar of what real models do
(tests/oracle_models.py: views, expands and transposes of parameters, tied, frozen, unused and
partly used parameters, BatchNorm, GRU/LSTM, a sparse embedding, weight_norm, a channels_last conv,
a reentrant checkpoint; forwards that write attributes, buffers, parameters, ``.data``, hooks and
submodules), 2 to 4 replicas (CPU, or the test device's three devices in turn), one bucket or many,
a launch strategy and an optimizer; then a training loop's operations: steps with ``backward``,
``retain_graph=True`` and two backwards, ``torch.autograd.grad``, ``backward(inputs=...)``,
accumulation without ``zero_grad``, second-order steps (a gradient penalty's backward through
``autograd.grad(create_graph=True)``, Hessian-vector products), ``no_sync()`` micro-steps (one or
two forwards before the backward, replicas skipping the sparse embedding, a ``no_grad`` forward
outside before the backward), ``.data`` edits between them, partial batches, a replica raising (an
``Exception`` or a ``BaseException``), two threads calling one wrapper, optimizer steps (SGD, AdamW
with weight decay), ``load_state_dict``, in-place edits, ``requires_grad`` toggles (also between
``no_sync()`` micro-steps), a deep copy or save and load of the wrapper mid-run, train/eval and
hooks on the originals (tensor and post-accumulate). Three runners (tests/oracle_runners.py) must
agree after every operation: ``FastDataParallel`` with persistent replicas, with
``persistent=False``, and DataParallel's semantics by hand on ``torch.chunk`` chunks. Compared:
outputs, the type of any exception, every ``.grad`` (None or not, then values), ``autograd.grad``
results, buffers, and the originals after optimizer steps. float64; after each operation the other
runners take the persistent runner's values (summation order must not drift).

With CPU replicas sharing the originals' storage (the default), an in-place parameter write in a
forward lands once per replica (documented); the ``inplace_param`` feature runs only under
``FASTDP_CPU_DISTINCT=1`` and on the test device's distinct ids, where replica 0's write alone
must reach the originals.

Environment: ``FASTDP_ORACLE_EXAMPLES`` (programs per backend and storage mode; default 200,
derandomized), ``FASTDP_ORACLE_STEPS`` (operations per program, default 10),
``FASTDP_ORACLE_SEED`` (a seed instead of derandomizing), ``FASTDP_ORACLE_SKIP`` (comma-separated
feature or operation names to leave out of the grammar; default none). Deep run:
``FASTDP_ORACLE_EXAMPLES=2000 python -m pytest -q tests/test_replicas_oracle.py``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import seed as hypothesis_seed
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from oracle_checks import LAUNCHES, LEFT_OUT, LOSSES, NAMES, SETTINGS, agree, halve_grad, on
from oracle_models import EXIT, FAIL, FEATURES, SKIP, VOCAB, D, OracleNet, ReplicaExit, _half
from oracle_runners import Chunked, Wrapped

from fastdp import _buckets
from fastdp.testing import ACCEL, ACCEL_DEVICES, home, replica_ids


class Oracle(RuleBasedStateMachine):
    kind = "cpu"  # the replicas' device kind (fastdp.testing.DEVICE_KINDS)

    @initialize(
        feats=st.sets(st.sampled_from(FEATURES)),
        n=st.integers(2, 4),
        cap=st.sampled_from([1e-4, _buckets.DEFAULT_CAP_MB]),
        launch=st.sampled_from(LAUNCHES),
        opt=st.sampled_from(["sgd", "adamw", "sgd+zero", "adamw+zero"]),
        seed=st.integers(0, 2**16),
    )
    def build(self, feats, n, cap, launch, opt, seed):
        feats = frozenset(feats) - LEFT_OUT
        shared = not _buckets.cpu_distinct() if self.kind == "cpu" else n > ACCEL_DEVICES
        if shared:  # replicas sharing a device share the originals: see the module docstring
            feats -= {"inplace_param"}
        if self.kind != "cpu":
            feats -= ACCEL_LACKS
        if "checkpoint" in feats:  # DataParallel's replica tensors are not leaves: a hook
            feats -= {"hooks_in_forward"}  # there gets None from a nested backward
        self.feats, self.n, self.pending, self.launch = feats, n, False, launch
        # a post-accumulate hook, with the reentrant checkpoint: see post_hook()
        self.post_hooked = self.hooked_checkpoint = False
        # the chunked runner left out of gradient and parameter comparisons from then on: a step
        # whose accumulation order only DataParallel's algorithm defines (see post_hook())
        self.fresh_only = False
        self.hooked = False  # a hook on an original (tensor or post-accumulate)
        self.named_only = False  # the last backward named its inputs: see agree()
        devices = replica_ids(self.kind, n)
        self.home = home(devices)
        model = OracleNet(feats, seed).to(self.home)
        self.runners = [
            Wrapped(copy.deepcopy(model), opt, devices, True, cap, launch),
            Wrapped(copy.deepcopy(model), opt, devices, False, cap, launch),
            Chunked(copy.deepcopy(model), opt, devices),
        ]
        self.gen = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------------------ helpers

    def each(self, fn, *per_runner) -> list | None:
        """``fn(runner, *args)`` for each runner; if any raises, all must raise the same type
        (then None)."""
        results, errors = [], []
        self.errors = errors
        for r, *args in (
            zip(self.runners, *per_runner) if per_runner else ((r,) for r in self.runners)
        ):
            try:
                results.append(fn(r, *args))
                errors.append(None)
            except Exception as e:  # compared below
                results.append(None)
                errors.append(e)
        if any(e is not None for e in errors):
            kinds = {n: type(e).__name__ if e else "no error" for n, e in zip(NAMES, errors)}
            assert len(set(kinds.values())) == 1, f"runners disagree: {kinds}; {errors}"
            return None
        return results

    def batch(self, b: int, mark: int | None = None, chunk: int = 0):
        if "partial_batch" in LEFT_OUT:
            b = self.n * -(-b // self.n)
        model = self.runners[0].model
        while (
            "bn" in self.feats
            and model.training
            and min(len(c) for c in torch.arange(b).chunk(self.n)) < 2
        ):
            b += 1  # BatchNorm in training needs two rows per chunk
        x = torch.randn(b, D, generator=self.gen, dtype=torch.float64)
        idx = torch.randint(0, VOCAB, (b,), generator=self.gen)
        if mark is not None:
            chunks = idx.chunk(self.n)
            chunks[chunk % len(chunks)][0] = mark
        return x.to(self.home), idx.to(self.home)

    def randn(self, *shape: int) -> torch.Tensor:
        """float64 normal values from the machine's generator, on the model's device."""
        return torch.randn(shape, generator=self.gen, dtype=torch.float64).to(self.home)

    def weights(self, out: torch.Tensor) -> torch.Tensor:
        return self.randn(*out.shape)

    def trainable(self) -> list[str]:
        return [n for n, p in self.runners[0].model.named_parameters() if p.requires_grad]

    # -------------------------------------------------------------------------------- steps

    @precondition(lambda self: not self.pending or "accumulate" not in LEFT_OUT)
    @rule(
        b=st.integers(1, 12),
        loss=st.sampled_from(LOSSES),
        zero=st.sampled_from(["none", "zeros", "keep"]),
        skip=st.none() | st.integers(0, 3),
        subset=st.integers(1, 2**12 - 1),
        then_step=st.booleans(),
    )
    def train_step(self, b, loss, zero, skip, subset, then_step):
        """zero_grad, forward, a backward of one kind, then (``then_step``) the optimizers'
        step, as a training loop does."""
        if "checkpoint" in self.feats and loss in ("autograd_grad", "backward_inputs"):
            loss = "backward"  # a reentrant checkpoint raises for both, after partial work
        if self.hooked_checkpoint:  # see post_hook()
            loss = "backward"
            zero = "none" if zero == "keep" and not self.fresh_only else zero
        if zero != "keep" or "accumulate" in LEFT_OUT:
            self.each(lambda r: r.zero_grad(zero == "none"))
        x, idx = self.batch(b, None if skip is None else SKIP, skip or 0)
        outs = self.each(lambda r: r.forward(x, idx))
        self.pending = False
        self.named_only = loss in ("autograd_grad", "backward_inputs")
        if outs is None:
            return
        agree(outs, "output")
        w, names = self.weights(outs[0]), self.trainable()
        if loss == "autograd_grad":
            res = self.each(lambda r, o: r.grad((o * w).sum(), names), outs)
            for k, name in enumerate(names if res else []):
                agree([r[k] for r in res], f"autograd.grad of {name}", unreached_none=True)
        elif loss == "backward_inputs":
            chosen = [n for i, n in enumerate(names) if subset >> (i % 12) & 1] or names[:1]
            self.each(lambda r, o: r.backward((o * w).sum(), chosen or None), outs)
        elif loss == "retain_graph":

            def twice(r, o):
                r.backward((o * w).sum(), retain_graph=True)
                r.backward((o * w).sum())

            self.each(twice, outs)
        else:
            self.each(lambda r, o: r.backward((o * w).sum()), outs)
        if then_step and "optimizer" not in LEFT_OUT:
            self.each(lambda r: r.step())

    # A reentrant checkpoint refuses autograd.grad; under create_graph, DataParallel's Broadcast
    # (persistent=False) cannot return its sparse input as an output (no view of a sparse tensor).
    @precondition(lambda self: not {"checkpoint", "sparse_emb"} & self.feats)
    @on("second_order")
    @rule(b=st.integers(1, 12), kind=st.sampled_from(["penalty", "hvp"]), zero=st.booleans())
    def second_order(self, b, kind, zero):
        """Gradients through the parameters' gradients (``create_graph=True``): a gradient
        penalty then its backward (SAM, R1), or a Hessian-vector product (influence functions,
        Newton-CG)."""
        if zero:
            self.each(lambda r: r.zero_grad(True))
        x, idx = self.batch(b)
        outs = self.each(lambda r: r.forward(x, idx))
        self.named_only = kind == "hvp"
        if outs is None:
            return
        agree(outs, "output")
        w = self.weights(outs[0])
        names = self.trainable()
        if not names:
            return
        gs = self.each(
            lambda r, o: r.grad((o * w).sum() + o.pow(2).sum(), names, create_graph=True), outs
        )
        if gs is None:
            return
        for k, name in enumerate(names):
            agree([g[k] for g in gs], f"create_graph grad of {name}", unreached_none=True)
        if kind == "penalty":
            self.each(lambda r, g: r.backward(sum(t.pow(2).sum() for t in g if t is not None)), gs)
            return
        v = [torch.randn(self.runners[0].param(n).shape, generator=self.gen) for n in names]
        v = [t.double().to(self.home) for t in v]
        hv = self.each(lambda r, g: r.hvp(g, names, v), gs)
        for k, name in enumerate(names if hv else []):
            agree([h[k] for h in hv], f"Hessian-vector product of {name}", unreached_none=True)

    @precondition(lambda self: "no_sync" not in LEFT_OUT and not self.hooked_checkpoint)
    @rule(b=st.integers(1, 12), skip=st.none() | st.integers(0, 3))
    def no_sync_micro_step(self, b, skip):
        x, idx = self.batch(b, None if skip is None else SKIP, skip or 0)
        w = self.randn(len(x), D)

        def micro(r):
            with r.no_sync():
                out = r.forward(x, idx)
                r.backward((out * w).sum())
            return out

        outs = self.each(micro)
        if outs is not None:
            agree(outs, "no_sync output")
        self.pending = True

    @precondition(
        lambda self: (
            "no_sync" not in LEFT_OUT and "two_forwards" not in LEFT_OUT and not self.post_hooked
        )
    )
    @rule(b1=st.integers(1, 12), b2=st.integers(1, 12), skip=st.none() | st.integers(0, 3))
    def no_sync_two_forwards(self, b1, b2, skip):
        """A micro-step calling the wrapper twice before one backward (a GAN's D(real) +
        D(fake), a loss over two batches)."""
        x1, i1 = self.batch(b1, None if skip is None else SKIP, skip or 0)
        x2, i2 = self.batch(b2)
        w1 = self.randn(len(x1), D)
        w2 = self.randn(len(x2), D)

        def micro(r):
            with r.no_sync():
                a = r.forward(x1, i1)
                b = r.forward(x2, i2, keep=True)
                r.backward((a * w1).sum() + (b * w2).sum())
            return a, b

        outs = self.each(micro)
        if outs is not None:
            agree([o[0] for o in outs], "no_sync first output")
            agree([o[1] for o in outs], "no_sync second output")
        self.pending = True

    @precondition(
        lambda self: (
            "no_sync" not in LEFT_OUT
            and "no_grad_forward" not in LEFT_OUT
            and not self.hooked_checkpoint
        )
    )
    @rule(b1=st.integers(1, 12), b2=st.integers(1, 12))
    def no_sync_then_no_grad_forward(self, b1, b2):
        """A micro-step whose backward runs after a ``no_grad`` forward outside ``no_sync()``
        (an evaluation, a teacher's targets, in the middle of an accumulation)."""
        x1, i1 = self.batch(b1)
        x2, i2 = self.batch(b2)
        w = self.randn(len(x1), D)

        def micro(r):
            with r.no_sync():
                a = r.forward(x1, i1)
            with torch.no_grad():
                e = r.forward(x2, i2, keep=True)
            r.backward((a * w).sum())
            return a, e

        outs = self.each(micro)
        if outs is not None:
            agree([o[0] for o in outs], "no_sync output")
            agree([o[1] for o in outs], "no-grad output")
        self.pending = True

    @precondition(lambda self: not self.post_hooked or self.launch == "inline")
    @on("two_forwards")
    @rule(b1=st.integers(1, 12), b2=st.integers(1, 12), zero=st.booleans())
    def two_forwards_step(self, b1, b2, zero):
        """A step calling the wrapper twice before one backward (a GAN's D(real) + D(fake)).
        With a post-accumulate hook each of DataParallel's ``Broadcast`` nodes accumulates in
        turn and the hook sees each: the chunked runner is compared no more."""
        if zero:
            self.each(lambda r: r.zero_grad(True))
        x1, i1 = self.batch(b1)
        x2, i2 = self.batch(b2)
        w1 = self.randn(len(x1), D)
        w2 = self.randn(len(x2), D)

        def step(r):
            a = r.forward(x1, i1)
            b = r.forward(x2, i2, keep=True)
            r.backward((a * w1).sum() + (b * w2).sum())
            return a, b

        self.fresh_only |= self.post_hooked
        self.named_only = False
        outs = self.each(step)
        if outs is not None:
            agree([o[0] for o in outs], "first output")
            agree([o[1] for o in outs], "second output")

    @precondition(lambda self: "data_edit" not in LEFT_OUT)
    @rule(kind=st.sampled_from(["clamp", "mul"]))
    def data_edit(self, kind):
        """Edits through ``.data`` (WGAN's clipping), inside a ``no_sync`` cycle or not: they
        bump no version counter."""

        def edit(r):
            for p in r.model.parameters():
                if kind == "clamp":
                    p.data.clamp_(-0.3, 0.3)
                else:
                    p.data.mul_(0.5)

        self.each(edit)

    @on("optimizer")
    @rule()
    def optimizer_step(self):
        self.each(lambda r: r.step())

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none):
        if self.pending and "zero_grad_pending" in LEFT_OUT:
            set_to_none = True
        self.each(lambda r: r.zero_grad(set_to_none))
        self.pending = False

    @on("no_grad_forward")
    @rule(b=st.integers(1, 12))
    def no_grad_forward(self, b):
        x, idx = self.batch(b)
        with torch.no_grad():
            outs = self.each(lambda r: r.forward(x, idx))
        if outs is not None:
            agree(outs, "no-grad output")

    @on("failing")
    @rule(b=st.integers(1, 12), k=st.integers(0, 3), grad=st.booleans())
    def failing_step(self, b, k, grad):
        x, idx = self.batch(b, FAIL, k)
        with torch.set_grad_enabled(grad):
            self.each(lambda r: r.forward(x, idx))
        assert all(isinstance(e, ValueError) for e in self.errors), self.errors

    @on("base_exception")
    @rule(b=st.integers(1, 12), k=st.integers(0, 3), grad=st.booleans())
    def base_exception_step(self, b, k, grad):
        """A replica raising a ``BaseException`` (``SystemExit``, a cancellation): every runner
        raises it as itself, and the steps after it run as before."""
        x, idx = self.batch(b, EXIT, k)
        caught = []
        with torch.set_grad_enabled(grad):
            for r in self.runners:
                try:
                    r.forward(x, idx)
                    caught.append(None)
                except ReplicaExit as e:
                    caught.append(e.args)
        assert caught == [("replica asked to exit",)] * len(self.runners), caught

    @precondition(lambda self: "threads" not in LEFT_OUT and not self.post_hooked)
    @precondition(lambda self: not self.pending)
    @rule(b1=st.integers(1, 12), b2=st.integers(1, 12))
    def two_threads(self, b1, b2):
        """Two threads call one wrapper (eval mode: BatchNorm's running stats would depend on
        the order); each output must equal the serial one."""
        training = self.runners[0].model.training
        self.each(lambda r: r.model.eval())
        batches = [self.batch(b1), self.batch(b2)]
        outs = self.each(lambda r: r.forward_threads(batches))
        if outs is not None:
            agree([o[0] for o in outs], "thread 1 output")
            agree([o[1] for o in outs], "thread 2 output")
            ws = [self.weights(o) for o in outs[0]]
            self.each(lambda r, o: r.backward(sum((a * w).sum() for a, w in zip(o, ws))), outs)
        self.each(lambda r: r.model.train(training))

    # ------------------------------------------------------------------------------ changes

    @precondition(lambda self: "inplace_edit" not in LEFT_OUT)
    @rule(factor=st.sampled_from([-1.0, 0.5, 2.0]))
    def inplace_edit(self, factor):
        def edit(r):
            with torch.no_grad():
                r.model.lin.weight.mul_(factor)
                for b in r.model.buffers():
                    if b.is_floating_point():
                        b.add_(factor)

        self.each(edit)

    @on("load_state_dict")
    @rule(seed=st.integers(0, 2**16), assign=st.booleans())
    def load_state_dict(self, seed, assign):
        sd = OracleNet(self.feats, seed).to(self.home).state_dict()

        def load(r):
            r.model.load_state_dict(copy.deepcopy(sd), assign=assign)
            if assign:
                r.reset_optimizers()

        self.each(load)

    @on("requires_grad")
    @rule(which=st.integers(0, 7), flag=st.booleans())
    def requires_grad(self, which, flag):
        names = [n for n, _ in self.runners[0].model.named_parameters()]
        self.each(lambda r: r.param(names[which % len(names)]).requires_grad_(flag))

    @precondition(lambda self: self.pending and "requires_grad" not in LEFT_OUT)
    @rule(which=st.integers(0, 7), flag=st.booleans())
    def requires_grad_pending(self, which, flag):
        """A parameter frozen or unfrozen between ``no_sync()`` micro-steps (gradual unfreezing
        during accumulation): the micro-steps before it keep the flag they ran with."""
        self.requires_grad(which, flag)

    @on("requires_grad")
    @rule(flag=st.booleans())
    def requires_grad_all(self, flag):
        """Freeze everything (replicas built then need no gradients), unfreeze everything."""
        self.each(lambda r: r.model.requires_grad_(flag))

    @precondition(lambda self: not self.hooked)  # tensor hooks are not copied or saved
    @on("round_trip")
    @rule(how=st.sampled_from(["deepcopy", "save"]))
    def round_trip(self, how):
        """The wrapper (the chunked runner: its model) deep-copied or saved and loaded between
        steps; training goes on with the copy, whose replicas are built anew."""
        self.each(lambda r: r.round_trip(how))

    @on("train_eval")
    @rule(training=st.booleans())
    def train_eval(self, training):
        self.each(lambda r: r.model.train(training))

    @on("orig_hook")
    @rule()
    def hook_on_original(self):
        self.each(lambda r: r.add_hook("lin.bias", _half))
        self.hooked = True

    @precondition(lambda self: "checkpoint" not in self.feats or self.launch == "inline")
    @on("post_hook")
    @rule(inside=st.booleans())
    def post_hook(self, inside):
        """Per-parameter clipping / optimizer-in-backward: a hook acting on ``.grad`` after each
        accumulation. With a reentrant checkpoint DataParallel accumulates in each nested
        backward (hooks see it), the chunked module does not: from then on steps start from
        ``.grad`` None or zeros, one backward each; inline only (on threads, DataParallel's
        ``Broadcast`` turn depends on the workers' sequence numbers). On a parameter inside the
        checkpoint (``inside``) the hook sees each replica's part and the outer backward's
        zeros: only DataParallel's algorithm defines the result."""
        inside = inside and "checkpoint" in self.feats
        self.each(lambda r: r.add_post_hook("ck.bias" if inside else "lin.bias", halve_grad))
        self.hooked = True
        self.post_hooked = True
        self.hooked_checkpoint = "checkpoint" in self.feats
        self.fresh_only |= inside

    # --------------------------------------------------------------------------- invariant

    @invariant()
    def runners_agree(self):
        """Parameters, buffers and (outside no_sync) gradients agree; then the other runners
        take the persistent runner's values."""
        if not hasattr(self, "runners"):
            return
        models = [r.model for r in self.runners]
        named = [dict(m.named_parameters()) for m in models]
        buffers = [dict(m.named_buffers()) for m in models]
        assert named[0].keys() == named[1].keys() == named[2].keys()
        assert buffers[0].keys() == buffers[1].keys() == buffers[2].keys()
        chunked = not self.fresh_only
        for name in named[0]:
            agree([p[name].detach() for p in named], f"parameter {name}", chunked=chunked)
            if not self.pending:
                grads = [p[name].grad for p in named]
                agree(grads, f".grad of {name}", self.named_only, chunked=chunked)
        for name in buffers[0]:
            agree([b[name] for b in buffers], f"buffer {name}")
        with torch.no_grad():
            for src, dst in (
                (named[0], named[1]),
                (named[0], named[2]),
                (buffers[0], buffers[1]),
                (buffers[0], buffers[2]),
            ):
                for name, t in src.items():
                    dst[name].copy_(t)
                    g, h = t.grad, dst[name].grad  # pending (no_sync): .grad differs by design
                    if (
                        not self.pending
                        and g is not None
                        and h is not None
                        and not g.is_sparse
                        and not h.is_sparse
                    ):
                        h.copy_(g)

    def teardown(self):
        for r in getattr(self, "runners", []):
            r.live = []


# On the test device: FASTDP_ORACLE_ACCEL_EXAMPLES programs (default 100: CI's budget), without
# what the device lacks: sparse tensors (the sparse embedding's gradient).
ACCEL_EXAMPLES = int(os.environ.get("FASTDP_ORACLE_ACCEL_EXAMPLES", "100"))
ACCEL_LACKS = frozenset({"sparse_emb"})


if "FASTDP_ORACLE_SEED" in os.environ:
    hypothesis_seed(int(os.environ["FASTDP_ORACLE_SEED"]))(Oracle)


@pytest.mark.usefixtures("backend")
def test_persistent_fresh_and_chunked_agree(storage):
    """The machine under each backend (extension, pure torch) and storage mode (``alias``:
    CPU replicas on the originals' storage; ``distinct``: storage of their own)."""
    run_state_machine_as_test(Oracle, settings=SETTINGS)


@pytest.mark.parametrize(
    "kind",
    [pytest.param("fdpaccel", marks=pytest.mark.skipif(not ACCEL, reason="FASTDP_TEST_ACCEL=1"))],
)
@pytest.mark.usefixtures("backend")
def test_persistent_fresh_and_chunked_agree_on_distinct_devices(kind):
    """The machine on the test device (tests/accel, asynchronous): replicas on its three devices
    in turn, the model and inputs on device 0, the chunked runner's copies on their chunks'
    devices; ``ACCEL_EXAMPLES`` programs per backend."""
    machine = type(f"Oracle_{kind}", (Oracle,), {"kind": kind})
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=ACCEL_EXAMPLES))
