"""The fused policy loss on the C++ CPU backend against the two-pass route, and the entropy mask's cost.

Run: ``python benchmarks/cpu_loss_ratios.py [--pairs 15] [--threads 2]``. Prints a table and writes
``benchmarks/results/cpu_loss_ratios.json`` (naming the CPU and its vector capability).

Cases, all forward + backward from fp32 logits ``[16, 128, 32000]`` (2048 x 32000) with reference logits and the
``k3`` KL (``kl_coef=0.04``), PPO clip 0.2 / 0.28:

- ``fused``: ``policy_loss(x, ..., ref=ref_logits)`` on the ``cpp`` backend (one kernel reads both logits, the
  gradient written in the forward);
- ``fused, no entropy``: the same with ``compute_entropy=False`` (the two-pass route's work: no entropy metric);
- ``two-pass``: ``token_logprobs`` of the policy and of the reference, then verl's loss and k3 in torch and
  autograd (the gradient pass reads the logits again); target: fused at least 1.4x faster;
- ``entropy mask``: ``fused`` with ``token_mask_entropy_quantile=0.8`` (TRL's ``top_entropy_quantile=0.2``);
  target: at most 1.25x the fused time.

The machine is shared and noisy: each pair of methods runs back to back, alternating which goes first, and the
ratio reported is the median of the per-pair ratios (with the medians of each method's times).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kltriton  # noqa: E402
from benchmarks.bench_policy_loss import verl_vanilla  # noqa: E402
from benchmarks.cpu_cpp_ratios import cpu_name, git_commit, logits_pair  # noqa: E402
from kltriton.kernels import cpp_library  # noqa: E402

B, T, V = 16, 128, 32000
CLIP_LOW, CLIP_HIGH, KL_COEF = 0.2, 0.28, 0.04


def inputs():
    gen = torch.Generator().manual_seed(0)
    x, ref, labels = logits_pair(B, T, V, gen)
    with torch.no_grad():
        old = kltriton.token_logprobs(x, labels, backend="cpp") + 0.2 * torch.randn(B, T, generator=gen)
    return x, ref, labels, old, torch.randn(B, generator=gen), torch.ones(B, T, dtype=torch.bool)


def methods(x, ref, labels, old, adv, mask):
    common = dict(old_logprobs=old, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=KL_COEF, kl_estimator="k3",
                  backend="cpp")

    def fused():
        kltriton.policy_loss(x.detach().requires_grad_(), labels, adv, ref=ref, **common).loss.backward()

    def fused_no_entropy():
        kltriton.policy_loss(x.detach().requires_grad_(), labels, adv, ref=ref, compute_entropy=False,
                             **common).loss.backward()

    def entropy_mask():
        kltriton.policy_loss(x.detach().requires_grad_(), labels, adv, ref=ref, token_mask_entropy_quantile=0.8,
                             **common).loss.backward()

    def two_pass():
        xr = x.detach().requires_grad_()
        with torch.no_grad():
            ref_logp = kltriton.token_logprobs(ref, labels, backend="cpp")
        verl_vanilla(kltriton.token_logprobs(xr, labels, backend="cpp"), old, adv, mask, ref_logp).backward()

    return {"fused": fused, "fused, no entropy": fused_no_entropy, "two-pass": two_pass,
            "entropy mask": entropy_mask}


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def pairs(a, b, n):
    """``n`` back-to-back timings of ``a`` and ``b`` (alternating the order): ``(a_times, b_times)``."""
    ta, tb = [], []
    for i in range(n):
        if i % 2:
            tb.append(seconds(b))
            ta.append(seconds(a))
        else:
            ta.append(seconds(a))
            tb.append(seconds(b))
    return ta, tb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_loss_ratios.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    how = cpp_library.load()
    validation = kltriton.set_validation(False)
    run = methods(*inputs())
    for fn in run.values():  # warm-up
        fn()
    rows = []
    for kernel, baseline, kind, target in (("fused", "two-pass", "speedup", 1.4),
                                           ("fused, no entropy", "two-pass", "speedup", 1.4),
                                           ("entropy mask", "fused", "slowdown", 1.25)):
        tk, tb = pairs(run[kernel], run[baseline], args.pairs)
        per_pair = [b / k if kind == "speedup" else k / b for k, b in zip(tk, tb)]
        ratio = statistics.median(per_pair)
        rows.append({"case": f"policy_loss fwd+bwd fp32 {B * T}x{V}, ref logits + k3", "kernel": kernel,
                     "kernel_ms": statistics.median(tk) * 1e3, "baseline": baseline,
                     "baseline_ms": statistics.median(tb) * 1e3, "metric": kind, "ratio": ratio,
                     "ratio_min": min(per_pair), "ratio_max": max(per_pair), "pairs": args.pairs, "target": target,
                     "meets_target": ratio >= target if kind == "speedup" else ratio <= target})
    kltriton.set_validation(validation)
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"device: cpu ({cpu_name()}), capability {capability}, threads={torch.get_num_threads()}, "
          f"torch {torch.__version__}; C++ backend: {how}")
    for r in rows:
        print(f"{r['kernel']:17s} {r['kernel_ms']:8.2f} ms  {r['baseline']:9s} {r['baseline_ms']:8.2f} ms  "
              f"{r['metric']} {r['ratio']:.2f}x (pairs {r['ratio_min']:.2f}-{r['ratio_max']:.2f}), "
              f"target {'>=' if r['metric'] == 'speedup' else '<='} {r['target']}x: "
              f"{'yes' if r['meets_target'] else 'NO'}")
    result = {"device": "cpu", "cpu_model": cpu_name(), "cpu_capability": capability,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "commit": git_commit(),
              "load_average_1_5_15_min": os.getloadavg(),  # the machine is shared: how busy it was
              "method": "interleaved pairs, median of the per-pair ratios", "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
