"""One word, one meaning (the words in docs/how-it-works.md): in fastdp/ and csrc/, an identifier
with "row" or "rows" in it names batch rows, so it lives where batch rows are split, counted or
copied (the planner, the scatter and gather, their C++); one with "plan" in it names the
``StepPlan`` or the planner that makes it; "pending", "arm" and "launch" live only where their one
meaning does (``SCOPED``). One entry per replica is a replica word, a chunk's sizes are its split,
a broadcast's buckets its layout, the doctor's list its checks."""

from __future__ import annotations

import glob
import io
import os
import re
import tokenize

import pytest
from models import ROOT

# Where "rows" are batch rows: the planner, the wrapper that counts a replica's rows, the scatter
# and gather (the host copies of the scatter and generate's gather included) and the losses and
# shards cut the same way.
ROWS_FILES = [
    "fastdp/_planner.py",
    "fastdp/scatter_gather.py",
    "fastdp/data_parallel.py",
    "fastdp/_methods.py",
    "fastdp/criterion.py",
    "fastdp/distributed.py",
    "csrc/scatter*",
    "csrc/gather*",
    "csrc/cpu/*",
    "csrc/cuda/scatter*",
    "csrc/cuda/gather*",
    "csrc/host_copy_route.*",
]
# The host copy route's names that the bindings expose to its tests; torch's name of a sparse CSC
# tensor's row indices.
ROWS_BOUND = {
    "csrc/bindings.cpp": {"StageRows", "stage_rows"},
    "fastdp/_transports.py": {"row_indices"},
}
ROW_WORDS = {"row", "rows"}
# Where the StepPlan is made, carried and executed (and ``info()``'s name for its stage), and its
# names; the planner module's name is allowed wherever it is imported.
PLAN_FILES = [
    "fastdp/_planner.py",
    "fastdp/data_parallel.py",
    "fastdp/scatter_gather.py",
    "fastdp/commands/info.py",
]
PLAN_NAMES = {"StepPlan", "make_plan", "plan", "_plan", "planner", "scatter_planned"}
PLAN_WORDS = {"plan", "plans", "planned", "planner", "planners", "planning"}
# Words held to the files of their one meaning: (words, files, names allowed in other files).
SCOPED = {
    # no_sync's gradients held on the replicas until the wrapper folds them into the originals:
    # the cycle that holds them and the wrapper that folds them; the replica set, which also
    # renews what a live graph needs (never "pending"), only names its no_sync calls
    "pending": (
        {"pending"},
        ["fastdp/_no_sync.py", "fastdp/data_parallel.py"],
        {"fastdp/_replica_set.py": {"holds_pending", "drop_pending"}},
    ),
    # prepare_replicas arms the replicas' SyncBatchNorm: one rendezvous for its block's launches
    "arm": ({"arm", "arms", "armed", "arming"}, ["fastdp/sync_batchnorm.py"], {}),
    # one call per replica (or ZeRO owner) run at once, and how (threads, inline, auto); CUDA's
    # kernel launches keep torch's name
    "launch": (
        {"launch", "launches", "launched", "launching", "launcher"},
        [
            "fastdp/_launch.py",
            "fastdp/_runners.py",
            "fastdp/parallel_apply.py",
            "fastdp/data_parallel.py",
            "fastdp/_replica_set.py",
            "fastdp/sync_batchnorm.py",
            "fastdp/zero_optimizer.py",
            "fastdp/_zero_shards.py",
            "fastdp/run.py",
            "fastdp/bench/*",
        ],
        {"csrc/cuda/multi_copy.cu": {"C10_CUDA_KERNEL_LAUNCH_CHECK"}},
    ),
}
SOURCES = ["fastdp/**/*.py", "csrc/**/*.cpp", "csrc/**/*.h", "csrc/**/*.cu", "csrc/**/*.cuh"]

CPP_SKIPPED = re.compile(
    r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S
)  # comments, string and character literals
CPP_NAME = re.compile(r"\b[A-Za-z_]\w*\b")
WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")


