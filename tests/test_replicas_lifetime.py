"""A wrapper that nothing outside refers to is collected with its model, replicas and worker
threads, also when the model refers back to it (a hook closing over the wrapper): the replica
snapshots (``DictSnapshot``, C++ or Python) are seen by the garbage collector."""

import gc
import time
import weakref

import pytest
import torch
from torch import nn

from fastdp import FastDataParallel
from fastdp.testing import worker_threads

# NOTE [ Tests under each launch strategy ] in tests/conftest.py; both storage modes, and the
# C++ snapshot (``ext``) and the Python one (``torch``).
pytestmark = pytest.mark.usefixtures("launch", "storage", "backend")


def _wrapper_in_a_cycle():
    """Weak references to a stepped wrapper and its model, whose hook closes over the wrapper."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    dp = FastDataParallel(model, device_ids=["cpu"] * 2)
    seen = []
    model[0].register_forward_hook(lambda mod, args, out: seen.append(dp.device_ids))
    for _ in range(2):
        dp(torch.randn(4, 3)).sum().backward()
    assert seen
    return weakref.ref(dp), weakref.ref(model)


def test_wrapper_referred_to_by_a_hook_is_collected_with_its_model():
    wrapper, model = _wrapper_in_a_cycle()
    gc.collect()
    assert wrapper() is None
    assert model() is None


def test_worker_threads_end_once_such_a_wrapper_is_collected():
    before = len(worker_threads())
    _wrapper_in_a_cycle()
    gc.collect()
    deadline = time.monotonic() + 10
    while len(worker_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(worker_threads()) <= before


def test_dict_snapshot_releases_what_it_holds_when_collected_in_a_cycle():
    from fastdp._snapshots import snapshot

    class Box:
        pass

    box = Box()
    box.payload = Box()
    box.snap = snapshot([box.__dict__])  # the dict holds the snapshot, the snapshot the dict
    payload = weakref.ref(box.payload)
    del box
    gc.collect()
    assert payload() is None
