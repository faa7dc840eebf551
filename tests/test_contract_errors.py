"""Errors: replica exceptions keep their type and say where; DataParallel's texts kept verbatim;
what a new user of the swap-in hits: clear errors for inputs no replica can take, DataParallel's
pass-through for ``device_ids=[]``."""

import re

import pytest
import torch
from torch import nn

from fastdp import FastDataParallel

# The replica errors run under each launch strategy, the swap-in's at the end once.
each_launch = pytest.mark.usefixtures("launch")  # NOTE [ Tests under each launch strategy ]


class FailIn(nn.Module):
    def __init__(self, exc, when_rows):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.exc, self.when_rows = exc, when_rows

    def forward(self, x):
        if x.shape[0] == self.when_rows:
            raise self.exc
        return self.lin(x)


@each_launch
def test_replica_exception_keeps_type_and_names_replica_and_device(backend):
    fdp = FastDataParallel(FailIn(KeyError("missing"), 2), device_ids=["cpu"] * 2)
    with pytest.raises(KeyError) as info:
        fdp(torch.ones(5, 2))  # chunks of 3 and 2: replica 1 raises
    text = str(info.value)
    assert "Caught KeyError in replica 1 on device cpu." in text
    assert "Original Traceback" in text and "raise self.exc" in text


@each_launch
def test_replica_exception_of_custom_type(backend):
    class MyError(RuntimeError):
        pass

    fdp = FastDataParallel(FailIn(MyError("boom"), 3), device_ids=["cpu"] * 2)
    with pytest.raises(MyError, match="Caught MyError in replica 0 on device cpu"):
        fdp(torch.ones(5, 2))
    assert fdp(torch.ones(4, 2)).shape == (4, 2)  # the next step works


@each_launch
def test_module_on_wrong_device_keeps_dataparallels_message(backend):
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    fdp = FastDataParallel(m, device_ids=["cpu"] * 2)
    with pytest.raises(
        RuntimeError,
        match=r"^module must have its parameters and buffers on device "
        r"cpu \(device_ids\[0\]\) but found one of them on device: meta$",
    ):
        fdp(torch.ones(4, 2))


@each_launch
def test_scripted_modules_are_replicated(backend):
    torch.manual_seed(0)
    m = torch.jit.script(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    x = torch.randn(6, 3)
    out = FastDataParallel(m, device_ids=["cpu"] * 3)(x)
    torch.testing.assert_close(out, m(x))
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


@each_launch
def test_unreplicatable_script_modules_keep_dataparallels_message(backend, monkeypatch):
    """Modern torch.jit scripts python children recursively, so the case can't be built by hand;
    the check itself is torch's (_replicatable_module), the message must stay verbatim."""
    import fastdp.replicate as rep

    monkeypatch.setattr(rep, "_replicatable_module", lambda module: False)
    fdp = FastDataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 2)
    with pytest.raises(
        RuntimeError,
        match="^Cannot replicate network where python modules are children of ScriptModule$",
    ):
        fdp(torch.ones(4, 2))


@each_launch
def test_lazy_modules_must_be_initialised_first(backend):
    fdp = FastDataParallel(nn.Sequential(nn.LazyLinear(3)), device_ids=["cpu"] * 2)
    # nn.DataParallel raises ValueError("Attempted to use an uninitialized parameter ...");
    # fastdp keeps that type and text and adds lazy.py's explanation.
    with pytest.raises(
        ValueError,
        match="Attempted to use an uninitialized parameter.*Modules with "
        "uninitialized parameters can't be used with `DataParallel`. Run a dummy",
    ):
        fdp(torch.ones(4, 5))


@each_launch
def test_mixed_cpu_and_cuda_ids_are_rejected():
    with pytest.raises(ValueError, match="mixes CPU and CUDA"):
        FastDataParallel(nn.Linear(2, 2), device_ids=["cpu", 0])


# ---- what a new user of the swap-in hits ------------------------------------------------------


class Sum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x, **kw):
        return self.w * 0 + 1.0


@pytest.mark.parametrize(
    "make,kind",
    [
        (lambda: torch.eye(4).to_sparse(), "sparse_coo"),
        (lambda: torch.eye(4).to_sparse_csr(), "sparse_csr"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    ],
)
def test_unsplittable_inputs_get_fastdps_message_naming_the_leaf(make, kind):
    fdp = FastDataParallel(Sum(), device_ids=["cpu"] * 2)
    with pytest.raises(TypeError, match=rf"input kwargs\['feats'\] is a .*{kind}.*whole"):
        fdp(torch.ones(4, 1), feats=make())
    with pytest.raises(TypeError, match=rf"input inputs\[0\] is a .*{kind}"):
        fdp(make())


def _torch_raises(op):
    """The type and text of the error of torch's ``op`` (which DataParallel's scatter calls)."""
    with pytest.raises(Exception) as info:
        op()
    return type(info.value), str(info.value)


@pytest.mark.parametrize(
    "make,torch_op,advice",
    [
        (lambda: torch.tensor(0.5), lambda: torch.tensor(0.5).chunk(2), r"t\.item\(\).*expand"),
        (
            lambda: torch.ones(4, 1, device="meta"),
            lambda: torch.ones(4, 1, device="meta").to("cpu"),
            r"meta device.*model\.module",
        ),
    ],
    ids=["0-dim", "meta"],
)
def test_0dim_and_meta_inputs_name_the_leaf_with_dataparallels_type(
    backend, make, torch_op, advice
):
    kind, text = _torch_raises(torch_op)  # DataParallel's scatter: chunk, then a copy per device
    fdp = FastDataParallel(Sum(), device_ids=["cpu"] * 2)
    with pytest.raises(kind, match=rf"^{re.escape(text)}.*input kwargs\['temperature'\].*{advice}"):
        fdp(torch.ones(4, 1), temperature=make())
    with pytest.raises(kind, match=rf"^{re.escape(text)}.*input inputs\[1\]"):
        fdp(torch.ones(4, 1), make())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the pass-through is for CUDA-less machines")
def test_empty_device_ids_without_cuda_run_the_module_as_dataparallel_does():
    m = nn.Linear(3, 2)
    fdp, dp = FastDataParallel(m, device_ids=[]), nn.DataParallel(m, device_ids=[])
    x = torch.randn(4, 3)
    assert fdp.device_ids == dp.device_ids == []
    assert torch.equal(fdp(x), dp(x))
