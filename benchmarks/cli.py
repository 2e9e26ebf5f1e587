"""Command line: ``python -m benchmarks run | compare | ab | plot | static | gpu | host`` (see ``--help`` of each)."""
import argparse
import dataclasses
import datetime
import importlib
import json
import re
import sys
from pathlib import Path

from benchmarks import compare, harness

OPS = ("token_logprobs", "token_kl", "fused_kl_reward", "policy_loss")
RESULTS = Path(__file__).resolve().parent / "results"


def _parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="time every op and baseline, write a JSON list of rows")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    run.add_argument("--grid", choices=tuple(harness.GRIDS), default="small")
    run.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    run.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON (default benchmarks/results)")
    run.add_argument("--methods", nargs="+", default=(), help="only these methods (e.g. cpp eager; default: all)")
    run.add_argument("--no-memory", action="store_true", help="CPU: skip the peak-memory processes")
    gate_help = (f"exit {compare.EXIT_REGRESSION} when a kltriton row got slower than OLD beyond noise, else "
                 f"{compare.EXIT_UNRELIABLE} when one cannot be judged (a flagged row, a bandwidth drift beyond "
                 f"--max-drift), else {compare.EXIT_OK}")
    gate = sub.add_parser("compare", help=gate_help, description=gate_help)
    gate.add_argument("old", type=Path)
    gate.add_argument("new", type=Path)
    gate.add_argument("--threshold", type=float, default=compare.THRESHOLD,
                      help=f"allowed median slowdown (default {compare.THRESHOLD})")
    gate.add_argument("--absolute", action="store_true",
                      help="compare raw times (default: correct kltriton rows for the drop of the bandwidth "
                           "measured on the same case)")
    gate.add_argument("--max-drift", type=float, default=compare.MAX_DRIFT,
                      help="bandwidth change between the runs, either way, beyond which a kltriton row is "
                           f"unreliable (default {compare.MAX_DRIFT})")
    pairs = sub.add_parser("ab", help="this checkout against another (OLD_TREE, e.g. a git worktree of the commit "
                           "before a change): interleaved runs, the median of the per-round new/old ratios")
    pairs.add_argument("old_tree", type=Path)
    pairs.add_argument("--rounds", type=int, default=3)
    pairs.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    pairs.add_argument("--grid", choices=tuple(harness.GRIDS), default="small")
    pairs.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    pairs.add_argument("--threshold", type=float, default=compare.THRESHOLD)
    pairs.add_argument("--out", type=Path, default=None, help="write the ratios as JSON here")
    pairs.add_argument("--methods", nargs="+", default=list(compare.GATED),
                       help="the methods timed (default: the gated kltriton backends)")
    plot = sub.add_parser("plot", help="write PNG plots next to a results JSON (needs matplotlib)")
    plot.add_argument("results", type=Path)
    sub.add_parser("static", help="compile every Triton kernel for sm_90, report registers, spills, SASS per element")
    sub.add_parser("gpu", help="one-command GPU validation: tests, benchmark grid, static report, summary")
    sub.add_parser("host", help="ops dispatched, host reads and host time of every public call at a tiny shape")
    return parser


def _run(args) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available")
        return 2
    grid = dataclasses.replace(harness.GRIDS[args.grid], only=tuple(args.methods), memory=not args.no_memory)
    rows = []
    for op in args.ops:
        rows += harness.run_op(importlib.import_module(f"benchmarks.bench_{op}"), grid, args.device)
    slug = re.sub(r"[^a-z0-9]+", "-", rows[0]["device_name"].lower()).strip("-")[:40]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.device}-{slug}_{args.grid}_{stamp}.json"
    path.write_text(json.dumps(rows, indent=1))
    print()
    print(headline(rows))
    flagged = [r for r in rows if r["flags"]]
    if flagged:
        print(f"\n{len(flagged)} row(s) flagged as implausible (compare will not use them as a baseline; re-run):")
        for row in flagged:
            print(harness.describe(row))
    print(f"\nwrote {len(rows)} rows to {path}")
    return 0


def headline(rows) -> str:
    """Median ms per backend (columns) for every op / mode / case (lines); '-' where not run."""
    timed = [r for r in rows if r["kind"] != "bandwidth" and r["time_ms_median"] is not None]
    names = list(dict.fromkeys(r["backend"] for r in timed))
    cases = {}
    for r in timed:
        key = (r["op"], r["mode"], r["tokens"], r["vocab"], r["dtype"], r["masked_frac"])
        cases.setdefault(key, {})[r["backend"]] = r["time_ms_median"]
    lines = [f"{'op':16s} {'mode':8s} {'tokens':>6s} {'vocab':>7s} {'dtype':5s} {'mask':>4s} "
             + " ".join(f"{n:>14s}" for n in names)]
    for (op, mode, tokens, vocab, dtype, masked), by_name in cases.items():
        cells = " ".join(f"{by_name[n]:14.2f}" if n in by_name else f"{'-':>14s}" for n in names)
        lines.append(f"{op:16s} {mode:8s} {tokens:6d} {vocab:7d} {dtype:5s} {masked:4.2f} {cells}")
    return "\n".join(lines)


SUBCOMMANDS = {"static": "benchmarks.static", "gpu": "benchmarks.gpu", "host": "benchmarks.host"}  # own argument parsers


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command == "compare":
        return compare.compare(args.old, args.new, args.threshold, args.absolute, args.max_drift)
    if args.command == "ab":
        from benchmarks.ab import ab

        return ab(args.old_tree, args.rounds, args.grid, args.ops, args.device, args.threshold, args.out, args.methods)
    from benchmarks.plot import plot

    for path in plot(args.results):
        print(f"wrote {path}")
    return 0
