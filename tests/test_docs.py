"""The README fits a screen and its figures are generated from committed results; comments and
docs state today's contract, with history left to git log and CHANGELOG.md (CONTRIBUTING.md)."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from fastdp.bench import headline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

# History told in prose: an issue or review number, "before the fix", a commit hash, a date.
NARRATION = re.compile(
    r"\bissue \d+|\breview N?\d+\b|\bbefore the (?:fix|change|refactor|rewrite)\b"
    r"|\b(?:before|until|since|after) (?:commit )?`?[0-9a-f]{7,40}\b"
    r"|\buntil 20\d\d\b|\bpreviously\b|\bthe old code\b",
    re.IGNORECASE,
)
HASH = re.compile(r"(?<![0-9a-fx_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![0-9a-z_])")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# A results folder's name carries its date: a path into bench/results names a source, not history.
RESULT_PATH = re.compile(r"(?:bench/)?results/[\w./-]+|gpu-h100-[\w-]+|cpu-[\w-]*2core[\w-]*")


def _checked_files() -> list[str]:
    pats = [
        "fastdp/**/*.py",
        "csrc/**/*.cpp",
        "csrc/**/*.h",
        "csrc/**/*.cu",
        "csrc/**/*.cuh",
        "README.md",
        "bench/README.md",
        "docs/*.md",
    ]
    return sorted({f for p in pats for f in glob.glob(os.path.join(ROOT, p), recursive=True)})


def _offences(path: str) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            text = RESULT_PATH.sub("", line)
            for rx in (NARRATION, HASH, DATE):
                m = rx.search(text)
                if m:
                    out.append(f"{os.path.relpath(path, ROOT)}:{n}: {m.group(0)!r}: {line.strip()}")
                    break
    return out


def test_no_history_narration_in_code_comments_readme_or_docs():
    bad = [o for f in _checked_files() for o in _offences(f)]
    assert not bad, "history belongs in git log / CHANGELOG.md:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "line, bad",
    [
        ("# fixed in issue 6", True),
        ("Before 1b9cb07 it rebuilt them", True),
        ("Until 2026-11-24 a wrapper", True),
        ("commit `02cf521`", True),
        ("see review N2", True),
        ("# see bench/results/gpu-h100-2026-11-24/README.md", False),
        ("pytorch #31460", False),
        ("x = 0xdeadbeef1", False),
        ("the dict no longer holds the key", False),
        ("a 1000-layer nn.Sequential", False),
    ],
)
def test_the_narration_check_itself(tmp_path, line, bad):
    p = tmp_path / "f.py"
    p.write_text(line + "\n")
    assert bool(_offences(str(p))) is bad


def test_readme_fits_a_screenful():
    with open(README) as f:
        assert len(f.readlines()) <= 200


def _generated_blocks() -> list[tuple[str, int, str]]:
    """(results path, replicas, the README's text) of every generated table in the README."""
    with open(README) as f:
        text = f.read()
    rx = re.compile(
        r"<!-- generated: python -m fastdp\.bench\.headline (\S+) --replicas (\d+) "
        r"-->\n(.*?)\n\n(\|.*?)\n(?:\n|$)",
        re.S,
    )
    return [
        (m.group(1), int(m.group(2)), m.group(3) + "\n\n" + m.group(4)) for m in rx.finditer(text)
    ]


def test_readme_figures_are_generated_from_committed_results():
    blocks = _generated_blocks()
    assert len(blocks) >= 2
    for path, replicas, shown in blocks:
        with open(os.path.join(ROOT, path)) as f:
            doc = json.load(f)
        want = f"{headline.device_line(doc, replicas)}\n\n{headline.table(doc, replicas)}"
        assert shown == want, path


def test_relative_links_in_the_docs_point_at_files():
    docs = [
        "README.md",
        "bench/README.md",
        "CONTRIBUTING.md",
        "CHANGELOG.md",
        *glob.glob("docs/*.md", root_dir=ROOT),
    ]
    broken = []
    for doc in docs:
        with open(os.path.join(ROOT, doc)) as f:
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read()):
                if "://" not in target and not os.path.exists(
                    os.path.join(ROOT, os.path.dirname(doc), target)
                ):
                    broken.append(f"{doc}: {target}")
    assert not broken


def test_every_results_and_experiments_folder_is_indexed_in_bench_readme():
    with open(os.path.join(ROOT, "bench", "README.md")) as f:
        index = f.read()
    for kind in ("results", "experiments"):
        top = os.path.join(ROOT, "bench", kind)
        folders = [d for d in os.listdir(top) if os.path.isdir(os.path.join(top, d))]
        missing = [d for d in folders if f"`{d}/`" not in index]
        assert folders and not missing, (kind, missing)
        unexplained = [d for d in folders if not os.path.exists(os.path.join(top, d, "README.md"))]
        assert not unexplained, (kind, unexplained)


def test_no_script_lives_in_a_results_folder():
    """A results folder holds data and its README; scripts live in bench/experiments/<topic>/."""
    found = glob.glob("bench/results/**/*.py", root_dir=ROOT, recursive=True)
    found += glob.glob("bench/results/**/*.sh", root_dir=ROOT, recursive=True)
    assert not found
