"""Benchmark ``kltriton.token_logprobs`` against the eager, torchrl, torch.compile, TRL, flash-attn
and Liger ways of getting the log-prob of each label.

Run alone: ``python -m benchmarks.bench_token_logprobs --device cpu --grid small``.
"""
import sys

import kltriton
from benchmarks import baselines

OP = "token_logprobs"
N_MODELS = 1  # reads the policy logits only


def _kltriton(backend, device):
    def factory(inp):
        baselines.check_backend(backend, device)
        return lambda x: kltriton.token_logprobs(x, inp.labels, mask=inp.mask, backend=backend)
    return factory


def _library(library, device):
    def factory(inp):
        logprobs = baselines.cross_entropy_logprobs(library, device)
        labels = inp.labels.masked_fill(~inp.mask, -100)
        return lambda x: logprobs(x, labels)
    return factory


def _installed_trl(inp):
    logprobs = baselines.installed_trl_logprobs()
    return lambda x: logprobs(x, inp.labels)


def methods(device):
    """``name -> (kind, factory)``; Liger last: it writes its gradient into the logits buffer."""
    compiled = baselines.compiled(baselines.eager_logprobs)
    return {
        "triton": ("kltriton", _kltriton("triton", device)),
        "cpp": ("kltriton", _kltriton("cpp", device)),
        "reference": ("kltriton", _kltriton("reference", device)),
        "eager": ("baseline", lambda inp: lambda x: baselines.eager_logprobs(x, inp.labels)),
        "torchrl_masked": ("baseline", lambda inp: lambda x: baselines.masked_logprobs(x, inp.labels, inp.mask)),
        "compile": ("baseline", lambda inp: lambda x: compiled(x, inp.labels)),
        "trl": ("baseline", lambda inp: lambda x: baselines.trl_logprobs(x, inp.labels)),
        "trl_installed": ("baseline", _installed_trl),
        "flash_attn": ("baseline", _library("flash_attn", device)),
        "liger": ("baseline", _library("liger", device)),
    }


if __name__ == "__main__":
    from benchmarks.cli import main

    raise SystemExit(main(["run", "--ops", OP, *sys.argv[1:]]))
