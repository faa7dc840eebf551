"""The replica runners: one replica under the caller's thread-local state, replicas in turn
inline or one thread each, and a replica's error re-raised in the caller.

Grad mode, inference mode and autocast (enabled flag *and* dtype, per device type: CPU, CUDA and
the replicas' accelerator; DataParallel carries only the CUDA flag) reach every replica;
accelerator replicas run under their device and the caller's current stream of that device (read
in the caller: NOTE [ The caller's streams ]). A replica's exception is re-raised in the caller as
its own type with ``Caught X in replica i on device d.`` and the original traceback, whichever
launch strategy ran it (the strategies and the rule that picks one: ``fastdp/_launch.py``); a
BaseException that is no Exception (SystemExit, KeyboardInterrupt, a cancellation) is re-raised
as itself, with that line as a note.
"""

from __future__ import annotations

import itertools
import threading
import traceback
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch.nn import Module

from fastdp._devices import public_id
from fastdp._torch_private import ExceptionWrapper

__all__ = [
    "BoundMethod",
    "capture_state",
    "current_launch",
    "launch_number",
    "ReplicaAborted",
    "raise_first_error",
    "reraise",
    "run_in_turn",
    "run_on_threads",
    "run_replica",
    "wait_for_stragglers",
]

_AUTOCAST_TYPES = ("cpu", "cuda")
_numbers = itertools.count(1)
_local = threading.local()  # ``launch``: the launch whose replica this thread runs, or None


def launch_number() -> int:
    """A number above every one handed out before (launches and rendezvous take them in order)."""
    return next(_numbers)


def current_launch() -> int | None:
    """The number of the launch (``capture_state``) whose replica this thread runs, else None."""
    return getattr(_local, "launch", None)


class BoundMethod:
    """Replica ``module``'s method ``name``, run by a launch in the replica's place: a call is
    ``getattr(module, name)(*args, **kwargs)`` (``FastDataParallel.generate``, ``call_method``)."""

    __slots__ = ("module", "name")

    def __init__(self, module: Module, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, self.name)(*args, **kwargs)


class ReplicaAborted(RuntimeError):
    """A replica stopped because another replica of the same step failed (SyncBatchNorm waits).

    ``parallel_apply`` re-raises the failing replica's own error in preference to these.
    """


# NOTE [ The caller's streams ]
# The current stream of CUDA (and of any accelerator) is thread-local: a worker thread's current
# stream is the default stream, whatever the caller entered with ``torch.cuda.stream(s)``. So the
# streams are read here, in the caller (as torch.nn.parallel.parallel_apply does), and entered by
# the replica (enter_state); a replica reading ``current_stream`` itself would run on the worker's
# default stream, unordered with the caller's work on ``s``: wrong values, silently.


def capture_state(devices: Sequence[torch.device] = ()) -> dict[str, Any]:
    """The caller's thread-local state that replicas must see, streams of ``devices`` included."""
    autocast = {}
    for dt in _AUTOCAST_TYPES + _other_accelerators(devices):
        if dt == "cuda" and not torch.cuda.is_available():
            continue
        if torch.is_autocast_enabled(dt):
            autocast[dt] = torch.get_autocast_dtype(dt)
    return {
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "autocast": autocast,
        "autocast_cache": torch.is_autocast_cache_enabled(),
        "streams": {
            d: torch.cuda.current_stream(d) if d.type == "cuda" else _current_stream(d)
            for d in set(devices)
            if d.type != "cpu"
        },
        "launch": launch_number(),
    }


def _other_accelerators(devices: Sequence[torch.device]) -> tuple[str, ...]:
    """The device types of ``devices`` whose autocast state is not among ``_AUTOCAST_TYPES``."""
    return tuple({d.type for d in devices if d.type not in _AUTOCAST_TYPES})


def _current_stream(d: torch.device) -> Any:
    """The current stream of a device of an accelerator other than CUDA (torch.accelerator)."""
    return torch.accelerator.current_stream(d)


def enter_state(stack: ExitStack, state: dict[str, Any], device: torch.device) -> None:
    """Enter ``state`` (from capture_state) and ``device`` on the current thread."""
    if state["inference"]:
        stack.enter_context(torch.inference_mode(True))
    stack.enter_context(torch.set_grad_enabled(state["grad"]))
    for dt in _AUTOCAST_TYPES:
        if dt in state["autocast"]:
            stack.enter_context(
                torch.autocast(
                    dt, dtype=state["autocast"][dt], cache_enabled=state["autocast_cache"]
                )
            )
        elif dt == "cuda" and device.type == "cuda":
            stack.enter_context(torch.autocast("cuda", enabled=False))
    if device.type not in _AUTOCAST_TYPES and device.type in state["autocast"]:
        dtype = state["autocast"][device.type]
        stack.enter_context(
            torch.autocast(device.type, dtype=dtype, cache_enabled=state["autocast_cache"])
        )
    if device.type == "cuda":
        stack.enter_context(torch.cuda.device(device.index))
        stream = state["streams"].get(device)
        if stream is None:  # a device the caller did not name: its current stream, read now
            stream = torch.cuda.current_stream(device)
        stack.enter_context(torch.cuda.stream(stream))
    elif device.type != "cpu":  # another accelerator: its device and stream through torch's API
        stack.enter_context(torch.accelerator.device_index(device.index))
        stream = state["streams"].get(device)
        stack.enter_context(stream if stream is not None else _current_stream(device))


