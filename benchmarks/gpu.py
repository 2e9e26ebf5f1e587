"""One-command GPU validation: ``python -m benchmarks gpu --out DIR [--dry-run] [--wheels DIR] [--static]``.

On one CUDA GPU (sized for an H100 / H200: every step's limit together under 8 minutes) it runs, each step a
subprocess with its own time limit so that one failing or slow step never stops the others:

1. ``wheels``: optional packages carried as wheel files (trl, liger-kernel, flash-attn: the GPU
   machines have no network) installed into ``DIR/site`` and put on ``PYTHONPATH`` for the steps.
2. ``check``: every kernel family's main variants on CUDA against the float64 reference
   (``tests/properties/test_device_families.py`` with ``KLTRITON_TEST_DEVICE=cuda``, a vocabulary of 151,936, bf16
   and fp32) and every public call captured in a CUDA graph and replayed, its eager call without a synchronization
   (``tests/properties/test_cuda_graphs.py``), split over ``CHECK_PROCESSES`` pytest processes at once
   (``KLTRITON_TEST_SPLIT``) so that their kernels compile in parallel, into one Triton cache the later steps reuse;
   JUnit XML and a log per process in ``DIR``. (The whole suite is written for CPU tensors and would spend the lease
   compiling.)
3. ``host``: ``python -m benchmarks host --device cuda``: per public call the ops dispatched, the host reads, the
   kernel launches (the profiler's) and the host time against eager.
4. ``bench_<op>``: the ``gpu`` benchmark grid (N 256 and 8192, V 32000 and 151936, bf16) of every op with every
   baseline that can run here (eager, TRL's formula and the installed ``trl``'s own function, Liger and flash-attn
   when importable); a baseline that cannot run is a note in its rows, never a failure. The JSON
   (``cuda-gpu_<op>.json``) is rewritten after every case, so a step stopped at its limit keeps its finished cases.
5. ``plots``: PNGs of each results JSON (needs matplotlib).
6. ``static`` (with ``--static`` only; it compiles every kernel, which this machine does as well without a GPU:
   ``python -m benchmarks static``): the static SASS report for this GPU's compute capability.

Then ``DIR/summary.md`` (and ``summary.json``): each step's status and time, and per op, mode and
case the median time of every method and kltriton's share of the measured read bandwidth.
``--dry-run`` prints the steps and commands without running anything (works on any machine).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPS = ("token_logprobs", "token_kl", "fused_kl_reward", "policy_loss")
# Seconds per step, together under 8 minutes with the start-up of each process. Measured on the first H100 run
# (2026-11-27): one op's three gpu-grid cases with every baseline took 37-57 s (four cases now); the whole test suite
# ran ~30 tests in 150 s (each new kernel variant compiles first), the static report did not finish 164 kernels in
# 45 s on 16 cores.
LIMITS = {"wheels": 20, "check": 150, "host": 45, "bench_token_logprobs": 55, "bench_token_kl": 55,
          "bench_fused_kl_reward": 55, "bench_policy_loss": 55, "plots": 10, "static": 120}
CHECK = ("tests/properties/test_device_families.py", "tests/properties/test_cuda_graphs.py")
CHECK_PROCESSES = 4  # the check's tests (28) split over processes that compile at once (16 cores on the GPU machines)


def _check(out: Path, py: str):
    """The check step's commands: one pytest process per part of the tests, each with a share of the CPU threads
    (the float64 reference runs there)."""
    threads = str(max(1, (os.cpu_count() or 1) // CHECK_PROCESSES))
    return [([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={out / f'check-{i}.xml'}", *CHECK],
             {"KLTRITON_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "0", "KLTRITON_TEST_SPLIT": f"{i}/{CHECK_PROCESSES}",
              "OMP_NUM_THREADS": threads})
            for i in range(CHECK_PROCESSES)]


def steps(out: Path, wheels: Path = None, arch: int = 90, static: bool = False):
    """``(name, [(argv, extra environment), ...])`` of every step, in order: a step's commands run at once."""
    py = sys.executable
    found = []
    if wheels is not None and any(wheels.glob("*.whl")):
        found.append(("wheels", [([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                   "--target", str(out / "site"), *sorted(str(w) for w in wheels.glob("*.whl"))],
                                  {})]))
    found.append(("check", _check(out, py)))
    found.append(("host", [([py, "-m", "benchmarks", "host", "--device", "cuda", "--seconds", "0.5", "--out",
                             str(out)], {"TRITON_INTERPRET": "0"})]))
    for op in OPS:
        found.append((f"bench_{op}", [([py, "-c", BENCH, op, str(out)], {"TRITON_INTERPRET": "0"})]))
    if static:
        found.append(("static", [([py, "-m", "benchmarks", "static", "--arch", str(arch), "--jobs",
                                   str(os.cpu_count() or 1), "--out", str(out)], {"TRITON_INTERPRET": "0"})]))
    return found


BENCH = "import sys; from benchmarks.gpu import bench; bench(*sys.argv[1:])"


def bench(op: str, out: str, grid: str = "gpu", device: str = "cuda") -> Path:
    """The ``grid`` of one op, case by case: the JSON is rewritten after every case, so a step
    stopped at its time limit keeps the cases it finished. Returns the JSON's path."""
    import importlib

    from benchmarks import harness

    cases = harness.GRIDS[grid]
    module = importlib.import_module(f"benchmarks.bench_{op}")
    path = Path(out) / f"{device}-{grid}_{op}.json"
    rows = []
    for case in cases.cases:
        one = harness.Grid((case,), skip=cases.skip, cpu_target_s=cases.cpu_target_s, cpu_rounds=cases.cpu_rounds)
        rows += harness.run_op(module, one, device)
        path.write_text(json.dumps(rows, indent=1))
    print(f"wrote {len(rows)} rows to {path}")
    return path


