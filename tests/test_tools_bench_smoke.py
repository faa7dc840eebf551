"""Smoke test of ``python -m fastdp.bench``: the CPU suites at tiny sizes, in-process, in a tmp dir.

Checks the shape of what the suite writes (JSON keys, table, plots), never the figures themselves.
"""

import importlib.util
import json
import os

import pytest

from fastdp.bench import cli, suites_gpu
from fastdp.testing import HAS_CUDA

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    suites = ["passthrough", "cpu-replicas", "overhead", "replicate", "module-build"]
    doc = cli.main(
        ["--tiny", "--no-progress", "--out", str(out), "--replicas", "2", "--suite", *suites]
    )
    return out, doc


def test_bench_writes_json_with_meta_headline_and_records(tiny_run):
    out, _ = tiny_run
    with open(out / "results.json") as f:
        doc = json.load(f)
    assert doc["schema"] == "fastdp-bench/1"
    meta = doc["meta"]
    for key in ("date", "command", "machine", "torch", "cuda", "fastdp", "suites", "wall_s"):
        assert key in meta, key
    assert {"cpu", "cores", "gpu"} <= set(meta["machine"])
    assert {"version", "commit"} <= set(meta["fastdp"])
    assert meta["command"].startswith("python -m fastdp.bench")
    assert "replicate_cpu" in doc["headline"] and "not_ok" in doc["headline"]


def test_bench_records_cover_every_cpu_suite_and_mode(tiny_run):
    _, doc = tiny_run
    recs = doc["records"]
    seen = {(r["suite"], r["mode"]) for r in recs}
    # passthrough needs a machine without CUDA (FastDataParallel(m) takes every GPU there)
    passthrough = (
        []
        if HAS_CUDA
        else [("passthrough", "bare"), ("passthrough", "fastdp"), ("passthrough", "torch_dp")]
    )
    for suite, mode in passthrough + [
        ("cpu-replicas", "fastdp"),
        ("cpu-replicas", "fastdp_noext"),
        ("cpu-replicas", "dp_algo"),
        ("overhead", "model_chunks"),
        ("overhead", "fastdp"),
        ("replicate", "fastdp"),
        ("replicate", "dp_algo"),
        ("module-build", "without"),
        ("module-build", "with"),
    ]:
        assert (suite, mode) in seen, (suite, mode)
    timed = [r for r in recs if r.get("status") == "ok"]
    assert timed and all({"min_ms", "median_ms", "max_ms"} <= set(r["time_ms"]) for r in timed)
    checked = [
        r
        for r in recs
        if r["suite"] == "cpu-replicas"
        and r["mode"] not in ("bare", "floor")
        and r.get("status") != "unsupported"
    ]
    assert checked and all("check" in r for r in checked)
    built = [r for r in recs if r["suite"] == "module-build" and r["mode"] == "with"]
    assert built and all(r["ratios"]["vs_without"] > 0 for r in built)
    assert all(r["nn_module_untouched"] for r in recs if r["suite"] == "module-build")
    over = [r for r in recs if r["suite"] == "overhead" and r["mode"] == "fastdp"]
    assert over and all("wrapper_calls_per_step" in r and "overhead_ms" in r for r in over)
    assert all({"total", "model", "outside"} <= set(r["calls"]) for r in over)


def test_bench_compares_launch_strategies_against_the_floor(tiny_run):
    out, doc = tiny_run
    recs = [
        r
        for r in doc["records"]
        if r["suite"] in ("cpu-replicas", "overhead") and r.get("status") == "ok"
    ]
    for suite in ("cpu-replicas", "overhead"):
        modes = {r["mode"] for r in recs if r["suite"] == suite}
        assert {"fastdp", "fastdp_threads", "fastdp_inline"} <= modes, (suite, modes)
    fast = [r for r in recs if r["mode"].startswith("fastdp") and r.get("replicas", 1) > 1]
    assert fast and all("vs_floor" in r["ratios"] for r in fast)
    auto = [r for r in fast if r["mode"] == "fastdp"]
    assert auto and all(r["launch"] == "auto" and r["launch_pick"] for r in auto)
    assert all(p["choice"] in ("threads", "inline") for r in auto for p in r["launch_pick"])
    with open(out / "results.json") as f:
        rows = json.load(f)["headline"]["launch"]
    assert {r["workload"] for r in rows} >= {"mlp10", "wide8"}
    assert all(r["floor_ms"] and r["auto_x_floor"] and r["auto_x_threads"] for r in rows)


def test_bench_writes_table(tiny_run):
    out, _ = tiny_run
    text = (out / "table.txt").read_text()
    assert "cpu-replicas" in text and "replicate" in text and "x floor" in text


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_bench_writes_png_plots(tiny_run):
    out, doc = tiny_run
    pngs = [p for p in os.listdir(out) if p.endswith(".png")]
    assert "replicate.png" in pngs and "steps_cpu-replicas.png" in pngs
    assert "launch_x_floor.png" in pngs
    assert doc["meta"]["plots"]
    from matplotlib.image import imread

    for p in pngs:  # the rules in fastdp/bench/plots.py's docstring
        assert imread(str(out / p)).shape[1] <= 1600, p


