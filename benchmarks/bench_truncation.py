"""Truncated sampling on the C++ CPU backend: ``token_logprobs(..., truncation=...)`` against the plain call.

Run: ``python benchmarks/bench_truncation.py [--rounds 15] [--n 2048] [--vocab 32000]``. fp32 logits
(``randn * 3``), labels at the row max (inside every kept set). The cases run round-robin, one call each per
round, so the noise of a shared machine falls on all of them alike; the JSON holds every case's median (ms) and
its ratio to the plain forward (or forward + backward). Writes
``benchmarks/results/cpu_truncation_<cpu>.json``.

Targets (forward): replay with K = 50 <= 1.3x the plain forward, recompute top_p = 0.9 <= 3x, top_k = 50 <= 2x.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kltriton  # noqa: E402
from benchmarks.cpu_cpp_ratios import cpu_name, git_commit  # noqa: E402
from kltriton.kernels import cpp_library  # noqa: E402

TARGETS = {"replay K=50": 1.3, "top_p=0.9": 3.0, "top_k=50": 2.0}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.n, args.vocab) * 3
    labels = x.argmax(-1)
    support = x.topk(50).indices
    truncations = {"plain": None, "replay K=50": kltriton.Truncation(support=support),
                   "top_p=0.9": kltriton.Truncation(top_p=0.9), "top_k=50": kltriton.Truncation(top_k=50),
                   "min_p=0.05": kltriton.Truncation(min_p=0.05),
                   "top_k=50 top_p=0.9 min_p=0.05": kltriton.Truncation(top_k=50, top_p=0.9, min_p=0.05)}
    xg = x.clone().requires_grad_()

    def forward(truncation):
        with torch.no_grad():
            kltriton.token_logprobs(x, labels, truncation=truncation, backend="cpp")

    def forward_backward(truncation):
        kltriton.token_logprobs(xg, labels, truncation=truncation, backend="cpp").sum().backward()
        xg.grad = None

    cases = {(name, kind): (fn, t) for name, t in truncations.items()
             for kind, fn in (("fwd", forward), ("fwd+bwd", forward_backward))}
    for fn, t in cases.values():  # warm-up (and the C++ build)
        fn(t)
    times = {key: [] for key in cases}
    for _ in range(args.rounds):
        for key, (fn, t) in cases.items():
            start = time.perf_counter()
            fn(t)
            times[key].append((time.perf_counter() - start) * 1e3)
    medians = {key: statistics.median(v) for key, v in times.items()}
    results = []
    for (name, kind), ms in medians.items():
        ratio = ms / medians[("plain", kind)]
        row = {"case": name, "pass": kind, "median_ms": round(ms, 3), "ratio_to_plain": round(ratio, 3),
               "spread_ms": [round(min(times[(name, kind)]), 3), round(max(times[(name, kind)]), 3)]}
        if kind == "fwd" and name in TARGETS:
            row.update(target=TARGETS[name], meets_target=ratio <= TARGETS[name])
        results.append(row)
        print(f"{name:32s} {kind:8s} {ms:9.2f} ms  x{ratio:5.2f}" + (f"  (target <= {TARGETS[name]})"
                                                                    if "target" in row else ""))
    cpu = cpu_name()
    out = args.out or ROOT / "benchmarks" / "results" / f"cpu_truncation_{re.sub(r'[^a-z0-9]+', '-', cpu.lower())}.json"
    out.write_text(json.dumps({
        "device": "cpu", "cpu_model": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "git_commit": git_commit(), "backend": cpp_library.load(), "shape": [args.n, args.vocab], "dtype": "float32",
        "rounds": args.rounds, "method": "round-robin, one call per case per round; medians",
        "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
