"""Build of torch-fastdp: one extension, ``fastdp._C``.

CUDA build whenever torch is a CUDA build and a CUDA toolkit is found (a GPU need not be visible);
CPU-only build otherwise.  Environment:

  FASTDP_FORCE_CPU=1    CPU-only build even where CUDA is possible.
  FASTDP_FORCE_CUDA=1   CUDA build or a loud failure saying why not.
  DEBUG=1               -O0 -g instead of -O3.
  NVCC_FLAGS            extra flags for nvcc.
  TORCH_CUDA_ARCH_LIST  archs to build for; without a visible GPU the default is
                        fastdp/_archs.py's default_archs (SASS 7.5-9.0 (+7.0 before CUDA 13,
                        +10.0;12.0 from CUDA 12.8) and PTX of the newest).
  CUDA_HOME             toolkit root; found from the nvcc on PATH when unset (wrapper scripts too).
"""

import glob
import os
import re
import runpy
import shutil
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# The arch-list decision, loaded by path: importing the fastdp package would need the extension.
_ARCHS = runpy.run_path(os.path.join(HERE, "fastdp", "_archs.py"))


def read_version() -> str:
    with open(os.path.join(HERE, "fastdp", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def _is_toolkit(root: str) -> bool:
    return os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")) and os.path.exists(
        os.path.join(root, "bin", "nvcc")
    )


def find_cuda_home() -> str | None:
    """The toolkit root. torch guesses dirname(dirname(which nvcc)), wrong for a wrapper script."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and _is_toolkit(os.environ[var]):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        real = os.path.realpath(nvcc)
        candidates.append(os.path.dirname(os.path.dirname(real)))
        try:
            with open(real, "rb") as f:
                head = f.read(4096)
            if head.startswith(b"#!"):  # a wrapper: look for the nvcc it execs
                for m in re.finditer(rb"(/[^\s\"']+)/bin/nvcc", head):
                    candidates.append(m.group(1).decode())
        except OSError:
            pass
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in candidates:
        if _is_toolkit(root):
            return root
    return None


FORCE_CPU = os.environ.get("FASTDP_FORCE_CPU", "0") == "1"
FORCE_CUDA = os.environ.get("FASTDP_FORCE_CUDA", "0") == "1"
if FORCE_CPU and FORCE_CUDA:
    sys.exit("setup.py: FASTDP_FORCE_CPU=1 and FASTDP_FORCE_CUDA=1 contradict each other")

_cuda_home = None if FORCE_CPU else find_cuda_home()
if _cuda_home:
    os.environ["CUDA_HOME"] = _cuda_home  # before cpp_extension reads it at import

import torch  # noqa: E402

# The oldest torch CI builds and tests (.ci/run stage 1: 2.11.0+cu130 with nvcc 13.0); keep in
# step with pyproject.toml's dependency and the README's Install section.
TORCH_FLOOR = (2, 11)
_tv = re.match(r"(\d+)\.(\d+)", torch.__version__)
if _tv is None or (int(_tv[1]), int(_tv[2])) < TORCH_FLOOR:
    sys.exit(
        f"setup.py: fastdp needs torch >= {TORCH_FLOOR[0]}.{TORCH_FLOOR[1]} (found "
        f"{torch.__version__}); pip install 'torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}' first"
    )

from torch.utils import cpp_extension  # noqa: E402


def want_cuda() -> bool:
    if FORCE_CPU:
        return False
    why_not = None
    if torch.version.cuda is None:
        why_not = f"torch {torch.__version__} is not a CUDA build"
    elif cpp_extension.CUDA_HOME is None or _cuda_home is None:
        why_not = "no CUDA toolkit found (set CUDA_HOME to the toolkit root)"
    if why_not and FORCE_CUDA:
        sys.exit(f"setup.py: FASTDP_FORCE_CUDA=1 but {why_not}")
    if why_not:
        print(f"fastdp: CPU-only build: {why_not}", file=sys.stderr)
    return why_not is None


def wheel_nvidia_dirs() -> tuple[list[str], list[str]]:
    """Headers and libraries that a pip CUDA torch ships in nvidia/* (cuBLAS, cuSPARSE, NCCL)."""
    incs, libs = [], []
    for site in sys.path:
        base = os.path.join(site, "nvidia")
        if not os.path.isdir(base):
            continue
        for sub in sorted(os.listdir(base)):
            if os.path.isdir(os.path.join(base, sub, "include")):
                incs.append(os.path.join(base, sub, "include"))
            if os.path.isdir(os.path.join(base, sub, "lib")):
                libs.append(os.path.join(base, sub, "lib"))
        break
    return incs, libs


# NOTE [ One libstdc++ ]
# A compiler driver that links libstdc++ statically (the GPU image's CXX=/opt/gcc/bin/g++
# does) puts a second libstdc++ inside fastdp._C whose locale facets are not the process's:
# the first error message that streams a number segfaults.
# Naming the process's own libstdc++ on the link line, ahead of the driver's libraries,
# resolves every std:: symbol to it (a NEEDED entry) and leaves nothing for a static copy.
def running_libstdcxx() -> str | None:
    """The libstdc++ this interpreter runs with (torch loaded it), from /proc/self/maps; Linux."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split(None, 5)[-1].strip()
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


def sources(with_cuda: bool) -> list[str]:
    srcs = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    if with_cuda:
        srcs += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
    return srcs


def make_extension():
    with_cuda = want_cuda()
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    macros = [("FASTDP_VERSION", f'"{read_version()}"')]
    extra = {"cxx": opt + ["-Wall", "-Wno-unused-function"]}
    include_dirs = [os.path.join(HERE, "csrc")]
    library_dirs, libraries, link_args = [], [], []
    libstdcxx = running_libstdcxx()
    if libstdcxx:  # NOTE [ One libstdc++ ]
        link_args.append(libstdcxx)
    if with_cuda:
        visible = torch.cuda.is_available() and torch.cuda.device_count() > 0
        cuda = _ARCHS["toolkit_cuda_version"](cpp_extension.CUDA_HOME, torch.version.cuda)
        chosen = _ARCHS["build_arch_list"](os.environ, cuda, visible)  # nvcc's archs, not torch's
        if chosen:
            os.environ["TORCH_CUDA_ARCH_LIST"] = chosen
            print(f"fastdp: no GPU visible, TORCH_CUDA_ARCH_LIST={chosen}", file=sys.stderr)
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "native")
        macros += [("WITH_CUDA", None), ("FASTDP_ARCH_LIST", f'"{archs}"')]
        extra["nvcc"] = opt + ["-lineinfo"] + os.environ.get("NVCC_FLAGS", "").split()
        incs, libs = wheel_nvidia_dirs()
        include_dirs += incs
        library_dirs += libs
        if any(os.path.exists(os.path.join(d, "libnccl.so.2")) for d in libs):
            link_args += ["-l:libnccl.so.2"]
            macros += [("FASTDP_WITH_NCCL", None)]
        elif any(os.path.exists(os.path.join(d, "libnccl.so")) for d in libs + ["/usr/lib64"]):
            libraries += ["nccl"]
            macros += [("FASTDP_WITH_NCCL", None)]
        link_args += [f"-Wl,-rpath,{d}" for d in libs]
        cls = cpp_extension.CUDAExtension
    else:
        macros += [("FASTDP_ARCH_LIST", '""')]
        cls = cpp_extension.CppExtension
    print(f"fastdp: building {'CUDA' if with_cuda else 'CPU-only'} extension", file=sys.stderr)
    return cls(
        name="fastdp._C",
        sources=sources(with_cuda),
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args=extra,
        library_dirs=library_dirs,
        libraries=libraries,
        extra_link_args=link_args,
    )


setup(
    name="torch-fastdp",
    version=read_version(),
    packages=find_packages(include=["fastdp", "fastdp.*"]),
    package_data={"fastdp": ["py.typed"]},  # PEP 561: users' type checkers read our hints
    ext_modules=[make_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
