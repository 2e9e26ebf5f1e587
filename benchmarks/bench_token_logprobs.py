"""Benchmark ``kltriton.token_logprobs`` against the eager, torchrl, torch.compile, TRL, flash-attn
and Liger ways of getting the log-prob of each label; and with the entropy (``*_entropy``: what TRL's GRPO and RLOO
ask of their logits, against TRL's in-package ``selective_log_softmax_and_entropy``; the backward through both).

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


def _kltriton_entropy(backend, device):
    def factory(inp):
        baselines.check_backend(backend, device)

        def logp_plus_entropy(x):
            logp, entropy = kltriton.token_logprobs(x, inp.labels, mask=inp.mask, return_entropy=True,
                                                    backend=backend)
            return logp + entropy
        return logp_plus_entropy
    return factory


def _eager_entropy(inp):
    return lambda x: baselines.eager_logprobs_plus_entropy(x, inp.labels).masked_fill(~inp.mask, 0.0)


def _installed_trl_entropy(inp):
    """TRL's ``selective_log_softmax_and_entropy`` (its Triton kernel on a GPU, its PyTorch code elsewhere) with the
    mask as its ``row_mask`` (zero where not scored, as kltriton's)."""
    function = baselines.installed_trl_function("selective_log_softmax_and_entropy")

    def logp_plus_entropy(x):
        logp, entropy = function(x, inp.labels, row_mask=inp.mask)
        return logp.float() + entropy.float()
    return logp_plus_entropy


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
        "triton_entropy": ("kltriton", _kltriton_entropy("triton", device)),
        "cpp_entropy": ("kltriton", _kltriton_entropy("cpp", device)),
        "eager_entropy": ("baseline", _eager_entropy),
        "trl_installed_entropy": ("baseline", _installed_trl_entropy),
        "flash_attn": ("baseline", _library("flash_attn", device)),
        "liger": ("baseline", _library("liger", device)),
    }


if __name__ == "__main__":
    from benchmarks.cli import main

    raise SystemExit(main(["run", "--ops", OP, *sys.argv[1:]]))
