"""Truncated sampling on the C++ CPU backend: ``token_logprobs(..., truncation=...)`` against the plain call.

Run: ``python benchmarks/bench_truncation.py [--rounds 15] [--n 2048] [--vocab 32000] [--dtype float32]
[--k 50] [--only replay]``. Logits ``randn * 3`` in ``--dtype``, labels at the row max (inside every kept set),
replay's support the ``--k`` largest ids. The cases run round-robin, one call each per round, so the noise of a
shared machine falls on all of them alike; the JSON holds every case's median (ms) and its ratio to the plain
forward (or forward + backward). ``--only replay`` times the plain call and replay alone. Writes
``benchmarks/results/cpu_truncation_<cpu>.json`` (fp32, every case) or ``cpu_truncation_<cpu>_<dtype>_<only>.json``.

Targets: replay's forward <= 1.3x the plain forward and its forward + backward <= 1.3x the plain forward +
backward; recompute (forward) top_p = 0.9 <= 3x, top_k = 50 <= 2x.
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

TARGETS = {("replay", "fwd"): 1.3, ("replay", "fwd+bwd"): 1.3, ("top_p=0.9", "fwd"): 3.0, ("top_k=50", "fwd"): 2.0}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--k", type=int, default=50, help="replay's support width")
    parser.add_argument("--only", choices=("replay",), default=None, help="time the plain call and replay alone")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = (torch.randn(args.n, args.vocab) * 3).to(DTYPES[args.dtype])
    labels = x.argmax(-1)
    support = x.topk(args.k).indices
    truncations = {"plain": None, "replay": kltriton.Truncation(support=support),
                   "top_p=0.9": kltriton.Truncation(top_p=0.9), "top_k=50": kltriton.Truncation(top_k=50),
                   "min_p=0.05": kltriton.Truncation(min_p=0.05),
                   "top_k=50 top_p=0.9 min_p=0.05": kltriton.Truncation(top_k=50, top_p=0.9, min_p=0.05)}
    if args.only:
        truncations = {name: truncations[name] for name in ("plain", args.only)}
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
        if (name, kind) in TARGETS:
            row.update(target=TARGETS[name, kind], meets_target=ratio <= TARGETS[name, kind])
        results.append(row)
        print(f"{name:32s} {kind:8s} {ms:9.2f} ms  x{ratio:5.2f}" + (f"  (target <= {row['target']})"
                                                                    if "target" in row else ""))
    cpu = cpu_name()
    suffix = "" if args.dtype == "float32" and args.only is None else f"_{args.dtype}_{args.only or 'all'}"
    out = args.out or ROOT / "benchmarks" / "results" / (f"cpu_truncation_{re.sub(r'[^a-z0-9]+', '-', cpu.lower())}"
                                                         f"{suffix}.json")
    out.write_text(json.dumps({
        "device": "cpu", "cpu_model": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "git_commit": git_commit(), "backend": cpp_library.load(), "shape": [args.n, args.vocab], "dtype": args.dtype,
        "replay_k": args.k,
        "rounds": args.rounds, "method": "round-robin, one call per case per round; medians",
        "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
