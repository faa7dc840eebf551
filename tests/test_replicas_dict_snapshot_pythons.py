"""``csrc/dict_snapshot.cpp`` on every CPython this machine has (its dict version fast path):
the version-tag fast path is compiled below 3.13 and left out from 3.13 on, so its contract is
checked under each interpreter, built as a bare pybind11 module (torch is not needed there).
Interpreters: this one plus pyenv's 3.10+ (``$PYENV_ROOT`` or ``~/.pyenv``); skips without a
compiler."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

CSRC = Path(__file__).resolve().parents[1] / "csrc"

_MODULE = """
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include "dict_snapshot.h"
PYBIND11_MODULE(_ds, m) {
  pybind11::class_<fastdp::DictSnapshot>(
      m, "DictSnapshot", pybind11::custom_type_setup(&fastdp::dict_snapshot_type_setup))
      .def(pybind11::init<const pybind11::list&>())
      .def("changed", &fastdp::DictSnapshot::changed);
}
"""

# Attribute stores after the specializing interpreter has warmed up, new and deleted keys, a
# change undone, a plain dict, held references, a cycle through a snapshot, the type check.
_CHECK = """
import gc, sys, weakref
sys.path.insert(0, sys.argv[1])
from _ds import DictSnapshot as S
class M:
    def __init__(self):
        self.training = True
        self._parameters = {"w": object()}
        for i in range(20):
            setattr(self, f"a{i}", i)
def store(o, v):
    o.a3 = v
objs = [M() for _ in range(20)]
for k in range(3000):
    store(objs[k % 20], k)
for o in objs:
    d, p = o.__dict__, o._parameters
    s = S([d, p])
    o.training = True
    assert s.changed() == []
    first = o.a3
    store(o, object())
    assert s.changed() == [0]
    store(o, first)
    assert s.changed() == []
    o.new = 1
    assert s.changed() == [0]
    del o.new
    assert s.changed() == []
    p["w"] = object()
    assert s.changed() == [1]
    d["a5"] = "x"
    assert s.changed() == [0, 1]
class Box:
    pass
b = {"v": Box()}
gone = weakref.ref(b["v"])
s = S([b])
b["v"] = Box()
assert gone() is not None and s.changed() == [0]
del s
gc.collect()
assert gone() is None
o = Box()
o.payload = Box()
o.snap = S([o.__dict__])  # o.__dict__ -> snapshot -> o.__dict__: the collector must see it
payload = weakref.ref(o.payload)
del o
gc.collect()
assert payload() is None
try:
    S([1])
    raise AssertionError("no TypeError")
except TypeError:
    pass
print("ok")
"""


def _pythons() -> list[str]:
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = {os.path.realpath(sys.executable): sys.executable}
    for p in sorted(glob.glob(os.path.join(root, "versions", "3.*", "bin", "python3"))):
        minor = p.split("/versions/3.")[-1].split(".")[0]
        if minor.isdigit() and int(minor) >= 10:  # pyproject's requires-python
            found.setdefault(os.path.realpath(p), p)
    return list(found.values())


@pytest.mark.parametrize("python", _pythons(), ids=lambda p: p.split("/versions/")[-1])
def test_dict_snapshot_keeps_its_contract_under_each_python(python, tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    info = subprocess.run(
        [
            python,
            "-c",
            "import sysconfig as s; print(s.get_paths()['include']); "
            "print(s.get_config_var('EXT_SUFFIX'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    include, suffix = info.stdout.split()
    if not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip(f"{python} has no headers")
    (tmp_path / "mod.cpp").write_text(_MODULE)
    build = subprocess.run(
        [
            cxx,
            "-O1",
            "-shared",
            "-fPIC",
            "-std=c++17",
            "-Werror=deprecated-declarations",
            f"-I{include_paths()[0]}",
            f"-I{include}",
            f"-I{CSRC}",
            str(tmp_path / "mod.cpp"),
            str(CSRC / "dict_snapshot.cpp"),
            "-o",
            str(tmp_path / f"_ds{suffix}"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run(
        [python, "-c", _CHECK, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]
