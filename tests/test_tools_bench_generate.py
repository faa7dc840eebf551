"""The bench's ``generate`` suite at tiny sizes: every mode timed, the wrappers' sequences checked
equal to the chunks', tokens per second and the ratios recorded, the table's columns present."""

import pytest

from fastdp.bench import cli

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def generate_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-generate")
    argv = ["--tiny", "--no-progress", "--no-plots", "--out", str(out), "--replicas", "2"]
    return out, cli.main([*argv, "--suite", "generate"])


def test_generate_suite_checks_then_times_every_mode(generate_run):
    _, doc = generate_run
    recs = [r for r in doc["records"] if r["suite"] == "generate" and "cpu" in r["task"]]
    modes = {r["mode"]: r for r in recs}
    assert set(modes) == {"bare", "floor", "fastdp", "fastdp_threads", "fastdp_inline", "dp_algo"}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in recs)
    for m in ("fastdp", "fastdp_threads", "fastdp_inline", "dp_algo"):
        assert modes[m]["check"]["equal_to_chunks"] is True
        assert {"vs_floor", "vs_bare"} <= set(modes[m]["ratios"])
    assert modes["fastdp"]["launch"] == "auto" and modes["fastdp"]["launch_pick"]


def test_generate_suite_table(generate_run):
    out, _ = generate_run
    text = (out / "table.txt").read_text()
    assert "generate:" in text and "tokens/s" in text and "x floor" in text
