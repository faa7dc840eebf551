"""The build: what was compiled, backend loading, ``fastdp.info()``, ``python -m fastdp.info``."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import fastdp
from fastdp import _backend


def test_info_has_the_documented_keys():
    d = fastdp.info()
    for key in (
        "version",
        "torch",
        "cuda",
        "built_with_cuda",
        "arch_list",
        "nccl",
        "gpus",
        "backend",
    ):
        assert key in d
    assert d["version"] == fastdp.__version__ and d["torch"] == torch.__version__
    assert set(d["backend"]) >= {"plan", "scatter", "gather", "refresh", "reduce"}


def test_extension_is_built_and_loaded():
    if os.environ.get("FASTDP_DISABLE_EXT") == "1":
        pytest.skip("FASTDP_DISABLE_EXT=1")
    assert _backend.loaded(), _backend.load_error()
    assert fastdp.info()["backend"]["scatter"] == "extension"


@pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("readelf") is None,
    reason="reads the ELF dynamic section with readelf (Linux)",
)
def test_the_extension_links_the_processes_libstdcxx():
    """NOTE [ One libstdc++ ] in setup.py: a driver that linked libstdc++ statically (the GPU
    image's CXX wrapper) gave fastdp._C its own copy, and the first TORCH_CHECK message with a
    number in it segfaulted. The library must be a NEEDED entry, not a copy inside."""
    if not _backend.loaded():
        pytest.skip(f"fastdp._C is not loaded: {_backend.load_error()}")
    so = _backend.ext().__file__
    needed = subprocess.run(
        ["readelf", "-d", so], capture_output=True, text=True, check=True
    ).stdout
    assert "[libstdc++.so" in needed, needed
    syms = subprocess.run(
        ["readelf", "-W", "--dyn-syms", so], capture_output=True, text=True, check=True
    ).stdout
    assert "_ZNSo9_M_insertImEERSoT_" not in [
        ln.split()[-1] for ln in syms.splitlines() if " FUNC " in ln and " UND " not in ln
    ]


def test_expected_build_flavour():
    """CI sets FASTDP_EXPECT_CUDA_BUILD=1 for the CUDA-torch build (no GPU), 0 for the CPU one."""
    expect = os.environ.get("FASTDP_EXPECT_CUDA_BUILD")
    if expect is None:
        pytest.skip("FASTDP_EXPECT_CUDA_BUILD not set")
    d = fastdp.info()
    assert d["built_with_cuda"] is (expect == "1")
    if expect == "1":
        assert d["arch_list"] and d["build_cuda_version"]


def test_disable_ext_env_forces_the_torch_path():
    code = "import fastdp, json; print(json.dumps(fastdp.info()['backend']))"
    env = dict(os.environ, FASTDP_DISABLE_EXT="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert '"scatter": "torch"' in out


def test_python_m_fastdp_info_prints_readably():
    out = subprocess.run(
        [sys.executable, "-m", "fastdp.info"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("fastdp ") and "built_with_cuda" in out.stdout
    assert "RuntimeWarning" not in out.stderr


def test_info_and_the_doctor_name_the_accelerator():
    """Here no accelerator (``none``) on the CPU; tests/accel names the test device."""
    from fastdp._devices import accelerator_type
    from fastdp.commands.doctor import doctor, format_report

    kind = accelerator_type() or "none"
    count = torch.accelerator.device_count() if kind != "none" else 0
    out = subprocess.run(
        [sys.executable, "-m", "fastdp", "info"], capture_output=True, text=True, check=True
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("  accelerator "))
    words = (
        [kind] if kind == "none" else [f"{kind},", str(count), "devices" if count > 1 else "device"]
    )
    assert line.split()[1:] == words
    report = doctor(only="no check has this name")
    assert (report["info"]["accelerator"], report["info"]["accelerator_devices"]) == (kind, count)
    assert f"accelerator: {' '.join(words)}" in format_report(report).splitlines()


def test_a_cuda_build_without_a_gpu_is_no_accelerator(monkeypatch):
    """torch.accelerator names CUDA in a CUDA build with no GPU: fastdp's accelerator is none."""
    from fastdp.commands.info import accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    assert accelerator() == ("none", 0)


def test_broken_build_warns_once_and_falls_back(tmp_path):
    """A _C that fails to import: one warning with the real error, then the torch path works."""
    pkg = tmp_path / "fastdp"
    src = os.path.dirname(fastdp.__file__)
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__", "bench"))
    (pkg / "_C.py").write_text("raise ImportError('simulated broken build')\n")
    code = (
        "import warnings, torch, fastdp\n"
        "from fastdp import FastDataParallel\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    m = FastDataParallel(torch.nn.Linear(2, 2), device_ids=['cpu'] * 2)\n"
        "    m(torch.ones(4, 2)); m(torch.ones(4, 2))\n"
        "msgs = [str(x.message) for x in w if 'could not be loaded' in str(x.message)]\n"
        "print(len(msgs), msgs[0])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert out.startswith("1 ") and "simulated broken build" in out


def test_a_stale_build_missing_a_function_counts_as_not_loaded() -> None:
    """fastdp/_backend.py decides in one place: no call site asks the extension what it has."""
    import subprocess
    import sys

    code = (
        "import sys, types; fake = types.ModuleType('fastdp._C'); "
        "fake.build_info = lambda: []; sys.modules['fastdp._C'] = fake; "
        "from fastdp import _backend; import fastdp; "
        "assert _backend.ext() is None and not _backend.loaded(); "
        "print(_backend.load_error())"
    )
    r = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stale build of fastdp._C lacks scatter_chunks, gather_into" in r.stdout


@pytest.mark.parametrize(
    "pattern, where",
    [
        (r"^DTYPES = ", "fastdp"),  # fastdp/_backend.py
        (r"#define FASTDP_PY_HIDDEN\b", "csrc"),  # csrc/py_hidden.h
        (r'ignored "-Winterference-size"', "csrc"),  # csrc/cuda/torch_cuda_headers.h
    ],
)
def test_shared_definitions_are_written_once(pattern, where):
    """Defined in one file, included or imported by the others."""
    root = pathlib.Path(__file__).resolve().parents[1] / where
    files = [
        str(f.relative_to(root))
        for f in sorted(root.rglob("*"))
        if f.suffix in (".py", ".h", ".cpp", ".cu")
        and re.search(pattern, f.read_text(), re.MULTILINE)
    ]
    assert len(files) == 1, files


def _clang_format() -> str | None:
    """The clang-format of this interpreter's environment (CI's CPU venv pins the PyPI wheel)."""
    beside = os.path.join(os.path.dirname(sys.executable), "clang-format")
    return beside if os.path.exists(beside) else shutil.which("clang-format")


@pytest.mark.skipif(_clang_format() is None, reason="clang-format is not installed here")
def test_csrc_follows_the_checked_in_clang_format_style():
    root = pathlib.Path(__file__).resolve().parents[1]
    files = sorted(str(f) for f in (root / "csrc").rglob("*") if f.suffix in (".h", ".cpp", ".cu"))
    r = subprocess.run(
        [_clang_format(), "--dry-run", "-Werror", *files], capture_output=True, text=True, cwd=root
    )
    assert (root / ".clang-format").is_file() and r.returncode == 0, r.stderr[-3000:]
