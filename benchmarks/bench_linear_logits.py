"""Benchmark log-probs from hidden states: ``kltriton.LinearLogits`` against eager (``hidden @ W.T``
then ``log_softmax`` + gather), TRL 1.16's ``ChunkedLogProbFunction`` (when installed) and the GEMM
floor (the matmuls kltriton does, alone), in time and peak memory.

Its inputs are hidden states and an LM head, not logits, so it runs on its own on the harness's
timers and memory probe: ``python -m benchmarks.bench_linear_logits [--tokens N --hidden H --vocab V
--dtype fp32 --out FILE]``. Modes: ``forward`` (no grad), ``fwd_bwd`` (gradient w.r.t. ``hidden`` only,
as the logits benchmarks take it w.r.t. the logits), ``fwd_bwd_w`` (w.r.t. ``hidden`` and ``weight``).
CPU peak memory: one fresh process per row (``harness.CPU_MEM_METHOD``), in MiB above the inputs;
``fwd_bwd_w`` includes the ``[V, H]`` weight gradient itself.
"""
import argparse
import json
import subprocess
import sys

import torch

from benchmarks import harness

MODES = ("forward", "fwd_bwd", "fwd_bwd_w")


def make(tokens, hidden, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, hidden, generator=g)).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, labels, torch.randn(tokens, generator=g)


def _kltriton(h, w, labels):
    import kltriton

    return kltriton.token_logprobs(kltriton.LinearLogits(h, w), labels)


def _eager(h, w, labels):
    return torch.log_softmax((h @ w.T).float(), -1).gather(-1, labels[:, None]).squeeze(-1)


def _trl(h, w, labels):
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(h, w, None, labels, 1.0, 32768)[0]


METHODS = {"kltriton": _kltriton, "eager": _eager, "trl": _trl}


def _gemm_floor(mode):
    """The GEMMs kltriton runs, alone: the projection; in the backward its recompute, ``d_hidden`` and
    (``fwd_bwd_w``) ``d_weight``."""
    def run(h, w, labels, grad):
        z = h @ w.T
        if mode == "forward":
            return z
        z = h @ w.T
        d_h = z @ w
        return (d_h, z.T @ h) if mode == "fwd_bwd_w" else d_h
    return run


def call(name, mode, h, w, labels, grad):
    """A no-argument callable doing ``name`` in ``mode``."""
    if name == "gemm_floor":
        fn = _gemm_floor(mode)
        return lambda: fn(h, w, labels, grad)
    fn = METHODS[name]
    if mode == "forward":
        def forward():
            with torch.no_grad():
                return fn(h, w, labels)
        return forward
    wrt = (h, w) if mode == "fwd_bwd_w" else (h,)

    def fwd_bwd():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_(mode == "fwd_bwd_w")
        return torch.autograd.grad(fn(hh, ww, labels), (hh, ww)[: len(wrt)], grad)
    return fwd_bwd


def available(name):
    if name != "trl":
        return None
    try:
        from trl.kernels import ChunkedLogProbFunction  # noqa: F401
    except ImportError as err:
        return f"trl not installed: {err}"
    return None


def peak_child(args):
    """Runs in a fresh process: peak bytes above the inputs of one call."""
    name, mode, tokens, hidden, vocab, dtype = args
    h, w, labels, grad = make(tokens, hidden, vocab, harness.DTYPES[dtype])
    return harness._peak_rss_above(call(name, mode, h, w, labels, grad))


def cpu_peak(name, mode, tokens, hidden, vocab, dtype):
    env = dict(harness.os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(harness.REPO))
    code = ("import json, sys; from benchmarks.bench_linear_logits import peak_child; "
            "print(peak_child(json.loads(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([name, mode, tokens, hidden, vocab, dtype])],
                         env=env, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None


def run(tokens, hidden, vocab, dtype, rounds=3, log=print):
    import kltriton

    kltriton.set_validation(False)
    env = harness.environment("cpu")
    h, w, labels, grad = make(tokens, hidden, vocab, harness.DTYPES[dtype])
    names = ["gemm_floor", "kltriton", "eager", "trl"]
    rows, samples = [], {}
    for name in names:
        note = available(name)
        if note:
            rows.append(dict(env, op="linear_logits", backend=name, note=note))
            continue
        for mode in MODES:
            samples[(name, mode)] = []
    for r in range(rounds):  # round-robin: a slow moment of the shared machine hits every row alike
        for (name, mode), times in samples.items():
            times += harness.time_ms(call(name, mode, h, w, labels, grad), "cpu", cpu_target_s=0.0,
                                     warmup=r == 0, min_repeats=1)
    for (name, mode), times in samples.items():
        times.sort()
        median = times[len(times) // 2]
        floor = sorted(samples[("gemm_floor", mode)])[len(samples[("gemm_floor", mode)]) // 2]
        peak = cpu_peak(name, mode, tokens, hidden, vocab, dtype)
        row = dict(env, op="linear_logits", backend=name, mode=mode, tokens=tokens, hidden=hidden, vocab=vocab,
                   dtype=dtype, time_ms_median=median, time_ms_min=times[0], time_ms_max=times[-1],
                   repeats=len(times), ratio_to_gemm_floor=median / floor, peak_mem_bytes=peak,
                   mem_method=harness.CPU_MEM_METHOD)
        rows.append(row)
        log(f"{name:11s} {mode:10s} {median:9.1f} ms  x{median / floor:5.2f} of GEMM floor  "
            f"peak {'-' if peak is None else f'{peak / 2**20:7.0f} MiB'}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=tuple(harness.DTYPES), default="fp32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = run(a.tokens, a.hidden, a.vocab, a.dtype, a.rounds)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
