"""What a replica set renews before a step (``fastdp/_renewal.py``): the rule as a decision table,
every combination of its inputs checked against it, and the set doing what the rule says."""

from __future__ import annotations

import itertools

import pytest
import torch
from models import linear_stack

import fastdp._replica_set
from fastdp import FastDataParallel
from fastdp._renewal import Renew, renewal

INPUTS = (
    "tainted",
    "graph_alive",
    "awaits_backward",
    "untracked",
    "linked",
    "copy_replicas",
    "micro_step",
    "first_micro_step",
)
_ = None  # any value
NOTHING, BUFFERS, TENSORS, ALL = Renew.NOTHING, Renew.BUFFERS, Renew.TENSORS, Renew.ALL
# fmt: off
TABLE = [
    # tainted alive awaits untracked linked copies micro first
    ((1, _, _, _, _, _, _, _), ALL),  # a forward replaced or hooked what the replicas hold
    # a step outside no_sync: a live graph (or one no node tracks) keeps the old tensors
    ((0, 0, 0, 0, _, _, 0, _), NOTHING),
    # copy replicas are refilled: fresh tensors, and fresh leaves where a cycle holds them (a
    # no_grad forward mid-cycle; the next micro-step refills the new tensors)
    ((0, 1, _, _, _, 1, 0, _), ALL),
    ((0, 0, 1, _, _, 1, 0, _), ALL),  # the same, for a micro-step's graph
    ((0, 0, 0, 1, _, 1, 0, _), ALL),  # and a graph no node tracks
    ((0, _, _, 1, _, 0, 0, _), TENSORS),  # a graph no node tracks
    ((0, 1, _, 0, 1, 0, 0, _), BUFFERS),  # the nodes serve again; replicas alias the originals
    ((0, 1, _, 0, 0, 0, 0, _), TENSORS),  # no nodes made once: nothing can tell
    ((0, 0, 1, 0, 1, 0, 0, _), BUFFERS),  # the same, for a micro-step's graph
    ((0, 0, 1, 0, 0, 0, 0, _), TENSORS),
    # a micro-step under no_sync (an untracked graph does not count)
    ((0, 0, 0, _, _, _, 1, _), NOTHING),
    ((0, 1, _, _, 1, 0, 1, 1), BUFFERS),  # the cycle's first: leaves on the tensors
    ((0, 1, _, _, 1, 1, 1, 1), TENSORS),
    ((0, 1, _, _, 0, _, 1, 1), TENSORS),
    ((0, 1, _, _, _, 1, 1, 0), ALL),  # mid-cycle: fresh tensors get fresh leaves
    ((0, 1, _, _, _, 0, 1, 0), BUFFERS),  # tensors aliasing the originals stay
    ((0, 0, 1, _, 1, 0, 1, 1), BUFFERS),  # the same, for a micro-step's graph
    ((0, 0, 1, _, 1, 1, 1, 1), TENSORS),
    ((0, 0, 1, _, 0, _, 1, 1), TENSORS),
    ((0, 0, 1, _, _, 1, 1, 0), ALL),
    ((0, 0, 1, _, _, 0, 1, 0), BUFFERS),
]
# fmt: on


def _matches(row: tuple, case: tuple) -> bool:
    return all(r is None or bool(r) == c for r, c in zip(row, case))


def mismatches(rule) -> list[str]:
    """Every combination of the inputs whose answer from ``rule`` is not the table's, or that
    the table gives no single answer for."""
    out = []
    for case in itertools.product((False, True), repeat=len(INPUTS)):
        rows = [want for row, want in TABLE if _matches(row, case)]
        got = rule(**dict(zip(INPUTS, case)))
        if len(rows) != 1 or got is not rows[0]:
            out.append(f"{dict(zip(INPUTS, map(int, case)))}: table {rows}, rule {got!r}")
    return out


def test_the_rule_is_the_table():
    assert mismatches(renewal) == []


def test_the_table_sees_a_changed_row():
    """The check itself: the rule with one row changed (mid-cycle copy replicas renewing their
    tensors but not their leaves) is told apart."""

    def changed(**state):
        if state["micro_step"] and not state["first_micro_step"] and not state["tainted"]:
            if state["copy_replicas"] and (state["graph_alive"] or state["awaits_backward"]):
                return Renew.TENSORS
        return renewal(**state)

    # alive three ways (graph, micro-step's backward, both), linked and untracked either way
    assert len(mismatches(changed)) == 3 * 2 * 2


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("answer", [Renew.NOTHING, Renew.TENSORS])
def test_the_set_renews_what_the_rule_says(monkeypatch, answer):
    """Every refresh asks the rule once, and the replica tensors are new exactly when it says
    so (inside ``no_sync()`` and outside)."""
    asked = []

    def rule(**state):
        asked.append(state)
        return answer

    fdp = FastDataParallel(linear_stack(2), device_ids=["cpu"] * 2)
    x = torch.randn(4, 32)
    fdp(x).sum().backward()
    monkeypatch.setattr(fastdp._replica_set, "renewal", rule)
    (rs,) = fdp._replica_sets.values()
    for no_sync in (False, True, True, False):
        before = rs.for_tests().tensors
        asked.clear()
        if no_sync:
            with fdp.no_sync():
                fdp(x).sum().backward()
        else:
            fdp(x).sum().backward()
        assert len(asked) == 1 and asked[0]["micro_step"] is no_sync
        assert (rs.for_tests().tensors is before) is (answer is Renew.NOTHING)
