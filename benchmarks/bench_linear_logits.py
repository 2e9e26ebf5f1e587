"""Benchmark log-probs from hidden states: ``kltriton.LinearLogits`` against eager (``hidden @ W.T``
then ``log_softmax`` + gather), TRL 1.16's ``ChunkedLogProbFunction`` (when installed; the head of every TRL
trainer) and the GEMM floor (the matmuls kltriton does, alone), in time and peak memory: the log-probs alone, and
with the entropy (``*_entropy``: what TRL's GRPO and RLOO heads ask for; the backward through both).

Its inputs are hidden states and an LM head, not logits, so it runs on its own on the harness's
timers and memory probe: ``python -m benchmarks.bench_linear_logits [--tokens N --hidden H --vocab V
--dtype fp32 --out FILE]``. Modes: ``forward`` (no grad), ``fwd_bwd`` (gradient w.r.t. ``hidden`` only,
as the logits benchmarks take it w.r.t. the logits), ``fwd_bwd_w`` (w.r.t. ``hidden`` and ``weight``).
CPU peak memory: one fresh process per row (``harness.CPU_MEM_METHOD``), in MiB above the inputs;
``fwd_bwd_w`` includes the ``[V, H]`` weight gradient itself. ``--policy-loss`` times
``policy_loss`` on ``LinearLogits`` instead (fused, two-pass, eager; against its 3-GEMM floor).
"""
import argparse

import torch

from benchmarks import baselines, harness

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


def _trl(h, w, labels, outputs=("log_probs",)):
    """TRL's fused head asked for ``outputs`` (its default asks for every optional statistic: name them)."""
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(h, w, None, labels, 1.0, 32768, None, 1.0, outputs)


def _with_entropy(h, w, labels):
    """kltriton's log-probs and entropy, summed: the backward goes through both (GRPO with an entropy bonus)."""
    import kltriton

    logp, entropy = kltriton.token_logprobs(kltriton.LinearLogits(h, w), labels, return_entropy=True)
    return logp + entropy


def _eager_with_entropy(h, w, labels):
    return baselines.eager_logprobs_plus_entropy(h @ w.T, labels)


def _trl_with_entropy(h, w, labels):
    logp, entropy = _trl(h, w, labels, ("log_probs", "entropy"))[:2]
    return logp + entropy


# The log-probs alone, and with the entropy (what TRL's GRPO and RLOO heads ask for).
METHODS = {"kltriton": _kltriton, "eager": _eager, "trl": lambda h, w, labels: _trl(h, w, labels)[0],
           "kltriton_entropy": _with_entropy, "eager_entropy": _eager_with_entropy, "trl_entropy": _trl_with_entropy}


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
    return harness.missing_note("trl", "trl.kernels:ChunkedLogProbFunction") if name.startswith("trl") else None


def peak_child(args):
    """Runs in a fresh process: peak bytes above the inputs of one call."""
    name, mode, tokens, hidden, vocab, dtype = args
    h, w, labels, grad = make(tokens, hidden, vocab, harness.DTYPES[dtype])
    return harness.peak_rss_above(call(name, mode, h, w, labels, grad))


def run(tokens, hidden, vocab, dtype, rounds=3, log=print):
    import kltriton

    kltriton.set_validation(False)
    env = harness.environment("cpu")
    h, w, labels, grad = make(tokens, hidden, vocab, harness.DTYPES[dtype])
    names = ["gemm_floor", *METHODS]
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
        peak = harness.peak_in_child("bench_linear_logits", [name, mode, tokens, hidden, vocab, dtype])
        row = dict(env, op="linear_logits", backend=name, mode=mode, tokens=tokens, hidden=hidden, vocab=vocab,
                   dtype=dtype, time_ms_median=median, time_ms_min=times[0], time_ms_max=times[-1],
                   repeats=len(times), ratio_to_gemm_floor=median / floor, peak_mem_bytes=peak,
                   mem_method=harness.CPU_MEM_METHOD)
        rows.append(row)
        log(f"{name:16s} {mode:10s} {median:9.1f} ms  x{median / floor:5.2f} of GEMM floor  "
            f"peak {'-' if peak is None else f'{peak / 2**20:7.0f} MiB'}")
    return rows


