"""The main job: KL-shaped rewards for a packed batch from two tiny causal LMs, fused vs eager.

``python -m kltriton demo`` builds a small Llama-style model from a config (random weights,
nothing downloaded) as the policy and a perturbed copy as the reference, packs prompts of
different lengths into one flat batch, and runs ``fused_kl_reward`` on it. It prints a
per-sequence table, checks the result against the eager torchrl-style computation
(``log_softmax`` of both models + gather + mask + ``reward - coef * kl``), and reports the
time and peak memory of both on the same logits.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import kltriton

LENGTHS = (37, 12, 64, 5, 90, 23)
VOCAB = 32000
COEF = 0.1


def build_models(vocab: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
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
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _peak_bytes(call, inputs, which, device):
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
        code = f"from kltriton.demo import _child_peak; _child_peak({path!r}, {which!r})"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def _status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child_peak(path, which):
    data = torch.load(path)
    fn = fused if which == "fused" else eager_rewards
    args = (data["logits"], data["ref_logits"], data["ids"], data["cu_seqlens"], data["scores"], COEF)
    tiny = (args[0][:2], args[1][:2], args[2][:2], torch.tensor([0, 2]), args[4][:1], COEF)
    fn(*tiny)  # warm up imports, kernel loading and thread pools on 2 rows, not on the real data
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak RSS to the current RSS
    base = _status_kib("VmRSS")
    fn(*args)
    print((_status_kib("VmHWM") - base) * 1024)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kltriton demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    args = parser.parse_args(argv)
    device = args.device

    policy, reference = build_models(args.vocab, device)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, args.vocab, (n,), generator=gen).to(device) for n in LENGTHS]
    ids = torch.cat(sequences)
    cu_seqlens = torch.tensor([0, *LENGTHS], device=device).cumsum(0)
    scores = (torch.randn(len(LENGTHS), generator=gen) * 3).to(device)
    logits, ref_logits = packed_logits(policy, sequences), packed_logits(reference, sequences)
    backend = kltriton.dispatch.resolve(None, "stream", logits.device.type, False)
    print(f"policy/reference: Llama, vocab {args.vocab}, 2 layers, random weights; device {device}, "
          f"backend {backend}")
    print(f"packed batch: {len(LENGTHS)} sequences, {ids.numel()} tokens, logits {tuple(logits.shape)} "
          f"{str(logits.dtype).replace('torch.', '')}\n")

    out = fused(logits, ref_logits, ids, cu_seqlens, scores, COEF)
    eager_reward, eager_kl = eager_rewards(logits, ref_logits, ids, cu_seqlens, scores, COEF)
    print(f"{'seq':>3} {'tokens':>6} {'scored':>6} {'mean k1 KL':>10} {'score':>7} {'sum reward':>11}")
    for s, n in enumerate(LENGTHS):
        span = slice(int(cu_seqlens[s]), int(cu_seqlens[s + 1]))
        print(f"{s:>3} {n:>6} {max(n - 1, 0):>6} {out.kl_per_seq[s].item():>10.5f} {scores[s].item():>7.3f} "
              f"{out.reward[span].sum().item():>11.4f}")
    err = max((out.reward - eager_reward).abs().max().item(), (out.kl - eager_kl).abs().max().item())
    agree = err < 1e-4
    print(f"\nagreement with eager: max |difference| = {err:.2e} -> {'OK' if agree else 'MISMATCH'}")

    run_fused = lambda: fused(logits, ref_logits, ids, cu_seqlens, scores, COEF)  # noqa: E731
    run_eager = lambda: eager_rewards(logits, ref_logits, ids, cu_seqlens, scores, COEF)  # noqa: E731
    t_fused, t_eager = _timed(run_fused, device), _timed(run_eager, device)
    inputs = {"logits": logits, "ref_logits": ref_logits, "ids": ids, "cu_seqlens": cu_seqlens, "scores": scores}
    mem_fused = _peak_bytes(run_fused, inputs, "fused", device)
    mem_eager = _peak_bytes(run_eager, inputs, "eager", device)
    mib = 2.0 ** 20
    print(f"\n{'':<22}{'time (ms)':>10}{'peak extra memory (MiB)':>26}")
    print(f"{'kltriton (' + backend + ')':<22}{t_fused:>10.2f}{mem_fused / mib:>26.1f}")
    print(f"{'eager torchrl-style':<22}{t_eager:>10.2f}{mem_eager / mib:>26.1f}")
    print(f"speed-up {t_eager / t_fused:.1f}x, logits are {logits.numel() * logits.element_size() / mib:.1f} MiB "
          f"per model")
    return 0 if agree else 1
