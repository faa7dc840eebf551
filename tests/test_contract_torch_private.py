"""The private torch APIs fastdp reaches (fastdp/_torch_private.py): each must still exist and do
what fastdp relies on. A failure here means a torch release changed one: fix the compat module,
never this test."""

from __future__ import annotations

import threading

import pytest
import torch

from fastdp import _torch_private as tp


def test_the_profiler_label_is_the_fast_one():
    assert tp.record_function is torch._C._profiler._RecordFunctionFast
    with tp.record_function("fastdp.test"):
        pass


def test_usage_logging_exists():
    assert callable(torch._C._log_api_usage_once)
    tp.log_api_usage_once("fastdp.test")


def test_exception_wrapper_reraises_with_the_original_type():
    try:
        raise KeyError("x")
    except KeyError:
        w = tp.ExceptionWrapper(where="in replica 0 on device cpu")
    with pytest.raises(KeyError, match="in replica 0 on device cpu"):
        w.reraise()


def test_tree_leaves_walks_nested_containers():
    a, b = torch.ones(1), torch.zeros(1)
    assert tp.tree_leaves([(a, {"k": b}), "s"]) == [a, b, "s"]


def test_sequence_numbers_order_ready_nodes():
    """A node given the highest sequence number runs first among ready nodes."""
    order = []
    a = torch.ones(1, requires_grad=True)
    x, y = a * 1, a * 2
    x.grad_fn.register_hook(lambda *_: order.append("x"))
    y.grad_fn.register_hook(lambda *_: order.append("y"))
    assert tp.set_sequence_nr(x.grad_fn)
    (x + y).sum().backward()
    assert order == ["x", "y"]  # without it, y (created later: higher number) runs first


def test_engine_callbacks_and_graph_task_ids():
    seen = []
    a = torch.ones(1, requires_grad=True)
    out = a * 2

    def hook(*_):
        seen.append(tp.current_graph_task_id())
        tp.queue_engine_callback(lambda: seen.append("done"))

    out.grad_fn.register_prehook(hook)
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    assert tp.current_graph_task_id() == -1  # outside a backward
    assert seen[1] == seen[3] == "done" and seen[0] >= 0 and seen[2] > seen[0]


def test_compiled_autograd_region_is_seen_from_a_python_nodes_backward():
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        @tp.untraced
        def backward(ctx, g):
            seen.append(tp.in_compiled_autograd())
            return g

    a = torch.ones(2, requires_grad=True)
    Probe.apply(a).sum().backward()
    with ca._enable(torch.compile(backend="eager")):
        Probe.apply(a).sum().backward()
    assert seen == [False, True] and not tp.in_compiled_autograd()
    torch._dynamo.reset()


def test_dynamo_contexts_are_found():
    dynamo = pytest.importorskip("torch._dynamo")
    ef = tp.dynamo_module("eval_frame")
    assert ef is not None and hasattr(ef, "OptimizedModule")
    assert tp.dynamo_module("config").recompile_limit >= 1
    assert hasattr(tp.functorch_config(), "force_non_lazy_backward_lowering")
    fn = torch.compile(lambda x: x + 1, backend="eager")
    ctx = tp.dynamo_context_of(fn)
    assert isinstance(ctx, ef._TorchDynamoContext)
    seen = []

    @tp.disable_dynamo
    def eager_part(x):
        seen.append((tp.enclosing_dynamo_context(), threading.get_ident()))
        return x

    def body(x):
        return eager_part(x * 2) + 1

    compiled = torch.compile(body, backend="eager")
    compiled(torch.ones(2))
    assert seen and isinstance(seen[0][0], ef._TorchDynamoContext)
    assert seen[0][0] is tp.dynamo_context_of(compiled)
    dynamo.reset()