def _run_step(name, commands, out: Path) -> dict:
    """Run a step's commands at once, each logging to ``DIR/<name>[-i].log``, all stopped at the step's limit."""
    site = out / "site"
    logs = [out / (f"{name}.log" if len(commands) == 1 else f"{name}-{i}.log") for i in range(len(commands))]
    start = time.monotonic()
    running, status = [], "ok"
    try:
        for (argv, extra_env), log in zip(commands, logs):
            env = dict(os.environ, **extra_env)
            if site.is_dir():
                env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")]).rstrip(
                    os.pathsep)
            with open(log, "w") as f:
                running.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT))
        for process in running:
            code = process.wait(timeout=max(0.0, start + LIMITS[name] - time.monotonic()))
            if code != 0 and status == "ok":
                status = f"exit {code}"
    except subprocess.TimeoutExpired:
        status = f"stopped at its {LIMITS[name]} s limit"
    except OSError as err:
        status = f"could not start: {err}"
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
    tails = [log.read_text(errors="replace").strip().splitlines()[-1:] for log in logs if log.exists()]
    return {"step": name, "status": status, "seconds": round(time.monotonic() - start, 1),
            "last_line": " / ".join(tail[0] for tail in tails if tail)}


def summary_table(rows) -> str:
    """Markdown: per op, mode and case, the median ms of every method; for kltriton's Triton rows
    also the share of the read bandwidth measured on the same case (``x.amax(-1)``)."""
    timed = [r for r in rows if r["kind"] != "bandwidth"]
    read = {(r["op"], r["tokens"], r["vocab"], r["dtype"], r["masked_frac"]): r["gbps"]
            for r in rows if r["kind"] == "bandwidth" and r["backend"] == "read_amax"}
    names = list(dict.fromkeys(r["backend"] for r in timed))
    cases = {}
    for r in timed:
        key = (r["op"], r["mode"], r["tokens"], r["vocab"], r["dtype"], r["masked_frac"])
        cases.setdefault(key, {})[r["backend"]] = r
    lines = ["| op | mode | tokens | vocab | dtype | masked | read GB/s | triton % of read | "
             + " | ".join(f"{n} ms" for n in names) + " |",
             "|" + "---|" * (8 + len(names))]
    for (op, mode, tokens, vocab, dtype, masked), by_name in cases.items():
        bw = read.get((op, tokens, vocab, dtype, masked))
        tri = by_name.get("triton")
        share = "-"
        if tri and tri["time_ms_median"] and bw:
            share = f"{100 * tri['bytes_moved'] / tri['time_ms_median'] / 1e6 / bw:.0f}%"
        cells = [f"{by_name[n]['time_ms_median']:.3f}" if n in by_name and by_name[n]["time_ms_median"] else "-"
                 for n in names]
        bw_cell = f"{bw:.0f}" if bw else "-"
        lines.append(f"| {op} | {mode} | {tokens} | {vocab} | {dtype} | {masked:.2f} | {bw_cell} | {share} | "
                     + " | ".join(cells) + " |")
    notes = sorted({f"{r['backend']}: {r['note']}" for r in timed if r.get("note") and not r["time_ms_median"]})
    return "\n".join(lines + ([""] + [f"- not run: {n}" for n in notes] if notes else []))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for logs, JSON, PNGs and summary.md")
    parser.add_argument("--wheels", type=Path, help="directory of .whl files to install first (no network there)")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and commands, run nothing")
    parser.add_argument("--static", action="store_true", help="also the static SASS report (compiles every kernel)")
    args = parser.parse_args(argv)
    arch = 90
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("benchmarks gpu: no CUDA device is available (use --dry-run to list the steps)")
            return 2
        major, minor = torch.cuda.get_device_capability()
        arch = 10 * major + minor
    plan = steps(args.out, args.wheels, arch, args.static)
    if args.dry_run:
        print(f"benchmarks gpu --out {args.out}: {len(plan)} steps, time limits sum to "
              f"{sum(LIMITS[name] for name, _ in plan)} s (+ plots {LIMITS['plots']} s)")
        for name, commands in plan:
            for cmd, extra_env in commands:  # a step's commands run at once
                env = " ".join(f"{k}={v}" for k, v in extra_env.items())
                print(f"[{name}, {LIMITS[name]} s] {env + ' ' if env else ''}{shlex.join(str(c) for c in cmd)}")
        print(f"[plots, {LIMITS['plots']} s] python -m benchmarks plot <each cuda-gpu_*.json>")
        print(f"then {args.out / 'summary.md'} and summary.json")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, commands in plan:
        results.append(_run_step(name, commands, args.out))
        print(f"{name:24s} {results[-1]['status']:30s} {results[-1]['seconds']:6.1f} s  {results[-1]['last_line']}",
              flush=True)
    rows = []
    for path in sorted(args.out.glob("cuda-gpu_*.json")):
        rows += json.loads(path.read_text())
        results.append(_run_step("plots", [([sys.executable, "-m", "benchmarks", "plot", str(path)], {})], args.out))
    table = summary_table(rows) if rows else "no benchmark rows were written"
    steps_md = "\n".join(f"| {r['step']} | {r['status']} | {r['seconds']} |" for r in results)
    (args.out / "summary.md").write_text(f"| step | status | s |\n|---|---|---|\n{steps_md}\n\n{table}\n")
    (args.out / "summary.json").write_text(json.dumps({"steps": results}, indent=1))
    print()
    print(table)
    return 0 if all(r["status"] == "ok" for r in results) else 1
