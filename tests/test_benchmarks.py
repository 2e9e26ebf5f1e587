"""The benchmark harness: the smoke grid runs and writes complete rows; ``compare`` gates regressions.

No assertion here depends on how fast anything ran.
"""
import copy
import json

import pytest

from benchmarks import cli, harness


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # One op keeps the test short; it is the widest (two models, reward shaping).
    assert cli.main(["run", "--device", "cpu", "--grid", "smoke", "--ops", "fused_kl_reward", "--out", str(out)]) == 0
    (path,) = out.glob("cpu-*_smoke_*.json")
    return path


def test_smoke_rows_have_every_field(smoke_results):
    rows = json.loads(smoke_results.read_text())
    assert {r["op"] for r in rows} == {"fused_kl_reward"}
    for row in rows:
        assert set(row) == set(harness.ROW_FIELDS)
        assert row["device"] == "cpu" and row["commit"] and row["torch"]
    timed = [r for r in rows if r["kind"] != "bandwidth" and r["time_ms_median"] is not None]
    assert {r["mode"] for r in timed} == set(harness.MODES)
    assert {"reference", "eager", "torchrl_masked", "trl"} <= {r["backend"] for r in timed}
    for row in timed:
        assert row["time_ms_min"] <= row["time_ms_median"] <= row["time_ms_max"]
        assert row["bytes_moved"] > 0 and row["gbps"] > 0 and row["roofline_frac"] > 0
        assert row["mem_method"]
    skipped = [r for r in rows if r["time_ms_median"] is None and r["kind"] != "bandwidth"]
    assert all(r["note"] for r in skipped)  # triton (no CUDA), flash-attn, Liger, compile on smoke


def test_masked_rows_move_fewer_bytes():
    full, masked = harness.Case(1024, 1000, "bf16", 0.0), harness.Case(1024, 1000, "bf16", 0.75)
    assert harness.bytes_moved(masked, 2, "forward") < 0.3 * harness.bytes_moved(full, 2, "forward")
    assert harness.bytes_moved(full, 1, "forward") == 1024 * 1000 * 2 + 1024 * 13


def _rows(median, low, high):
    row = dict.fromkeys(harness.ROW_FIELDS)
    row.update(op="token_kl", kind="kltriton", backend="cpp", mode="forward", tokens=256, vocab=32000,
               dtype="fp32", masked_frac=0.0, time_ms_median=median, time_ms_min=low, time_ms_max=high)
    baseline = dict(row, kind="baseline", backend="eager")
    return [row, baseline]


def _write(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return str(path)


def test_compare_flags_a_doubled_time(tmp_path):
    old = _write(tmp_path, "old.json", _rows(10.0, 9.5, 10.5))
    slowed = _rows(10.0, 9.5, 10.5)
    slowed[0].update(time_ms_median=20.0, time_ms_min=19.0, time_ms_max=21.0)  # kltriton 2x slower, eager not
    assert cli.main(["compare", old, _write(tmp_path, "new.json", slowed)]) != 0


def test_compare_corrects_for_a_slower_machine(tmp_path):
    """2x slower with the bandwidth measured in the same run halved is the machine, not kltriton;
    --absolute still flags it, and a 2x slowdown at unchanged bandwidth is flagged."""
    old_rows, new_rows = _rows(10.0, 9.5, 10.5), _rows(20.0, 19.0, 21.0)
    for row in old_rows:
        row["bw_ref_gbps"] = 10.0
    for row in new_rows:
        row["bw_ref_gbps"] = 5.0
    old, new = _write(tmp_path, "old.json", old_rows), _write(tmp_path, "new.json", new_rows)
    assert cli.main(["compare", old, new]) == 0
    assert cli.main(["compare", old, new, "--absolute"]) != 0
    for row in new_rows:
        row["bw_ref_gbps"] = 10.0
    assert cli.main(["compare", old, _write(tmp_path, "same_bw.json", new_rows)]) != 0


def test_compare_passes_identical_and_overlapping_noise(tmp_path):
    old_rows = _rows(10.0, 9.0, 14.0)
    old = _write(tmp_path, "old.json", old_rows)
    assert cli.main(["compare", old, _write(tmp_path, "same.json", copy.deepcopy(old_rows))]) == 0
    # Median 20% slower but the spreads overlap: noise, not a regression.
    assert cli.main(["compare", old, _write(tmp_path, "noisy.json", _rows(12.0, 11.0, 16.0))]) == 0


def test_compare_does_not_gate_baselines(tmp_path):
    old_rows, new_rows = _rows(10.0, 9.5, 10.5), _rows(10.0, 9.5, 10.5)
    new_rows[1].update(time_ms_median=30.0, time_ms_min=29.0, time_ms_max=31.0)
    assert cli.main(["compare", _write(tmp_path, "a.json", old_rows), _write(tmp_path, "b.json", new_rows)]) == 0


def test_plot_writes_pngs(smoke_results):
    pytest.importorskip("matplotlib")
    from benchmarks.plot import plot

    for path in plot(smoke_results):
        assert path.exists() and path.stat().st_size > 0
