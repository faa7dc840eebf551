"""Tasks (a suite plans them all first, so the bar knows the total; each returns its records),
settings, and the one place where a configuration is checked, timed and recorded. A failure is
recorded as the record's ``status`` (``oom``, ``error``, ``check_failed``); the run goes on."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fastdp import comm
from fastdp.bench import modes, timing
from fastdp.bench.workloads import Workload


@dataclass
class Settings:
    """How hard to measure; ``profile`` picks the workload sizes (tiny, quick, cpu or gpu)."""

    profile: str = "cpu"
    repeats: int = 10
    warmup: int = 1
    min_repeat_s: float = 0.02
    max_total_s: float | None = 3.0  # None: every repeat
    replicas: tuple[int, ...] = (1, 2, 4)
    rtol_cpu: float = 1e-4
    rtol_cuda: float = 2e-3  # cuDNN picks per-shape algorithms (TF32 convolutions by default)
    check: bool = True


@dataclass
class Task:
    suite: str
    label: str
    fn: Callable[[], list[dict]]


def last_only(make: Callable) -> Callable:
    """``make`` with its last result kept: the same arguments again return it; other arguments
    drop it before ``make`` runs (one model alive at a time)."""
    last: dict = {}

    def get(*key: object) -> object:
        if key not in last:
            last.clear()
            last[key] = make(*key)
        return last[key]

    return get


def short_error(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block."""
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def guarded(record: dict, body: Callable[[dict], None]) -> dict:
    """Runs ``body(record)``, turning OOM and exceptions into the record's status."""
    record.setdefault("status", "ok")
    try:
        body(record)
    except Exception as e:  # recorded and shown in the table, never hidden
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            record.update(status="oom", error=short_error(e))
            _release()
        else:
            record.update(status="error", error=short_error(e))
            record["traceback"] = traceback.format_exc(limit=-4)
    return record


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _pool_allocations() -> int:
    """Blocks the extension's pinned pool allocated so far (0 without a CUDA build)."""
    return comm.copy_stats()["pinned_pool_allocations"]


def time_into(s: Settings, fns: dict, recs: dict, sync: Callable[[], None] | None = None) -> None:
    """Times ``fns`` interleaved into ``recs[key]["time_ms"]`` (same keys); a failure (OOM, error)
    is recorded in every record that was being timed."""
    if not fns:
        return
    before = _pool_allocations()

    def body(_: dict) -> None:
        kw = dict(warmup=s.warmup, repeats=s.repeats, min_repeat_s=s.min_repeat_s)
        for key, st in timing.measure_many(fns, max_total_s=s.max_total_s, sync=sync, **kw).items():
            recs[key]["time_ms"] = st.as_dict()
            recs[key]["pinned_pool_allocations"] = {"before": before}
        after = _pool_allocations()
        for key in fns:
            recs[key].setdefault("pinned_pool_allocations", {})["after"] = after

    failed = guarded({}, body)
    if failed.get("status", "ok") != "ok":
        for key in fns:
            recs[key].update(status=failed["status"], error=failed.get("error"))


