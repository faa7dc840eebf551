import os
import signal

import pytest
import torch

from fastdp import _backend
from fastdp.testing import ACCEL, BACKENDS, set_backend

if ACCEL:  # FASTDP_TEST_ACCEL=1: the test device for the whole process, before any backward
    import accel

    accel.enable(3, asynchronous=True)

# NOTE [ Tests under each launch strategy ]
# The files that exercise replicas end to end (parity, persistent, stateful, faults, upstream,
# thread state, errors) use the ``launch`` fixture: each of their tests runs once per strategy,
# forced through FASTDP_LAUNCH (read when a wrapper is made). With FASTDP_LAUNCH set in the
# environment only that strategy runs, and every other test sees it too (one CI job per strategy).
LAUNCHES = (
    [os.environ["FASTDP_LAUNCH"]]
    if os.environ.get("FASTDP_LAUNCH")
    else ["threads", "inline", "auto"]
)


@pytest.fixture(params=LAUNCHES)
def launch(request, monkeypatch):
    """Run the test with ``FASTDP_LAUNCH`` set to each launch strategy in turn."""
    monkeypatch.setenv("FASTDP_LAUNCH", request.param)
    return request.param


@pytest.fixture(params=["alias", "distinct"])
def storage(request, monkeypatch):
    """CPU replicas on the originals' storage (the default), then with storage of their own
    (``FASTDP_CPU_DISTINCT=1``: distinct GPUs' semantics); read when a replica set is built."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1" if request.param == "distinct" else "0")
    return request.param


@pytest.fixture
def distinct(monkeypatch):
    """CPU replicas with storage of their own (``FASTDP_CPU_DISTINCT=1``) for the whole test."""
    monkeypatch.setenv("FASTDP_CPU_DISTINCT", "1")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test once with the C++ extension allowed and once on the pure-torch path."""
    prev = set_backend(request.param)
    yield request.param
    _backend.set_enabled(prev)


# The upstream ports' replica sets: two CPU replicas always, two sharing cuda:0 with a GPU.
UPSTREAM_REPLICAS = [
    pytest.param(["cpu", "cpu"], id="cpu2"),
    pytest.param(
        [0, 0],
        id="cuda00",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]


@pytest.fixture(params=UPSTREAM_REPLICAS)
def devices(request):
    """A replica set of the upstream ports (test_upstream_*.py)."""
    return request.param


ACCEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accel")


def _in_accel(config) -> list[bool]:
    here = str(config.invocation_params.dir)
    args = [os.path.abspath(os.path.join(here, a.split("::")[0])) for a in config.args]
    return [a == ACCEL or a.startswith(ACCEL + os.sep) for a in args]


def pytest_configure(config):
    inside = _in_accel(config)
    if any(inside) and not all(inside):
        raise pytest.UsageError("tests/accel runs in a process of its own: pytest tests/accel")


def pytest_ignore_collect(collection_path, config):
    """tests/accel registers a torch backend for the whole process: its tests run in a process of
    their own (``pytest tests/accel``), never inside a run that collects anything else."""
    if str(collection_path) == ACCEL and not all(_in_accel(config)):
        return True
    return None


def pytest_addoption(parser):
    parser.addoption(
        "--zoo",
        choices=["ci", "all"],
        default=None,
        help="tests/test_hf_zoo.py: 'ci' (default) a fixed sample on 2 replicas; 'all' every "
        "class on 2 and 3 replicas (as FASTDP_ZOO=all)",
    )


def pytest_report_header(config):
    from fastdp.commands.info import info

    d = info()
    return (
        f"fastdp {d['version']}: torch {d['torch']}, extension loaded={d['extension_loaded']}, "
        f"built_with_cuda={d['built_with_cuda']}, gpus={len(d['gpus'])}, "
        f"FASTDP_DISABLE_EXT={os.environ.get('FASTDP_DISABLE_EXT', '0')}"
    )


@pytest.fixture
def replica_builds(monkeypatch):
    """A list that gets one entry per ``ReplicaSet`` built during the test."""
    from fastdp._replica_set import ReplicaSet

    builds: list[int] = []
    orig = ReplicaSet.__init__

    def counting(self, *a, **k):
        builds.append(1)
        orig(self, *a, **k)

    monkeypatch.setattr(ReplicaSet, "__init__", counting)
    return builds


@pytest.fixture
def sigint():
    """SIGINT raises KeyboardInterrupt while ``state["armed"]`` (the yielded dict), then never
    kills the run; the previous handler is restored after the test. Needed because a run started
    as a background job of a non-interactive shell (``pytest &`` in a script, some CI runners)
    inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    state = {"armed": True}

    def handler(signum, frame):
        if state["armed"]:
            raise KeyboardInterrupt

    prev = signal.signal(signal.SIGINT, handler)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, prev)
