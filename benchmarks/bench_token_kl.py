"""Benchmark ``kltriton.token_kl`` (k1, reference logits) against computing both log-probs the
eager, torchrl, torch.compile, TRL, flash-attn and Liger ways and subtracting.

Run alone: ``python -m benchmarks.bench_token_kl --device cpu --grid small``.
"""
import sys

import kltriton
from benchmarks import baselines

OP = "token_kl"
N_MODELS = 2  # reads the policy and the reference logits


def _kltriton(backend, device):
    def factory(inp):
        baselines.check_backend(backend, device)
        return lambda x: kltriton.token_kl(x, inp.ref, inp.labels, mask=inp.mask, backend=backend).kl
    return factory


def _eager_kl(x, ref, labels):
    return baselines.eager_logprobs(x, labels) - baselines.eager_logprobs(ref, labels)


def _torchrl_kl(x, ref, labels, mask):
    return baselines.masked_logprobs(x, labels, mask) - baselines.masked_logprobs(ref, labels, mask)


def _trl_kl(x, ref, labels):
    return baselines.trl_logprobs(x, labels) - baselines.trl_logprobs(ref, labels)


def _library(library, device):
    def factory(inp):
        logprobs = baselines.cross_entropy_logprobs(library, device)
        labels = inp.labels.masked_fill(~inp.mask, -100)
        return lambda x: logprobs(x, labels) - logprobs(inp.ref, labels)
    return factory


def methods(device):
    """``name -> (kind, factory)``; Liger last: it writes its gradient into the logits buffer."""
    compiled = baselines.compiled(_eager_kl)
    return {
        "triton": ("kltriton", _kltriton("triton", device)),
        "cpp": ("kltriton", _kltriton("cpp", device)),
        "reference": ("kltriton", _kltriton("reference", device)),
        "eager": ("baseline", lambda inp: lambda x: _eager_kl(x, inp.ref, inp.labels)),
        "torchrl_masked": ("baseline", lambda inp: lambda x: _torchrl_kl(x, inp.ref, inp.labels, inp.mask)),
        "compile": ("baseline", lambda inp: lambda x: compiled(x, inp.ref, inp.labels)),
        "trl": ("baseline", lambda inp: lambda x: _trl_kl(x, inp.ref, inp.labels)),
        "flash_attn": ("baseline", _library("flash_attn", device)),
        "liger": ("baseline", _library("liger", device)),
    }


if __name__ == "__main__":
    from benchmarks.cli import main

    raise SystemExit(main(["run", "--ops", OP, *sys.argv[1:]]))
