"""A method of the module on every replica: ``FastDataParallel.generate`` and ``call_method``.

The step is forward's (plan, scatter, refresh, launch, gather: ``FastDataParallel._forward``)
with each replica's bound method in the place of its forward (``fastdp._runners.BoundMethod``).
What differs lives here: the checks made before the step, and ``generate``'s gather.

``generate``'s gather (docs/features.md, *Generation and any method*): sequences of different
lengths are right-padded with the pad token (the call's ``pad_token_id``, else its
``generation_config``'s, else the module's; else the EOS token in the same order), per-step
tuples (``scores``, ``logits``, attentions, hidden states) padded with zeros over the steps a
replica did not take, ``beam_indices`` with -1 and shifted to index the gathered rows, the cache
returned as a list of each replica's; every other field gathered as ``forward``'s outputs are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn import Module

from fastdp import _tree
from fastdp._planner import batch_size, flatten_inputs
from fastdp.scatter_gather import gather

__all__ = ["MethodCall", "generate_call", "method_call"]

Gather = Callable[[list[Any], Sequence[Any], Sequence[Any], torch.device], Any]

# per-step tuples (one entry per generated token): padded over missing steps
_STEP_FIELDS = (
    "scores",
    "logits",
    "attentions",
    "hidden_states",
    "decoder_attentions",
    "cross_attentions",
    "decoder_hidden_states",
)
_CACHE_FIELDS = ("cache", "past_key_values")  # each replica's own, on its device
# generate's arguments that cannot be split over replicas (a shared object each would write)
_REFUSED = {
    "streamer": "each replica would write its rows into the one streamer",
    "assistant_model": "assisted decoding runs one assistant model for a batch of one",
    "past_key_values": "a cache holds the whole batch on one device",
}


class MethodCall:
    """What a step that calls ``name`` on every replica needs beyond forward's walk: the name,
    and a gather of its own (None: the wrapper's ``gather`` seam, forward's rules)."""

    __slots__ = ("name", "label", "gather")

    def __init__(self, name: str, gather: Gather | None = None) -> None:
        self.name = name
        self.label = f"FastDataParallel.{name}"  # the step's profiler label
        self.gather = gather  # (outputs, each replica's inputs, kwargs, output device) -> result


def method_call(
    module: Module, name: str, args: tuple, kwargs: dict, dim: int, n_devices: int
) -> MethodCall:
    """The call of ``module``'s method ``name`` on every replica, after its checks: the
    ``AttributeError`` of a module without it (naming the module's class), a ``TypeError`` for
    an attribute that is not callable, and on several devices a ``ValueError`` for inputs of
    different batch sizes."""
    if not isinstance(name, str):
        raise TypeError(f"fastdp: call_method takes the method's name, got {type(name).__name__}")
    if not callable(getattr(module, name)):  # Module.__getattr__ names the class
        raise TypeError(f"fastdp: {type(module).__name__}.{name} is not a method")
    if n_devices > 1:
        check_batch(args, kwargs, dim)
    return MethodCall(name)


def generate_call(
    module: Module, args: tuple, kwargs: dict, dim: int, n_devices: int
) -> MethodCall:
    """``generate`` on every replica: ``method_call``'s checks, the batch along dim 0, none of
    ``_REFUSED`` on several devices, and the gather that pads (the module docstring)."""
    call = method_call(module, "generate", args, kwargs, dim, 1)  # the method's own checks
    if n_devices > 1:
        if dim != 0:
            raise ValueError(f"fastdp: generate splits the batch along dim 0, not {dim}")
        check_batch(args, kwargs, 0)
        for key, why in _REFUSED.items():
            if kwargs.get(key) is not None:
                raise ValueError(
                    f"fastdp: generate({key}=...) is not supported on several replicas ({why}); "
                    "call model.module.generate(...) for it"
                )
        if batch_size((args, kwargs), 0) is None:
            raise ValueError(
                "fastdp: generate splits the batch of its tensor inputs, and none was given; "
                "pass input_ids (or the model's input tensor)"
            )
    call.gather = lambda outputs, inputs, kws, device: gather_generated(
        outputs, [_rows(i, k) for i, k in zip(inputs, kws)], device, _Settings(module, kwargs)
    )
    return call


def check_batch(args: tuple, kwargs: dict, dim: int) -> None:
    """Every tensor input has the same size along ``dim`` (the batch), else a ``ValueError``
    naming each input and its rows. Tensors without ``dim`` are left to the scatter's errors."""
    spec, leaves = flatten_inputs(args, kwargs)
    sizes = {i: t.shape[dim] for i, t in enumerate(leaves) if -t.dim() <= dim < t.dim()}
    if len(set(sizes.values())) < 2:
        return
    names = _tree.paths(spec, "", {}) if spec is not None else {}
    where = ", ".join(f"{_name(names.get(i), i)} ({n} rows)" for i, n in sizes.items())
    raise ValueError(
        f"fastdp: every tensor input of one call must have the same rows along dim {dim}, but "
        f"{where} differ; each replica takes the same rows of every input"
    )


def _name(path: str | None, i: int) -> str:
    """A leaf's path as the caller wrote it: ``args[0]``, ``kwargs['attention_mask']``."""
    if path is None:
        return f"args[{i}]"
    kind, _, rest = path.partition("]")  # "[0][1]..." -> args, "[1]['mask']..." -> kwargs
    return ("args" if kind == "[0" else "kwargs") + rest


def _rows(inputs: Any, kwargs: Any) -> int:
    rows = batch_size((inputs, kwargs), 0)
    return 1 if rows is None else rows


class _Settings:
    """The generation settings the gather needs, read as ``generate`` reads them: the call's
    keyword, else its ``generation_config``'s, else the module's ``generation_config``."""

    def __init__(self, module: Module, kwargs: dict) -> None:
        self.kwargs = kwargs
        self.configs = [kwargs.get("generation_config"), getattr(module, "generation_config", None)]

    def get(self, key: str) -> Any:
        if self.kwargs.get(key) is not None:
            return self.kwargs[key]
        for cfg in self.configs:
            if getattr(cfg, key, None) is not None:
                return getattr(cfg, key)
        return None

    def pad_token(self) -> int:
        pad = self.get("pad_token_id")
        if pad is None:
            pad = self.get("eos_token_id")
        if isinstance(pad, torch.Tensor):
            pad = pad.flatten().tolist()
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
        if pad is None:
            raise ValueError(
                "fastdp: the replicas generated sequences of different lengths, and there is no "
                "pad_token_id (nor eos_token_id) to right-pad them with; pass pad_token_id=... "
                "to generate or set model.generation_config.pad_token_id"
            )
        return int(pad)


def gather_generated(
    outputs: list[Any], rows: list[int], device: torch.device, settings: _Settings
) -> Any:
    """The replicas' ``generate`` outputs as one: a tensor of sequences, or a ``ModelOutput``
    (the module docstring); any other output gathered as forward's."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return gather(_pad_right(outputs, settings.pad_token), device)
    if not isinstance(first, Mapping):
        return gather(outputs, device)
    parts: list[dict[str, Any]] = [{} for _ in outputs]
    caches: dict[str, list[Any]] = {}
    for key in first.keys():
        values = [o.get(key) for o in outputs]
        if key in _CACHE_FIELDS:
            caches[key] = values
            continue
        if key == "sequences":
            values = _pad_right(values, settings.pad_token)
        elif key == "beam_indices":
            values = _beam_indices(values, rows, int(settings.get("num_beams") or 1))
        elif key in _STEP_FIELDS and isinstance(values[0], tuple):
            values = _pad_steps(values, rows)
        for part, v in zip(parts, values):
            part[key] = v
    out = gather(parts, device) if parts[0] else {}
    return type(first)(**out, **caches)


def _pad_right(tensors: list[torch.Tensor], pad: Callable[[], int]) -> list[torch.Tensor]:
    """Sequences of different lengths (dim 1) right-padded to the longest with ``pad()``."""
    longest = max(t.shape[1] for t in tensors)
    if all(t.shape[1] == longest for t in tensors):
        return tensors
    value = pad()
    return [torch.nn.functional.pad(t, (0, longest - t.shape[1]), value=value) for t in tensors]


def _beam_indices(values: list[torch.Tensor], rows: list[int], beams: int) -> list[torch.Tensor]:
    """Each replica's ``beam_indices`` (rows of its own batch's ``scores``; -1: no step) padded
    with -1 and shifted by the rows of the replicas before it, so they index the gathered
    ``scores`` as one ``generate`` over the whole batch would."""
    longest = max(t.shape[1] for t in values)
    out, offset = [], 0
    for t, n in zip(values, rows):
        t = torch.nn.functional.pad(t, (0, longest - t.shape[1]), value=-1)
        out.append(torch.where(t >= 0, t + offset, t))
        offset += n * beams
    return out


def _pad_steps(values: list[tuple], rows: list[int]) -> list[tuple]:
    """Per-step tuples padded to the most steps with zeros shaped as the longest replica's
    entry of that step, with this replica's rows."""
    longest = max(range(len(values)), key=lambda r: len(values[r]))
    like, ref_rows = values[longest], rows[longest]
    out = []
    for steps, n in zip(values, rows):
        extra = tuple(_zeros(like[s], n, ref_rows) for s in range(len(steps), len(like)))
        out.append(tuple(steps) + extra)
    return out


def _zeros(like: Any, rows: int, ref_rows: int) -> Any:
    """Zeros shaped as ``like`` (a tensor, or nested tuples of them: a step's layers), with
    ``rows`` batch rows where ``like`` has ``ref_rows`` (beams and returned sequences kept)."""
    if isinstance(like, tuple):
        return tuple(_zeros(x, rows, ref_rows) for x in like)
    per_row = like.shape[0] // max(ref_rows, 1)
    return like.new_zeros((rows * per_row, *like.shape[1:]))
