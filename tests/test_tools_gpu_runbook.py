"""tests/gpu.sh, the GPU runbook: its plumbing on the CPU (FASTDP_GPU_DRY_RUN=1).

CI runs every stage's dry run (`bash tests/gpu.sh all`) and the quick check's (`quick`); here the
cheapest stage, the record it writes, the quick check's time box and the usage error, so that a
broken script fails the suite too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from models import ROOT


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FASTDP_GPU_DRY_RUN="1", PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(Path(ROOT) / "tests" / "gpu.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_build_stage_dry_run_writes_its_log_and_json(tmp_path: Path) -> None:
    r = _run("build", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads((tmp_path / "build.json").read_text())
    assert rec["stage"] == "build" and rec["rc"] == 0 and rec["dry_run"] is True
    log = (tmp_path / "build.log").read_text()
    assert "pip install --no-build-isolation --no-deps -e ." in log and "fastdp " in log


def test_quick_check_fits_its_budget_and_time_boxes_every_stage() -> None:
    """The quick check is one device command (at most 10 minutes, 9 asked): the sum of its stage
    caps may exceed the budget (a stage that ends early leaves time to the next), but the budget
    plus a stage's kill grace (10 s) and the summary's limit (20 s) must fit, and every cap."""
    script = (Path(ROOT) / "tests" / "gpu_quick.sh").read_text()
    budget = int(re.search(r"GPU_CHECK_BUDGET_S:-(\d+)", script).group(1))
    assert budget + 10 + 20 <= 9 * 60
    caps = re.findall(r"^run_stage ([\w-]+) (\d+) ", script, re.M)
    assert {n for n, _ in caps} >= {"build", "probes", "zero", "bench-comm", "tests-core",
                                    "sanitize"}  # fmt: skip
    assert all(int(c) <= budget for _, c in caps)
    stages = (Path(ROOT) / "tests" / "gpu_quick" / "stages.sh").read_text()
    assert "source tests/gpu_quick/stages.sh" in script and "setsid" in stages
    assert "kill -KILL --" in stages and "timeout --kill-after" in stages  # the fallback


def _quick(out: Path, **env: str) -> subprocess.CompletedProcess:
    """The quick check's dry run into `out`, with `env` (GPU_CHECK_SKIP, GPU_CHECK_BUDGET_S)."""
    return subprocess.run(
        ["bash", str(Path(ROOT) / "tests" / "gpu.sh"), "quick", str(out)],
        env=dict(os.environ, FASTDP_GPU_DRY_RUN="1", PYTHON=sys.executable, **env),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_quick_check_steps_zero_redundancy_optimizer_in_a_stage_of_its_own(tmp_path: Path) -> None:
    """The zero stage: its probe (skipped without a GPU) and its test files, summarised."""
    skip = "build probes bench-comm tests-core sanitize bench-steps doctor"
    r = _quick(tmp_path, GPU_CHECK_SKIP=skip)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert re.search(r"^zero +ok ", summary, re.M), summary
    assert "zero_steps" in summary and "pytest (zero stage)" in summary
    recs = json.loads((tmp_path / "zero-probes.json").read_text())
    assert [rec["probe"] for rec in recs] == ["zero_steps"]
    assert re.search(r"\d+ passed, \d+ skipped", (tmp_path / "zero.log").read_text())


def _bash(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=dict(os.environ, **env), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_stage_cut_by_the_deadline_is_cut_not_failed_and_its_whole_group_dies(
    tmp_path: Path,
) -> None:
    """A stage stopped at the deadline's shorter limit reads CUT and fails nothing; one stopped at
    its own cap reads TIMEOUT and fails the run; either way every process the stage started dies
    with it (a background child, a nested `timeout --foreground`)."""
    kids = 'sleep 300 & echo $! >>"$T/pids"; timeout --foreground 300 sleep 301 & ' \
        'echo $! >>"$T/pids"; wait'  # fmt: skip
    r = _bash(
        f"""source tests/gpu_quick/stages.sh
        SUMMARY=$T/summary.txt SKIP=" " START=$(date +%s) RESERVE=0 MIN_STAGE_S=1
        DEADLINE=$((START + 3))
        run_stage slow 90 "$T/slow.log" '{kids}'
        quick_verdict && echo "verdict after CUT: pass"
        DEADLINE=$((START + 600))
        run_stage own 2 "$T/own.log" 'sleep 30'
        quick_verdict || echo "verdict after TIMEOUT: fail"
        """,
        T=str(tmp_path),
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert re.search(r"^slow +CUT +rc=124 ", summary, re.M), summary + r.stderr
    assert re.search(r"^own +TIMEOUT +rc=124 ", summary, re.M), summary
    assert "verdict after CUT: pass" in r.stdout and "verdict after TIMEOUT: fail" in r.stdout
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_each_sanitizer_run_gets_a_quarter_of_the_stage(tmp_path: Path) -> None:
    """Four sanitizer runs, each stopped at (STAGE_LIM - 30) / 4 s: all end inside the stage."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nexec sleep 100\n")
    fake.chmod(0o755)
    r = _bash("bash tests/gpu_quick/sanitize.sh", SANITIZER=str(fake), STAGE_LIM="38",
              PY=sys.executable)  # fmt: skip
    assert r.returncode == 1 and "each run's limit: 2s" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("rc=124") == 4, r.stdout


def test_header_probes_are_time_boxed(tmp_path: Path) -> None:
    """A hanging nvidia-smi costs GPU_CHECK_PROBE_S, not the run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 300\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    skip = "build probes zero bench-comm tests-core sanitize bench-steps doctor"
    r = _quick(tmp_path, GPU_CHECK_SKIP=skip, GPU_CHECK_PROBE_S="2",
               PATH=f"{bin_dir}:{os.environ['PATH']}")  # fmt: skip
    summary = (tmp_path / "summary.txt").read_text()
    assert r.returncode == 0 and "nvidia-smi: rc=124" in summary, summary + r.stderr


def test_the_summary_names_the_failed_tests_of_a_killed_pytest(tmp_path: Path) -> None:
    """Killed before its summary, a verbose pytest's progress lines still name the failed tests
    (xdist's form too)."""
    (tmp_path / "tests.log").write_text(
        "tests/test_a.py::test_b[x y] FAILED                 [ 20%]\n"
        "[gw3] [ 30%] FAILED tests/test_c.py::test_d[1-2]\n"
        "[gw1] [ 40%] PASSED tests/test_c.py::test_e\n"
    )  # fmt: skip
    s = subprocess.run(
        [sys.executable, str(Path(ROOT) / "tests" / "gpu_quick" / "summarize.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "FAILED tests/test_a.py::test_b[x y]" in s.stdout, s.stdout + s.stderr
    assert "FAILED tests/test_c.py::test_d[1-2]" in s.stdout and "test_e" not in s.stdout


def test_unknown_stage_is_a_usage_error(tmp_path: Path) -> None:
    r = _run("nope", str(tmp_path))
    assert r.returncode == 2 and "usage" in r.stderr


def test_quick_check_probes_run_and_are_summarised_without_a_gpu(tmp_path: Path) -> None:
    """The probe driver (one process per probe; without a GPU only the first runs) and the
    summary that reads its record: every probe of the plan has a line."""
    if torch_has_cuda():
        pytest.skip("a GPU machine runs the probes themselves (bash tests/gpu.sh quick)")
    quick = Path(ROOT) / "tests" / "gpu_quick"
    out = tmp_path / "probes.json"
    r = subprocess.run(
        [sys.executable, str(quick / "run_probes.py"), "--all", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    recs = json.loads(out.read_text())
    assert recs[0]["probe"] == "env" and all(rec["status"] == "skip" for rec in recs)
    s = subprocess.run(
        [sys.executable, str(quick / "summarize.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert s.returncode == 0, s.stderr
    assert all(rec["probe"] in s.stdout for rec in recs) and (tmp_path / "bench.json").exists()


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
