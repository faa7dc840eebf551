"""The transformers zoo (``tests/hf_zoo.py``): each model class of six auto mappings, three AdamW
steps in train mode on CPU replicas, persistent replicas against ``persistent=False`` (bit for
bit: outputs, gradients, parameters, buffers) and both against DataParallel's semantics computed
on the plain module (outputs, every gradient, parameters and buffers after each step, within
float tolerance where the summation order of gradients differs).

By default a fixed stratified sample on 2 replicas; ``FASTDP_ZOO=all`` or ``--zoo=all``: every
class on 2 and 3 replicas. A class the harness cannot build skips with the cause; a comparison
never skips.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import fastdp

if os.environ.get("CI") and os.environ.get("FASTDP_ALLOW_NO_TRANSFORMERS") != "1":
    import transformers  # noqa: F401  (CI installs it: these tests must not skip there)
pytest.importorskip("transformers")

import hf_zoo  # noqa: E402

STEPS = 3
LR = 1e-3
# Each step starts where the reference's does (its parameters, buffers and AdamW state loaded in
# place into both wrappers' modules), so outputs and buffers are bit for bit at every step: the
# same parameters on the same chunks. Gradients are sums over chunks in another order than
# autograd's on the plain module: within GRAD_TOL of each tensor's largest magnitude. AdamW
# divides by the root of the second moment, so where a gradient is rounding noise (a key
# projection's bias: softmax ignores it) the noise decides the sign of a step of about LR:
# parameters after the step are within PARAM_TOL. Persistent replicas against persistent=False:
# everything bit for bit.
GRAD_TOL = 5e-6
PARAM_TOL = 2 * LR


def pytest_generate_tests(metafunc):
    if "arch" in metafunc.fixturenames:
        archs, replicas = hf_zoo.selected(metafunc.config.getoption("--zoo"))
        metafunc.parametrize("replicas", replicas, ids=lambda n: f"x{n}")
        metafunc.parametrize("arch", archs, ids=lambda a: a.id)


def _run(runner, kwargs: dict) -> object:
    return runner(**{k: v.clone() for k, v in kwargs.items()})


@pytest.mark.filterwarnings("ignore")
def test_training_steps_match_dataparallel_semantics(arch, replicas):
    try:
        model, inputs = hf_zoo.build(arch)
    except hf_zoo.BuildError as e:
        pytest.skip(f"harness cannot build {arch.class_name}: {e}")
    devices = ["cpu"] * replicas
    ref = hf_zoo.Reference(copy.deepcopy(model), replicas)
    runs = {
        "ref": ref,
        "fresh": fastdp.FastDataParallel(copy.deepcopy(model), devices, persistent=False),
        "persistent": fastdp.FastDataParallel(copy.deepcopy(model), devices),
    }
    opts = {k: torch.optim.AdamW(v.parameters(), lr=LR) for k, v in runs.items()}
    for step in range(STEPS):
        kwargs = inputs(step)
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        try:
            out = _run(ref, kwargs)
            hf_zoo.objective(out).backward()
        except Exception as e:  # noqa: BLE001 - the plain module on the chunks: not fastdp's
            pytest.skip(f"plain {arch.class_name} fails on the chunks: {type(e).__name__}: {e}")
        ref.zero_unused_grads()
        outs, grads = {"ref": hf_zoo.flatten(out)}, {"ref": hf_zoo.snapshot_grads(ref.module)}
        for name in ("fresh", "persistent"):
            out = _run(runs[name], kwargs)
            outs[name] = hf_zoo.flatten(out)
            hf_zoo.objective(out).backward()
            grads[name] = hf_zoo.snapshot_grads(runs[name].module)
        buffers = {k: hf_zoo.snapshot_buffers(v.module) for k, v in runs.items()}
        for o in opts.values():
            o.step()
        params = {k: hf_zoo.snapshot_params(v.module) for k, v in runs.items()}
        checks = [
            ("outputs", outs, 0.0),
            ("buffers", buffers, 0.0),
            ("gradients", grads, GRAD_TOL),
            ("parameters", params, PARAM_TOL),
        ]
        bad = []
        for what, got, tol in checks:
            for name in ("fresh", "persistent"):
                msg = hf_zoo.first_mismatch(got[name], got["ref"], tol == 0.0, tol, tol)
                bad += [f"{name} {what} vs reference: {msg}"] if msg else []
            msg = hf_zoo.first_mismatch(got["persistent"], got["fresh"], exact=True)
            bad += [f"persistent {what} vs persistent=False: {msg}"] if msg else []
        assert not bad, f"step {step}:\n" + "\n".join(bad)
        for name in ("fresh", "persistent"):
            hf_zoo.load_state(runs[name].module, opts[name], ref.module, opts["ref"])
