"""``python -m benchmarks ab OLD_TREE``: this checkout's kltriton against another one's (a commit before a change)
on the same machine, in interleaved pairs.

Both sides are timed by this checkout's harness (``benchmarks/``): each run sees one tree's ``kltriton`` through a
directory of two links, ``benchmarks`` (this checkout's) and ``kltriton`` (the tree's), so only the library differs
and the old tree needs no benchmark code of its own (its C++ library builds from its own ``csrc``, cached by the
hash of its sources). Each round runs ``python -m benchmarks run`` once per tree, in alternating order (old, new;
new, old; ...), so a machine that speeds up or slows down over the minutes weighs on both sides alike. For every
row (op, backend, mode, shape, dtype, mask) the ratio ``new / old`` of the two medians is taken within each round,
and the median of those ratios over the rounds is reported with their min and max: a pair ratio is what survives a
shared, drifting machine, where two separate runs' absolute times do not (``compare``). A gated row
(``compare.GATED``) is a regression when its median ratio exceeds ``1 + threshold`` and every round's ratio is
above 1. By default only the gated backends are timed, without the peak-memory processes.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.compare import EXIT_OK, EXIT_REGRESSION, GATED, KEY, THRESHOLD

NEW_TREE = Path(__file__).resolve().parent.parent


def _run(tree: Path, grid: str, ops, device: str, methods, out: Path) -> dict:
    """``{row key: median ms}`` of one ``benchmarks run`` of this checkout's harness on ``tree``'s kltriton."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as view:
        (Path(view) / "benchmarks").symlink_to(NEW_TREE / "benchmarks")
        (Path(view) / "kltriton").symlink_to(tree / "kltriton")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [view, os.environ.get("PYTHONPATH")])))
        subprocess.run([sys.executable, "-m", "benchmarks", "run", "--device", device, "--grid", grid, "--ops", *ops,
                        "--methods", *methods, "--no-memory", "--out", str(out)], cwd=view, env=env, check=True,
                       stdout=subprocess.DEVNULL)
    (path,) = out.glob("*.json")
    rows = json.loads(path.read_text())
    return {tuple(r[k] for k in KEY): r["time_ms_median"] for r in rows
            if r["kind"] != "bandwidth" and r["time_ms_median"] is not None}


def ab(old_tree: Path, rounds: int, grid: str, ops, device: str, threshold: float = THRESHOLD, out=None,
       methods=GATED) -> int:
    old_tree = Path(old_tree).resolve()
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = [("old", old_tree), ("new", NEW_TREE)]
            if r % 2:
                order.reverse()
            times = {name: _run(tree, grid, ops, device, methods, Path(tmp) / f"{r}-{name}") for name, tree in order}
            for key, new_ms in times["new"].items():
                if key in times["old"] and times["old"][key] > 0:
                    ratios.setdefault(key, []).append(new_ms / times["old"][key])
    rows, regressed = [], []
    print(f"new / old, median of {rounds} interleaved pairs (min..max); old = {old_tree}")
    print(f"{'op':16s} {'backend':9s} {'mode':8s} {'tokens':>6s} {'vocab':>7s} {'dtype':5s} {'mask':>4s}  ratio")
    for key, values in sorted(ratios.items(), key=lambda kv: tuple(map(str, kv[0]))):
        op, backend, mode, tokens, vocab, dtype, masked = key
        median = statistics.median(values)
        bad = backend in GATED and median > 1 + threshold and min(values) > 1
        regressed += [key] if bad else []
        rows.append(dict(zip(KEY, key), ratio_median=median, ratio_min=min(values), ratio_max=max(values),
                         rounds=len(values), regression=bad))
        print(f"{op:16s} {backend:9s} {mode:8s} {tokens:6d} {vocab:7d} {dtype:5s} {masked:4.2f}  "
              f"{median:.3f} ({min(values):.3f}..{max(values):.3f}){'  REGRESSION' if bad else ''}")
    if out is not None:
        Path(out).write_text(json.dumps(dict(old_tree=str(old_tree), grid=grid, device=device, rounds=rounds,
                                             rows=rows), indent=1))
        print(f"wrote {out}")
    print(f"{len(regressed)} gated row(s) slower than {1 + threshold:.2f}x in every round" if regressed
          else "no gated row slower in every round beyond the threshold")
    return EXIT_REGRESSION if regressed else EXIT_OK
