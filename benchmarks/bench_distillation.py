"""Benchmark distillation from hidden states: ``kltriton.token_divergence`` with both models as ``LinearLogits``
against eager TRL (``GKDTrainer.generalized_jsd_loss`` on materialized logits), TRL 1.16's chunked kernel
(``DistillationTrainer``'s ``_chunked_divergence_loss``) and the GEMM floor; and a ``TopK`` teacher against plain
``token_logprobs`` on the same student.

``python -m benchmarks.bench_distillation [--tokens 2048 --hidden 1024 --vocab 32000 --topk 64 --rounds 3
--out FILE]``. Every call is forward + backward w.r.t. the student's hidden states and LM head weight
(``fwd_bwd_w``), the teacher without gradient, the loss TRL's ``batchmean``. Divergences: forward KL (TRL's
``beta=0``), reverse KL (``beta=1``) and the generalized JSD (``beta=0.5``). The floor: the four GEMMs the fused
route runs (the student's and the teacher's projections, ``d_hidden``, ``d_weight``), alone. The rows are timed
round-robin over every method, ``--rounds`` times, and report medians (the machine may be shared). CPU peak memory:
one fresh process per row (``harness.CPU_MEM_METHOD``), in MiB above the inputs, the ``[V, H]`` weight gradient
included.
"""
import argparse

import torch

from benchmarks import harness

DIVERGENCES = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5}  # and TRL's beta for each


def make(tokens, hidden, vocab, dtype, topk, seed=0):
    """Student and teacher hidden states and LM heads, labels, and the teacher's top-k ids and log-probs."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype)
    ht = (h.float() + 0.5 * torch.randn(tokens, hidden, generator=g)).to(dtype)
    wt = (w.float() + 0.5 * torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with torch.no_grad():
        teacher = torch.log_softmax((ht @ wt.T).float(), -1)
        ids = torch.topk(teacher, topk, -1).indices
        logp = teacher.gather(-1, ids)
    return h, w, ht, wt, labels, ids, logp


def _kltriton(divergence):
    def fn(h, w, ht, wt, labels, ids, logp):
        import kltriton

        return kltriton.token_divergence(kltriton.LinearLogits(h, w), kltriton.LinearLogits(ht, wt), labels,
                                         divergence=divergence, beta=0.5, reduction="batchmean")
    return fn


def _eager_trl(beta):
    def fn(h, w, ht, wt, labels, ids, logp):
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

        with torch.no_grad():
            teacher = ht @ wt.T
        return GKDTrainer.generalized_jsd_loss(h @ w.T, teacher, labels=labels, beta=beta)
    return fn


def _trl_chunked(beta):
    def fn(h, w, ht, wt, labels, ids, logp):
        from trl.trainer.distillation_trainer import _chunked_divergence_loss

        mask = torch.ones(1, h.shape[0], dtype=torch.long)
        return _chunked_divergence_loss(h[None], ht[None], w, wt, mask, beta)[0]
    return fn


def _topk(h, w, ht, wt, labels, ids, logp):
    import kltriton

    return kltriton.token_divergence(kltriton.LinearLogits(h, w), kltriton.TopK(ids, logp), labels,
                                     divergence="forward_kl", reduction="batchmean")


def _token_logprobs(h, w, ht, wt, labels, ids, logp):
    import kltriton

    return kltriton.token_logprobs(kltriton.LinearLogits(h, w), labels).mean()


def _gemm_floor(h, w, ht, wt, labels, ids, logp):
    """The four GEMMs of the fused route alone."""
    with torch.no_grad():
        teacher = ht @ wt.T
    z = h @ w.T
    return teacher, z @ w, z.T @ h


METHODS = {"gemm_floor_4": _gemm_floor, "topk": _topk, "token_logprobs": _token_logprobs}
for _name, _beta in DIVERGENCES.items():
    METHODS.update({f"kltriton_{_name}": _kltriton(_name), f"eager_trl_{_name}": _eager_trl(_beta),
                    f"trl_chunked_{_name}": _trl_chunked(_beta)})


def call(name, inputs):
    """A no-argument callable: ``name`` forward + backward w.r.t. the student's hidden states and weight."""
    fn = METHODS[name]
    h, w, *rest = inputs
    if name == "gemm_floor_4":
        return lambda: fn(*inputs)

    def fwd_bwd():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        return torch.autograd.grad(fn(hh, ww, *rest), (hh, ww))
    return fwd_bwd


