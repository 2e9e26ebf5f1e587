"""The main job: KL-shaped rewards for a packed batch from two tiny causal LMs, fused vs eager.

``python -m kltriton demo [--tokens N] [--vocab V] [--coef C] [--device D]`` builds a small
Llama-style model from a config (random weights, nothing downloaded) as the policy and a perturbed
copy as the reference, packs sequences of different lengths into one flat batch of N tokens, and
runs ``fused_kl_reward`` on it. It prints a per-sequence table, checks the result against the eager
torchrl-style computation (``log_softmax`` of both models + gather + mask + ``reward - coef * kl``),
and reports the time (median of several runs, with the range) and peak memory of both on the same
logits.
"""
import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile

import torch

import kltriton
from kltriton.timing import time_ms

TOKENS = 2048
SEQUENCES = 8
VOCAB = 32000
COEF = 0.1


def build_models(vocab: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    policy = LlamaForCausalLM(config).to(device).eval()
    reference = LlamaForCausalLM(config).to(device).eval()
    reference.load_state_dict(policy.state_dict())
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return policy, reference


@torch.no_grad()
def packed_logits(model, sequences):
    """Run each sequence on its own and concatenate: flat ``[N, V]`` logits of a packed batch."""
    return torch.cat([model(input_ids=seq[None]).logits[0] for seq in sequences])


def eager_rewards(logits, ref_logits, ids, cu_seqlens, scores, coef):
    """The torchrl-style eager computation (RolloutFromModel / KLRewardTransform arithmetic)."""
    logp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    ref_logp = torch.log_softmax(ref_logits.float(), -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    n = ids.numel()
    valid = torch.ones(n, dtype=torch.bool, device=ids.device)
    valid[(cu_seqlens[1:] - 1).remainder(n)] = False  # the last token of a sequence has no next token
    kl = torch.zeros(n, device=ids.device)
    kl[:-1] = logp - ref_logp
    kl = kl.masked_fill(~valid, 0)
    reward = -coef * kl
    lengths = cu_seqlens.diff()
    for s in range(len(lengths)):
        if lengths[s] > 1:
            reward[cu_seqlens[s + 1] - 2] += scores[s]
    return reward, kl


def fused(logits, ref_logits, ids, cu_seqlens, scores, coef):
    return kltriton.fused_kl_reward(logits, ref_logits, ids, coef=coef, scores=scores, cu_seqlens=cu_seqlens,
                                    shift_labels=True)


def _timed(fn, device, repeats=7):
    """``(median, min, max)`` wall time of ``fn`` in ms (``kltriton.timing.time_ms``)."""
    times = time_ms(fn, device, cpu_target_s=0.0, min_repeats=repeats)
    return statistics.median(times), min(times), max(times)


def _peak_bytes(call, inputs, which, device, coef):
    """Peak memory of ``call()`` above its inputs: the CUDA allocator's peak on GPU; on CPU the
    peak resident size (VmHWM, reset through /proc/self/clear_refs) of a fresh process that
    loads ``inputs`` and runs the ``which`` path once."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "inputs.pt")
        torch.save(inputs, path)
        code = f"from kltriton.demo import _child_peak; _child_peak({path!r}, {which!r}, {coef!r})"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def _status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child_peak(path, which, coef):
    data = torch.load(path)
    fn = fused if which == "fused" else eager_rewards
    args = (data["logits"], data["ref_logits"], data["ids"], data["cu_seqlens"], data["scores"], coef)
    tiny = (args[0][:2], args[1][:2], args[2][:2], torch.tensor([0, 2]), args[4][:1], coef)
    fn(*tiny)  # warm up imports, kernel loading and thread pools on 2 rows, not on the real data
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak RSS to the current RSS
    base = _status_kib("VmRSS")
    fn(*args)
    print((_status_kib("VmHWM") - base) * 1024)


def _lengths(tokens: int, sequences: int, gen) -> list:
    """``sequences`` random lengths (at least 2 each) adding up to ``tokens``."""
    cuts = torch.randperm(tokens - 2 * sequences + 1, generator=gen)[:sequences - 1].sort().values.tolist()
    bounds = [0, *cuts, tokens - 2 * sequences]
    return [2 + hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]


def _int_at_least(low: int):
    """An argparse ``type``: an int ``>= low`` (anything else is a usage error, exit status 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def _finite_float(text: str) -> float:
    """An argparse ``type``: a finite float."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {value}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kltriton demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=_int_at_least(2), default=TOKENS,
                        help=f"packed tokens, at least 2 per sequence (default {TOKENS})")
    parser.add_argument("--sequences", type=_int_at_least(1), default=SEQUENCES,
                        help=f"sequences (default {SEQUENCES})")
    parser.add_argument("--vocab", type=_int_at_least(1), default=VOCAB, help=f"vocabulary size (default {VOCAB})")
    parser.add_argument("--coef", type=_finite_float, default=COEF, help=f"KL coefficient (default {COEF})")
    args = parser.parse_args(argv)
    if args.tokens < 2 * args.sequences:
        parser.error(f"--tokens must be at least 2 x --sequences ({2 * args.sequences}), got {args.tokens}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA device; use --device cpu "
                     "(python -m kltriton info shows what runs here)")
    device, coef = args.device, args.coef

    policy, reference = build_models(args.vocab, device)
    gen = torch.Generator().manual_seed(1)
    lengths = _lengths(args.tokens, args.sequences, gen)
    sequences = [torch.randint(0, args.vocab, (n,), generator=gen).to(device) for n in lengths]
    ids = torch.cat(sequences)
    cu_seqlens = torch.tensor([0, *lengths], device=device).cumsum(0)
    scores = (torch.randn(len(lengths), generator=gen) * 3).to(device)
    logits, ref_logits = packed_logits(policy, sequences), packed_logits(reference, sequences)
    backend = kltriton.dispatch.resolve(None, "stream", logits.device.type, False)
    mib = 2.0 ** 20
    print(f"policy/reference: Llama, vocab {args.vocab}, 2 layers, random weights; device {device}, "
          f"backend {backend}")
    print(f"packed batch: {len(lengths)} sequences, {ids.numel()} tokens, logits {tuple(logits.shape)} "
          f"{str(logits.dtype).replace('torch.', '')} ({logits.numel() * logits.element_size() / mib:.0f} MiB "
          f"per model); coef {coef}\n")

    out = fused(logits, ref_logits, ids, cu_seqlens, scores, coef)
    k3 = kltriton.token_kl(logits, ref_logits, ids, estimator="k3", cu_seqlens=cu_seqlens, shift_labels=True).kl
    eager_reward, eager_kl = eager_rewards(logits, ref_logits, ids, cu_seqlens, scores, coef)
    print(f"{'seq':>3} {'tokens':>6} {'scored':>6} {'mean k1 KL':>10} {'mean k3 KL':>10} {'score':>7} "
          f"{'sum reward':>11}")
    for s, n in enumerate(lengths):
        span = slice(int(cu_seqlens[s]), int(cu_seqlens[s + 1]))
        print(f"{s:>3} {n:>6} {n - 1:>6} {out.kl_per_seq[s].item():>10.5f} {k3[span].sum().item() / (n - 1):>10.5f} "
              f"{scores[s].item():>7.3f} {out.reward[span].sum().item():>11.4f}")
    print("k1 = logp - ref_logp is an unbiased estimate of KL(policy || ref) whose per-token (and small-sample) "
          "value can be negative;\nk3 = exp(-k1) + k1 - 1 is never negative (TRL's GRPO, verl's low_var_kl).")
    err = max((out.reward - eager_reward).abs().max().item(), (out.kl - eager_kl).abs().max().item())
    agree = err < 1e-4
    print(f"\nagreement with eager: max |difference| = {err:.2e} -> {'OK' if agree else 'MISMATCH'}")

    run_fused = lambda: fused(logits, ref_logits, ids, cu_seqlens, scores, coef)  # noqa: E731
    run_eager = lambda: eager_rewards(logits, ref_logits, ids, cu_seqlens, scores, coef)  # noqa: E731
    t_fused, t_eager = _timed(run_fused, device), _timed(run_eager, device)
    inputs = {"logits": logits, "ref_logits": ref_logits, "ids": ids, "cu_seqlens": cu_seqlens, "scores": scores}
    mem_fused = _peak_bytes(run_fused, inputs, "fused", device, coef)
    mem_eager = _peak_bytes(run_eager, inputs, "eager", device, coef)
    print(f"\n{'':<22}{'time ms (median, min-max of 7)':>32}{'peak extra memory (MiB)':>26}")
    for name, (med, lo, hi), mem in ((f"kltriton ({backend})", t_fused, mem_fused),
                                     ("eager torchrl-style", t_eager, mem_eager)):
        print(f"{name:<22}{med:>14.1f} ({lo:7.1f} - {hi:7.1f}){mem / mib:>26.1f}")
    print(f"speed-up {t_eager[0] / t_fused[0]:.1f}x (median), {t_eager[1] / t_fused[2]:.1f}x worst case "
          f"(fastest eager vs slowest kltriton)")
    return 0 if agree else 1
