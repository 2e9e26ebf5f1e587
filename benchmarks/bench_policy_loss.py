"""Benchmark ``kltriton.policy_loss`` (PPO / GRPO clipped surrogate, dual clip, token-mean, and a k3 KL
penalty against reference logits, GRPO's ``beta``) forward + backward against eager PyTorch
(log_softmax + gather of both models + verl's ``compute_policy_loss_vanilla`` and ``kl_penalty``
formulas), against the two-pass route (kltriton ``token_kl`` + the same loss in PyTorch), and on CUDA
against Liger's Triton GRPO loss when installed (its reference log-probs computed in the timed call
by kltriton's ``token_logprobs``, since Liger takes log-probs, not logits).

The fused route writes the logits gradient in the forward: ``fwd_bwd`` moves one read of each
model's logits and one write of the gradient (``bytes_moved``), ``backward`` alone moves nothing
for the unit upstream gradient (its GB/s column is meaningless; the harness's ``backward`` mode
replays the graph with ``retain_graph=True``, which the fused op refuses by design: see
policy_loss). Run alone: ``python -m benchmarks.bench_policy_loss --grid small``.
"""
import sys

import torch

import kltriton
from benchmarks import baselines
from benchmarks.harness import Unavailable

OP = "policy_loss"
N_MODELS = 2  # the policy and the reference logits
CLIP_LOW, CLIP_HIGH, DUAL_CLIP, KL_COEF = 0.2, 0.28, 3.0, 0.04


def _rollout(inp):
    """Old log-probs near the policy's and one advantage per sequence (fixed seed)."""
    gen = torch.Generator(device=inp.logits.device).manual_seed(1)
    with torch.no_grad():
        logp = baselines.eager_logprobs(inp.logits, inp.labels)
    old = logp + 0.2 * torch.randn(logp.shape, generator=gen, device=logp.device)
    adv = torch.randn(logp.shape[0], generator=gen, device=logp.device)
    return old, adv


def verl_vanilla(logp, old, adv, mask, ref_logp=None):
    """verl 0.9 compute_policy_loss_vanilla + agg_loss("token-mean"), written as verl writes it, plus
    ``KL_COEF`` times the token-mean k3 penalty (verl ``kl_penalty("low_var_kl")`` without its clamp)
    when ``ref_logp`` is given."""
    adv = adv[:, None]
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    clip1 = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.min(-adv * DUAL_CLIP, clip1), clip1)
    m = mask.float()
    loss = (pg * m).sum() / m.sum()
    if ref_logp is not None:
        d = ref_logp - logp
        loss = loss + KL_COEF * ((torch.exp(d) - d - 1) * m).sum() / m.sum()
    return loss


def _kltriton(backend, device):
    def factory(inp):
        baselines.check_backend(backend, device)
        old, adv = _rollout(inp)
        return lambda x: kltriton.policy_loss(x, inp.labels, adv, old_logprobs=old, ref=inp.ref, mask=inp.mask,
                                              clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=DUAL_CLIP,
                                              kl_coef=KL_COEF, kl_estimator="k3", backend=backend).loss
    return factory


def _eager(inp):
    old, adv = _rollout(inp)
    return lambda x: verl_vanilla(baselines.eager_logprobs(x, inp.labels), old, adv, inp.mask,
                                  baselines.eager_logprobs(inp.ref, inp.labels))


def _two_pass(device):
    def factory(inp):
        backend = "cpp" if device == "cpu" else "triton"
        baselines.check_backend(backend, device)
        old, adv = _rollout(inp)
        def loss(x):
            out = kltriton.token_kl(x, inp.ref, inp.labels, mask=inp.mask, backend=backend)
            return verl_vanilla(out.logprobs, old, adv, inp.mask, out.ref_logprobs)
        return loss
    return factory


def _liger(device):
    def factory(inp):
        if device != "cuda":
            raise Unavailable("liger: CUDA only")
        try:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss
        except ImportError as err:
            raise Unavailable(f"liger GRPO loss not installed: {err}") from None
        old, adv = _rollout(inp)

        def loss(x):
            # Liger's loss takes the logits of the prompt's last position too (it shifts them off).
            padded = torch.cat([x, x[:, -1:]], dim=1)
            with torch.no_grad():
                ref_logp = kltriton.token_logprobs(inp.ref, inp.labels, backend="triton")
            out = triton_grpo_loss(padded, old_logp=old, ref_logp=ref_logp, completion_ids=inp.labels,
                                   advantages=adv, completion_mask=inp.mask.int(), temperature=1.0, beta=KL_COEF,
                                   eps_low=CLIP_LOW, eps_high=CLIP_HIGH, inplace=False)
            return (out[0] * inp.mask).sum() / inp.mask.sum()
        return loss
    return factory


def methods(device):
    """``name -> (kind, factory)``."""
    return {
        "triton": ("kltriton", _kltriton("triton", device)),
        "cpp": ("kltriton", _kltriton("cpp", device)),
        "reference": ("kltriton", _kltriton("reference", device)),
        "two_pass": ("baseline", _two_pass(device)),
        "eager": ("baseline", _eager),
        "liger": ("baseline", _liger(device)),
    }


if __name__ == "__main__":
    from benchmarks.cli import main

    raise SystemExit(main(["run", "--ops", OP, *sys.argv[1:]]))