def available(name):
    if not name.startswith(("eager_trl", "trl_chunked")):
        return None
    return harness.missing_note("trl", "trl.experimental.gkd.gkd_trainer:GKDTrainer",
                                "trl.trainer.distillation_trainer:_chunked_divergence_loss")


def peak_child(args):
    """Runs in a fresh process: peak bytes above the inputs of one call."""
    import kltriton

    kltriton.set_validation(False)
    name, tokens, hidden, vocab, dtype, topk = args
    return harness.peak_rss_above(call(name, make(tokens, hidden, vocab, harness.DTYPES[dtype], topk)))


def _median(times):
    return sorted(times)[len(times) // 2]


def run(tokens, hidden, vocab, dtype, topk, rounds=3, memory=True, only=None, log=print):
    import kltriton

    kltriton.set_validation(False)
    env = harness.environment("cpu")
    inputs = make(tokens, hidden, vocab, harness.DTYPES[dtype], topk)
    rows, samples = [], {}
    for name in only or METHODS:
        note = available(name)
        if note:
            rows.append(dict(env, op="distillation", backend=name, note=note))
        else:
            samples[name] = []
    for r in range(rounds):  # round-robin: a slow moment of the shared machine hits every row alike
        for name, times in samples.items():
            times += harness.time_ms(call(name, inputs), "cpu", cpu_target_s=0.0, warmup=r == 0, min_repeats=1)
    median = {name: _median(times) for name, times in samples.items()}
    peaks = {name: harness.peak_in_child("bench_distillation", [name, tokens, hidden, vocab, dtype, topk],
                                         TRL_EXPERIMENTAL_SILENCE="1") if memory else None for name in samples}
    for name, times in samples.items():
        divergence = next((d for d in DIVERGENCES if name.endswith(d)), None)
        eager = f"eager_trl_{divergence}" if divergence else None
        row = dict(env, op="distillation", backend=name, mode="fwd_bwd_w", tokens=tokens, hidden=hidden,
                   vocab=vocab, dtype=dtype, topk=topk if name == "topk" else None,
                   time_ms_median=median[name], time_ms_min=min(times), time_ms_max=max(times), repeats=len(times),
                   peak_mem_bytes=peaks[name], mem_method=harness.CPU_MEM_METHOD)
        if "gemm_floor_4" in median:
            row["ratio_to_gemm_floor"] = median[name] / median["gemm_floor_4"]
        if eager in median:
            row["speedup_vs_eager_trl"] = median[eager] / median[name]
            if peaks[name] is not None and peaks.get(eager):
                row["peak_mem_frac_of_eager_trl"] = peaks[name] / peaks[eager]
        if name == "topk" and "token_logprobs" in median:
            row["ratio_to_token_logprobs"] = median[name] / median["token_logprobs"]
        rows.append(row)
        extras = "  ".join(f"{k} {row[k]:.3f}" for k in ("ratio_to_gemm_floor", "speedup_vs_eager_trl",
                                                          "peak_mem_frac_of_eager_trl", "ratio_to_token_logprobs")
                           if k in row)
        peak = "-" if peaks[name] is None else f"{peaks[name] / 2**20:7.0f} MiB"
        log(f"{name:24s} {median[name]:9.1f} ms  peak {peak}  {extras}")
    return rows


def main(argv=None):
    p = harness.lm_head_arguments(argparse.ArgumentParser(description=__doc__))
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument("--only", default=None, help="comma-separated method names (default: all)")
    a = p.parse_args(argv)
    only = a.only.split(",") if a.only else None
    rows = run(a.tokens, a.hidden, a.vocab, a.dtype, a.topk, a.rounds, memory=not a.no_memory, only=only)
    harness.save_rows(rows, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
