"""The benchmark harness: the smoke grid runs and writes complete rows; ``compare`` gates regressions.

No assertion here depends on how fast anything ran.
"""
import copy
import json
import sys
import types
import warnings

import pytest
import torch

from benchmarks import baselines, cli, compare, harness


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
        assert isinstance(row["flags"], list)
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


def _row(median, low, high, backend="cpp", mode="forward", bw=None):
    """A timed row of token_kl at 256 x 32000 fp32 (``backend`` "cpp" is gated, "eager" is a baseline)."""
    row = dict.fromkeys(harness.ROW_FIELDS)
    row.update(op="token_kl", kind="kltriton" if backend == "cpp" else "baseline", backend=backend, mode=mode,
               tokens=256, vocab=32000, dtype="fp32", masked_frac=0.0, time_ms_median=median, time_ms_min=low,
               time_ms_max=high, bw_ref_gbps=bw)
    return row


def _rows(median, low, high, bw=None):
    """A gated row and an eager baseline row at the same times."""
    return [_row(median, low, high, bw=bw), _row(median, low, high, backend="eager", bw=bw)]


def _write(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return str(path)


def _compare(tmp_path, old_rows, new_rows, *args):
    """``(exit code, printed table)`` of ``compare`` on the two lists of rows."""
    lines = []
    code = compare.compare(_write(tmp_path, "old.json", old_rows), _write(tmp_path, "new.json", new_rows),
                           *args, out=lines.append)
    return code, "\n".join(lines)


def test_compare_flags_a_doubled_time(tmp_path):
    old = _write(tmp_path, "old.json", _rows(10.0, 9.5, 10.5))
    slowed = _rows(10.0, 9.5, 10.5)
    slowed[0].update(time_ms_median=20.0, time_ms_min=19.0, time_ms_max=21.0)  # kltriton 2x slower, eager not
    assert cli.main(["compare", old, _write(tmp_path, "new.json", slowed)]) == compare.EXIT_REGRESSION


def test_compare_corrects_for_a_slower_machine(tmp_path):
    """2x slower with the bandwidth measured in the same run halved is the machine, not kltriton;
    --absolute still flags it, and a 2x slowdown at unchanged bandwidth is flagged."""
    old_rows, new_rows = _rows(10.0, 9.5, 10.5, bw=10.0), _rows(20.0, 19.0, 21.0, bw=5.0)
    old, new = _write(tmp_path, "old.json", old_rows), _write(tmp_path, "new.json", new_rows)
    assert cli.main(["compare", old, new]) == compare.EXIT_OK
    assert cli.main(["compare", old, new, "--absolute"]) == compare.EXIT_REGRESSION
    same_bw = _write(tmp_path, "same_bw.json", _rows(20.0, 19.0, 21.0, bw=10.0))
    assert cli.main(["compare", old, same_bw]) == compare.EXIT_REGRESSION


def test_compare_calls_a_stalled_probe_unreliable(tmp_path):
    """The case seen: 66x slower while the new run's probe read 0.036 GB/s in a stall. Dividing by
    that drift called it faster; it must be unreliable, with its own exit code."""
    old_rows, new_rows = _rows(1.0, 0.95, 1.05, bw=50.0), _rows(66.0, 65.0, 67.0, bw=0.036)
    code, table = _compare(tmp_path, old_rows, new_rows)
    assert code == compare.EXIT_UNRELIABLE
    assert "UNRELIABLE: bandwidth of the case 1.39e+03x lower in new" in table and "faster" not in table
    # A stall in the old run's probe cannot be trusted either (its rows may be inflated too).
    code, table = _compare(tmp_path, new_rows, old_rows)
    assert code == compare.EXIT_UNRELIABLE and "1.39e+03x lower in old" in table
    # Raw times still see the slowdown; the window is an option.
    assert _compare(tmp_path, old_rows, new_rows, compare.THRESHOLD, True)[0] == compare.EXIT_REGRESSION
    assert cli.main(["compare", _write(tmp_path, "a.json", old_rows), _write(tmp_path, "b.json", new_rows),
                     "--max-drift", "2000"]) == compare.EXIT_OK  # divided by 1389: "faster"


def test_compare_drift_window_edges(tmp_path):
    """Up to MAX_DRIFT the drift is corrected; a 2x slowdown with normal probe noise (1.2x) is a regression."""
    old_rows = _rows(10.0, 9.5, 10.5, bw=40.0)
    assert _compare(tmp_path, old_rows, _rows(19.0, 18.5, 19.5, bw=40.0 / compare.MAX_DRIFT))[0] == compare.EXIT_OK
    assert _compare(tmp_path, old_rows, _rows(19.0, 18.5, 19.5, bw=0.99 * 40.0 / compare.MAX_DRIFT))[0] \
        == compare.EXIT_UNRELIABLE
    assert _compare(tmp_path, old_rows, _rows(20.0, 19.0, 21.0, bw=40.0 / 1.2))[0] == compare.EXIT_REGRESSION


def test_compare_passes_identical_and_overlapping_noise(tmp_path):
    old_rows = _rows(10.0, 9.0, 14.0, bw=30.0)
    code, table = _compare(tmp_path, old_rows, copy.deepcopy(old_rows))
    assert code == compare.EXIT_OK and "0 regression(s), 0 unreliable gated row(s)" in table
    # Median 20% slower but the spreads overlap: noise, not a regression.
    assert _compare(tmp_path, old_rows, _rows(12.0, 11.0, 16.0, bw=30.0))[0] == compare.EXIT_OK


def test_compare_does_not_gate_baselines(tmp_path):
    old_rows, new_rows = _rows(10.0, 9.5, 10.5), _rows(10.0, 9.5, 10.5)
    new_rows[1].update(time_ms_median=30.0, time_ms_min=29.0, time_ms_max=31.0)
    assert cli.main(["compare", _write(tmp_path, "a.json", old_rows), _write(tmp_path, "b.json", new_rows)]) == 0


def _modes(forward, backward, fwd_bwd):
    """The three rows of the cpp method, each ``(median, min, max)``."""
    return [_row(*forward), _row(*backward, mode="backward"), _row(*fwd_bwd, mode="fwd_bwd")]


def test_flag_implausible_spread_and_ordering():
    clean = _modes((2.0, 1.9, 2.2), (3.0, 2.9, 3.1), (5.0, 4.8, 5.5))
    harness.flag_implausible(clean)
    assert [r["flags"] for r in clean] == [[], [], []]
    # The committed outlier: backward 190 ms (all samples) against 21 ms fwd+bwd.
    outlier = _modes((8.9, 8.4, 11.6), (190.2, 187.0, 211.7), (21.3, 20.2, 24.0))
    harness.flag_implausible(outlier)
    assert outlier[0]["flags"] == [] and outlier[2]["flags"] == []
    assert outlier[1]["flags"] == ["ordering: fastest backward call 187 ms > fwd_bwd median 21.3 ms"]
    # One stalled call 20x the fastest: the median is fine, the max is not a usable bound.
    spread = _modes((2.0, 1.9, 2.2), (3.0, 1.7, 34.9), (5.0, 4.8, 5.5))
    harness.flag_implausible(spread)
    assert spread[1]["flags"] == [f"spread: slowest call 20.5x the fastest (limit {harness.MAX_SPREAD:g}x)"]
    assert spread[0]["flags"] == spread[2]["flags"] == []


def test_compare_does_not_use_flagged_baselines(tmp_path):
    # A wide old spread (one stalled call) would call a 2x slower backward "noise (spreads overlap)".
    old_rows = _modes((2.0, 1.9, 2.2), (3.0, 2.9, 40.0), (8.0, 7.8, 8.2))
    new_rows = _modes((2.0, 1.9, 2.2), (6.0, 5.9, 6.1), (8.0, 7.8, 8.2))
    code, table = _compare(tmp_path, old_rows, new_rows)
    assert code == compare.EXIT_UNRELIABLE
    assert "UNRELIABLE: old: spread: slowest call 13.8x the fastest" in table and "noise" not in table
    # A regression elsewhere decides the exit code.
    new_rows[2].update(time_ms_median=16.0, time_ms_min=15.8, time_ms_max=16.2)
    assert _compare(tmp_path, old_rows, new_rows)[0] == compare.EXIT_REGRESSION
    # The committed outlier as a baseline: a new backward of 12 ms would be "faster".
    old_rows = _modes((8.9, 8.4, 11.6), (190.2, 187.0, 211.7), (21.3, 20.2, 24.0))
    new_rows = _modes((8.9, 8.4, 11.6), (12.0, 11.5, 13.0), (21.3, 20.2, 24.0))
    code, table = _compare(tmp_path, old_rows, new_rows)
    assert code == compare.EXIT_UNRELIABLE
    assert "UNRELIABLE: old: ordering: fastest backward call 187 ms" in table and "faster" not in table


def _losses(logits, labels, index):
    losses = torch.nn.functional.cross_entropy(logits, labels, ignore_index=index, reduction="none")
    return losses, torch.zeros_like(losses)


# flash_attn.ops.triton.cross_entropy.cross_entropy_loss in flash-attn 2.8.3 and in 2.5.7.
def _ce_2_8_3(logits, labels, precomputed_lse=None, label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
              ignore_index=-100, inplace_backward=False, process_group=None):
    return _losses(logits, labels, ignore_index)


def _ce_2_5_7(logits, labels, label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0, ignored_index=-100,
              inplace_backward=False, process_group=None):
    return _losses(logits, labels, ignored_index)


@pytest.mark.parametrize("cross_entropy_loss", [_ce_2_8_3, _ce_2_5_7])
def test_flash_attn_baseline_passes_the_ignore_keyword_it_takes(monkeypatch, cross_entropy_loss):
    names = ("flash_attn", "flash_attn.ops", "flash_attn.ops.triton", "flash_attn.ops.triton.cross_entropy")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].cross_entropy_loss = cross_entropy_loss
    x, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    labels[0, 0] = -100
    logprobs = baselines.cross_entropy_logprobs("flash_attn", "cuda")(x, labels)  # "cuda": the fake runs anywhere
    expected = baselines.eager_logprobs(x, labels.clamp(min=0)).masked_fill(labels < 0, 0.0)
    torch.testing.assert_close(logprobs, expected)


