"""The differential oracle's model grammar (tests/test_replicas_oracle.py): one module whose parts
are switched on by feature names, each a thing real models do.

Inputs: ``x`` (rows, D) float64 and ``idx`` (rows,) int64 in [0, VOCAB). ``idx == SKIP`` in a
chunk makes that replica skip the sparse embedding and the ``branch`` parameter (parameters used by
some replicas only); ``idx == FAIL`` makes the replica raise ``ValueError`` before touching state,
``idx == EXIT`` a ``ReplicaExit``, a ``BaseException`` (as ``SystemExit`` or a cancellation).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.checkpoint import checkpoint

D = 4
VOCAB = 10
SKIP, FAIL, EXIT = -1, -2, -3


class ReplicaExit(BaseException):
    """Not an ``Exception``: what ``SystemExit``, ``KeyboardInterrupt`` or a test framework's
    failure is to a replica's forward."""


# What a model is made of (parameters used through views, shared, frozen, unused, in several
# buckets...) and what its forward writes (attributes, buffers, parameters, .data, hooks, modules).
STRUCTURE = (
    "view",
    "expand",
    "transpose",
    "tied",
    "frozen",
    "unused",
    "twice",
    "branch",
    "bn",
    "gru",
    "lstm",
    "sparse_emb",
    "weight_norm",
    "conv_cl",
    "checkpoint",
)
FORWARD_WRITES = (
    "attr_write",
    "buffer_reassign",
    "buffer_inplace",
    "param_reassign",
    "submodule_swap",
    "data_assign",
    "inplace_param",
    "hooks_in_forward",
)
FEATURES = STRUCTURE + FORWARD_WRITES


def _half(g: torch.Tensor) -> torch.Tensor:
    return g * 0.5


class OracleNet(nn.Module):
    """The parts named in ``feats`` (a frozenset of FEATURES), in a fixed order; float64."""

    def __init__(self, feats: frozenset, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.feats = feats
        f = feats
        self.lin = nn.Linear(D, D)
        if "view" in f:
            self.p = nn.Parameter(torch.randn(D))  # used as p.view(1, D)
        if "expand" in f:
            self.e = nn.Parameter(torch.randn(D))  # used as e.reshape(1, D).expand(rows, D)
        if "transpose" in f:
            self.wt = nn.Parameter(torch.randn(D, D) / D)  # used as wt.t()
        if "tied" in f:
            self.dec = nn.Linear(D, D, bias=False)
            self.dec.weight = self.lin.weight
        if "frozen" in f:
            self.fz = nn.Parameter(torch.randn(D), requires_grad=False)
        if "unused" in f:
            self.unused = nn.Linear(D, D)
        if "twice" in f:
            self.s = nn.Parameter(torch.randn(D))
        if "branch" in f:
            self.branch = nn.Parameter(torch.randn(D))
        if "bn" in f:
            self.bn = nn.BatchNorm1d(D)
        if "gru" in f:
            self.gru = nn.GRU(D, D, batch_first=True)
        if "lstm" in f:
            self.lstm = nn.LSTM(D, D, batch_first=True)
        if "sparse_emb" in f:
            self.emb = nn.Embedding(VOCAB, D, sparse=True)
        if "weight_norm" in f:
            self.wn = weight_norm(nn.Linear(D, D))
        if "conv_cl" in f:
            self.conv = nn.Conv2d(2, 2, 1).to(memory_format=torch.channels_last)
        if "checkpoint" in f:  # reentrant: each replica's recompute is a nested backward
            self.ck = nn.Linear(D, D)
        if "buffer_reassign" in f:
            self.register_buffer("count", torch.zeros(1))
        if "buffer_inplace" in f:
            self.register_buffer("steps", torch.zeros(1))
        if "param_reassign" in f:
            self.pr = nn.Parameter(torch.randn(D))
        if "submodule_swap" in f:
            self.act = nn.Tanh()
        if "inplace_param" in f:
            self.ema = nn.Parameter(torch.zeros(D), requires_grad=False)
        self.double()

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if (idx == FAIL).any():
            raise ValueError("replica asked to fail")
        if (idx == EXIT).any():
            raise ReplicaExit("replica asked to exit")
        skip = bool((idx == SKIP).any())
        h = self._writes_before(x)
        if "checkpoint" in self.feats:  # its own leaf input: the other parameters' gradients
            # are ready before the recompute, so a bucket node may run before the nested backward
            h = h + checkpoint(self._checkpointed, h.detach().requires_grad_(), use_reentrant=True)
        if "view" in self.feats:  # a 1-row chunk makes p's gradient a view of another's
            h = h + torch.tanh(self.lin(h) + self.p.view(1, D))
        else:
            h = self.lin(h)
        return self._structure(h, idx, skip)

    def _writes_before(self, x: torch.Tensor) -> torch.Tensor:
        f, h = self.feats, x
        if "attr_write" in f:  # a fresh replica never has .last
            if "last" in self.__dict__:
                h = h + 1.0
            self.last = x.detach().sum()
        if "buffer_reassign" in f:
            h = h + 0.1 * self.count
            self.count = self.count + 1
        if "buffer_inplace" in f:
            h = h + 0.1 * self.steps
            if self.training:
                self.steps.add_(1)
        if "param_reassign" in f:
            h = h + self.pr
            self.pr = nn.Parameter(self.pr.detach() * 2)
        if "submodule_swap" in f:
            h = self.act(h)
            self.act = nn.Identity()
        if "inplace_param" in f:
            h = h + self.ema
            if self.training:
                with torch.no_grad():
                    self.ema.mul_(0.5).add_(0.5 * x.mean(0))
        if "data_assign" in f:  # max-norm style
            with torch.no_grad():
                self.lin.weight.data = torch.renorm(self.lin.weight.data, 2, 0, 0.5)
        if "hooks_in_forward" in f and torch.is_grad_enabled() and self.lin.weight.requires_grad:
            self.lin.weight.register_hook(_half)
        return h

    def _structure(self, h: torch.Tensor, idx: torch.Tensor, skip: bool) -> torch.Tensor:
        f = self.feats
        if "expand" in f:
            h = h * self.e.reshape(1, D).expand(h.shape[0], D)
        if "transpose" in f:
            h = h + torch.tanh(h @ self.wt.t())
        if "tied" in f:
            h = self.dec(torch.tanh(h))
        if "frozen" in f:
            h = h * (1 + 0.1 * self.fz)
        if "twice" in f:
            h = h * self.s + self.s
        if "branch" in f and not skip:
            h = h + self.branch
        if "bn" in f:
            h = self.bn(h)
        for name in ("gru", "lstm"):
            if name in f:
                out, _ = getattr(self, name)(torch.stack([h, torch.tanh(h)], 1))
                h = h + out[:, -1]
        if "sparse_emb" in f and not skip:
            h = h + self.emb(idx.clamp(min=0))
        if "weight_norm" in f:
            h = self.wn(h)
        if "conv_cl" in f:
            y = self.conv(h.reshape(-1, 2, 1, 2).contiguous(memory_format=torch.channels_last))
            h = h + y.reshape(h.shape[0], D)
        return h

    def _checkpointed(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.ck(h))
