"""State-dict interop: ``unwrap``, and ``load_state_dict`` taking ``module.``-prefixed or bare keys.

Bare keys (the plain module's names) are the interchange format:
``fastdp.unwrap(model).state_dict()`` saves them from FastDataParallel, ``nn.DataParallel`` and DDP
alike, and FSDP2's ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` returns them
too. ``FastDataParallel.load_state_dict`` accepts them as well as its own ``module.`` keys
(pytorch #3805), and keys saved through ``torch.compile`` (``_orig_mod.`` segments).
"""

from __future__ import annotations

import difflib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from torch.nn import DataParallel, Module
from torch.nn.modules.module import _IncompatibleKeys
from torch.nn.parallel import DistributedDataParallel

__all__ = ["unwrap", "load_wrapped_state_dict"]

_PREFIX = "module."
_MAX_DEPTH = 3
_COMPILED = "_orig_mod."  # torch.compile's OptimizedModule holds the module as _orig_mod


def unwrap(model: Module) -> Module:
    """The innermost module of FastDataParallel / ``nn.DataParallel`` / DDP / ``torch.compile``.

    Nested wrappers are peeled one after the other; anything else is returned as is. Its
    ``state_dict()`` has bare keys, loadable into the plain model, DDP's ``module`` and FSDP2.
    """
    while True:
        if isinstance(model, (DataParallel, DistributedDataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(
            getattr(model, "_orig_mod", None), Module
        ):
            model = model._orig_mod  # torch.compile's wrapper
        else:
            return model


def _best_depth(keys: list[str], expected: set[str]) -> int:
    """How many ``module.`` prefixes to strip so that most keys are expected keys."""
    best, best_score = 0, sum(k in expected for k in keys)
    for depth in range(1, _MAX_DEPTH + 1):
        prefix = _PREFIX * depth
        if not keys or not all(k.startswith(prefix) for k in keys):
            break
        score = sum(k[len(prefix) :] in expected for k in keys)
        if score > best_score:
            best, best_score = depth, score
    return best


def _strip(state_dict: Mapping[str, Any], depth: int) -> OrderedDict:
    prefix = _PREFIX * depth
    out = OrderedDict((k[len(prefix) :], v) for k, v in state_dict.items())
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        new_meta = OrderedDict()
        for k, v in meta.items():
            full = k + "."
            if full.startswith(prefix):
                new_meta[full[len(prefix) :].rstrip(".")] = v
        out._metadata = new_meta  # type: ignore[attr-defined]
    return out


def _without_compile_segments(state_dict: Mapping[str, Any], expected: list[str]) -> Any:
    """``torch.compile(FastDataParallel(m)).state_dict()`` keys read ``_orig_mod.module.x``;
    drop the segment where the model expects none (metadata too)."""
    if any(_COMPILED in k for k in expected) or not any(_COMPILED in k for k in state_dict):
        return state_dict
    out = OrderedDict((k.replace(_COMPILED, ""), v) for k, v in state_dict.items())
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            ((k + ".").replace(_COMPILED, "").rstrip("."), v) for k, v in meta.items()
        )
    return out


def _near(key: str, candidates: list[str], what: str, prefix: str) -> str:
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.5)
    return f" ({what}: {', '.join(repr(prefix + c) for c in close)})" if close else ""


def load_wrapped_state_dict(
    wrapper: Module, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> _IncompatibleKeys:
    """``wrapper.load_state_dict`` for a wrapper holding ``wrapper.module``; keys with any number
    of ``module.`` prefixes (up to 3) or none. Returns DataParallel-style (``module.``) key names.
    """
    inner: Module = wrapper.module
    expected = list(inner.state_dict().keys())
    state_dict = _without_compile_segments(state_dict, expected)
    keys = list(state_dict.keys())
    depth = _best_depth(keys, set(expected))
    result = inner.load_state_dict(_strip(state_dict, depth), strict=False, assign=assign)
    missing = [_PREFIX + k for k in result.missing_keys]
    unexpected = [_PREFIX + k for k in result.unexpected_keys]
    if strict and (result.missing_keys or result.unexpected_keys):
        shown = _PREFIX * depth
        lines = []
        if result.unexpected_keys:
            pool = result.missing_keys or expected
            lines.append(
                "Unexpected key(s) in state_dict: "
                + "; ".join(
                    f'"{shown + k}"{_near(k, pool, "nearest expected", shown)}'
                    for k in result.unexpected_keys
                )
                + "."
            )
        if result.missing_keys:
            given = [k[len(shown) :] for k in keys]
            lines.append(
                "Missing key(s) in state_dict: "
                + "; ".join(
                    f'"{shown + k}"{_near(k, given, "nearest in the checkpoint", shown)}'
                    for k in result.missing_keys
                )
                + "."
            )
        how = "bare keys" if depth == 0 else f"keys with the prefix {shown!r}"
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(wrapper).__name__} (read as {how}):\n\t"
            + "\n\t".join(lines)
        )
    return _IncompatibleKeys(missing, unexpected)
