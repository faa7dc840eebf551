"""``fastdp.install`` / ``uninstall`` and ``python -m fastdp.run`` (fastdp/install.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp import FastDataParallel

ORIGINAL = nn.DataParallel


@pytest.fixture(autouse=True)
def _restore():
    yield
    while fastdp.installed():
        fastdp.uninstall()
    assert nn.DataParallel is ORIGINAL


def test_install_patches_every_home_and_uninstall_restores():
    fastdp.install(device_ids=["cpu"] * 2)
    dpm = sys.modules["torch.nn.parallel.data_parallel"]
    assert nn.DataParallel is torch.nn.parallel.DataParallel is dpm.DataParallel
    assert issubclass(nn.DataParallel, FastDataParallel)
    fastdp.uninstall()
    assert nn.DataParallel is ORIGINAL and not fastdp.installed()


def test_defaults_fill_what_the_caller_did_not_pass():
    with fastdp.install(device_ids=["cpu"] * 2, launch="inline", scalar_outputs="mean"):
        m = nn.DataParallel(nn.Linear(3, 1))  # as HF Trainer calls it
        assert m.device_ids == [torch.device("cpu")] * 2 and m.launch == "inline"
        assert m.scalar_outputs == "mean"
        out = m(torch.randn(4, 3))
        assert out.shape == (4, 1)
        explicit = nn.DataParallel(nn.Linear(3, 1), device_ids=["cpu"] * 3)
        assert len(explicit.device_ids) == 3
    assert nn.DataParallel is ORIGINAL


def test_isinstance_checks_keep_working_both_ways():
    plain = FastDataParallel(nn.Linear(1, 1), device_ids=["cpu"] * 2)
    with fastdp.install(device_ids=["cpu"] * 2):
        made = nn.DataParallel(nn.Linear(1, 1))
        assert isinstance(plain, nn.DataParallel) and isinstance(made, nn.DataParallel)
        assert isinstance(made, ORIGINAL) and isinstance(made, FastDataParallel)
        assert fastdp.unwrap(made) is made.module
    assert isinstance(made, nn.DataParallel)


def test_installs_nest_and_are_thread_safe():
    with fastdp.install(launch="inline"):
        with fastdp.install(launch="threads"):
            assert nn.DataParallel.fastdp_defaults == {"launch": "threads"}
        assert nn.DataParallel.fastdp_defaults == {"launch": "inline"}
    threads = [
        threading.Thread(target=lambda: (fastdp.install(), fastdp.uninstall())) for _ in range(16)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert nn.DataParallel is ORIGINAL


SCRIPT = """
import sys, torch, torch.nn as nn
m = nn.DataParallel(nn.Linear(4, 2))
out = m(torch.randn(5, 4))
print(type(m).__module__, len(m.device_ids), tuple(out.shape), sys.argv[1:])
"""


def test_python_m_fastdp_run_runs_an_unchanged_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cmd = [
        sys.executable,
        "-m",
        "fastdp.run",
        "--device-ids",
        "cpu,cpu",
        str(script),
        "--flag",
        "x",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["fastdp.install", "2", "(5,", "2)", "['--flag',", "'x']"]
