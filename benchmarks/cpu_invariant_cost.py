"""The invariant mode's cost on the C++ CPU backend: each op with ``kltriton.set_invariant(True)`` against the
default mode, forward + backward.

Run: ``python benchmarks/cpu_invariant_cost.py [--pairs 9] [--threads 2]``. Prints a table and writes
``benchmarks/results/cpu_invariant_cost.json`` (naming the CPU and its vector capability).

Cases, fp32 logits ``[8, 128, 32000]`` (N = 1024 rows, V = 32000), ``backend="cpp"``, forward and the backward of a
weighted sum of the outputs:

- ``token_logprobs``: the log-probs;
- ``token_logprobs, forward``: the same without a gradient (``torch.no_grad()``);
- ``token_logprobs + entropy``: with ``return_entropy=True``;
- ``fused_kl_reward``: with reference logits, the ``k3`` estimator, ``coef=0.05``.

The machine is shared and noisy: the two modes run back to back, alternating which goes first, and the ratio
reported is the median of the per-pair ratios (with the medians of each mode's times).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kltriton  # noqa: E402
from benchmarks.cpu_cpp_ratios import cpu_name, git_commit, logits_pair  # noqa: E402

B, T, V = 8, 128, 32000


def inputs():
    gen = torch.Generator().manual_seed(0)
    x, ref, labels = logits_pair(B, T, V, gen)
    weights = torch.randn(B, T, generator=gen)
    return x, ref, labels, weights


def cases(x, ref, labels, weights):
    def logprobs():
        leaf = x.detach().requires_grad_()
        (kltriton.token_logprobs(leaf, labels, backend="cpp") * weights).sum().backward()

    def logprobs_forward():
        with torch.no_grad():
            kltriton.token_logprobs(x, labels, backend="cpp")

    def logprobs_entropy():
        leaf = x.detach().requires_grad_()
        logp, entropy = kltriton.token_logprobs(leaf, labels, return_entropy=True, backend="cpp")
        ((logp + entropy) * weights).sum().backward()

    def kl_reward():
        leaf = x.detach().requires_grad_()
        out = kltriton.fused_kl_reward(leaf, ref, labels, coef=0.05, estimator="k3", backend="cpp")
        (out.kl * weights).sum().backward()

    return {"token_logprobs": logprobs, "token_logprobs, forward": logprobs_forward, "token_logprobs + entropy": logprobs_entropy, "fused_kl_reward": kl_reward}


def timed(fn, invariant: bool) -> float:
    previous = kltriton.set_invariant(invariant)
    try:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    finally:
        kltriton.set_invariant(previous)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_invariant_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, fn in cases(*inputs()).items():
        timed(fn, False), timed(fn, True)  # warm-up: the C++ library, the allocator
        default, invariant = [], []
        for pair in range(args.pairs):
            for mode in ((False, True) if pair % 2 == 0 else (True, False)):
                (invariant if mode else default).append(timed(fn, mode))
        ratios = [i / d for i, d in zip(invariant, default)]
        row = {"case": name, "default_ms": statistics.median(default), "invariant_ms": statistics.median(invariant),
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        rows.append(row)
        print(f"{name:28s} default {row['default_ms']:8.1f} ms  invariant {row['invariant_ms']:8.1f} ms  "
              f"ratio {row['ratio_median']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})", flush=True)
    result = {"cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
              "torch": torch.__version__, "commit": git_commit(), "shape": [B, T, V], "dtype": "float32",
              "pairs": args.pairs, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
