"""The plan of a step, in one place: the ``StepPlan`` every stage reads, made once before the
scatter: the devices, the batch-size rule, uneven splits (``chunk_sizes=`` / ``balance=``), and
each input leaf with its dim and chunk sizes (its *split*), which the scatter
(``fastdp/scatter_gather.py``) executes without deciding anything again.

Uneven splits: ``FastDataParallel(..., chunk_sizes=[...])`` fixes the rows each device gets (they
must sum to the batch); ``balance=[w0, w1, ...]`` turns relative shares into sizes for whatever
batch comes, by largest-remainder rounding (quota ``B * w_i / sum(w)``, floors, then one more row to
the largest fractional parts, ties to the lower device index). Devices that get 0 rows are skipped:
replicas run only on the others, and outputs are gathered in device order.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from fastdp import _tree
from fastdp._devices import public_id

OnDrop = Callable[[str], None]
_STRIDED = torch.strided


def chunk_sizes_for(size: int, num_devices: int) -> list[int]:
    """``torch.chunk``'s sizes for one leaf of ``size`` rows over ``num_devices``."""
    if num_devices <= 0:
        raise ValueError(f"fastdp.splits_for: need at least one device, got {num_devices}")
    if size < 0:
        raise ValueError(f"fastdp.splits_for: leaf size must be >= 0, got {size}")
    if size == 0:
        return [0] * num_devices
    split = -(-size // num_devices)
    return [min(split, size - off) for off in range(0, size, split)]


@functools.lru_cache(maxsize=256)
def _torch_chunk(size: int, num_devices: int) -> tuple[int, ...]:
    """``chunk_sizes_for``, memoised (batch sizes repeat from step to step)."""
    return tuple(chunk_sizes_for(size, num_devices))


# NOTE [ DataParallel's chunking ]
# Each tensor leaf is chunked as ``torch.chunk`` chunks it (``split = ceil(size / n)``, so a leaf
# may yield fewer than ``n`` chunks; ``n`` chunks of 0 for an empty leaf). As DataParallel's
# ``scatter`` ``zip``s its containers, the step runs as many replicas as the leaf with the fewest
# chunks has: the other leaves' extra chunks (their last rows) are dropped. HF Trainer relies on it
# (``num_items_in_batch`` has one row per GPU, so a partial last batch drops its spare rows). The
# wrapper warns once naming the dropped leaves, or raises with ``strict_chunks=True``. With explicit
# ``chunk_sizes`` (one per device) leaves of size ``sum(chunk_sizes)`` take them; others are chunked
# by ``torch.chunk`` over as many devices and truncated the same way.
def _splits(
    leaf_sizes: Sequence[int], num_devices: int, chunk_sizes: Sequence[int] | None
) -> tuple[list[Sequence[int]], list[int]]:
    """Each leaf's chunk sizes, all of one length, and the leaves that lose rows (NOTE
    [ DataParallel's chunking ]): the one place the rule is written."""
    if chunk_sizes is not None:
        if len(chunk_sizes) != num_devices:
            raise ValueError(
                f"fastdp: chunk_sizes has {len(chunk_sizes)} entries but there are "
                f"{num_devices} devices"
            )
        for c in chunk_sizes:
            if c < 0:
                raise ValueError(f"fastdp: chunk_sizes must be non-negative, got {c}")
        total, given = sum(chunk_sizes), tuple(chunk_sizes)
        splits = [given if s == total else _torch_chunk(s, num_devices) for s in leaf_sizes]
    else:
        splits = [_torch_chunk(s, num_devices) for s in leaf_sizes]
    if len(splits) < 2:
        return splits, []
    k = min(map(len, splits))
    lost = []
    for i, s in enumerate(splits):
        if len(s) != k:  # only a truncated split can lose rows (its cut chunks may be empty)
            splits[i] = s[:k]
            if sum(s[:k]) != leaf_sizes[i]:
                lost.append(i)
    return splits, lost


def splits_for(
    leaf_sizes: Sequence[int], num_devices: int, chunk_sizes: Sequence[int] | None = None
) -> list[list[int]]:
    """Chunk sizes per leaf (NOTE [ DataParallel's chunking ]): all of one length, the fewest
    chunks any leaf has; ``dropped(leaf_sizes, splits)`` says which leaves lose rows."""
    return [list(s) for s in _splits(leaf_sizes, num_devices, chunk_sizes)[0]]


def dropped(leaf_sizes: Sequence[int], splits: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the leaves whose chunk sizes do not cover all their rows."""
    return [i for i, (s, p) in enumerate(zip(leaf_sizes, splits)) if sum(p) != s]


def batch_size(obj: Any, dim: int) -> int | None:
    """The batch-size rule: the size along ``dim`` of the first tensor leaf of nested inputs
    (scatter's container rules) that has ``dim``; None when none has. A leaf without ``dim`` (a
    0-dim tensor) is skipped, as the wrapper's plan skips it (scatter then raises its own error)."""
    t = _tree.first_tensor(obj, lambda t: -t.dim() <= dim < t.dim())
    return None if t is None else t.size(dim)


def balanced_chunk_sizes(batch: int, weights: Sequence[float]) -> list[int]:
    """Largest-remainder split of ``batch`` rows by ``weights`` (exact rational arithmetic).

    Example: ``balanced_chunk_sizes(10, [1, 2, 1]) == [3, 5, 2]`` (quotas 2.5, 5, 2.5; the one row
    left goes to the first of the tied remainders).
    """
    fw = [Fraction(w) for w in weights]
    total = sum(fw)
    quotas = [batch * w / total for w in fw]
    sizes = [math.floor(q) for q in quotas]
    left = batch - sum(sizes)
    order = sorted(range(len(fw)), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in order[:left]:
        sizes[i] += 1
    return sizes


def check_split_args(
    chunk_sizes: Sequence[int] | None, balance: Sequence[float] | None, num_devices: int | None
) -> tuple[list[int] | None, list[float] | None]:
    """Validate ``chunk_sizes`` / ``balance`` of the constructor (``num_devices=None``: none)."""
    if chunk_sizes is not None and balance is not None:
        raise ValueError(
            f"fastdp: chunk_sizes and balance are mutually exclusive; got chunk_sizes="
            f"{list(chunk_sizes)} and balance={list(balance)}. Pass one of them"
        )
    if chunk_sizes is not None:
        sizes = list(chunk_sizes)
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in sizes):
            raise ValueError(f"fastdp: chunk_sizes must be non-negative ints, got {sizes}")
        if num_devices is not None and len(sizes) != num_devices:
            raise ValueError(
                f"fastdp: chunk_sizes has {len(sizes)} entries but device_ids has {num_devices} "
                "devices; give one size per device (0 skips a device)"
            )
        return sizes, None
    if balance is not None:
        weights = [float(w) for w in balance]
        if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                "fastdp: balance must be finite, non-negative weights with a positive sum, got "
                f"{list(balance)}"
            )
        if num_devices is not None and len(weights) != num_devices:
            raise ValueError(
                f"fastdp: balance has {len(weights)} entries but device_ids has {num_devices} "
                "devices; give one weight per device (0 skips a device)"
            )
        return None, weights
    return None, None


def devices_with_rows(
    devices: Sequence[torch.device],
    batch: int | None,
    dim: int,
    chunk_sizes: Sequence[int] | None,
    balance: Sequence[float] | None,
) -> tuple[list[torch.device], list[int] | None]:
    """The devices that get rows and their chunk sizes, or ``(devices, None)`` for torch.chunk.

    Devices with 0 rows are dropped (all of them kept for an empty batch, as torch.chunk would).
    """
    if chunk_sizes is None and balance is None:
        return list(devices), None
    if chunk_sizes is not None:
        sizes = list(chunk_sizes)
        if batch is not None and sum(sizes) != batch:
            raise ValueError(
                f"fastdp: chunk_sizes {sizes} sum to {sum(sizes)} but the batch has {batch} rows "
                f"along dim {dim}"
            )
    elif batch is None:  # no tensor to split: inputs go by reference to the weighted devices
        sizes = [1 if w > 0 else 0 for w in balance]
    else:
        sizes = balanced_chunk_sizes(batch, balance)
    if batch == 0:
        return list(devices), sizes
    keep = [i for i, s in enumerate(sizes) if s > 0]
    return [devices[i] for i in keep], (None if batch is None else [sizes[i] for i in keep])


def warn_dropped(message: str) -> None:
    """The default for rows dropped as DataParallel drops them: a ``UserWarning`` at the caller
    of ``fastdp.scatter_gather.scatter`` / ``scatter_kwargs``."""
    warnings.warn(message, UserWarning, stacklevel=4)


def flatten_inputs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> tuple[tuple | None, list[torch.Tensor]]:
    """The tree of ``(inputs, kwargs)`` and its tensor leaves; the tree is None where the inputs
    are positional tensors only (no kwargs): then the leaves are the inputs."""
    if not kwargs and inputs:
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                break
        else:
            return None, list(inputs)
    leaves: list[torch.Tensor] = []
    return _tree.flatten((tuple(inputs), kwargs or {}), leaves), leaves


def split_leaves(
    spec: tuple | None,
    leaves: list[torch.Tensor],
    num_devices: int,
    dim: int,
    chunk_sizes: Sequence[int] | None,
    on_drop: OnDrop | None,
    with_kwargs: bool,
) -> tuple[list[int], list[Sequence[int]]]:
    """Each leaf's dim and split over ``num_devices``, in one pass over the leaves; raises where
    a leaf cannot be chunked. Leaves that lose rows are narrowed in place to the rows replicas get
    (views: the rest get no gradient) and ``on_drop`` (default: a warning) hears which."""
    dims, sizes = [], []
    for i, t in enumerate(leaves):
        n = t.dim()
        if n == 0 or t.layout is not _STRIDED or t.is_nested or t.is_meta:
            raise _unsplittable(t, _names(spec, leaves, with_kwargs)[i])
        d = dim % n if dim < 0 else dim
        if d >= n:
            raise IndexError(
                f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
                f"but got {dim})"
            )
        dims.append(d)
        sizes.append(t.shape[d])
    if chunk_sizes is None and len(sizes) == 1:  # the commonest input: one batch tensor
        return dims, [_torch_chunk(sizes[0], num_devices)]
    splits, lost = _splits(sizes, num_devices, chunk_sizes)
    if lost:
        for i in lost:
            leaves[i] = leaves[i].narrow(dims[i], 0, sum(splits[i]))
        (on_drop or warn_dropped)(_drop_message(spec, leaves, sizes, splits, lost, with_kwargs))
    return dims, splits


def _unsplittable(t: torch.Tensor, path: str) -> Exception:
    """The error for a leaf no replica can take, naming it: a meta tensor and a 0-dim one get the
    type and the text DataParallel's scatter raises, then fastdp's; sparse and nested tensors
    a TypeError."""
    if t.is_meta:
        return NotImplementedError(
            f"Cannot copy out of meta tensor; no data! fastdp: input {path} is on the meta "
            "device (a shape without data), which cannot be copied to the replicas. Pass it "
            "with data on the module's device; to trace shapes on the meta device, call the "
            "plain module (model.module)."
        )
    if t.layout is _STRIDED and not t.is_nested:
        return RuntimeError(
            f"chunk expects at least a 1-dimensional tensor. fastdp: input {path} is a 0-dim "
            "tensor, which cannot be chunked along the batch dim for the replicas (nn."
            "DataParallel cannot either). Pass a scalar as a Python number (t.item()), or as "
            "one value per row (t.expand(batch_size)): each replica then gets its rows' values."
        )
    kind = "a nested tensor" if t.is_nested else f"a {t.layout} tensor"
    return TypeError(
        f"fastdp: input {path} is {kind}, which cannot be chunked along the batch dim for the "
        "replicas (nn.DataParallel cannot either). Pass it dense (.to_dense(), or padded "
        "with torch.nested.to_padded_tensor), or inside an object that is not a tensor, "
        "list, tuple or dict so that every replica receives it whole."
    )


def _names(spec: tuple | None, leaves: list[torch.Tensor], with_kwargs: bool) -> list[str]:
    """Each leaf's readable path: ``inputs[0]``, ``kwargs['num_items']`` (with ``with_kwargs``
    the tree is of an ``(inputs, kwargs)`` pair; None: positional tensors)."""
    out: dict[int, str] = {}
    if spec is None:
        out = {i: f"inputs[{i}]" for i in range(len(leaves))}
    elif with_kwargs:
        _tree.paths(spec[2][0], "inputs", out)
        _tree.paths(spec[2][1], "kwargs", out)
    else:
        _tree.paths(spec, "inputs", out)
    return [out.get(i, f"tensor {i}") for i in range(len(leaves))]


def _drop_message(
    spec: tuple | None,
    leaves: list[torch.Tensor],
    sizes: list[int],
    splits: list[Sequence[int]],
    lost: list[int],
    with_kwargs: bool,
) -> str:
    names = _names(spec, leaves, with_kwargs)
    what = ", ".join(f"{names[i]} ({sizes[i]} rows, {sum(splits[i])} used)" for i in lost)
    return (
        f"fastdp: input tensors split into different numbers of chunks; as nn.DataParallel "
        f"does, {len(splits[0])} replica(s) run (the fewest chunks of any tensor) and the "
        f"extra rows of {what} are dropped. Pass strict_chunks=True to make this an error."
    )


@dataclass(slots=True)
class StepPlan:
    """One forward's decisions, made once before the scatter and read by every stage after it.

    The scatter executes the leaf fields as they are: replica ``r`` gets chunk ``r`` of every
    leaf (``splits[i][r]`` rows along ``dims[i]``) on ``devices[r]``, rebuilt into ``spec``.
    """

    compile_ctx: Any  # the torch.compile context replicas run under (None: eager)
    devices: list[torch.device]  # the devices that get rows, in replica order
    ids: list[Any]  # their ids as the seams take them (the wrapper's own list unless custom_split)
    sizes: list[int] | None = None  # rows per device (chunk_sizes/balance); None: torch.chunk's
    batch: int | None = None  # the first input's rows, where sizes or Scattered need it
    unreplicated: bool = False  # the module runs itself: no accelerator, or one CPU device
    custom_split: bool = False  # devices/sizes differ from the wrapper's defaults
    verified: Any = None  # NOTE [ One signature per step ] in fastdp/data_parallel.py
    leaves: list[torch.Tensor] | None = None  # tensor leaves, narrowed to the rows replicas get
    # (flatten's order); None: not split here (unreplicated, or an overridden scatter seam)
    spec: tuple | None = None  # the tree of (inputs, kwargs) around the leaves; None: the
    # inputs are positional tensors, the leaves themselves
    dims: list[int] | None = None  # each leaf's dim, non-negative
    splits: list[Sequence[int]] | None = None  # splits[i][r]: rows of leaf i for replica r;
    # one length for all leaves, the number of replicas (NOTE [ DataParallel's chunking ])

    def chunk_rows(self, n: int) -> list[int] | None:
        """Batch rows of the first ``n`` replicas (None when no tensor input fixed them)."""
        if self.sizes is not None:
            return self.sizes[:n]
        return None if self.batch is None else chunk_sizes_for(self.batch, len(self.devices))[:n]


def make_plan(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    devices: Sequence[torch.device],
    ids: list[Any],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    balance: Sequence[float] | None = None,
    gather_output: bool = True,
    ctx: Any = None,
    verified: Any = None,
    split: bool = True,
    on_drop: OnDrop | None = None,
) -> StepPlan:
    """The plan of one forward over ``devices`` (empty: the module runs unreplicated), whose
    ids as the seams take them are ``ids`` (kept as given, not copied): chunk sizes
    (``torch.chunk``'s along ``dim``, or ``chunk_sizes=`` / ``balance=``; ``gather_output=False``
    counts the batch too), context and, with ``split`` (the wrapper's own scatter seam runs),
    each leaf's split (``on_drop``: told of rows dropped, NOTE [ DataParallel's chunking ])."""
    devices = list(devices)
    unreplicated = not devices or (len(devices) == 1 and devices[0].type == "cpu")
    sizes, used, batch = None, devices, None
    if chunk_sizes is not None or balance is not None or not gather_output:
        # [beyond DP] the devices that get rows, and how many
        batch = batch_size((inputs, kwargs), dim)
        if devices:
            used, sizes = devices_with_rows(devices, batch, dim, chunk_sizes, balance)
    custom_split = sizes is not None or len(used) != len(devices)
    ids = [public_id(d) for d in used] if custom_split else ids
    if not split or unreplicated:
        return StepPlan(ctx, used, ids, sizes, batch, unreplicated, custom_split, verified)
    spec, leaves = flatten_inputs(inputs, kwargs)
    dims, splits = split_leaves(spec, leaves, len(used), dim, sizes, on_drop, True)
    return StepPlan(
        ctx, used, ids, sizes, batch, False, custom_split, verified, leaves, spec, dims, splits
    )
