"""``python -m fastdp info``: what fastdp was built with, the accelerator it runs on and which
path each stage takes. ``fastdp.info()`` returns the same as a dict."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from fastdp import _backend
from fastdp._devices import accelerator_type
from fastdp._version import __version__

_STAGES = {
    "scatter": "scatter_chunks",
    "gather": "gather_into",
}
# NOTE [ Buckets ], ``_reducer.reduce_add``: the same engine whatever the extension does.
_ENGINE = (
    "engine: flat buckets; CPU transport (copies, sums); CUDA transport "
    "(torch's broadcast/reduce_add: NCCL between distinct GPUs, else copies)"
)


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def accelerator() -> tuple[str, int]:
    """The accelerator replicas run on and its device count: ``fastdp._devices``'s (CUDA when
    available, else ``torch.accelerator``'s current one); ``("none", 0)`` without one, a CUDA
    build without a GPU included."""
    kind = accelerator_type()
    return (kind, torch.accelerator.device_count()) if kind else ("none", 0)


def info() -> dict[str, Any]:
    """A dict describing this installation (see ``python -m fastdp info``)."""
    build = _backend.build_info()
    ext = _backend.ext()
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    backend = {stage: "extension" if ext is not None else "torch" for stage in _STAGES}
    backend.update(
        plan="python (torch.chunk sizes; NOTE [ DataParallel's chunking ])",
        refresh=_ENGINE,
        reduce=_ENGINE
        + (
            "; bucket node: C++ (csrc/bucket_reduce.cpp)"
            if ext
            else "; bucket node: Python (BucketReduce)"
        ),
    )
    kind, count = accelerator()
    return {
        "version": __version__,
        "torch": torch.__version__,
        "accelerator": kind,
        "accelerator_devices": count,
        "cuda": torch.version.cuda,
        "extension_loaded": _backend.loaded(),
        "extension_enabled": _backend.enabled(),
        "extension_error": _backend.load_error(),
        "built_with_cuda": build.get("built_with_cuda") == "1",
        "build_cuda_version": build.get("cuda_version") or None,
        "arch_list": build.get("arch_list") or None,
        "nccl": build.get("nccl_version") or _nccl_version(),
        "gpus": gpus,
        "backend": backend,
    }


def accelerator_line(d: dict[str, Any]) -> str:
    """``cuda, 2 devices``; ``none`` (``d``: ``info()``'s dict)."""
    kind, n = d["accelerator"], d["accelerator_devices"]
    return kind if kind == "none" else f"{kind}, {n} device{'s' if n != 1 else ''}"


def format_info(d: dict[str, Any]) -> str:
    lines = ["fastdp " + d["version"], f"  {'accelerator':<18} {accelerator_line(d)}"]
    for key, value in d.items():
        if key in ("version", "backend", "accelerator", "accelerator_devices"):
            continue
        lines.append(f"  {key:<18} {value}")
    lines.append("  backend (per stage):")
    for stage, path in d["backend"].items():
        lines.append(f"    {stage:<16} {path}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdp info", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the dict as JSON")
    args = p.parse_args(argv)
    d = info()
    print(json.dumps(d, indent=1, default=str) if args.json else format_info(d))
    return 0
