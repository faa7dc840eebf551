"""The CUDA build's decisions, checked on any machine: the default arch list (Volta to Blackwell,
PTX of the newest, following nvcc's CUDA version rather than torch's), the event header the
sources use, and the torch floor setup.py enforces. The nvcc compile check needs nvcc.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastdp._archs import build_arch_list, default_archs


@pytest.mark.parametrize("cuda", ["11.8", "12.6", "12.8", "13.0"])
def test_default_archs_cover_volta_to_blackwell_with_ptx(cuda: str) -> None:
    archs = default_archs(cuda).split(";")
    newest = archs[-1]
    assert newest.endswith("+PTX"), archs  # JIT on GPUs newer than the newest SASS
    assert {"7.5", "8.0", "8.6"} <= set(archs)
    assert float(newest.removesuffix("+PTX")) >= 9.0
    major = int(cuda.split(".")[0])
    assert ("7.0" in archs) == (major < 13)  # CUDA 13 dropped Volta (sm_70)


def test_arch_list_decision() -> None:
    assert build_arch_list({"TORCH_CUDA_ARCH_LIST": "9.0"}, "13.0", gpu_visible=False) is None
    assert build_arch_list({}, "13.0", gpu_visible=True) is None  # torch: the visible GPUs
    assert build_arch_list({}, "13.0", gpu_visible=False) == default_archs("13.0")


def test_default_archs_are_valid_for_torchs_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.cpp_extension import _get_cuda_arch_flags

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", default_archs("13.0"))
    flags = _get_cuda_arch_flags()
    assert "-gencode=arch=compute_120,code=compute_120" in flags  # PTX of the newest
    assert "-gencode=arch=compute_75,code=sm_75" in flags
    assert "-gencode=arch=compute_90,code=sm_90" in flags


def _nvcc() -> str | None:
    import shutil

    home = os.environ.get("CUDA_HOME")
    path = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    return path if path and os.path.exists(path) else None


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc on this machine")
def test_default_archs_compile_with_this_nvcc(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from torch.utils.cpp_extension import _get_cuda_arch_flags

    nvcc = _nvcc()
    release = re.search(
        r"release (\d+\.\d+)",
        subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout,
    ).group(1)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", default_archs(release))
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* x) { x[threadIdx.x] += 1.f; }\n")
    r = subprocess.run(
        [nvcc, "-c", str(src), "-o", str(tmp_path / "k.o"), *_get_cuda_arch_flags()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_default_archs_follow_nvcc_not_torch(tmp_path) -> None:
    """torch cu128 with nvcc 12.6 must not ask for compute_100/120 (nvcc 12.6 has neither)."""
    from fastdp._archs import nvcc_release, toolkit_cuda_version

    assert nvcc_release("Cuda compilation tools, release 12.6, V12.6.85") == "12.6"
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.6, V12.6.85'\n")
    nvcc.chmod(0o755)
    version = toolkit_cuda_version(str(tmp_path), "12.8")
    assert version == "12.6"
    assert "10.0" not in default_archs(version) and "12.0" not in default_archs(version)
    assert toolkit_cuda_version(None, "12.8") == "12.8"  # no toolkit to ask: torch's


def test_cuda_sources_use_the_long_standing_event_header() -> None:
    """c10/cuda/CUDAEvent.h and c10::cuda::CUDAEvent exist only from torch 2.11;
    ATen/cuda/CUDAEvent.h and at::cuda::CUDAEvent for years."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    for f in root.rglob("*"):
        if f.suffix in (".h", ".cpp", ".cu"):
            text = f.read_text()
            assert "<c10/cuda/CUDAEvent.h>" not in text and "c10::cuda::CUDAEvent" not in text, f


def test_setup_stops_below_the_torch_floor(tmp_path) -> None:
    """Below the declared floor setup.py stops with one clear line."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.4.0+cu121'\n")
    env = {k: v for k, v in os.environ.items() if k != "FASTDP_FORCE_CUDA"}  # CI's CUDA stage
    env.update(PYTHONPATH=str(tmp_path), FASTDP_FORCE_CPU="1")
    r = subprocess.run(
        [sys.executable, str(root / "setup.py"), "--version"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "fastdp needs torch >= 2.11 (found 2.4.0+cu121)" in r.stderr, r.stderr
    floor = re.search(r'"torch>=([\d.]+)"', (root / "pyproject.toml").read_text())[1]
    assert floor == "2.11"
