"""Benchmark ``kltriton.fused_kl_reward`` (k1, coef 0.1, sequence scores at the last scored token)
against the same reward built from eager, torchrl, torch.compile, TRL, flash-attn and Liger
log-probs.

Run alone: ``python -m benchmarks.bench_fused_kl_reward --device cpu --grid small``.
"""
import sys

import kltriton
from benchmarks import baselines

OP = "fused_kl_reward"
N_MODELS = 2  # reads the policy and the reference logits
COEF = 0.1


def _kltriton(backend, device):
    def factory(inp):
        baselines.check_backend(backend, device)
        return lambda x: kltriton.fused_kl_reward(x, inp.ref, inp.labels, coef=COEF, scores=inp.scores,
                                                  mask=inp.mask, backend=backend).reward
    return factory


def _eager_reward(x, ref, labels, mask, scores):
    kl = (baselines.eager_logprobs(x, labels) - baselines.eager_logprobs(ref, labels)) * mask
    return baselines.reward_from_kl(kl, mask, scores, COEF)


def _torchrl_reward(x, ref, labels, mask, scores):
    kl = baselines.masked_logprobs(x, labels, mask) - baselines.masked_logprobs(ref, labels, mask)
    return baselines.reward_from_kl(kl, mask, scores, COEF)


def _trl_reward(x, ref, labels, mask, scores):
    kl = (baselines.trl_logprobs(x, labels) - baselines.trl_logprobs(ref, labels)) * mask
    return baselines.reward_from_kl(kl, mask, scores, COEF)


def _library(library, device):
    def factory(inp):
        logprobs = baselines.cross_entropy_logprobs(library, device)
        labels = inp.labels.masked_fill(~inp.mask, -100)

        def reward(x):
            kl = logprobs(x, labels) - logprobs(inp.ref, labels)
            return baselines.reward_from_kl(kl, inp.mask, inp.scores, COEF)
        return reward
    return factory


def _plain(fn):
    return lambda inp: lambda x: fn(x, inp.ref, inp.labels, inp.mask, inp.scores)


def methods(device):
    """``name -> (kind, factory)``; Liger last: it writes its gradient into the logits buffer."""
    compiled = baselines.compiled(_eager_reward)
    return {
        "triton": ("kltriton", _kltriton("triton", device)),
        "cpp": ("kltriton", _kltriton("cpp", device)),
        "reference": ("kltriton", _kltriton("reference", device)),
        "eager": ("baseline", _plain(_eager_reward)),
        "torchrl_masked": ("baseline", _plain(_torchrl_reward)),
        "compile": ("baseline", _plain(compiled)),
        "trl": ("baseline", _plain(_trl_reward)),
        "flash_attn": ("baseline", _library("flash_attn", device)),
        "liger": ("baseline", _library("liger", device)),
    }


if __name__ == "__main__":
    from benchmarks.cli import main

    raise SystemExit(main(["run", "--ops", OP, *sys.argv[1:]]))
