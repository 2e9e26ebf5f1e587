"""Speed of the C++ CPU backend relative to eager PyTorch and to a single read of the logits.

Run: ``python benchmarks/cpu_cpp_ratios.py [--repeat 7] [--threads N]``. Prints a table and writes
``benchmarks/results/cpu_cpp_ratios.json``. Every number is the best wall time of ``--repeat``
runs after a warm-up; ratios > 1 mean the C++ kernel is faster (``speedup``) or, for the
``x_read`` rows, how many times a plain read (``amax``) the kernel takes.

Targets: forward >= 8x faster than log_softmax+gather and <= 3x an amax read;
bf16 >= 10x faster than log_softmax(x.float())+gather; backward >= 4x faster than eager autograd;
KL forward with both logits (with and without the full KL) <= 2x reading both once;
policy_loss forward + backward >= 1.4x faster than the two-pass route and <= 1.25x one logits copy.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kltriton.kernels import cpp_library, statistics  # noqa: E402
from kltriton.kernels.constants import ENTROPY, FULL_KL, REF  # noqa: E402
from kltriton.kernels.stream import cpp as cpp_stream  # noqa: E402
from kltriton.timing import time_ms  # noqa: E402


def temp(value) -> torch.Tensor:
    """A temperature as the backends take it: a 0-dim float64 tensor."""
    return torch.tensor(value, dtype=torch.float64)


def logits_pair(batch: int, seq: int, vocab: int, gen: torch.Generator):
    """``(x, ref, labels)`` drawn from ``gen``: policy logits ``[batch, seq, vocab]`` (scale 2), reference logits
    near them (``x + 0.1`` noise) and labels ``[batch, seq]``, the inputs of the scripts that time two ways of running
    the same ops on them (``cpu_loss_ratios``, ``cpu_invariant_cost``)."""
    x = torch.randn(batch, seq, vocab, generator=gen) * 2
    ref = x + 0.1 * torch.randn(batch, seq, vocab, generator=gen)
    return x, ref, torch.randint(0, vocab, (batch, seq), generator=gen)


def timeit(fn, repeat: int) -> float:
    """Best wall time in seconds of ``repeat`` runs after a warm-up (robust to other load on a small box)."""
    return min(time_ms(fn, "cpu", cpu_target_s=0.0, min_repeats=repeat)) / 1e3


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_cpp_ratios.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    how = cpp_library.load()
    torch.manual_seed(0)
    rep = args.repeat
    rows = []

    def add(name, kernel_s, base_name, base_s, kind, target):
        ratio = base_s / kernel_s if kind == "speedup" else kernel_s / base_s
        ok = ratio >= target if kind == "speedup" else ratio <= target
        rows.append({"case": name, "kernel_ms": kernel_s * 1e3, "baseline": base_name, "baseline_ms": base_s * 1e3,
                     "metric": kind, "ratio": ratio, "target": target, "meets_target": ok})

    # 1. forward token log-probs, fp32 2048 x 32000
    n, v = 2048, 32000
    x = torch.randn(n, v)
    t = torch.randint(0, v, (n,))
    fwd = lambda: cpp_stream.forward(x, None, t, temp(1.0), 0)  # noqa: E731
    k = timeit(fwd, rep)
    add("fwd logp fp32 2048x32000", k, "log_softmax+gather", timeit(lambda: torch.log_softmax(x, -1).gather(1, t[:, None]), rep),
        "speedup", 8.0)
    amax_x = timeit(lambda: x.amax(-1), rep)
    add("fwd logp fp32 2048x32000", k, "amax (one read)", amax_x, "x_read", 3.0)

    # 2. bf16 1024 x 151936
    nb, vb = 1024, 151936
    xb = torch.randn(nb, vb).bfloat16()
    tb = torch.randint(0, vb, (nb,))
    kb = timeit(lambda: cpp_stream.forward(xb, None, tb, temp(1.0), 0), rep)
    add("fwd logp bf16 1024x151936", kb, "log_softmax(x.float())+gather",
        timeit(lambda: torch.log_softmax(xb.float(), -1).gather(1, tb[:, None]), max(3, rep // 2)), "speedup", 10.0)
    add("fwd logp bf16 1024x151936", kb, "amax (one read)", timeit(lambda: xb.amax(-1), rep), "x_read", 3.0)
    del xb

    # 3. backward fp32 2048 x 32000 vs eager autograd of log_softmax + gather. Both allocate their
    # [N, V] outputs; the C++ kernel asks for transparent huge pages for its one output (fewer page
    # faults), eager autograd allocates three [N, V] tensors on the default 4 KiB pages.
    st = cpp_stream.forward(x, None, t, temp(1.0), 0)
    g = torch.randn(n)
    basis = statistics.gradient_basis({"logp": g}, st, temp(1.0))
    kbw = timeit(lambda: cpp_stream.backward(x, None, t, temp(1.0), st.lse, None, basis), rep)
    xr = x.clone().requires_grad_()

    def eager_bw():
        out = torch.log_softmax(xr, -1).gather(1, t[:, None]).squeeze(1)
        (gx,) = torch.autograd.grad(out, xr, g)
        return gx

    add("bwd logp fp32 2048x32000", kbw, "eager autograd log_softmax+gather", timeit(eager_bw, max(3, rep // 2)),
        "speedup", 4.0)
    del xr

    # 4. KL forward with both logits vs reading both once
    y = x + 0.1 * torch.randn(n, v)
    both = timeit(lambda: (x.amax(-1), y.amax(-1)), rep)
    kkl = timeit(lambda: cpp_stream.forward(x, y, t, temp(1.0), REF), rep)
    add("fwd KL both logits fp32 2048x32000", kkl, "amax(x)+amax(y)", both, "x_read", 2.0)
    kfull = timeit(lambda: cpp_stream.forward(x, y, t, temp(1.0), REF | FULL_KL), rep)
    add("fwd full KL fp32 2048x32000", kfull, "amax(x)+amax(y)", both, "x_read", 2.0)
    kent = timeit(lambda: cpp_stream.forward(x, None, t, temp(1.0), ENTROPY), rep)
    add("fwd logp+entropy fp32 2048x32000", kent, "amax (one read)", amax_x, "x_read", 3.0)

    # 5. policy_loss, fwd + bwd from logits [16, 128, 32000] fp32: the fused op against the
    # two-pass route (token_logprobs + verl's loss in torch + autograd), and against one copy of the
    # logits, which is what its gradient costs at least: allocating and writing [N, V] (x.clone(), the
    # fresh pages included) or, without the allocation, y.copy_(x) into a buffer that already exists.
    import kltriton
    from benchmarks.bench_policy_loss import verl_vanilla

    validation = kltriton.set_validation(False)
    x3, t3 = x.view(16, n // 16, v), t.view(16, n // 16)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        old = kltriton.token_logprobs(x3, t3, backend="cpp") + 0.2 * torch.randn(t3.shape, generator=gen)
    adv, mask = torch.randn(16, generator=gen), torch.ones(t3.shape, dtype=torch.bool)

    def fused_loss():
        xr = x3.detach().requires_grad_()
        kltriton.policy_loss(xr, t3, adv, old_logprobs=old, clip_high=0.28, dual_clip=3.0, backend="cpp").loss.backward()

    def two_pass_loss():
        xr = x3.detach().requires_grad_()
        verl_vanilla(kltriton.token_logprobs(xr, t3, backend="cpp"), old, adv, mask).backward()

    kpl = timeit(fused_loss, rep)
    add("policy_loss fwd+bwd fp32 2048x32000", kpl, "two-pass (token_logprobs + torch loss)", timeit(two_pass_loss, rep),
        "speedup", 1.4)
    add("policy_loss fwd+bwd fp32 2048x32000", kpl, "one copy, allocated (x.clone())", timeit(x.clone, rep),
        "x_read", 1.25)
    buffer = torch.empty_like(x)
    add("policy_loss fwd+bwd fp32 2048x32000", kpl, "one copy into a buffer (y.copy_(x))",
        timeit(lambda: buffer.copy_(x), rep), "x_read", 1.25)
    kltriton.set_validation(validation)

    print(f"device: cpu ({cpu_name()}), threads={torch.get_num_threads()}, torch {torch.__version__}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"C++ backend: {how}")
    print(f"{'case':36s} {'kernel ms':>10s} {'baseline':36s} {'base ms':>9s} {'ratio':>8s} {'target':>10s}  ok")
    for r in rows:
        tgt = (">= " if r["metric"] == "speedup" else "<= ") + f"{r['target']:g}x"
        label = "faster" if r["metric"] == "speedup" else "of read"
        print(f"{r['case']:36s} {r['kernel_ms']:10.2f} {r['baseline']:36s} {r['baseline_ms']:9.2f} "
              f"{r['ratio']:7.2f}x {tgt:>10s}  {'yes' if r['meets_target'] else 'NO'} ({label})")
    result = {
        "device": "cpu",
        "cpu_model": cpu_name(),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "git_commit": git_commit(),
        "backend": how,
        "repeat": rep,
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
