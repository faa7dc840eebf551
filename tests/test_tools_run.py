"""``python -m fastdp run`` runs a script as ``python`` does (``fastdp/install.py``): each test runs
both in a subprocess started in another working directory and compares what the script sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from models import ROOT

PROBE = """
import json, os, pickle, sys
import helper  # a sibling module of the script, or of the module's folder

class Point:  # defined in __main__: pickling it needs __main__ to be this module
    pass

print(json.dumps({
    "argv": sys.argv, "path0": os.path.realpath(sys.path[0]), "name": __name__,
    "file": os.path.realpath(__file__), "helper": helper.VALUE,
    "main_is_this": sys.modules["__main__"].__dict__ is globals(),
    "pickles": type(pickle.loads(pickle.dumps(Point()))).__name__,
}))
"""


def _run(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _seen(args: list[str], cwd: str) -> dict:
    proc = _run(args, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def project(tmp_path):
    """A script with a sibling module in ``proj/``, and an unrelated working directory."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "proj" / "helper.py").write_text("VALUE = 42\n")
    (tmp_path / "proj" / "probe.py").write_text(textwrap.dedent(PROBE))
    return tmp_path


@pytest.mark.parametrize("command", [["-m", "fastdp", "run"], ["-m", "fastdp.run"]])
def test_script_sees_what_python_gives_it(project, command):
    script = str(project / "proj" / "probe.py")
    want = _seen([script, "--flag", "x"], cwd=str(project / "elsewhere"))
    got = _seen(
        [*command, "--device-ids", "cpu,cpu", script, "--flag", "x"], cwd=str(project / "elsewhere")
    )
    assert got == want
    assert got["path0"] == os.path.realpath(project / "proj") and got["helper"] == 42


def test_relative_script_path_is_argv0_as_given(project):
    want = _seen(["../proj/probe.py", "a"], cwd=str(project / "elsewhere"))
    got = _seen(["-m", "fastdp", "run", "../proj/probe.py", "a"], cwd=str(project / "elsewhere"))
    assert got == want and got["argv"] == ["../proj/probe.py", "a"]


def test_dash_m_runs_a_module_as_python_m_does(project):
    want = _seen(["-m", "probe", "--lr", "1"], cwd=str(project / "proj"))
    got = _seen(
        ["-m", "fastdp", "run", "--launch", "inline", "-m", "probe", "--lr", "1"],
        cwd=str(project / "proj"),
    )
    assert got == want and got["name"] == "__main__"


def test_script_exit_status_is_kept(project):
    (project / "proj" / "fail.py").write_text("import sys\nsys.exit(3)\n")
    assert (
        _run(["-m", "fastdp", "run", str(project / "proj" / "fail.py")], str(project)).returncode
        == 3
    )


def test_help_gives_the_whole_description(project):
    proc = _run(["-m", "fastdp", "run", "--help"], str(project))
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for phrase in (
        "sys.path[0]`` is the script's folder",
        "-m module",
        "a line on stderr says so.",
        "--scalar-outputs",
        "examples:",
    ):
        assert phrase in text


def test_no_dataparallel_built_is_said_in_one_line(project):
    (project / "proj" / "plain.py").write_text("print('ran')\n")
    proc = _run(
        ["-m", "fastdp", "run", "--device-ids", "cpu,cpu", str(project / "proj" / "plain.py")],
        str(project),
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ran"
    lines = [x for x in proc.stderr.splitlines() if "fastdp.run:" in x]
    assert len(lines) == 1 and "no nn.DataParallel was built" in lines[0]
    assert "more than one CUDA device" in lines[0]


def test_no_line_when_a_dataparallel_was_built(project):
    (project / "proj" / "dp.py").write_text(
        "import torch, torch.nn as nn\nnn.DataParallel(nn.Linear(2, 2))(torch.ones(4, 2))\n"
    )
    proc = _run(
        ["-m", "fastdp", "run", "--device-ids", "cpu,cpu", str(project / "proj" / "dp.py")],
        str(project),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no nn.DataParallel" not in proc.stderr
