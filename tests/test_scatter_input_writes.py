"""Replicas that write into their own input chunk in place (NOTE [ Input chunks written in place ]).

FSMT's ``shift_tokens_right`` (``input_ids.masked_fill_``) and the QA heads of Canine, RemBert and
Splinter (``start_positions.clamp_``) write into their inputs. On distinct GPUs DataParallel's
chunks 1.. are copies, so a write never invalidates what another replica saved; fastdp's chunks
on one device must behave the same. Reference: the plain module on the same chunks in turn.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fastdp import FastDataParallel, comm
from fastdp.testing import CPU2

CPU3 = ["cpu", "cpu", "cpu"]


class MaskIds(nn.Module):
    """``ids.masked_fill_`` before the embedding saves them (FSMT's shift_tokens_right)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids.masked_fill_(ids == 9, 0)
        return self.emb(ids).sum(1)


class ClampPositions(nn.Module):
    """A QA head's loss: ``start_positions.clamp_`` after a loss saved another replica's chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, start_positions: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)
        start_positions.clamp_(0, logits.size(1) - 1)
        return nn.functional.cross_entropy(logits, start_positions, reduction="sum")[None]


def _ids() -> torch.Tensor:
    return torch.tensor([[9, 1], [2, 9], [9, 9], [3, 4], [9, 5]])


def _reference(module: nn.Module, inputs: list[tuple], n: int) -> tuple[torch.Tensor, list]:
    """The plain module on the chunks in turn (copies, as on distinct GPUs): outputs
    concatenated, gradients summed."""
    per_chunk = list(zip(*(t.chunk(n) for t in inputs)))
    per_chunk = [tuple(t.clone() for t in c) for c in per_chunk]
    out = torch.cat([module(*c) for c in per_chunk])
    out.sum().backward()
    return out.detach(), [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("ids", [CPU2, CPU3], ids=["2", "3"])
def test_replica_writing_its_input_ids_matches_the_plain_module(
    launch, storage, backend, persistent, ids
):
    torch.manual_seed(0)
    net = MaskIds()
    ref_net = copy.deepcopy(net)
    want, want_grads = _reference(ref_net, [_ids()], len(ids))
    fdp = FastDataParallel(net, device_ids=ids, persistent=persistent)
    for _ in range(2):  # the second step runs on persistent replicas
        net.zero_grad()
        out = fdp(_ids())
        out.sum().backward()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        for p, g in zip(net.parameters(), want_grads):
            torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("persistent", [True, False])
def test_replica_clamping_its_positions_matches_the_plain_module(launch, storage, persistent):
    torch.manual_seed(0)
    net = ClampPositions()
    x = torch.randn(5, 4)
    pos = torch.tensor([7, -1, 2, 9, 3])
    want, want_grads = _reference(copy.deepcopy(net), [x, pos.clone()], 2)
    fdp = FastDataParallel(net, device_ids=CPU2, persistent=persistent)
    out = fdp(x, start_positions=pos.clone())
    out.sum().backward()
    torch.testing.assert_close(out, want)
    for p, g in zip(net.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g)


def test_write_through_chunk_zero_bumps_the_callers_version():
    """Chunk 0 is a view of the caller's tensor, as DataParallel's is: the caller's own graph
    that saved the input sees the write (autograd raises, as with the plain module)."""
    net = MaskIds()
    fdp = FastDataParallel(net, device_ids=CPU2)
    ids = _ids()
    before = ids._version
    fdp(ids)
    assert ids._version > before


def test_chunks_after_the_first_are_not_copies():
    """No bytes move: a chunk after the first shares the caller's storage (and is written there,
    the documented difference from DataParallel's copies)."""
    seen = []

    class Record(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            seen.append(ids)
            return ids.float()

    ids = _ids()
    FastDataParallel(Record(), device_ids=CPU2)(ids)
    chunk1 = next(c for c in seen if c.data_ptr() != ids.data_ptr())
    assert chunk1.untyped_storage().data_ptr() == ids.untyped_storage().data_ptr()
    assert chunk1.data_ptr() == ids[3:].data_ptr()
    chunk1.add_(100)
    assert ids[3:].min() >= 100


def test_leaves_that_require_grad_keep_their_history():
    net = nn.Linear(3, 2)
    x = torch.randn(5, 3, requires_grad=True)
    fdp = FastDataParallel(net, device_ids=CPU2)
    fdp(x).sum().backward()
    ref = x.detach().clone().requires_grad_()
    net(ref).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_own_version_views_share_bytes_not_versions(backend):
    x = torch.arange(12.0).view(4, 3)
    chunk = x[2:]
    (view,) = comm.own_version_views([chunk])
    assert view._is_view() and view._base is not x and not view.requires_grad
    assert view._base.shape == chunk._base.shape  # a base like every other replica's
    assert (view.data_ptr(), view.stride(), view.shape) == (
        chunk.data_ptr(),
        chunk.stride(),
        chunk.shape,
    )
    before = (x._version, view._version)
    view.mul_(2)
    assert x._version == before[0] and view._version == before[1] + 1
    torch.testing.assert_close(x[2:], torch.arange(6.0, 12.0).view(2, 3) * 2)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_split_own_versions_is_split_with_own_counters(backend, replicas):
    """The one-device scatter: values and geometry of ``split``'s chunks, replica-major; chunk 0
    shares the leaf's version counter, chunks 1.. have their own over a base of the leaf's base's
    shape; a leaf that requires grad keeps ``split``'s chunks and their history."""
    base = torch.arange(60.0).view(6, 10)
    leaves = [base.t()[2:9], torch.arange(7), torch.randn(4, 7, requires_grad=True)]
    splits = [[3, 3, 1][:replicas], [5, 1, 1][:replicas], [4, 2, 1][:replicas]]
    splits = [p[:-1] + [n - sum(p[:-1])] for p, n in zip(splits, (6, 7, 7))]
    dims = [1, 0, 1]
    flat = comm.split_own_versions(leaves, splits, dims)
    n = len(leaves)
    assert len(flat) == replicas * n
    for i, (leaf, rows, d) in enumerate(zip(leaves, splits, dims)):
        ref = leaf.split_with_sizes(rows, d)
        for r in range(replicas):
            got = flat[r * n + i]
            assert (got.shape, got.stride(), got.data_ptr()) == (
                ref[r].shape,
                ref[r].stride(),
                ref[r].data_ptr(),
            )
            torch.testing.assert_close(got, ref[r])
            assert got._is_view()
            if leaf.requires_grad:
                assert got.grad_fn is not None
            elif r > 0:
                assert got._base.shape == (leaf._base if leaf._is_view() else leaf).shape
                before = (leaf._version, got._version)
                got.add_(0)
                assert leaf._version == before[0] and got._version == before[1] + 1
    before = leaves[1]._version
    flat[1].add_(0)  # chunk 0 of leaf 1
    assert leaves[1]._version == before + 1
