"""``python -m fastdp.doctor``: passes on this machine, fails naming the check and the switch when a
path is broken on purpose, and writes the same report as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import fastdp
from fastdp import _backend
from fastdp._doctor import main

needs_ext = pytest.mark.skipif(not _backend.loaded(), reason="fastdp._C is not built")


def test_doctor_passes_here_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "doctor.json"
    assert main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] is True
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["training parity cpu"] == "PASS"
    if _backend.loaded():
        assert statuses["scatter pageable -> cpu"] == "PASS"
        assert statuses["gather cpu -> cpu"] == "PASS"
    if not torch.cuda.is_available():
        assert statuses["p2p matrix"] == "SKIP"
        assert "GPU checks were skipped" in capsys.readouterr().out


def test_doctor_function_returns_the_report() -> None:
    report = fastdp.doctor("training parity cpu")
    assert [c["name"] for c in report["checks"]] == ["training parity cpu"]
    assert report["checks"][0]["status"] == "PASS" and report["ok"]


class _FlipsAByte:
    """The extension, with its scatter flipping one byte of the first chunk."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def scatter_chunks(self, *args):
        out = [[t.clone() for t in row] for row in self._real.scatter_chunks(*args)]
        x = out[0][0]
        if x.is_contiguous() and x.numel() and x.dtype.itemsize == 4:
            x.view(torch.uint8).view(-1)[:1].bitwise_xor_(1)
        return out


@needs_ext
def test_doctor_fails_on_a_wrong_byte_naming_the_check_and_the_switch(monkeypatch, capsys) -> None:
    monkeypatch.setattr(_backend, "_ext", _FlipsAByte(_backend._ext))
    assert main(["-k", "pageable -> cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  scatter pageable -> cpu" in out
    assert "values differ at 1 element(s)" in out
    assert "FAILED scatter pageable -> cpu: set FASTDP_DISABLE_EXT=1" in out


def test_doctor_runs_as_a_module_with_the_extension_disabled() -> None:
    env = {"FASTDP_DISABLE_EXT": "1"}
    r = subprocess.run([sys.executable, "-m", "fastdp.doctor", "-k", "cpu"], capture_output=True,
                       text=True, timeout=300, env={**__import__("os").environ, **env})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SKIP  scatter pageable -> cpu" in r.stdout and "FASTDP_DISABLE_EXT=1" in r.stdout
    assert "PASS  training parity cpu" in r.stdout
