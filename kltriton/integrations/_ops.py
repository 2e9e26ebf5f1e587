"""The two calls the log-prob-level integrations (verl, OpenRLHF) make into kltriton's public API."""
import torch

import kltriton

# No label equals this, so every position is scored (the libraries' helpers score every position).
_NO_IGNORE = torch.iinfo(torch.int64).min


def logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 ``log_softmax(logits / temperature)`` at ``labels`` (every position), differentiable."""
    return kltriton.token_logprobs(logits, labels, temperature=temperature, ignore_index=_NO_IGNORE)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """fp32 entropy of ``softmax(logits)`` per position, differentiable, from the same streaming pass."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return kltriton.token_logprobs(logits, labels, ignore_index=_NO_IGNORE, return_entropy=True)[1]