def words(name: str) -> set[str]:
    """The lower-case words of an identifier: ``StageRows`` -> {stage, rows}, ``_copy_rows2`` ->
    {copy, rows}."""
    return {w.lower() for w in WORD.findall(name)}


def identifiers(path: str, text: str) -> set[str]:
    """The identifiers of a Python or C++ source, comments and string literals left out."""
    if path.endswith(".py"):
        toks = tokenize.generate_tokens(io.StringIO(text).readline)
        return {t.string for t in toks if t.type == tokenize.NAME}
    return set(CPP_NAME.findall(CPP_SKIPPED.sub(" ", text)))


def _matches(rel: str, patterns: list[str]) -> bool:
    return any(glob.fnmatch.fnmatch(rel, p) for p in patterns)


def offences(rel: str, text: str) -> list[str]:
    """``rel``'s identifiers that use "row(s)" or "plan" outside their one meaning."""
    out = []
    for name in sorted(identifiers(rel, text)):
        w = words(name)
        rows_ok = _matches(rel, ROWS_FILES) or name in ROWS_BOUND.get(rel, ())
        if w & ROW_WORDS and not rows_ok:
            out.append(f"{rel}: {name!r}: 'rows' are batch rows, only in {ROWS_FILES}")
        plan_ok = name == "_planner" or (_matches(rel, PLAN_FILES) and name in PLAN_NAMES)
        if w & PLAN_WORDS and not plan_ok:
            out.append(f"{rel}: {name!r}: 'plan' is the StepPlan, named {sorted(PLAN_NAMES)}")
        for word, (forms, files, bound) in SCOPED.items():
            if w & forms and not (_matches(rel, files) or name in bound.get(rel, ())):
                out.append(f"{rel}: {name!r}: {word!r} has one meaning, only in {files}")
    return out


def _sources() -> list[str]:
    found = {f for p in SOURCES for f in glob.glob(os.path.join(ROOT, p), recursive=True)}
    return sorted(os.path.relpath(f, ROOT) for f in found)


def test_each_word_keeps_its_one_meaning():
    bad = []
    for rel in _sources():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            bad += offences(rel, f.read())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "rel, text, bad",
    [
        ("fastdp/_reducer.py", "def reduce_rows(rows): pass\n", 2),
        ("fastdp/_reducer.py", "per_replica = [row for row in x]\n", 1),
        ("fastdp/_reducer.py", "# rows of a replica\nx = 'rows'\n", 0),
        ("fastdp/comm.py", "def scatter(leaves, plan): pass\n", 1),
        ("fastdp/comm.py", "from fastdp._planner import splits_for\n", 0),
        ("fastdp/_planner.py", "def chunk_rows(plan: StepPlan): pass\n", 0),
        ("csrc/bucket_reduce.cpp", "void sum_rows(int rows); // rows\n", 2),
        ("csrc/bucket_reduce.cpp", 'TORCH_CHECK(x, "one plan row");\n', 0),
        ("csrc/scatter.cpp", "int64_t rows = 0; auto plan = 1;\n", 1),
        ("csrc/bindings.cpp", "fastdp::StageRows r = fastdp::stage_rows(s);\n", 0),
        ("csrc/bindings.cpp", "HostCopyPlan p;\n", 1),
        ("csrc/cuda/gather_cuda.cu", "std::vector<Pending> pending;\n", 2),
        ("fastdp/_no_sync.py", "def take_pending(self): pass\n", 0),
        ("fastdp/_reducer.py", "class Pending: pass\n", 1),
        ("fastdp/_replica_set.py", "def drop_pending(self): self.pending_graph = 1\n", 1),
        ("fastdp/_reducer.py", "def arm(self): pass\n", 1),
        ("fastdp/_buckets.py", "armed = launch_order = 1\n", 2),
        ("fastdp/sync_batchnorm.py", "self.armed = launch_number()\n", 0),
        ("csrc/cuda/multi_copy.cu", "C10_CUDA_KERNEL_LAUNCH_CHECK();\n", 0),
    ],
)
def test_the_words_check_itself(rel, text, bad):
    assert len(offences(rel, text)) == bad
