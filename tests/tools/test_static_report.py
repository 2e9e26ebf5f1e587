"""The static report of the compiled kernels guards their shape: no spills, 128-bit loads where
V % 16 == 0, no barrier inside a forward vocab loop (``python -m benchmarks static``).

Compiles for sm_90 in a subprocess (the rest of the suite runs the interpreter); ``--quick`` compiles
every variant at two (vocab, dtype) cases, ~30 s cold, seconds once Triton's cache is warm.
"""
import json
import os
import subprocess
import sys


def test_static_report_has_no_problems(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-m", "benchmarks", "static", "--quick", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (path,) = tmp_path.glob("static_sm90_*.json")
    report = json.loads(path.read_text())
    assert report["problems"] == []
    rows = report["rows"]
    forward = [r for r in rows if r["kernel"] == "_stream_forward_kernel"]
    # Every request the bits allow (kltriton.kernels.stream.triton.requests): each statistic's variant is named
    # after it.
    assert {r["variant"] for r in forward} == {
        "fwd", "fwd+entropy", "fwd+reflogp", "fwd+entropy+reflogp", "fwd+reflogp+fullkl", "fwd+entropy+reflogp+fullkl",
        "fwd+reflogp+forwardkl", "fwd+entropy+reflogp+forwardkl", "fwd+reflogp+fullkl+forwardkl",
        "fwd+entropy+reflogp+fullkl+forwardkl", "fwd+head", "fwd+entropy+head"}
    assert all(r["loop_barriers"] == 0 and r["loop_shuffles"] == 0 for r in forward)
    loss = [r for r in rows if r["kernel"] == "_loss_forward_kernel"]
    assert {r["variant"] for r in loss} == {"ppo", "ppo+ref+k3+ent", "ppo+ref+full+ent", "cispo+rlogp+k3+",
                                            "sapo+rlogp+k3", "dppo_kl+ref+full"}
    families = {r["kernel"] for r in rows}
    assert {"_truncated_forward_kernel", "_jsd_forward_kernel", "_jsd_backward_kernel",
            "_accumulate_kernel"} <= families
    # the truncation family's backward: the stream family's kernel with the floor
    stream_backward = {r["variant"] for r in rows if r["kernel"] == "_stream_backward_kernel"}
    assert {"trunc-bwd", "trunc-bwd+plogp"} <= stream_backward
    assert all(r["spill_bytes"] == 0 for r in rows)  # 128-bit loads: report["problems"] (static.problems)
