"""The small input matrix of ``python -m fastdp.doctor`` and its bit-exact comparison.

Every copy-like path is run twice on the same inputs, once through the extension and once through
the torch path of ``fastdp.comm`` (``torch.chunk``/``Tensor.to``/``torch.cat``, and
``torch.nn.parallel.comm`` between distinct GPUs), and the results must agree bit for bit: values,
dtype, shape, strides and device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from fastdp import _backend

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool,
          torch.complex64]


class Mismatch(AssertionError):
    """The extension and torch disagree: the check FAILs with this text."""


class Skip(Exception):
    """The check cannot run here: SKIP with this text."""


def make(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
         small_ints: bool = False) -> torch.Tensor:
    """A CPU tensor of `dtype` with varied bits (integers in [-8, 8] when `small_ints`, so that
    sums are exact in every dtype and order: NCCL's reduction order is not torch's)."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if small_ints or not (dtype.is_floating_point or dtype.is_complex):
        x = torch.randint(-8, 9, shape, generator=gen)
        return torch.complex(x.float(), -x.float()).to(dtype) if dtype.is_complex else x.to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=gen)
    return torch.randn(shape, generator=gen).to(dtype)


def cases(small_ints: bool = False) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(label, CPU tensor, dim): every dtype, then layouts, sizes and dims in float32 and bf16."""
    gen = torch.Generator().manual_seed(0)
    for dt in DTYPES:
        yield f"{str(dt)[6:]} 7x5 dim0", make((7, 5), dt, gen, small_ints), 0
    for dt in (torch.float32, torch.bfloat16, torch.bool, torch.complex64):
        name = str(dt)[6:]
        yield f"{name} transposed dim1", make((5, 7), dt, gen, small_ints).t(), 1
        yield f"{name} strided dim-1", make((6, 9), dt, gen, small_ints)[::2, ::2], -1
    x = make((5, 3, 4, 2), torch.float32, gen, small_ints)
    yield "float32 channels_last dim0", x.contiguous(memory_format=torch.channels_last), 0
    yield "float32 channels_last dim1", x.contiguous(memory_format=torch.channels_last), 1
    yield "float32 0 rows", make((0, 3), torch.float32, gen, small_ints), 0
    yield "float32 1 row", make((1, 3), torch.float32, gen, small_ints), 0
    yield "float32 odd 13x1 dim0", make((13, 1), torch.float32, gen, small_ints), 0
    yield "float32 dim1 of 3x11", make((3, 11), torch.float32, gen, small_ints), 1
    yield "complex64 conj view", make((7, 3), torch.complex64, gen, small_ints).conj(), 0


def describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} stride {t.stride()} on {t.device}"


def same(got: Any, want: Any, where: str, strides: bool = True) -> None:
    """Raises Mismatch unless `got` and `want` (tensors, or nested lists/tuples) are bit-identical
    (strides too when `strides`: the coalesced ops promise values, and torch's own flat buckets
    give contiguous copies where a per-tensor copy keeps the source's strides)."""
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise Mismatch(f"{where}: {len(want)} results expected, got {got!r:.80}")
        for k, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{where}[{k}]", strides)
        return
    meta = (got.dtype, got.shape, got.stride() if strides else 0, got.device)
    if meta != (want.dtype, want.shape, want.stride() if strides else 0, want.device):
        raise Mismatch(f"{where}: got {describe(got)}, torch gives {describe(want)}")
    g, w = got.detach().resolve_conj().cpu(), want.detach().resolve_conj().cpu()
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        first = tuple(bad[0].tolist()) if len(bad) else "?"
        raise Mismatch(f"{where}: values differ at {len(bad)} element(s), first at {first}")


def ext_vs_torch(fn: Callable[[], Any], where: str, strides: bool = True) -> None:
    """Runs fn() through the extension and through torch; their results must be bit-identical."""
    with _backend.use_extension(True):
        got = fn()
    with _backend.use_extension(False):
        want = fn()
    sync()
    same(got, want, where, strides)


AVOID_EXT = "FASTDP_DISABLE_EXT=1"


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need_ext(cuda: bool = False) -> None:
    """Skip unless the extension is loaded and enabled (and built with CUDA, for ``cuda``)."""
    if not _backend.enabled():
        raise Skip(f"extension disabled ({AVOID_EXT}): the torch path is used everywhere")
    if not _backend.loaded():
        raise Skip(f"fastdp._C not loaded: {_backend.load_error()}")
    if cuda and _backend.build_info().get("built_with_cuda") != "1":
        raise Skip("CPU-only build: CUDA copies take the torch path")


def need_gpus(n: int) -> None:
    if gpus() < n:
        raise Skip(f"needs {n} CUDA GPU(s), {gpus()} visible")


def sync() -> None:
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
