"""``python -m fastdp COMMAND``: every command answers ``--help``, the module entry points keep
working, and ``fastdp.info`` / ``fastdp.doctor`` stay callable whichever import came first."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = ("info", "doctor", "run", "bench")


def _py(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", COMMANDS)
def test_python_m_fastdp_command_help(command):
    proc = _py("-m", "fastdp", command, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: python -m fastdp {command}")


@pytest.mark.parametrize("command", COMMANDS)
def test_module_entry_point_still_works(command):
    proc = _py("-m", f"fastdp.{command}", "--help")
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


def test_python_m_fastdp_lists_the_commands_and_rejects_others():
    proc = _py("-m", "fastdp", "--help")
    assert proc.returncode == 0 and all(c in proc.stdout for c in COMMANDS)
    assert _py("-m", "fastdp", "nope").returncode == 2


def test_info_prints_the_version():
    import fastdp

    proc = _py("-m", "fastdp", "info")
    assert proc.returncode == 0 and proc.stdout.startswith(f"fastdp {fastdp.__version__}")


@pytest.mark.parametrize(
    "code",
    [
        "import fastdp.info; import fastdp; assert fastdp.info()['version']",
        "import fastdp; fastdp.info(); import fastdp.info; assert fastdp.info()['version']",
        "from fastdp import info; import fastdp.info; assert info()['version']",
        "import fastdp.doctor, fastdp; assert callable(fastdp.doctor) and callable(fastdp.info)",
        "import fastdp.doctor as d; from fastdp.commands.doctor import doctor; assert d is doctor",
        "import fastdp.info, fastdp.commands.info as m; assert fastdp.info is m.info",
    ],
)
def test_modules_named_as_functions_stay_callable(code):
    proc = _py("-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_commands_live_in_their_subpackage():
    """``python -m fastdp X`` runs ``fastdp.commands.X``; no command module beside the stages."""
    import pathlib

    from fastdp.commands import COMMANDS as modules

    assert (
        modules["info"] == "fastdp.commands.info" and modules["doctor"] == "fastdp.commands.doctor"
    )
    pkg = pathlib.Path(__file__).resolve().parents[1] / "fastdp"
    assert not any((pkg / f).exists() for f in ("_info.py", "_doctor_cases.py", "_callable.py"))