# --- policy_loss on LinearLogits: gradients of hidden and weight produced in the forward -----------

def _loss_inputs(tokens, h, w, labels):
    """Old log-probs near the policy's, per-token advantages, a full mask (fixed seed)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        logp = _eager(h, w, labels)
    return logp + 0.2 * torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)


def _loss_methods(old, adv):
    """``name -> fn(h, w, labels) -> loss``: the fused op, the two-pass route (kltriton log-probs from
    ``LinearLogits``, verl's loss in torch, autograd) and eager."""
    import kltriton
    from benchmarks.bench_policy_loss import CLIP_HIGH, CLIP_LOW, DUAL_CLIP, verl_vanilla

    mask = torch.ones(1, old.numel(), dtype=torch.bool)
    return {
        "kltriton": lambda h, w, labels: kltriton.policy_loss(
            kltriton.LinearLogits(h, w), labels, adv, old_logprobs=old, clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
            dual_clip=DUAL_CLIP).loss,
        "two_pass": lambda h, w, labels: verl_vanilla(_kltriton(h, w, labels)[None], old[None], adv[None], mask),
        "eager": lambda h, w, labels: verl_vanilla(_eager(h, w, labels)[None], old[None], adv[None], mask),
    }


def _loss_floor(h, w, labels):
    """The three GEMMs of the fused route alone: projection, ``d_hidden``, ``d_weight``."""
    z = h @ w.T
    return z @ w, z.T @ h


def run_policy_loss(tokens, hidden, vocab, dtype, rounds=3, log=print):
    """``policy_loss`` on ``LinearLogits``, forward + backward w.r.t. hidden and weight (fp32 rows)."""
    import kltriton

    kltriton.set_validation(False)
    env = harness.environment("cpu")
    h, w, labels, _ = make(tokens, hidden, vocab, harness.DTYPES[dtype])
    old, adv = _loss_inputs(tokens, h, w, labels)
    calls = {"gemm_floor_3": lambda: _loss_floor(h, w, labels)}
    for name, fn in _loss_methods(old, adv).items():
        def fwd_bwd(fn=fn):
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            return torch.autograd.grad(fn(hh, ww, labels), (hh, ww))
        calls[name] = fwd_bwd
    samples = {name: [] for name in calls}
    for r in range(rounds):  # round-robin, as run()
        for name, fn in calls.items():
            samples[name] += harness.time_ms(fn, "cpu", cpu_target_s=0.0, warmup=r == 0, min_repeats=1)
    median = {name: sorted(t)[len(t) // 2] for name, t in samples.items()}
    rows = []
    for name, times in samples.items():
        times.sort()
        row = dict(env, op="linear_policy_loss", backend=name, mode="fwd_bwd_w", tokens=tokens, hidden=hidden,
                   vocab=vocab, dtype=dtype, time_ms_median=median[name], time_ms_min=times[0],
                   time_ms_max=times[-1], repeats=len(times),
                   ratio_to_gemm_floor=median[name] / median["gemm_floor_3"],
                   speedup_vs_two_pass=median["two_pass"] / median[name])
        rows.append(row)
        log(f"{name:13s} fwd_bwd_w {median[name]:9.1f} ms  x{row['ratio_to_gemm_floor']:5.2f} of the 3-GEMM floor  "
            f"two-pass / this: {row['speedup_vs_two_pass']:.2f}")
    return rows


def main(argv=None):
    p = harness.lm_head_arguments(argparse.ArgumentParser(description=__doc__))
    p.add_argument("--policy-loss", action="store_true",
                   help="time policy_loss on LinearLogits (fwd + bwd w.r.t. hidden and weight) instead")
    a = p.parse_args(argv)
    rows = (run_policy_loss if a.policy_loss else run)(a.tokens, a.hidden, a.vocab, a.dtype, a.rounds)
    harness.save_rows(rows, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
