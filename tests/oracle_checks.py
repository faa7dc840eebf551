"""What the differential oracle (tests/test_replicas_oracle.py) draws from and how it compares:
the operations it may run, those left out (``FASTDP_ORACLE_SKIP``), the launches, the hypothesis
settings (``FASTDP_ORACLE_EXAMPLES``, ``FASTDP_ORACLE_STEPS``, ``FASTDP_ORACLE_SEED``) and
``agree``, the three runners' comparison."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import precondition
from oracle_models import FEATURES

OPERATIONS = (
    "no_sync",
    "optimizer",
    "load_state_dict",
    "inplace_edit",
    "requires_grad",
    "train_eval",
    "failing",
    "threads",
    "no_grad_forward",
    "orig_hook",
    "autograd_grad",
    "backward_inputs",
    "retain_graph",
    "accumulate",
    "partial_batch",
    "zero_grad_pending",
    "two_forwards",
    "data_edit",
    "post_hook",
    "second_order",
    "round_trip",
    "base_exception",
)
LEFT_OUT = frozenset(filter(None, os.environ.get("FASTDP_ORACLE_SKIP", "").split(",")))
_unknown = LEFT_OUT - set(FEATURES) - set(OPERATIONS)
assert not _unknown, f"FASTDP_ORACLE_SKIP: unknown names {sorted(_unknown)}"
LAUNCHES = [None] if os.environ.get("FASTDP_LAUNCH") else ["threads", "inline"]
NAMES = ("persistent", "fresh", "chunked")
TOL = dict(rtol=1e-7, atol=1e-9, equal_nan=True)  # an edit may make a variance negative
LOSSES = [
    k for k in ("backward", "retain_graph", "autograd_grad", "backward_inputs") if k not in LEFT_OUT
]


def on(name: str):
    return precondition(lambda self: name not in LEFT_OUT and not self.pending)


def _dense(g):
    return g.to_dense() if g is not None and g.is_sparse else g


def halve_grad(p: torch.Tensor) -> None:
    p.grad.mul_(0.5)


def agree(values: list, what: str, unreached_none: bool = False, chunked: bool = True) -> None:
    """``values`` per runner (persistent, fresh, chunked). The wrappers must agree exactly on None
    or not; DataParallel gives an unused parameter zeros where the chunked module has None.
    ``unreached_none``: a backward that named its inputs (``autograd.grad``, ``inputs=``) gives
    a parameter whose whole bucket went unused None with persistent replicas, zeros with
    DataParallel (README, *Persistent replicas*). ``chunked``: compare with the chunked runner."""
    p, f, c = map(_dense, values)
    if unreached_none and p is None and f is not None and not f.any():
        p = f
    assert (p is None) == (f is None), f"{what}: persistent {p} vs fresh {f}"
    if p is not None:
        torch.testing.assert_close(p, f, **TOL, msg=lambda m: f"{what}, persistent vs fresh: {m}")
    if not chunked:
        return
    if c is None:
        assert p is None or not p.any(), f"{what}: persistent {p} vs chunked None"
    else:
        assert p is not None, f"{what}: persistent None vs chunked {c}"
        torch.testing.assert_close(p, c, **TOL, msg=lambda m: f"{what}, vs chunked: {m}")


SETTINGS = settings(
    max_examples=int(os.environ.get("FASTDP_ORACLE_EXAMPLES", "200")),
    stateful_step_count=int(os.environ.get("FASTDP_ORACLE_STEPS", "10")),
    derandomize="FASTDP_ORACLE_SEED" not in os.environ,
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
