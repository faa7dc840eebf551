"""Uneven splits: explicit ``chunk_sizes`` or relative ``balance`` weights per device.

``FastDataParallel(..., chunk_sizes=[...])`` fixes the rows each device gets (they must sum to the
batch); ``balance=[w0, w1, ...]`` turns relative shares into sizes for whatever batch comes, by
largest-remainder rounding (quota ``B * w_i / sum(w)``, floors, then one more row to the largest
fractional parts, ties to the lower device index). Devices that get 0 rows are skipped: replicas
run only on the others, and outputs are gathered in device order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch

from fastdp import _tree

__all__ = ["balanced_chunk_sizes", "check_split_args", "first_batch_size", "plan_devices"]


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


def first_batch_size(obj: Any, dim: int) -> int | None:
    """Size along ``dim`` of the first tensor leaf of nested inputs (scatter's container rules)."""
    leaves: list[torch.Tensor] = []
    _tree.flatten(obj, leaves)
    for t in leaves:  # a leaf without ``dim`` (0-dim) is skipped; scatter raises its own error
        if -t.dim() <= dim < t.dim():
            return t.size(dim)
    return None


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
