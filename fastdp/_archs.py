"""Which CUDA archs a build compiles for: the decision ``setup.py`` makes, testable on its own.

Pure Python without torch, so that ``setup.py`` can load it by path before importing anything.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping


def default_archs(cuda_version: str) -> str:
    """The arch list of a build made where no GPU is visible.

    SASS for the common data-centre and workstation GPUs, plus PTX of the newest, which the driver
    JIT-compiles on anything newer (a build without PTX has no kernel image there). CUDA 13
    dropped Volta (sm_70); Blackwell SASS needs CUDA 12.8.
    """
    major, minor = (int(x) for x in (cuda_version.split(".") + ["0"])[:2])
    ver = (major, minor)
    archs = ["7.5", "8.0", "8.6"] if ver >= (13, 0) else ["7.0", "7.5", "8.0", "8.6"]
    archs.append("9.0")
    if ver >= (12, 8):
        archs += ["10.0", "12.0"]
    archs[-1] += "+PTX"
    return ";".join(archs)


def build_arch_list(env: Mapping[str, str], cuda_version: str, gpu_visible: bool) -> str | None:
    """The TORCH_CUDA_ARCH_LIST setup.py sets, or None to leave it to torch.

    None when the user chose (``TORCH_CUDA_ARCH_LIST`` set) or a GPU is visible (torch then builds
    for the visible GPUs, with PTX of the newest). Otherwise ``default_archs(cuda_version)``:
    torch's own default fails without a visible GPU.
    """
    if env.get("TORCH_CUDA_ARCH_LIST") or gpu_visible:
        return None
    return default_archs(cuda_version)


def nvcc_release(text: str) -> str | None:
    """``"13.0"`` from ``nvcc --version``'s output (``Cuda compilation tools, release 13.0``)."""
    m = re.search(r"release (\d+)\.(\d+)", text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def toolkit_cuda_version(cuda_home: str | None, torch_cuda: str) -> str:
    """The CUDA version the default arch list must follow: the compiler's, which may be older
    than torch's (torch cu128 with nvcc 12.6 cannot compile sm_100/sm_120); torch's when nvcc
    cannot be asked."""
    if cuda_home:
        try:
            out = subprocess.run(
                [f"{cuda_home}/bin/nvcc", "--version"], capture_output=True, text=True, timeout=60
            ).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        found = nvcc_release(out)
        if found:
            return found
    return torch_cuda
