"""The README fits a screen and its figures are generated from committed results; comments and
docs state today's contract, with history left to git log and CHANGELOG.md; NOTEs are few, short,
figure-free comment blocks, each defined once where it is cited (CONTRIBUTING.md)."""

from __future__ import annotations

import ast
import glob
import json
import os
import re

import pytest
from models import ROOT

from fastdp.bench import headline

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


# NOTEs: `# NOTE [ Title ]` (or `// NOTE [ Title ]`) heads a comment block above the code it
# governs; the block ends at the first line that is not a comment. Cited as `NOTE [ Title ]`.
NOTE_SOURCES = [
    "fastdp/**/*.py",
    "csrc/**/*.cpp",
    "csrc/**/*.h",
    "csrc/**/*.cu",
    "csrc/**/*.cuh",
    "tests/**/*.py",
    "bench/**/*.py",
    "setup.py",
]
NOTE_CITERS = [*NOTE_SOURCES, "docs/*.md", "README.md", "bench/README.md", "CONTRIBUTING.md"]
NOTE_HEADER = re.compile(r"^\s*(#|//) NOTE \[ (.+?) \]\s*$")
NOTE_CITATION = re.compile(r"(torch's\s+)?NOTE \[\s+(.+?)\s+\]", re.S)
NOTE_IN_DOCSTRING = re.compile(r"^\s*NOTE \[ .+? \]\s*:?\s*$", re.M)
MAX_NOTE_LINES = 10
MAX_NOTES = 28
# A figure: a number with a unit of time, size, rate, ratio or print size ("3 %", "~2 us",
# "1.76×", "0.98x floor", "25 MiB", "1600 px", "300 seconds"). Measurements and defaults change
# with the machine and the code; a NOTE names the results folder or the constant that holds them.
# Numbers that are not quantities stay: an index or a count in prose ("replica 0", "dim 0",
# "2 GPUs", "buckets of one"), a version ("CPython 3.11"), an issue ("pytorch #118260"), hex.
FIGURE = re.compile(
    r"(?<![\w.#])~?\d+(?:[.,]\d+)?\s*(?:%|×|x\b|percent\b|[µu]s\b|ms\b|ns\b|s\b|sec(?:ond)?s?\b"
    r"|min(?:ute)?s?\b|[KMGT]i?B\b|[KMGT]B/s|px\b|pt\b)|\bx floor\b",
    re.IGNORECASE,
)
# Prose that counts or places code drifts as the code changes: "16 lines", "line 40". A limit
# ("at most 10 lines", "up to ~300 lines") is a rule, not a count.
LINE_COUNT = re.compile(r"\b\d+[- ]lines?\b|\blines? \d+\b", re.IGNORECASE)
LIMIT_BEFORE = re.compile(r"(?:at most|up to|under|within|≤)\s*~?$", re.IGNORECASE)


def _files(patterns: list[str]) -> list[str]:
    found = {f for p in patterns for f in glob.glob(os.path.join(ROOT, p), recursive=True)}
    return sorted(f for f in found if os.path.abspath(f) != os.path.abspath(__file__))


def _note_blocks(path: str) -> list[tuple[str, int, list[str]]]:
    """(title, line, body lines) of every NOTE defined in ``path``."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out = []
    for i, line in enumerate(lines):
        m = NOTE_HEADER.match(line)
        if not m:
            continue
        body = []
        for nxt in lines[i + 1 :]:
            if not nxt.lstrip().startswith(m.group(1)) or NOTE_HEADER.match(nxt):
                break
            body.append(nxt)
        out.append((m.group(2), i + 1, body))
    return out


def _notes() -> dict[str, list[tuple[str, int, list[str]]]]:
    """Title -> its definitions: (file, line, body)."""
    notes: dict[str, list[tuple[str, int, list[str]]]] = {}
    for path in _files(NOTE_SOURCES):
        for title, n, body in _note_blocks(path):
            notes.setdefault(title, []).append((os.path.relpath(path, ROOT), n, body))
    return notes


def _citations(path: str) -> set[str]:
    """The titles of fastdp's NOTEs that ``path`` names (torch's own are cited as torch's)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r'"\s*\n\s*"', "", text)  # C++ strings continued on the next line
    text = re.sub(r"\n\s*(?:#|//)?\s*", " ", text)  # comments continued on the next line
    return {m.group(2) for m in NOTE_CITATION.finditer(text) if not m.group(1)}


