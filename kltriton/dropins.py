"""Drop-in replacements for the log-prob helpers trainers already call."""
import torch

from kltriton.ops.token_logprobs import token_logprobs


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's ``selective_log_softmax``: ``log_softmax(logits, -1)`` gathered at ``index``.

    Args:
        logits: ``[..., V]``. index: integer ``[...]`` (every entry scored; no ignore value).
    Returns:
        fp32 ``[...]`` log-probs, differentiable w.r.t. ``logits``.
    """
    return token_logprobs(logits, index, ignore_index=torch.iinfo(torch.int64).min)


def logprobs_of_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchrl ``RolloutFromModel.logprobs_of_labels``: log-probs of ``labels`` (``[B, T]``) under
    ``logits`` (``[B, T, V]``), no masking."""
    return token_logprobs(logits, labels, ignore_index=torch.iinfo(torch.int64).min)
