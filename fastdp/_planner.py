"""The plan of a step, in one place: chunk sizes for every input leaf (DataParallel's rules),
the batch-size rule, uneven splits (``chunk_sizes=`` / ``balance=``) and the ``StepPlan`` every
stage reads. Scatter applies the plan (``fastdp/scatter_gather.py``).

NOTE [ DataParallel's chunking ]
Each tensor leaf is chunked as ``torch.chunk`` chunks it (``split = ceil(size / n)``, so a leaf
may yield fewer than ``n`` chunks; ``n`` chunks of 0 for an empty leaf). As DataParallel's
``scatter`` ``zip``s its containers, the step runs as many replicas as the leaf with the fewest
chunks has: the other leaves' extra chunks (their last rows) are dropped. HF Trainer relies on it
(``num_items_in_batch`` has one row per GPU, so a partial last batch drops its spare rows). The
wrapper warns once naming the dropped leaves, or raises with ``strict_chunks=True``. With explicit
``chunk_sizes`` (one per device) leaves of size ``sum(chunk_sizes)`` take them; others are chunked
by ``torch.chunk`` over as many devices and truncated the same way.

NOTE [ Uneven splits ]
``FastDataParallel(..., chunk_sizes=[...])`` fixes the rows each device gets (they must sum to the
batch); ``balance=[w0, w1, ...]`` turns relative shares into sizes for whatever batch comes, by
largest-remainder rounding (quota ``B * w_i / sum(w)``, floors, then one more row to the largest
fractional parts, ties to the lower device index). Devices that get 0 rows are skipped: replicas
run only on the others, and outputs are gathered in device order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from fastdp import _tree
from fastdp._devices import public_id


def chunk_sizes_for(size: int, num_devices: int) -> list[int]:
    """``torch.chunk``'s sizes for one leaf of ``size`` rows over ``num_devices``."""
    if num_devices <= 0:
        raise ValueError(f"fastdp.plan_chunks: need at least one device, got {num_devices}")
    if size < 0:
        raise ValueError(f"fastdp.plan_chunks: leaf size must be >= 0, got {size}")
    if size == 0:
        return [0] * num_devices
    split = -(-size // num_devices)
    return [min(split, size - off) for off in range(0, size, split)]


def plan_chunks(
    leaf_sizes: Sequence[int], num_devices: int, chunk_sizes: Sequence[int] | None = None
) -> list[list[int]]:
    """Chunk sizes per leaf (NOTE [ DataParallel's chunking ]): all of one length, the fewest
    chunks any leaf has; ``dropped(leaf_sizes, plan)`` says which leaves lose rows."""
    if chunk_sizes is not None:
        if len(chunk_sizes) != num_devices:
            raise ValueError(
                f"fastdp: chunk_sizes has {len(chunk_sizes)} entries but there are "
                f"{num_devices} devices"
            )
        for c in chunk_sizes:
            if c < 0:
                raise ValueError(f"fastdp: chunk_sizes must be non-negative, got {c}")
        total = sum(chunk_sizes)
        plan = [
            list(chunk_sizes) if s == total else chunk_sizes_for(s, num_devices) for s in leaf_sizes
        ]
    else:
        plan = [chunk_sizes_for(s, num_devices) for s in leaf_sizes]
    if plan:
        k = min(len(p) for p in plan)
        plan = [p if len(p) == k else p[:k] for p in plan]
    return plan


def dropped(leaf_sizes: Sequence[int], plan: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the leaves whose planned chunks do not cover all their rows."""
    return [i for i, (s, p) in enumerate(zip(leaf_sizes, plan)) if sum(p) != s]


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


def plan_devices(
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


@dataclass(slots=True)
class StepPlan:
    """One forward's decisions, made once before the scatter and read by every stage after it."""

    compile_ctx: Any  # the torch.compile context replicas run under (None: eager)
    devices: list[torch.device]  # the devices that get rows, in replica order
    ids: list[Any]  # their ids as the seams take them (the wrapper's own list unless custom_split)
    sizes: list[int] | None = None  # rows per device (chunk_sizes/balance); None: torch.chunk's
    batch: int | None = None  # the first input's rows, where sizes or Scattered need it
    unreplicated: bool = False  # the module runs itself: no accelerator, or one CPU device
    custom_split: bool = False  # devices/sizes differ from the wrapper's defaults
    verified: Any = None  # NOTE [ One signature per step ] in fastdp/data_parallel.py

    def chunk_rows(self, n: int) -> list[int] | None:
        """Batch rows of the first ``n`` replicas (None when no tensor input fixed them)."""
        if self.sizes is not None:
            return self.sizes[:n]
        return None if self.batch is None else chunk_sizes_for(self.batch, len(self.devices))[:n]


def make_plan(
    wrapper: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any], ctx: Any, verified: Any = None
) -> StepPlan:
    """The plan of one ``FastDataParallel`` forward: devices, chunk sizes, context."""
    devices: list[torch.device] = wrapper._devices if wrapper.device_ids else []
    sizes, used, batch = None, devices, None
    if (
        wrapper.chunk_sizes is not None or wrapper.balance is not None or not wrapper.gather_output
    ):  # [beyond DP] the devices that get rows, and how many
        batch = batch_size((inputs, kwargs), wrapper.dim)
        if devices:
            used, sizes = plan_devices(
                devices, batch, wrapper.dim, wrapper.chunk_sizes, wrapper.balance
            )
    custom_split = sizes is not None or len(used) != len(devices)
    ids = [public_id(d) for d in used] if custom_split else wrapper.device_ids
    unreplicated = not devices or (len(devices) == 1 and devices[0].type == "cpu")
    return StepPlan(ctx, used, ids, sizes, batch, unreplicated, custom_split, verified)
