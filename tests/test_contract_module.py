"""The wrapper's contract with user code: attributes, parameters, buffers, state_dict, cycles."""

import copy
import gc
import types
import weakref

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fastdp import FastDataParallel
from fastdp.testing import HAS_CUDA, onlyCUDA


class UsesParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        p = next(self.parameters())  # fails inside nn.DataParallel replicas (StopIteration)
        return self.lin(x.to(p.dtype))


def test_next_parameters_works_inside_replicas(backend):
    m = UsesParameters()
    x = torch.randn(6, 3, dtype=torch.float64)
    out = FastDataParallel(m, device_ids=["cpu"] * 3)(x)
    assert_close(out, m(x.float()))


class RecordsSelf(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.seen = []  # shared by the replicas (their dicts copy the reference)

    def forward(self, x):
        self.seen.append(self)
        return self.lin(x)


@pytest.mark.parametrize("persistent", [True, False])
def test_a_forward_bound_in_the_module_dict_runs_on_each_replica(launch, storage, persistent):
    """``model.forward = MethodType(f, model)`` (accelerate, PEFT): each replica's forward gets
    the replica as ``self`` (DataParallel's get the original, and so its weights)."""
    m = RecordsSelf()
    ref = copy.deepcopy(m)
    m.forward = types.MethodType(RecordsSelf.forward, m)
    fdp = FastDataParallel(m, device_ids=["cpu"] * 3, persistent=persistent)
    for _ in range(2):
        m.seen.clear()
        x = torch.randn(6, 3)
        fdp(x).sum().backward()
        assert len(m.seen) == 3 and len({id(r) for r in m.seen}) == 3 and m not in m.seen
        sum(ref(c).sum() for c in x.chunk(3)).backward()
        assert_close(m.lin.weight.grad, ref.lin.weight.grad)
    assert m.forward.__self__ is m


def test_is_a_dataparallel_and_state_dict_keys_carry_module_prefix():
    m = nn.Linear(2, 2)
    fdp = FastDataParallel(m, device_ids=["cpu"] * 2)
    assert isinstance(fdp, nn.DataParallel)
    assert list(fdp.state_dict()) == ["module.weight", "module.bias"]
    dp_keys = list(nn.DataParallel(nn.Linear(2, 2)).state_dict())
    assert list(fdp.state_dict()) == dp_keys or dp_keys == ["weight", "bias"]  # DP w/o GPU


def test_attributes_follow_dataparallel():
    fdp = FastDataParallel(nn.Linear(2, 2), device_ids=["cpu", torch.device("cpu")], dim=1)
    assert fdp.device_ids == [torch.device("cpu")] * 2
    assert fdp.output_device == torch.device("cpu")
    assert fdp.src_device_obj == torch.device("cpu") and fdp.dim == 1


@pytest.mark.skipif(HAS_CUDA, reason="pass-through happens only without a GPU")
def test_no_gpu_and_no_ids_is_a_pass_through():
    m = nn.Linear(2, 2)
    fdp = FastDataParallel(m)
    assert fdp.device_ids == []
    x = torch.randn(5, 2)
    assert_close(fdp(x), m(x))


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
def test_cuda_ids_without_cuda_warn_and_pass_through():
    m = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        fdp = FastDataParallel(m, device_ids=[0, 1])
    assert fdp.device_ids == [] and fdp(torch.ones(3, 2)).shape == (3, 2)


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
def test_a_cuda_build_without_a_gpu_is_no_accelerator(monkeypatch):
    """torch's CUDA build names CUDA its accelerator with no GPU present: DataParallel's
    pass-through (no devices), not a wrapper over zero CUDA devices."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: cuda)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    fdp = FastDataParallel(nn.Linear(2, 2))
    assert fdp.device_ids == [] and fdp(torch.ones(3, 2)).shape == (3, 2)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        assert FastDataParallel(nn.Linear(2, 2), device_ids=[0, 1]).device_ids == []


def test_single_cpu_device_calls_the_module_directly(backend):
    seen = []
    m = nn.Linear(2, 2)
    m.register_forward_hook(lambda mod, i, o: seen.append(mod))
    x = torch.randn(4, 2)
    assert_close(FastDataParallel(m, device_ids=["cpu"])(x), m(x))
    assert seen[0] is m  # the original module, not a replica


def test_batchnorm_running_stats_come_from_replica_zero_only(backend):
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    ref = copy.deepcopy(bn)
    x = torch.randn(12, 4) * 3 + 1
    FastDataParallel(bn, device_ids=["cpu"] * 3)(x)
    ref(x[:4])  # replica 0's chunk
    assert_close(bn.running_mean, ref.running_mean)
    assert_close(bn.running_var, ref.running_var)
    assert bn.num_batches_tracked.item() == 1


def test_replica_zero_aliases_parameters_and_buffers(backend):
    bn = nn.BatchNorm1d(2)
    fdp = FastDataParallel(bn, device_ids=["cpu"] * 2)
    replicas = fdp.replicate(bn, fdp.device_ids)
    assert replicas[0].weight.data_ptr() == bn.weight.data_ptr()
    assert replicas[0].running_mean is bn.running_mean
    # other replicas: buffers are copies; parameters on the same device share storage (values are
    # read-only in a forward) but, like DataParallel's copies, have their own version counters
    assert replicas[1].running_mean.data_ptr() != bn.running_mean.data_ptr()
    assert replicas[1].running_mean is not bn.running_mean
    v = bn.weight._version
    with torch.no_grad():
        replicas[1].weight.add_(1)
    assert bn.weight._version == v  # other replicas have their own version counters


def test_unused_parameters_get_zero_gradients(backend):
    class Partial(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x)

    m = Partial()
    FastDataParallel(m, device_ids=["cpu"] * 2)(torch.ones(4, 2)).sum().backward()
    assert m.unused.weight.grad is not None and not m.unused.weight.grad.any()


def test_no_reference_cycles_after_a_step(backend):
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    fdp = FastDataParallel(m, device_ids=["cpu"] * 3)
    fdp(torch.randn(6, 4)).sum().backward()  # warm-up
    gc.collect()
    gc.disable()
    try:
        x = torch.randn(6, 4)
        out = fdp(x)
        refs = [weakref.ref(out), weakref.ref(x)]  # x: its chunks are saved by the graph
        out.sum().backward()
        del out, x
        assert all(r() is None for r in refs)  # freed by refcounting alone
        assert gc.collect() == 0
    finally:
        gc.enable()


@onlyCUDA
def test_repeated_cuda_ids_are_accepted(backend):
    m = nn.Linear(3, 3).cuda()
    fdp = FastDataParallel(m, device_ids=[0, 0])
    x = torch.randn(4, 3, device="cuda")
    assert_close(fdp(x), m(x))


class Counting(FastDataParallel):
    """Overrides the seams with DataParallel's own signatures (no ``plan=``), as subclasses of
    nn.DataParallel do."""

    calls: list

    def scatter(self, inputs, kwargs, device_ids):
        self.calls.append("scatter")
        return super().scatter(inputs, kwargs, device_ids)

    def replicate(self, module, device_ids):
        self.calls.append("replicate")
        return super().replicate(module, device_ids)

    def parallel_apply(self, replicas, inputs, kwargs):
        self.calls.append("parallel_apply")
        return super().parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs, output_device):
        self.calls.append("gather")
        return super().gather(outputs, output_device)


def test_seams_with_dataparallels_signatures_are_called_in_order(backend):
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ref = copy.deepcopy(m)
    fdp = Counting(m, ["cpu"] * 3)
    fdp.calls = []
    x = torch.randn(9, 3)
    for _ in range(2):  # the second step reuses the persistent replicas through the override
        out = fdp(x)
    assert fdp.calls == ["scatter", "replicate", "parallel_apply", "gather"] * 2
    assert len(fdp._replica_sets) == 1
    assert_close(out, torch.cat([ref(c) for c in x.chunk(3)]))  # BatchNorm per chunk
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_a_step_writes_no_attributes_on_the_wrapper(backend):
    """The step's state lives in its plan (issue 21): nothing is set on the module per step."""
    fdp = FastDataParallel(nn.Linear(3, 2), ["cpu"] * 2)
    fdp(torch.randn(4, 3)).sum().backward()
    before = dict(fdp.__dict__)
    fdp(torch.randn(4, 3)).sum().backward()
    assert {k: v for k, v in fdp.__dict__.items() if before.get(k, object()) is not v} == {}
    assert type(fdp).__setattr__ is nn.Module.__setattr__
