"""Benchmark ``kltriton.policy_loss`` (PPO / GRPO clipped surrogate, dual clip, token-mean) forward +
backward against eager PyTorch (log_softmax + gather + verl's ``compute_policy_loss_vanilla``
formulas), against the two-pass route (kltriton ``token_logprobs`` + the same loss in PyTorch), and
on CUDA against Liger's Triton GRPO loss when installed.

The fused route writes the logits gradient in the forward: ``fwd_bwd`` moves one read and one write
of the logits (``bytes_moved``), ``backward`` alone moves nothing for the unit upstream gradient
(its GB/s column is meaningless; the harness's ``backward`` mode replays the graph with
``retain_graph=True``, which the fused op refuses by design: see policy_loss). Run alone: ``python -m benchmarks.bench_policy_loss --grid small``.
"""
import sys

import torch

import kltriton
from benchmarks import baselines
from benchmarks.harness import Unavailable

OP = "policy_loss"
N_MODELS = 1  # the policy logits only
CLIP_LOW, CLIP_HIGH, DUAL_CLIP = 0.2, 0.28, 3.0


def _rollout(inp):
    """Old log-probs near the policy's and one advantage per sequence (fixed seed)."""
    gen = torch.Generator(device=inp.logits.device).manual_seed(1)
    with torch.no_grad():
        logp = baselines.eager_logprobs(inp.logits, inp.labels)
    old = logp + 0.2 * torch.randn(logp.shape, generator=gen, device=logp.device)
    adv = torch.randn(logp.shape[0], generator=gen, device=logp.device)
    return old, adv


def verl_vanilla(logp, old, adv, mask):
    """verl 0.9 compute_policy_loss_vanilla + agg_loss("token-mean"), written as verl writes it."""
    adv = adv[:, None]
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    clip1 = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.min(-adv * DUAL_CLIP, clip1), clip1)
    m = mask.float()
    return (pg * m).sum() / m.sum()


def _kltriton(backend, device):
    def factory(inp):
        baselines.check_backend(backend, device)
        old, adv = _rollout(inp)
        return lambda x: kltriton.policy_loss(x, inp.labels, adv, old_logprobs=old, mask=inp.mask,
                                              clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=DUAL_CLIP,
                                              backend=backend).loss
    return factory


def _eager(inp):
    old, adv = _rollout(inp)
    return lambda x: verl_vanilla(baselines.eager_logprobs(x, inp.labels), old, adv, inp.mask)


def _two_pass(device):
    def factory(inp):
        backend = "cpp" if device == "cpu" else "triton"
        baselines.check_backend(backend, device)
        old, adv = _rollout(inp)
        return lambda x: verl_vanilla(kltriton.token_logprobs(x, inp.labels, mask=inp.mask, backend=backend),
                                      old, adv, inp.mask)
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
            out = triton_grpo_loss(padded, old_logp=old, ref_logp=None, completion_ids=inp.labels,
                                   advantages=adv, completion_mask=inp.mask.int(), temperature=1.0, beta=0.0,
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
