"""torch.compile with FastDataParallel: NOTE [ Compiled replicas ], NOTE [ Compiling the wrapper ].

Reference: the same module compiled the same way, called on the same chunks in turn. Most tests
use dynamo's ``eager``/``aot_eager`` backends (what fastdp controls is dynamo's side: contexts,
guards, recompiles; the backend only turns graphs into code); one uses inductor. Compiles are
counted as graphs made (``torch._dynamo.utils.counters``) plus dynamo's cache entries on the
compiled code (one per compile or recompile).
"""

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import fastdp
from fastdp.testing import HAS_CUDA

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo(caplog):
    """Each test starts from empty dynamo caches (cache entries live on shared code objects);
    dynamo's recompile reasons are captured for the failure messages (``recompiles()``)."""
    gc.collect()  # earlier tests' garbage: its finalizers would run inside compiled calls
    dynamo.reset()
    counters.clear()
    torch._logging.set_logs(recompiles=True)
    caplog.set_level("DEBUG", logger="torch._dynamo")
    yield
    torch._logging.set_logs()
    dynamo.reset()


@pytest.fixture
def recompiles(caplog):
    return lambda: "\n".join(r.getMessage() for r in caplog.records if "ecompil" in r.getMessage())


def compiles():
    """Graphs dynamo made plus cache entries (compiles and recompiles) on the code a test
    compiles: frames of unrelated code (a finalizer the garbage collector runs while dynamo's
    callback is active) do not count."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.external_utils import wrap_inline

    codes = [
        Net.forward.__code__,
        wrap_inline(make).__code__,  # wrap_inline: torch.nn classes
        fastdp.FastDataParallel.forward.__code__,
    ]
    entries = sum(len(_debug_get_cache_entry_list(c)) for c in codes)
    return entries + counters["stats"]["unique_graphs"]


class Net(nn.Module):
    """A user-defined class: ``m.compile()`` compiles nothing for torch.nn's own classes."""

    def __init__(self, width=32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4)
        )
        self.scale = 1.0

    def forward(self, x):
        return self.body(x) * self.scale


def make(seed=0):
    torch.manual_seed(seed)
    return Net()


def compiled(m, form, **options):
    if form == "torch.compile":
        return torch.compile(m, **options)
    m.compile(**options)
    return m


def chunked(module, x, n=2):
    return torch.cat([module(c) for c in x.chunk(n)])