# Ctrl-C during a step: a KeyboardInterrupt must reach the caller promptly. A real SIGINT interrupts
# Thread.join, but _thread.interrupt_main (IPython, timers) only sets a flag that is checked between
# bytecodes, so joins wake every _POLL_S. Replica threads cannot be stopped: they finish on their
# own, and the next parallel_apply waits for them first (``wait_for_stragglers``): two steps never
# run on one module at once.
_POLL_S = 0.05
_stragglers: list[threading.Thread] = []


def _join(t: threading.Thread) -> None:
    while t.is_alive():
        t.join(_POLL_S)


def wait_for_stragglers() -> None:
    """Join the replica threads of an interrupted step. See the comment above ``_POLL_S``."""
    while _stragglers:
        _join(_stragglers[-1])
        _stragglers.pop()


def _wrapped_error(i: int, device: torch.device) -> ExceptionWrapper:
    """The exception being handled, as replica ``i`` on ``device`` raised it."""
    return ExceptionWrapper(where=f"in replica {i} on device {public_id(device)}")


class _Raised(ExceptionWrapper):
    """A replica's BaseException that is no Exception, kept as itself: rebuilt from a message it
    would lose SystemExit's code, a cancellation's arguments, or become a RuntimeError."""

    def __init__(self, exc: BaseException, i: int, device: torch.device) -> None:
        self.exc_type, self.exc = type(exc), exc
        self.where = f"in replica {i} on device {public_id(device)}"

    def reraise(self) -> None:
        exc, self.exc = self.exc, None
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"Caught {self.exc_type.__name__} {self.where}.")
        raise exc


def run_replica(
    i: int, module: Module, inp: Any, kwargs: dict, device: torch.device, state: dict[str, Any]
) -> Any:
    """Call one replica; returns its output or an ExceptionWrapper (never raises: a persistent
    worker outlives a replica's SystemExit; torch's parallel_apply, whose thread ends, reports a
    KeyError for the missing result)."""
    outer, _local.launch = current_launch(), state.get("launch")
    try:
        with ExitStack() as stack:
            enter_state(stack, state, device)
            if not isinstance(inp, (list, tuple)):
                inp = (inp,)
            return module(*inp, **kwargs)
    except Exception:
        return _wrapped_error(i, device)
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller (raise_first_error)
        return _Raised(e, i, device)
    finally:
        _local.launch = outer


def run_in_turn(
    modules: Sequence[Module],
    inputs: Sequence[Any],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[torch.device],
) -> list[Any]:
    """The ``inline`` strategy: each replica in turn on the caller's thread.

    Here the state ``capture_state`` reads (grad and inference mode, autocast, every device's
    current stream) is in force already, so an accelerator replica only enters its device (whose
    current stream on this thread is the caller's). Errors are wrapped as ``run_replica`` wraps
    them, so every replica runs, as on threads, and ``raise_first_error`` picks the same error. A
    KeyboardInterrupt propagates at once, with nothing left running (later replicas do not run).
    """
    out = []
    for i, module in enumerate(modules):
        inp, device = inputs[i], devices[i]
        if not isinstance(inp, (list, tuple)):
            inp = (inp,)
        try:
            if device.type == "cuda":
                with torch.cuda.device(device.index):
                    out.append(module(*inp, **kwargs[i]))
            elif device.type != "cpu":
                with torch.accelerator.device_index(device.index):
                    out.append(module(*inp, **kwargs[i]))
            else:
                out.append(module(*inp, **kwargs[i]))
        except Exception:
            out.append(_wrapped_error(i, device))
    return out


def run_on_threads(
    modules: Sequence[Module],
    inputs: Sequence[Any],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[torch.device],
) -> list[Any]:
    """The ``threads`` strategy without a worker pool: one fresh thread per replica (torch's
    ``parallel_apply``), one replica on the caller's thread. The caller has waited for an
    interrupted call's stragglers (``wait_for_stragglers``)."""
    state = capture_state(devices)
    results: list[Any] = [None] * len(modules)

    def work(i: int) -> None:
        results[i] = run_replica(i, modules[i], inputs[i], kwargs[i], devices[i], state)

    if len(modules) > 1:
        threads = [
            threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(modules))
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                _join(t)
        except BaseException:  # KeyboardInterrupt: return at once, let the replicas finish alone
            _stragglers.extend(t for t in threads if t.is_alive())
            raise
    elif modules:
        work(0)
    return results


def raise_first_error(results: Sequence[Any]) -> None:
    """Re-raise the first replica error, preferring a BaseException that is no Exception (it
    ends the step as it would inline, on the caller's thread), then a replica's own error over
    ``ReplicaAborted``."""
    errors = [out for out in results if isinstance(out, ExceptionWrapper)]
    if errors:
        first = next((e for e in errors if isinstance(e, _Raised)), None) or next(
            (e for e in errors if not issubclass(e.exc_type, ReplicaAborted)), errors[0]
        )
        reraise(first)


def reraise(wrapper: ExceptionWrapper) -> None:
    """``wrapper.reraise()`` without its reference cycle.

    ``ExceptionWrapper.reraise`` keeps the exception in a local of its own frame, which the
    exception's traceback holds: a cycle that keeps the failed step (replicas, inputs, the wrapper
    and its workers) alive until the garbage collector runs. Clearing that finished frame breaks it.
    """
    try:
        wrapper.reraise()
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # skips frames still executing (this one)
        raise
