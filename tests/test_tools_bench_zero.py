"""The bench's ``zero`` suite at tiny sizes: every mode timed, the sharded optimizer checked
against the unsharded one, the bytes recorded, the table's columns present."""

import pytest

from fastdp.bench import cli


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-zero")
    doc = cli.main(["--tiny", "--no-progress", "--out", str(out), "--suite", "zero"])
    return out, doc


def test_zero_suite_times_every_mode_in_both_storage_modes(zero_run):
    _, doc = zero_run
    recs = [r for r in doc["records"] if r["suite"] == "zero"]
    seen = {(r["storage"], r["mode"]) for r in recs}
    for storage in ("alias", "distinct"):
        for mode in ("floor", "unsharded", "zero", "unsharded_opt_step", "zero_opt_step"):
            assert (storage, mode) in seen
    assert all(r.get("status", "ok") == "ok" and r["time_ms"]["median_ms"] > 0 for r in recs)
    zero = [r for r in recs if r["mode"] == "zero"]
    assert all(r["check"]["parameters_equal_unsharded"] for r in zero)
    assert all({"vs_floor", "vs_unsharded"} <= set(r["ratios"]) for r in zero)
    for r in zero:
        assert len(r["optimizer_bytes"]) == 4
        assert sum(r["optimizer_bytes"]) == r["unsharded_optimizer_bytes"] > 0
        assert r["index0_share"] <= 0.30
        copies = r["zero_copy_bytes_per_step"]
        assert (copies > 0) == (r["storage"] == "distinct")


def test_zero_suite_table(zero_run):
    out, _ = zero_run
    text = (out / "table.txt").read_text()
    assert "zero:" in text and "x unsharded" in text and "state per index" in text