def assert_step_matches(dp, net, ref_callable, ref_net, x, n=2):
    net.zero_grad()
    ref_net.zero_grad()
    out = dp(x)
    out.pow(2).sum().backward()
    expected = chunked(ref_callable, x, n)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(net.named_parameters(), ref_net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


FORMS = ["torch.compile", "module.compile"]


@pytest.mark.parametrize("form", FORMS)
def test_compiled_module_replicas_match_compiled_plain_module(form):
    net, ref = make(), make()
    dp = fastdp.FastDataParallel(compiled(net, form, backend="aot_eager"), ["cpu"] * 2)
    plain = compiled(ref, form, backend="aot_eager")
    x = torch.randn(32, 16)
    for _ in range(3):
        assert_step_matches(dp, net, plain, ref, x)
    assert counters["stats"]["unique_graphs"] > 0  # the replicas ran compiled code
    assert list(net.body) == list(net.body._modules.values())  # the original is intact
    rs = next(iter(dp._replica_sets.values())).for_tests()
    for r in rs.replicas:  # each runs itself, not the original
        inner = r._orig_mod if form == "torch.compile" else r
        entry = r.forward if form == "torch.compile" else r._compiled_call_impl
        assert inner is not net and entry._torchdynamo_orig_callable.__self__ is inner


def test_torch_compile_module_was_recursion_error_and_left_the_original_intact():
    net = make()
    dp = fastdp.FastDataParallel(torch.compile(net, backend="eager"), ["cpu"] * 2)
    dp(torch.randn(8, 16))
    # Module._replicate_for_data_parallel on an OptimizedModule wrote the copy's dicts into the
    # inner module: net._modules became {'_orig_mod': net} (RecursionError on the next call).
    assert set(net._modules) == {"body"}
    assert net(torch.randn(2, 16)).shape == (2, 4)


@pytest.mark.parametrize("form", FORMS)
def test_steady_state_has_no_recompiles_and_compiles_once_for_all_replicas(form):
    net = make()
    dp = fastdp.FastDataParallel(compiled(net, form, backend="eager"), ["cpu"] * 3)
    x = torch.randn(48, 16)
    dp(x).sum().backward()
    assert compiles() == 2  # one cache entry and one graph for the three replicas
    before = compiles()
    for _ in range(20):
        dp(x).sum().backward()
    assert compiles() == before


@pytest.mark.parametrize("last", [45, 40])  # chunks (15, 15, 15) and (14, 14, 12)
def test_partial_last_batch_costs_at_most_the_plain_modules_recompiles(last):
    net, ref = make(), make()
    x, tail = torch.randn(48, 16), torch.randn(last, 16)
    plain = torch.compile(ref, backend="eager")
    chunked(plain, x, 3)
    before = compiles()
    chunked(plain, tail, 3)
    plains = compiles() - before
    dynamo.reset()  # the plain module and the replicas share cache entries (one code object)
    dp = fastdp.FastDataParallel(torch.compile(net, backend="eager"), ["cpu"] * 3)
    for _ in range(2):
        dp(x).sum().backward()
    before = compiles()
    dp(tail).sum().backward()
    assert compiles() - before <= plains
    before = compiles()
    for _ in range(3):  # the dynamic entry serves both sizes from now on
        dp(x).sum().backward()
        dp(tail).sum().backward()
    assert compiles() == before


def test_model_change_rebuilds_replicas_without_stale_compiled_code():
    net, ref = make(), make()
    dp = fastdp.FastDataParallel(torch.compile(net, backend="eager"), ["cpu"] * 2)
    plain = torch.compile(ref, backend="eager")
    x = torch.randn(16, 16)
    assert_step_matches(dp, net, plain, ref, x)
    net.scale = ref.scale = 3.0  # a constant the compiled code specialised on
    assert_step_matches(dp, net, plain, ref, x)
    torch.manual_seed(3)
    net.body[2] = nn.Linear(32, 32)  # a new layer: new parameters in the graph
    ref.body[2] = copy.deepcopy(net.body[2])
    assert_step_matches(dp, net, plain, ref, x)
    net.body[1] = nn.Tanh()  # a different op
    ref.body[1] = nn.Tanh()
    assert_step_matches(dp, net, plain, ref, x)


def test_compiled_submodule_and_fresh_replicas():
    net, ref = make(), make()
    net.body = torch.compile(net.body, backend="eager")
    ref.body = torch.compile(ref.body, backend="eager")
    x = torch.randn(16, 16)
    for persistent in (True, False):
        dp = fastdp.FastDataParallel(net, ["cpu"] * 2, persistent=persistent)
        assert_step_matches(dp, net, ref, ref, x)
    out = fastdp.data_parallel(net, x, ["cpu"] * 2)
    torch.testing.assert_close(out, chunked(ref, x))


WRAPPER_FORMS = ["torch.compile(FastDataParallel(m))", "FastDataParallel(m).compile()"]


def compiled_wrapper(net, form, **options):
    dp = fastdp.FastDataParallel(net, ["cpu"] * 2)
    if form == WRAPPER_FORMS[0]:
        return torch.compile(dp, **options)
    dp.compile(**options)
    return dp


@pytest.mark.parametrize("form", WRAPPER_FORMS)
def test_compiling_the_wrapper_compiles_every_replica_without_warnings(form, recompiles):
    net, ref = make(), make()
    plain = torch.compile(ref, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:  # what a user's console would show
        warnings.simplefilter("always")
        dp = compiled_wrapper(net, form, backend="aot_eager")
        x = torch.randn(32, 16)
        assert_step_matches(dp, net, plain, ref, x)
        assert counters["stats"]["unique_graphs"] >= 1  # the module, not the wrapper
        before = compiles()
        for _ in range(20):
            dp(x).sum().backward()
        assert compiles() == before, (dict(counters["frames"]), recompiles())
    assert [str(w.message) for w in caught] == []
    for reason in counters["graph_break"]:  # at most the one clean break into the wrapper
        assert "FastDataParallel.forward" in reason


def test_torch_compile_wrapper_fullgraph_names_the_form_that_works():
    dp = torch.compile(
        fastdp.FastDataParallel(make(), ["cpu"] * 2), backend="eager", fullgraph=True
    )
    with pytest.raises(Exception, match=r"model\.compile\(fullgraph=True\)"):
        dp(torch.randn(8, 16))


def test_wrapper_compile_fullgraph_and_mode_reach_the_replicas():
    net, ref = make(), make()
    dp = fastdp.FastDataParallel(net, ["cpu"] * 2)
    dp.compile(backend="eager", fullgraph=True, dynamic=True)
    x = torch.randn(16, 16)
    assert_step_matches(dp, net, torch.compile(ref, backend="eager", fullgraph=True), ref, x)
    ctx = next(iter(dp._replica_sets.values())).for_tests().compile_ctx
    assert ctx.fullgraph and ctx._dynamic is True
    before = compiles()
    dp(torch.randn(13, 16)).sum().backward()  # dynamic=True: no recompile for a new size
    assert compiles() == before


def test_compiled_replicas_under_no_sync_do_not_recompile():
    net, ref = make(), make()
    dp = fastdp.FastDataParallel(torch.compile(net, backend="aot_eager"), ["cpu"] * 2)
    x = torch.randn(16, 16)
    dp(x).sum().backward()
    net.zero_grad()
    with dp.no_sync():
        dp(x).pow(2).sum().backward()  # replicas on leaves (NOTE [ no_sync ]): warm once
    dp(x).pow(2).sum().backward()
    chunked(ref, x).pow(2).sum().backward()
    chunked(ref, x).pow(2).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    before = compiles()
    for _ in range(5):
        with dp.no_sync():
            dp(x).sum().backward()
        dp(x).sum().backward()
    assert compiles() == before


def test_inductor_compiled_replicas_match_and_stay_compiled():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    dp = fastdp.FastDataParallel(torch.compile(net), ["cpu"] * 2)
    plain = torch.compile(ref)
    x = torch.randn(16, 16)
    assert_step_matches(dp, net, plain, ref, x)
    before = compiles()
    for _ in range(5):
        dp(x).sum().backward()
    assert compiles() == before


def test_compiled_replica_tensors_are_static_graph_inputs():
    """Persistent replica tensors keep their addresses: marked static for CUDA graphs."""
    dp = fastdp.FastDataParallel(torch.compile(make(), backend="eager"), ["cpu"] * 2)
    dp(torch.randn(8, 16)).sum().backward()
    rs = next(iter(dp._replica_sets.values())).for_tests()
    assert all(t._dynamo_static_input_type == "unguarded" for row in rs.tensors for t in row)


@pytest.mark.parametrize("launch", ["threads", "auto", "inline"])
@pytest.mark.parametrize("compile_it", [True, False])
def test_compiled_replicas_run_in_order_whatever_the_launch(launch, compile_it):
    """NOTE [ Compiled replicas run in order ]: dynamo's guards are not thread-safe."""
    net = make()
    dp = fastdp.FastDataParallel(
        torch.compile(net, backend="eager") if compile_it else net, ["cpu"] * 2, launch=launch
    )
    for _ in range(9):  # past auto's trial steps
        dp(torch.randn(8, 16)).sum().backward()
    rs = next(iter(dp._replica_sets.values())).for_tests()
    assert rs.in_order is compile_it
    if compile_it:
        assert dp.last_launch == "inline"
    elif launch != "auto":
        assert dp.last_launch == launch


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (CUDA graphs)")
def test_reduce_overhead_on_replicas_sharing_one_gpu():
    """See NOTE [ Compiled replicas run in order ]: unverified until a GPU run."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).cuda()
    ref = copy.deepcopy(net)
    dp = fastdp.FastDataParallel(torch.compile(net, mode="reduce-overhead"), [0, 0])
    plain = torch.compile(ref, mode="reduce-overhead")
    x = torch.randn(16, 16, device="cuda")
    for _ in range(4):  # cudagraph trees record after warm-up runs
        assert_step_matches(dp, net, plain, ref, x)
    before = compiles()
    for _ in range(10):
        dp(x).sum().backward()
    assert compiles() == before