def test_gpu_suites_code_runs_on_cpu_devices_in_dry_run(tmp_path, monkeypatch):
    """Every line of the GPU suites runs (on CPU devices) even where no GPU exists."""
    monkeypatch.setattr(suites_gpu, "DRY_RUN", True)
    doc = cli.main(
        [
            "--tiny",
            "--gpu-dry-run",
            "--no-progress",
            "--no-plots",
            "--replicas",
            "2",
            "--out",
            str(tmp_path),
            "--suite",
            "gpu-comm",
            "gpu-replicate",
            "gpu-steps",
        ]
    )
    by_suite = {r["suite"] for r in doc["records"]}
    assert {"gpu-comm", "gpu-replicate", "gpu-steps"} <= by_suite
    fast = [r for r in doc["records"] if r["mode"] in ("fastdp", "copy")]
    assert fast and all(r["status"] == "ok" for r in fast), [
        (r["suite"], r.get("op"), r.get("error")) for r in fast if r["status"] != "ok"
    ]


def test_compile_suite_records_compile_time_recompiles_and_floor_ratios(tmp_path):
    """The compile suite at its tiny size (one 64-wide MLP on 2 CPU replicas, inductor)."""
    pytest.importorskip("torch._dynamo")
    doc = cli.main(
        [
            "--tiny",
            "--no-progress",
            "--no-plots",
            "--replicas",
            "2",
            "--out",
            str(tmp_path),
            "--suite",
            "compile",
        ]
    )
    recs = {r["mode"]: r for r in doc["records"] if r["suite"] == "compile"}
    assert set(recs) == {
        "floor_compiled",
        "fastdp_compiled",
        "fastdp_wrapper",
        "dp_algo_compiled",
        "floor",
        "fastdp",
        "torch_dp",
    }
    assert recs["torch_dp"]["status"] == "unsupported"
    for m in ("fastdp_compiled", "fastdp_wrapper", "dp_algo_compiled", "fastdp"):
        assert recs[m]["status"] == "ok", recs[m].get("error") or recs[m].get("check")
        assert "vs_floor" in recs[m]["ratios"]
    for m in ("floor_compiled", "fastdp_compiled", "fastdp_wrapper"):
        assert {"first_step_s", "frames_first_step", "recompiles_20_steps"} <= set(recs[m])
    assert "x floor" in (tmp_path / "table.txt").read_text()


@pytest.mark.skipif(HAS_CUDA, reason="nn.DataParallel takes the GPUs where CUDA is available")
def test_torch_dp_without_cuda_is_checked_against_the_whole_batch():
    """nn.DataParallel without CUDA runs the module on the whole batch: with BatchNorm its output
    differs from the chunked reference, which must not read as a failed check."""
    from fastdp.bench import workloads as wl
    from fastdp.bench.runner import Settings, time_modes

    w = wl.catalogue("tiny")["resnet50"]
    model, args = wl.build(w, "cpu"), wl.make_inputs(w, "cpu")
    recs = time_modes(
        Settings(profile="tiny", repeats=1, max_total_s=0.5),
        suite="gpu-steps",
        w=w,
        model=model,
        args=args,
        devices=["cpu", "cpu"],
        n=2,
        ref_device="cpu",
        mode_list=("torch_dp", "fastdp"),
    )
    by_mode = {r["mode"]: r for r in recs}
    assert by_mode["torch_dp"]["status"] == "ok", by_mode["torch_dp"].get("check")
    assert by_mode["fastdp"]["status"] == "ok", by_mode["fastdp"].get("check")


def test_repeats_asked_for_are_all_timed():
    """``--repeats N`` times N repeats even where the profile's time cap would cut them short."""
    from fastdp.bench import timing

    s = cli.settings("cpu", 7, (4,))
    assert (s.repeats, s.max_total_s) == (7, None)
    assert cli.settings("cpu", None, (4,)).max_total_s == 3.0
    slow = timing.measure_many(
        {"a": lambda: sum(range(20_000))}, repeats=7, warmup=1, max_total_s=s.max_total_s
    )
    capped = timing.measure_many(
        {"a": lambda: sum(range(20_000))}, repeats=7, warmup=1, max_total_s=1e-9
    )
    assert (slow["a"].repeats, capped["a"].repeats) == (7, 3)


def test_interleaved_rounds_rotate_which_function_runs_first():
    from fastdp.bench import timing

    order: list[str] = []
    fns = {k: (lambda k=k: order.append(k)) for k in "abc"}
    timing.measure_many(fns, repeats=3, warmup=1)
    rounds = order[-9:]  # after each function's warm-up and calibration calls
    assert [rounds[i : i + 3] for i in (0, 3, 6)] == [list("abc"), list("bca"), list("cab")]