def _docstring_offences(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [
        f"{os.path.relpath(path, ROOT)}: {getattr(node, 'name', 'module')}"
        for node in ast.walk(tree)
        if isinstance(node, kinds)
        and NOTE_IN_DOCSTRING.search(ast.get_docstring(node, clean=False) or "")
    ]


def _figures(lines: list[str]) -> list[str]:
    return [m.group(0) for line in lines for m in FIGURE.finditer(RESULT_PATH.sub("", line))]


def _line_counts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [
        f"{os.path.relpath(path, ROOT)}: {m.group(0)!r}"
        for m in LINE_COUNT.finditer(text)
        if not LIMIT_BEFORE.search(text[: m.start()])
    ]


def test_every_note_fits_ten_lines():
    """A NOTE states one invariant; more than ten lines is several NOTEs or a design document."""
    long = [
        f"{path}:{n}: NOTE [ {title} ] has {len(body)} lines"
        for title, defs in _notes().items()
        for path, n, body in defs
        if len(body) > MAX_NOTE_LINES
    ]
    assert not long, "\n".join(long)


def test_no_note_inside_a_docstring():
    """A docstring is the caller's (``help()`` prints it); a NOTE is the implementer's, a ``#``
    block above the code it governs. Docstrings may cite a NOTE, not hold one."""
    bad = [
        o
        for path in _files(NOTE_SOURCES)
        if path.endswith(".py")
        for o in _docstring_offences(path)
    ]
    assert not bad, "\n".join(bad)


CPP_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
CPP_STRINGS = re.compile(r'"(?:\\.|[^"\\\n])*"(?:\s*"(?:\\.|[^"\\\n])*")*')  # adjacent: one


def _binding_string_citations(text: str) -> list[str]:
    """The NOTE citations inside C++ string literals (adjacent literals joined, as the compiler
    joins them): a pybind docstring is what ``help()`` prints."""
    out = []
    for m in CPP_STRINGS.finditer(CPP_COMMENT.sub("", text)):
        joined = "".join(re.findall(r'"((?:\\.|[^"\\\n])*)"', m.group(0)))
        out += [c.group(0) for c in NOTE_CITATION.finditer(joined)]
    return out


def test_no_note_cited_in_a_binding_docstring():
    """A binding's docstring is the caller's too (``help(fastdp._C.x)``): a NOTE it needs is
    cited in a ``//`` comment above the binding, or at the code the NOTE governs."""
    bad = [
        f"{os.path.relpath(path, ROOT)}: {c}"
        for path in _files(["csrc/**/*.cpp", "csrc/**/*.cu"])
        for c in _binding_string_citations(open(path, encoding="utf-8").read())
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "text, cited",
    [
        ('m.def("f", &f, "Sums (NOTE [ Summing in place ]).");', True),
        ('m.def("f", &f, "Sums (see NOTE "\n        "[ Summing in place ]).");', True),
        ('// See NOTE [ Summing in place ].\nm.def("f", &f, "Sums.");', False),
        ('m.def("f", &f, "Sums; torch\'s NOTE [ x ] too.");', True),
    ],
)
def test_the_binding_docstring_check_itself(text, cited):
    assert bool(_binding_string_citations(text)) is cited


def test_no_figures_in_a_note():
    """A NOTE holds no measured figure or default value (see ``FIGURE``): it names the results
    folder, or the constant, that holds the number."""
    bad = [
        f"{path}:{n}: NOTE [ {title} ]: {_figures(body)}"
        for title, defs in _notes().items()
        for path, n, body in defs
        if _figures(body)
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "line, figure",
    [
        ("3 % of CPU time a step", True),
        ("5-8 % across processes", True),
        ("costs ~2 us per gradient", True),
        ("(mlp100, 4 replicas: +1 ms a step)", True),
        ("threads is 1.76× the floor", True),
        ("auto at 0.98x floor", True),
        ("a 1 MiB checksum copy", True),
        ("at most 1600 px wide, text >= 10 pt", True),
        ("FASTDP_SYNC_TIMEOUT seconds, default 300 seconds", True),
        ("the chunks of replica 0 along dim 0", False),
        ("on 2 GPUs, buckets of one", False),
        ("CPython 3.11 and 3.12", False),
        ("pytorch #118260, #123177", False),
        ("PY_VERSION_HEX < 0x030D0000", False),
        ("see bench/results/cpu-2core-2026-11-26-anchor", False),
    ],
)
def test_the_figure_check_itself(line, figure):
    assert bool(_figures([line])) is figure


def test_every_cited_note_is_defined_exactly_once():
    """A citation names a NOTE that exists, once: in fastdp/, csrc/, tests/, bench/ or setup.py.
    torch's own NOTEs are cited as ``torch's NOTE [ ... ]``."""
    notes = _notes()
    twice = [f"NOTE [ {t} ]: {[(p, n) for p, n, _ in d]}" for t, d in notes.items() if len(d) > 1]
    missing = sorted(
        f"{os.path.relpath(path, ROOT)}: NOTE [ {title} ]"
        for path in _files(NOTE_CITERS)
        for title in _citations(path)
        if title not in notes
    )
    assert not twice and not missing, "\n".join(twice + missing)


def test_the_notes_stay_few():
    """Long reasoning goes once into a NOTE; what one function needs is its own comment. A
    ceiling keeps the NOTEs a set a maintainer can read in one sitting."""
    assert len(_notes()) <= MAX_NOTES, sorted(_notes())


def test_docs_do_not_count_or_place_lines_of_code():
    """ "``_forward``, 16 lines" and "line 40" drift with every change; say what the code does."""
    docs = ["README.md", "bench/README.md", "CONTRIBUTING.md", "docs/*.md"]
    bad = [o for path in _files(docs) for o in _line_counts(path)]
    assert not bad, "\n".join(bad)
