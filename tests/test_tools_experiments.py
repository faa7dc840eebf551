"""The one-off experiments of ``bench/experiments/`` and the A/B table ``bench/ab_summary.py``
cannot rot unseen: every measuring script runs on today's fastdp at a tiny size (one that patched
the internals of the commit it measured is removed, its README keeping the command and the
commit), every folder says what it measured and where its data is, and the summarisers reproduce
the tables committed beside their data."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest
from models import ROOT

BENCH = os.path.join(ROOT, "bench")
EXPERIMENTS = os.path.join(BENCH, "experiments")
RESULTS = os.path.join(BENCH, "results")
SCRIPTS = sorted(glob.glob(os.path.join(EXPERIMENTS, "*", "*.py")))
SHELL = sorted(glob.glob(os.path.join(EXPERIMENTS, "*", "*.sh")))


def _load(path: str):  # noqa: ANN202
    name = "experiment_" + re.sub(r"\W", "_", os.path.relpath(path, BENCH))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ids(paths: list[str]) -> list[str]:
    return [os.path.relpath(p, EXPERIMENTS) for p in paths]


def test_every_experiment_folder_has_a_readme_naming_its_results_folder():
    folders = [
        d for d in sorted(os.listdir(EXPERIMENTS)) if os.path.isdir(os.path.join(EXPERIMENTS, d))
    ]
    assert folders
    with open(os.path.join(EXPERIMENTS, "README.md")) as f:
        index = f.read()
    for d in folders:
        with open(os.path.join(EXPERIMENTS, d, "README.md")) as f:
            text = f.read()
        named = re.findall(r"results/([\w.-]+)/", text)
        assert named and all(os.path.isdir(os.path.join(RESULTS, n)) for n in named), d
        assert f"`{d}/`" in index, d


@pytest.mark.parametrize("path", SCRIPTS, ids=_ids(SCRIPTS))
def test_experiment_script_imports_without_running(path):
    module = _load(path)
    assert callable(getattr(module, "main", None)), f"{path}: its work belongs in main()"


@pytest.mark.parametrize("path", SHELL, ids=_ids(SHELL))
def test_experiment_shell_script_parses_and_names_existing_files(path):
    subprocess.run(["bash", "-n", path], check=True)
    with open(path) as f:
        for rel in re.findall(r"\.\./[\w./-]+\.py", f.read()):
            assert os.path.exists(os.path.join(os.path.dirname(path), rel)), rel


# The measuring scripts: fastdp's public API, the bench's own modules and the extension switch,
# each run at a tiny size in a fresh process (they switch the extension off process-wide).
RUNS = [
    ("compile-calls/calls.py", ()),
    ("noext-anchor/cpu_ratio.py", ("mlp10", "smoke")),
    ("noext-cost/steps.py", ("mlp10", "2")),
    ("instructions/instructions.py", ("noext", "1")),
    ("noext-checks/ratio.py", ("mlp10",)),
    ("noext-in-process/in_process.py", ("mlp10",)),
    ("plan-once/count.py", ()),
    ("plan-once/timing.py", ("1",)),
]


@pytest.mark.parametrize("script, args", RUNS, ids=[r[0] for r in RUNS])
def test_experiment_runs_at_a_tiny_size(script, args):
    # this checkout's fastdp, whichever one the interpreter has installed
    subprocess.run(
        [sys.executable, os.path.join(EXPERIMENTS, script), *args],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},
    )


def test_every_measuring_script_runs_at_a_tiny_size():
    """Summarisers are checked against their committed tables; every other script is in RUNS."""
    measuring = {p for p in _ids(SCRIPTS) if os.path.basename(p) != "summarize.py"}
    assert measuring == {script for script, _ in RUNS}


def _printed(main, folder: str, *args: str) -> str:  # noqa: ANN001
    out, cwd = io.StringIO(), os.getcwd()
    argv = sys.argv
    try:
        os.chdir(folder)
        sys.argv = ["summarize.py", *args]
        with contextlib.redirect_stdout(out):
            main()
    finally:
        os.chdir(cwd)
        sys.argv = argv
    return out.getvalue()


@pytest.mark.parametrize(
    "script, folder, args, table",
    [
        ("ab_summary.py", "cpu-2core-2026-11-25-fresh-replicas", (), "ratios.md"),
        ("ab_summary.py", "cpu-2core-2026-11-27-issue38-final", (), "ratios.md"),
        ("experiments/noext-anchor/summarize.py", "cpu-2core-2026-11-26-anchor", (), "ratios.md"),
        (
            "experiments/noext-anchor/summarize.py",
            "cpu-2core-2026-11-26-anchor",
            ("second",),
            "ratios-second.md",
        ),
        (
            "experiments/compile-phases/summarize.py",
            "cpu-2core-2026-11-26-compile",
            (),
            "ratios.md",
        ),
        (
            "experiments/compile-calls/summarize.py",
            "cpu-2core-2026-11-26-compile-calls",
            (),
            "ratios.md",
        ),
    ],
)
def test_summariser_reproduces_the_committed_table(script, folder, args, table):
    module = _load(os.path.join(BENCH, script))
    with open(os.path.join(RESULTS, folder, table)) as f:
        want = f.read()
    assert _printed(module.main, os.path.join(RESULTS, folder), *args) == want


def test_ab_summary_runs_on_a_folder_given_on_the_command_line():
    folder = os.path.join(RESULTS, "cpu-2core-2026-11-25-fresh-replicas")
    got = subprocess.run(
        [sys.executable, os.path.join(BENCH, "ab_summary.py"), folder],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    with open(os.path.join(folder, "ratios.md")) as f:
        assert got == f.read()


def test_hf_zoo_summary_groups_a_junit_file_by_replicas(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase name="test_zoo[x2-BertModel]" time="1.5"/>'
        '<testcase name="test_zoo[x2-GPT2Model]" time="1"><failure message="boom"/></testcase>'
        '<testcase name="test_zoo[x3-T5Model]" time="0">'
        '<skipped message="harness cannot build T5Model: 3 inputs"/></testcase>'
        "</testsuite></testsuites>"
    )
    module = _load(os.path.join(EXPERIMENTS, "hf-zoo", "summarize.py"))
    _printed(module.main, str(tmp_path), str(xml))
    text = (tmp_path / "summary.txt").read_text()
    assert "2 replicas: 2 architectures, 2 built, 2 compared, 1 passed, 1 failed" in text
    assert "3 replicas: 1 architectures, 0 built" in text
    assert (tmp_path / "summary.json").exists()
