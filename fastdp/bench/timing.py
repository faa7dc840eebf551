"""Timing (warm-up, calibrated repeats, min / median / max) and Python call counting; how both
measure is in bench/README.md, *Measurement*."""

from __future__ import annotations

import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch


@dataclass
class Stats:
    """Seconds per step of one measured configuration, reported in milliseconds."""

    min_ms: float
    median_ms: float
    max_ms: float
    mean_ms: float
    repeats: int
    inner: int
    warmup: int

    @classmethod
    def of(cls, ms: list[float], *, repeats: int, inner: int, warmup: int) -> Stats:
        """The statistics of ``ms``, one time per repeat in milliseconds."""
        mid, mean = statistics.median(ms), statistics.fmean(ms)
        return cls(min(ms), mid, max(ms), mean, repeats, inner, warmup)

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def cuda_sync(devices: Sequence[torch.device | int | str]) -> Callable[[], None]:
    """A function that synchronises every CUDA device in ``devices`` (a no-op for CPU)."""
    idx = sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})
    if not idx:
        return lambda: None

    def sync() -> None:
        for i in idx:
            torch.cuda.synchronize(i)

    return sync


Timed = Callable[[], object] | tuple[Callable[[], object], Callable[[object], None]]


def _once(fn: Callable[[], object], after: Callable[[object], None] | None, sync) -> float:
    """One synchronised call of ``fn`` (seconds); ``after(result)`` runs outside the timing."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    dt = time.perf_counter() - t0
    if after is not None:
        after(out)
    return dt


def _repeat(fn: Callable[[], object], k: int, sync: Callable[[], None]) -> float:
    """``k`` calls of ``fn`` between two synchronisations: milliseconds per call."""
    sync()
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    sync()
    return (time.perf_counter() - t0) / k * 1e3


def measure_many(
    fns: dict[str, Timed],
    *,
    warmup: int = 2,
    repeats: int = 10,
    min_repeat_s: float = 0.0,
    max_total_s: float | None = None,
    sync: Callable[[], None] | None = None,
    max_inner: int = 10_000,
) -> dict[str, Stats]:
    """Times each of ``fns`` after ``warmup`` calls: ``repeats`` repeats of ``inner`` calls each
    (``inner`` calibrated so that a repeat lasts ``min_repeat_s``), interleaved: repeat k of every
    function before repeat k + 1 of any, round k starting at function k, so that load changes hit
    them alike. ``max_total_s`` caps the time of all repeats (at least 3 are kept). A value
    ``(fn, after)`` times one call of ``fn`` per repeat, then calls ``after(fn's result)`` untimed.
    """
    sync = sync or (lambda: None)
    pairs = {k: (f if isinstance(f, tuple) else (f, None)) for k, f in fns.items()}
    inner: dict[str, int] = {}
    first: dict[str, float] = {}
    for name, (fn, after) in pairs.items():
        for _ in range(max(warmup, 1)):  # at least one: the first call builds lazy state
            _once(fn, after, sync)
        first[name] = max(_once(fn, after, sync), 1e-9)
        k = int(min(max_inner, max(1, math.ceil(min_repeat_s / first[name]))))
        inner[name] = 1 if after is not None else k
    if max_total_s is not None:
        per_round = sum(first[k] * inner[k] for k in pairs)
        repeats = max(3, min(repeats, int(max_total_s / per_round)))
    times: dict[str, list[float]] = {k: [] for k in pairs}
    names = list(pairs)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, after = pairs[name]
            if after is not None:
                times[name].append(_once(fn, after, sync) * 1e3)
            else:
                times[name].append(_repeat(fn, inner[name], sync))
    return {
        name: Stats.of(ms, repeats=repeats, inner=inner[name], warmup=warmup)
        for name, ms in times.items()
    }


class CallCounter:
    """Counts Python ``'call'`` events in every thread (bench/README.md, *Python calls per step*).

    The hook is installed on entry, so threads started inside the ``with`` block carry it; it
    counts only inside ``counted()`` and uninstalls itself in each thread after exit. A call made
    while one of ``model_codes`` (the model's ``forward`` code objects) runs in the same thread is
    the model's. ``areas`` maps a name to a path prefix: outside calls whose code file starts with
    it are also counted under that name; the prefix under ``"_exclude"`` is left out.
    """

    def __init__(self, areas: dict[str, str] | None = None, model_codes: set | None = None) -> None:
        self.areas = {k: v for k, v in (areas or {}).items() if k != "_exclude"}
        self._exclude = (areas or {}).get("_exclude")
        self._model_codes = frozenset(model_codes or ())
        self._on = self._installed = False  # the counts themselves start in counted()
        self._lock = threading.Lock()
        self._tls = threading.local()

    def _hook(self, frame, event, arg):
        if not self._installed:
            sys.setprofile(None)
            return
        if not self._on:
            return
        code = frame.f_code
        if event == "return":
            if code in self._model_codes:
                self._tls.inside = max(0, getattr(self._tls, "inside", 0) - 1)
            return
        if event != "call":
            return
        inside = getattr(self._tls, "inside", 0)
        if code in self._model_codes:
            inside += 1
            self._tls.inside = inside
        with self._lock:
            self.count += 1
            if inside:
                self.model_count += 1
                return
            self.by_code[code] = self.by_code.get(code, 0) + 1
            if self.areas:
                f = code.co_filename
                if not (self._exclude and f.startswith(self._exclude)):
                    for name, prefix in self.areas.items():
                        if f.startswith(prefix):
                            self.in_area[name] += 1

    def __enter__(self) -> CallCounter:
        self._installed = True
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(self._hook)
        else:
            threading.setprofile(self._hook)
            sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._on = False
        self._installed = False
        threading.setprofile(None)
        sys.setprofile(None)

    def counted(self, fn: Callable[[], object], steps: int = 1) -> dict[str, float]:
        """Calls ``fn`` ``steps`` times with counting on; returns calls per step: ``total``,
        ``model`` (inside the model's forward), ``outside`` (the rest)."""
        self.count = self.model_count = 0
        self.in_area = dict.fromkeys(self.areas, 0)
        self.by_code: dict = {}
        self._steps = steps
        self._on = True
        try:
            for _ in range(steps):
                fn()
        finally:
            self._on = False
        return {
            "total": self.count / steps,
            "model": self.model_count / steps,
            "outside": (self.count - self.model_count) / steps,
        }

    def top(self, n: int = 12) -> list[list]:
        """The ``n`` most called functions outside the model during the last ``counted``, per
        step, as ``[path/to/file.py:line function, calls]`` (last three path components)."""

        def where(c) -> str:
            return f"{'/'.join(c.co_filename.split('/')[-3:])}:{c.co_firstlineno} {c.co_name}"

        entries = sorted(self.by_code.items(), key=lambda kv: -kv[1])[:n]
        return [[where(c), k / self._steps] for c, k in entries]

    def area_counts(self) -> dict[str, float]:
        """Calls per step outside the model in each area during the last ``counted``."""
        return {k: v / self._steps for k, v in self.in_area.items()}


def forward_codes(module) -> set:
    """The code objects of the ``forward`` methods of ``module`` and all its submodules."""
    found = (getattr(type(m).forward, "__code__", None) for m in module.modules())
    return {code for code in found if code is not None}
