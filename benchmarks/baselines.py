"""The per-token log-prob formulas the benchmarks compare against, written as trainers write them.

Each ``*_logprobs(x, labels)`` takes ``[B, T, V]`` logits and ``[B, T]`` labels and returns fp32
``[B, T]``. The optional libraries (Liger-Kernel, flash-attn) are imported only when
``cross_entropy_logprobs`` is called, never at import time.
"""
import inspect

import torch

from benchmarks.harness import Unavailable


def eager_logprobs(x, labels):
    """The common eager form: an fp32 ``[N, V]`` log-softmax, then a gather."""
    return torch.log_softmax(x.float(), -1).gather(-1, labels[..., None]).squeeze(-1)


def eager_logprobs_plus_entropy(x, labels):
    """The eager form with the entropy, summed so that a backward goes through both: one fp32 ``[N, V]``
    log-softmax, the gather and ``-sum(p log p)``."""
    logp_all = torch.log_softmax(x.float(), -1)
    return logp_all.gather(-1, labels[..., None]).squeeze(-1) - (logp_all.exp() * logp_all).sum(-1)


def compiled(fn):
    """``torch.compile(fn)`` without buffer donation, so the ``backward`` mode can replay the
    compiled backward with ``retain_graph=True`` (donated buffers forbid that)."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
    return torch.compile(fn)


def masked_logprobs(x, labels, mask):
    """torchrl-style: the eager form with unscored positions zeroed by ``masked_fill``."""
    return eager_logprobs(x, labels).masked_fill(~mask, 0.0)


def trl_logprobs(x, labels):
    """TRL's ``selective_log_softmax`` formula: fp32 ``gather - logsumexp`` looped over the batch
    rows; for half types a per-row ``log_softmax`` in the logits' dtype."""
    if x.dtype in (torch.float32, torch.float64):
        picked = x.gather(-1, labels[..., None]).squeeze(-1)
        return picked - torch.stack([torch.logsumexp(row, -1) for row in x])
    rows = [torch.log_softmax(row, -1).gather(-1, lab[:, None]).squeeze(-1) for row, lab in zip(x, labels)]
    return torch.stack(rows).float()


def installed_trl_function(name: str):
    """The installed ``trl``'s own ``trl.trainer.utils.<name>`` (a fused Triton kernel on a GPU in recent TRL), or
    ``Unavailable`` when trl is not importable or has no such function."""
    try:
        from trl.trainer import utils
    except ImportError as err:
        raise Unavailable(f"trl not installed: {err}") from None
    if not hasattr(utils, name):
        raise Unavailable(f"the installed trl has no trl.trainer.utils.{name}")
    return getattr(utils, name)


def installed_trl_logprobs():
    """The installed ``trl``'s own ``selective_log_softmax`` as fp32 log-probs (``installed_trl_function``)."""
    selective_log_softmax = installed_trl_function("selective_log_softmax")
    return lambda x, labels: selective_log_softmax(x, labels).float()


def cross_entropy_logprobs(library: str, device: str):
    """``-cross_entropy(x, labels, reduction='none')`` from Liger-Kernel or flash-attn (CUDA only)."""
    if device != "cuda":
        raise Unavailable(f"{library}: CUDA only")
    try:
        if library == "liger":
            from liger_kernel.transformers.functional import liger_cross_entropy

            def loss(x2d, labels1d):
                return liger_cross_entropy(x2d, labels1d, ignore_index=-100, reduction="none")
        else:
            from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

            ignore = flash_attn_ignore_keyword(cross_entropy_loss)

            def loss(x2d, labels1d):
                return cross_entropy_loss(x2d, labels1d, **{ignore: -100})[0]
    except ImportError as err:
        raise Unavailable(f"{library} not installed: {err}") from None

    def logprobs(x, labels):
        return -loss(x.view(-1, x.shape[-1]), labels.reshape(-1)).float().view(labels.shape)

    return logprobs


def flash_attn_ignore_keyword(cross_entropy_loss) -> str:
    """flash-attn's ``cross_entropy_loss`` takes ``ignore_index`` since 2.5.8 (April 2024); older releases
    spelled it ``ignored_index``."""
    parameters = inspect.signature(cross_entropy_loss).parameters
    return "ignore_index" if "ignore_index" in parameters else "ignored_index"


def reward_from_kl(kl, mask, scores, coef):
    """``-coef * kl`` plus each sequence's score at its last scored position (RolloutFromModel style)."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(-1)
    bonus = torch.where(last >= 0, scores, torch.zeros_like(scores))
    return (-coef * kl).scatter_add(-1, last.clamp(min=0)[:, None], bonus[:, None])


def check_backend(backend: str, device: str) -> None:
    """Raise ``Unavailable`` when a kltriton backend cannot be timed on ``device``."""
    from kltriton import dispatch

    if backend == "triton" and device != "cuda":
        raise Unavailable("triton: CUDA only here (the CPU interpreter is far too slow to time)")
    if backend == "cpp" and device != "cpu":
        raise Unavailable("cpp: CPU only")
    usable, why = dispatch.availability(backend)
    if not usable:
        raise Unavailable(f"{backend}: {why}")
