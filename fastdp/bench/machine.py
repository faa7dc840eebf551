"""What the figures were measured on: machine, versions, fastdp commit, command and date."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys

import torch

import fastdp


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> dict:
    if not torch.cuda.is_available():
        return {"count": 0, "names": [], "driver": None}
    n = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    peer = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
    return {
        "count": n,
        "names": [p.name for p in props],
        "memory_gib": [round(p.total_memory / 2**30, 1) for p in props],
        "capability": [f"{p.major}.{p.minor}" for p in props],
        "driver": smi.splitlines()[0] if smi else None,
        "peer_access": peer,
    }


def git_commit() -> dict:
    """The commit of the checkout fastdp was imported from (None outside a git checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastdp.__file__)))
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if commit is None:
        return {"commit": None, "dirty": None}
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return {"commit": commit, "dirty": bool(dirty)}


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


ENV_PREFIXES = ("FASTDP_", "OMP_", "MKL_", "CUDA_VISIBLE")  # the variables a run records


def describe(argv: list[str]) -> dict:
    try:
        info = fastdp.info()
    except Exception as e:  # the info report must never stop a benchmark
        info = {"error": f"{type(e).__name__}: {e}"}
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m fastdp.bench" + (" " + shlex.join(argv) if argv else ""),
        "argv": list(argv),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "cores_usable": len(affinity(0)) if affinity else os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "gpu": gpus(),
        },
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "fastdp": {"version": fastdp.__version__, **git_commit(), "info": info},
        "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
    }