def test_plot_writes_pngs(smoke_results):
    """The smoke grid has no unmasked case: its half-masked rows are plotted, with no empty figure."""
    pytest.importorskip("matplotlib")
    from benchmarks.plot import plot

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "nothing to plot" would fail here
        paths = plot(smoke_results)
    assert len(paths) == 3
    for path in paths:
        assert path.exists() and path.stat().st_size > 0


def _mem_row(backend, tokens, mib, op="token_kl"):
    row = _row(1.0, 1.0, 1.0, backend=backend, mode="fwd_bwd")
    row.update(op=op, tokens=tokens, peak_mem_bytes=None if mib is None else mib * 2**20, roofline_frac=0.5,
               device_name="test cpu", torch="2.13", commit="0123456789abcdef")
    return row


def test_plot_draws_coinciding_lines_once_with_every_name():
    """5 backends where 3 coincide (within 0.1%, as peak memory does) give 3 lines, each visible and named."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plot import _lines

    mib = {"cpp": (31, 62), "reference": (125, 158), "eager": (93.7, 187.4), "torchrl_masked": (93.7, 187.3),
           "trl": (93.72, 187.4)}
    rows = [_mem_row(name, tokens, m) for name, pair in mib.items() for tokens, m in zip((256, 512), pair)]
    rows.append(_mem_row("compile", 256, None))  # not measured: no line, no legend entry
    fig, ax = plt.subplots()
    _lines(ax, rows, "tokens", "peak_mem_bytes", 1 / 2**20)
    assert [line.get_label() for line in ax.get_lines()] == ["cpp", "reference", "eager ≈ torchrl_masked ≈ trl"]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[31, 62], [125, 158], [93.7, 187.4]]
    plt.close(fig)
    # Meeting at one point is not coinciding: both lines stay.
    rows = [_mem_row("a", 256, 10), _mem_row("a", 512, 20), _mem_row("b", 256, 10), _mem_row("b", 512, 40)]
    fig, ax = plt.subplots()
    _lines(ax, rows, "tokens", "peak_mem_bytes", 1 / 2**20)
    assert [line.get_label() for line in ax.get_lines()] == ["a", "b"]
    plt.close(fig)


def test_plot_warns_instead_of_writing_empty_figures(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plot import plot

    untimed = [dict(_row(None, None, None), note="cpp: not built")]
    results = tmp_path / "untimed.json"
    results.write_text(json.dumps(untimed))
    with pytest.warns(UserWarning, match="no timed rows; nothing written"):
        assert plot(results) == []
    assert not list(tmp_path.glob("*.png"))
    # Timed rows without memory numbers: the memory figure alone is left out.
    results = tmp_path / "no_memory.json"
    no_memory = [_mem_row("cpp", 256, None), _mem_row("cpp", 512, None)]
    results.write_text(json.dumps(no_memory + [dict(row, mode="forward") for row in no_memory]))
    with pytest.warns(UserWarning, match="memory_vs_tokens.png: nothing to plot for token_kl; not written"):
        paths = plot(results)
    assert [p.name for p in paths] == ["no_memory_time_vs_vocab.png", "no_memory_roofline.png"]


def test_ab_times_each_tree_s_kltriton_with_this_harness(tmp_path):
    """``ab`` of this checkout against itself: one row per timed method, mode and case, only the methods asked for,
    a ratio per round; the old tree needs only its ``kltriton`` (a copy without ``benchmarks/``)."""
    import shutil
    from pathlib import Path

    from benchmarks.ab import ab

    old = tmp_path / "old"
    shutil.copytree(Path(harness.REPO) / "kltriton", old / "kltriton", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(harness.REPO) / "csrc", old / "csrc")
    out = tmp_path / "ab.json"
    assert ab(old, rounds=1, grid="smoke", ops=["token_logprobs"], device="cpu", out=out,
              methods=["reference"]) in (compare.EXIT_OK, compare.EXIT_REGRESSION)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["mode"]) for r in rows} == {("reference", mode) for mode in harness.MODES}
    assert all(r["rounds"] == 1 and r["ratio_median"] > 0 for r in rows)
