"""``python -m benchmarks gpu``: the dry run lists every step on any machine, and the summary
table reads benchmark rows (the real run needs a CUDA device)."""
from benchmarks import cli, gpu


def test_dry_run_lists_every_step(tmp_path, capsys):
    assert cli.main(["gpu", "--out", str(tmp_path / "run"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for step in ("check", "host", "bench_token_logprobs", "bench_token_kl", "bench_fused_kl_reward",
                 "bench_policy_loss", "plots"):
        assert f"[{step}," in out
    assert "[static," not in out  # only with --static: it compiles every kernel, as this machine does without a GPU
    assert "KLTRITON_TEST_DEVICE=cuda TRITON_INTERPRET=0" in out
    # the lease: every step's limit (the plots once per op's JSON) inside 8 minutes
    steps = [name for name, _ in gpu.steps(tmp_path, tmp_path, 90)] + ["wheels"]
    assert sum(gpu.LIMITS[name] for name in steps) + 3 * gpu.LIMITS["plots"] < 8 * 60
    assert not (tmp_path / "run").exists()  # nothing ran


def test_summary_table_shares_of_read_bandwidth():
    case = dict(op="token_logprobs", mode="forward", tokens=8192, vocab=151936, dtype="bf16", masked_frac=0.0)
    rows = [dict(case, kind="bandwidth", backend="read_amax", gbps=3000.0, time_ms_median=None),
            dict(case, kind="kltriton", backend="triton", time_ms_median=1.0, bytes_moved=2.7e9, note=None),
            dict(case, kind="baseline", backend="liger", time_ms_median=None, note="liger not installed")]
    table = gpu.summary_table(rows)
    assert "| token_logprobs | forward | 8192 | 151936 | bf16 | 0.00 | 3000 | 90% | 1.000 | - |" in table
    assert "not run: liger: liger not installed" in table


def test_bench_writes_after_every_case(tmp_path):
    """The per-op step on the CPU smoke grid: a JSON of rows, every baseline present or a note."""
    import json

    path = gpu.bench("token_logprobs", str(tmp_path), grid="smoke", device="cpu")
    rows = json.loads(path.read_text())
    assert path.name == "cpu-smoke_token_logprobs.json"
    timed = [r for r in rows if r["kind"] != "bandwidth"]
    assert {"eager", "cpp", "liger", "trl_installed"} <= {r["backend"] for r in timed}
    assert all(r["time_ms_median"] is not None or r["note"] for r in timed)
    assert "| token_logprobs |" in gpu.summary_table(rows)


def test_check_processes_split_the_tests_between_them(tmp_path):
    """The check step's ``KLTRITON_TEST_SPLIT`` parts are disjoint and together the whole file."""
    import os
    import subprocess
    import sys

    def collected(extra_env):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                               *gpu.CHECK], cwd=gpu.REPO, env=dict(os.environ, **extra_env), capture_output=True,
                              text=True, check=True)
        return [line for line in done.stdout.splitlines() if "::" in line]

    commands = gpu.steps(tmp_path)[0][1]
    assert len(commands) == gpu.CHECK_PROCESSES
    parts = [collected({"KLTRITON_TEST_SPLIT": env["KLTRITON_TEST_SPLIT"]}) for _, env in commands]
    whole = collected({})
    assert len(whole) > gpu.CHECK_PROCESSES and all(parts)
    assert sorted(sum(parts, [])) == sorted(whole)


def test_a_step_runs_its_commands_at_once_and_stops_them_at_its_limit(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(gpu.LIMITS, "check", 3)
    quick = ([sys.executable, "-c", "print('done')"], {})
    slow = ([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], {})
    result = gpu._run_step("check", [slow, quick, slow], tmp_path)
    assert result["status"] == "stopped at its 3 s limit" and result["seconds"] < 10  # at once: 3 s, not 3 x 3 s
    assert (tmp_path / "check-1.log").read_text().strip() == "done"
    assert result["last_line"] == "started / done / started"
    assert gpu._run_step("check", [quick, quick], tmp_path)["status"] == "ok"
