"""The doctor's inputs and how it compares them (the checks are in ``fastdp/commands/doctor.py``).

Every copy-like path is run twice on the same inputs, once through the extension and once through
the torch path of ``fastdp.comm`` (``torch.chunk``/``Tensor.to``/``torch.cat``, and
``torch.nn.parallel.comm`` between distinct GPUs), and the results must agree bit for bit: values,
dtype, shape, strides and device. ``cases()`` is the small matrix of every path; the kernel
checks' ``kernel_cases()`` are at real sizes: every dtype at 2^20 + 3 elements (odd: a tail in
every vector width), 1M-element transposed, strided and channels_last views, and 40 MiB buffers
(several staging windows, the direct pinned path); ``quick`` shrinks them to a few KiB and
1 MiB + 3. Those compare raw bytes (``same_bits``: float8 too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from fastdp import _backend
from fastdp._backend import DTYPES

MiB = 1 << 20
AVOID_EXT = "FASTDP_DISABLE_EXT=1"


class Mismatch(AssertionError):
    """The extension and torch disagree: the check FAILs with this text."""


class Skip(Exception):
    """The check cannot run here: SKIP with this text."""


def make(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    gen: torch.Generator,
    small_ints: bool = False,
    wide_ints: bool = False,
) -> torch.Tensor:
    """A CPU tensor of `dtype` with varied bits (integers in [-8, 8] when `small_ints`, so that
    sums are exact in every dtype and order: NCCL's reduction order is not torch's; every byte
    value when `wide_ints`)."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    exact = dtype.is_floating_point or dtype.is_complex
    if wide_ints and not exact:
        lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
        return torch.randint(lo, hi, shape, generator=gen, dtype=dtype)
    if small_ints or not exact:
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


def kernel_dtypes() -> list[torch.dtype]:
    """Every dtype torch copies here (float8 where this torch has it)."""
    out = [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    ]
    return out + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def kernel_cases(quick: bool = False) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(label naming dtype, shape and layout; CPU tensor; dim)."""
    gen = torch.Generator().manual_seed(0)
    n = 4096 + 3 if quick else MiB + 3
    side = 67 if quick else 1031
    cl = 8 if quick else 64
    big = MiB + 3 if quick else 40 * MiB

    def fill(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        return make(shape, dt, gen, wide_ints=True)

    for dt in kernel_dtypes():
        yield f"{str(dt).removeprefix('torch.')} ({n},)", fill((n,), dt), 0
    yield f"float32 ({side + 4}, {side}).t() dim 1", fill((side + 4, side), torch.float32).t(), 1
    yield (
        f"bfloat16 ({side}, {2 * side})[:, ::2] dim 0",
        fill((side, 2 * side), torch.bfloat16)[:, ::2],
        0,
    )
    x = fill((4, cl, cl, cl), torch.float16).contiguous(memory_format=torch.channels_last)
    yield f"float16 (4, {cl}, {cl}, {cl}) channels_last dim 0", x, 0
    yield f"float16 (4, {cl}, {cl}, {cl}) channels_last dim 1", x, 1
    yield f"uint8 ({big},) {big / MiB:.1f} MiB", fill((big,), torch.uint8), 0
    yield f"float32 ({big // 4 + 3},) {big / MiB:.1f} MiB", fill((big // 4 + 3,), torch.float32), 0


def big_kernel_cases(quick: bool) -> list[tuple[str, torch.Tensor, int]]:
    return [c for c in kernel_cases(quick) if "MiB" in c[0]]


def kernel_labels(quick: bool = False) -> list[str]:
    return [label for label, _, _ in kernel_cases(quick)]


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


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s raw bytes, flat (a conj or neg view resolved first)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def same_bits(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """Raises Mismatch unless dtype, shape, device and every byte agree (strides aside)."""
    meta = (got.dtype, tuple(got.shape), got.device)
    if meta != (want.dtype, tuple(want.shape), want.device):
        raise Mismatch(
            f"{where}: got {meta}, torch gives {(want.dtype, tuple(want.shape), want.device)}"
        )
    g, w = bits(got), bits(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        raise Mismatch(f"{where}: {len(bad)} byte(s) differ, the first at byte {int(bad[0])}")


def ext_vs_torch(fn: Callable[[], Any], where: str, strides: bool = True) -> None:
    """Runs fn() through the extension and through torch; their results must be bit-identical."""
    with _backend.use_extension(True):
        got = fn()
    with _backend.use_extension(False):
        want = fn()
    sync()
    same(got, want, where, strides)


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