def time_modes(
    s: Settings,
    *,
    suite: str,
    w: Workload,
    mode_list: Sequence[str],
    model: nn.Module,
    args: tuple,
    devices: Sequence | None = None,
    n: int | None = None,
    ref_device: torch.device | str | None = None,
    bare_model: nn.Module | None = None,
    **fields: object,
) -> list[dict]:
    """Checks each wrapper, then times every mode of ``mode_list`` interleaved; one record each.

    ``bare`` runs ``bare_model`` (default ``model``) on the whole batch, ``floor`` on the
    replicas' chunks in turn (neither is checked); the wrappers run on ``devices`` (``n`` of them,
    checked against ``ref_device``, by default the first, or the CPU without devices). A mode that
    fails its set-up or first step is recorded and left out of the timing; the others are still
    timed. ``auto`` wrappers are timed once their trial steps are over (``modes.settle``).
    ``fields`` go into every record: ``step`` ("train", the default, or "forward"), ``input``
    (by default the workload's), any other.
    """
    n = n or (len(devices) if devices else 1)
    base = dict(suite=suite, workload=w.name, input=w.input_kind, replicas=n, step="train")
    base.update(batch=w.batch, layers=w.layers, **fields)
    names = devices and [f"cuda:{d}" if isinstance(d, int) else str(d) for d in devices]
    ref_device = ref_device or (names[0] if names else "cpu")
    sync = timing.cuda_sync(names or [])  # every CUDA device in use, before and after a repeat
    recs = {m: {**base, "mode": m, "devices": None if m == "bare" else names} for m in mode_list}
    make = modes.train_step if base["step"] == "train" else modes.forward_step
    steps: dict[str, Callable[[], None]] = {}
    calls: dict[str, Callable] = {}
    with contextlib.ExitStack() as stack:
        for m in mode_list:
            target = (bare_model or model) if m in ("bare", "floor") else model
            wrapper = modes.wrapped(m, target, None if m == "bare" else devices)

            def setup(r: dict, m: str = m, wrapper: contextlib.AbstractContextManager = wrapper):
                calls[m] = call = stack.enter_context(wrapper)
                if m not in ("bare", "floor") and s.check:
                    check_mode(r, s, m, model, call, args, n, ref_device)
                fn = modes.in_mode(m, make(call, args))
                if "check" not in r:
                    fn()  # a mode that cannot run fails here, inside its own record
                modes.settle(call, fn)
                steps[m] = fn

            guarded(recs[m], setup)
        model.zero_grad(set_to_none=True)
        time_into(s, steps, recs, sync)
        model.zero_grad(set_to_none=True)
        record_launch(recs, calls)
    return list(recs.values())


def check_mode(
    r: dict, s: Settings, m: str, model: nn.Module, call: Callable, args: tuple, n: int, ref_device
) -> None:
    """``r["check"]``: mode ``m``'s outputs and gradients against the module on the chunks."""
    rtol = s.rtol_cuda if torch.device(ref_device).type == "cuda" else s.rtol_cpu
    # nn.DataParallel without CUDA runs the module on the whole batch
    chunks = 1 if m == "torch_dp" and not call.device_ids else n
    with modes.mode_context(m):
        r["check"] = modes.check(model, call, args, chunks, ref_device, rtol)
    if not r["check"]["ok"]:
        r["status"] = "check_failed"


def record_launch(recs: dict, calls: dict) -> None:
    """Each fastdp record gets its wrapper's strategy: forced, or what ``auto`` picked (with the
    trial's medians) in ``launch_pick``; and the last timed step's ``comm_stats()`` (buckets,
    broadcasts, reduces, bytes: NOTE [ Buckets ] in ``fastdp/_buckets.py``)."""
    for m, call in calls.items():
        launch = getattr(call, "launch", None)
        if launch is None or m not in recs:
            continue
        if hasattr(call, "comm_stats"):
            recs[m]["comm_stats"] = call.comm_stats()
        recs[m]["launch"] = launch
        if launch == "auto":
            recs[m]["launch_pick"] = call.launch_report()


def run_tasks(tasks: list[Task], progress: bool = True, sink: Callable | None = None) -> list[dict]:
    """Runs every task under a tqdm bar on stderr (no bar when tqdm is missing); ``sink`` gets
    each task's records as soon as it is done (what a run cut short keeps)."""
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            tqdm.monitor_interval = 0  # no monitor thread: it would show up in call counts
            bar = tqdm(total=len(tasks), unit="cfg", dynamic_ncols=True, leave=False)
        except ImportError:
            print("fastdp.bench: tqdm is not installed; no progress bar.", file=sys.stderr)
    out: list[dict] = []
    for t in tasks:
        if bar is not None:
            bar.set_description(f"{t.suite}: {t.label}"[:60])
        t0, records = time.perf_counter(), []
        failed = guarded(
            {"suite": t.suite, "label": t.label}, lambda _, got=records, fn=t.fn: got.extend(fn())
        )
        if failed["status"] != "ok":  # a bug in one task must not lose the others
            records = [failed]
        for r in records:
            r["task"], r["task_s"] = t.label, round(time.perf_counter() - t0, 3)
        out.extend(records)
        if sink is not None:
            sink(records)
        t.fn = None  # drop the task's models and wrappers before the next one
        _release()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out
