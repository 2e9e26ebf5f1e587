"""Drop-in replacements for the log-prob helpers trainers already call, with their signatures.

TRL 1.16 (``trl.trainer.utils``): ``selective_log_softmax``, ``selective_log_softmax_and_entropy``,
``entropy_from_logits``; torchrl ``RolloutFromModel.logprobs_of_labels``. One difference from the
originals: the results are fp32 whatever the logits' dtype (the kernels accumulate in fp32).
"""
import torch

from kltriton.functional.token_logprobs import token_logprobs

NO_IGNORE = torch.iinfo(torch.int64).min  # the originals score every position


def _row_mask(row_mask, index):
    """TRL's ``row_mask`` (shape of ``index``; 0 = skipped, any dtype) as a bool mask."""
    if row_mask is None:
        return None
    if not isinstance(row_mask, torch.Tensor) or tuple(row_mask.shape) != tuple(index.shape):
        raise ValueError(f"row_mask must be a tensor of index's shape {tuple(index.shape)}")
    return row_mask != 0


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, temperature=1.0,
                          row_mask=None) -> torch.Tensor:
    """TRL's ``selective_log_softmax``: ``log_softmax(logits / temperature, -1)`` gathered at ``index``.

    Args:
        logits: ``[..., V]``.
        index: integer ``[...]`` (one log-prob per position), or ``[..., K]`` (K per position,
            e.g. top-K ids).
        temperature: ``> 0``; a float, a 0-dim tensor or a tensor of the leading shape ``[...]``.
        row_mask: optional, shape of ``index``: where it is 0 the log-prob is 0 (and not computed).
    Returns:
        fp32, shape of ``index``; differentiable w.r.t. ``logits``.

    With ``[..., K]`` the kernel runs once over ``K`` copies of each row made by a stride-0 view
    (one launch, no copy of the logits; on a GPU the K reads of a row are adjacent programs and
    mostly hit L2): each log-prob is computed exactly as for ``K = 1``, so values, gradients and
    batch invariance are those of the single-label kernel. The cost is ``K`` passes over the row,
    and a backward that holds ``K`` gradient rows per position before summing them.
    """
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index must be an integer tensor, got {type(index).__name__}")
    mask = _row_mask(row_mask, index)
    if index.shape == logits.shape[:-1]:
        return token_logprobs(logits, index, temperature=temperature, ignore_index=NO_IGNORE, mask=mask)
    if index.dim() != logits.dim() or index.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"index must have shape {tuple(logits.shape[:-1])} or {tuple(logits.shape[:-1])} + (K,), "
                         f"got {tuple(index.shape)}")
    vocab, k = logits.shape[-1], index.shape[-1]
    rows = logits.reshape(-1, vocab)  # a view wherever the leading dims merge
    repeated = rows.unsqueeze(1).expand(rows.shape[0], k, vocab)  # stride 0 over K: no copy
    if isinstance(temperature, torch.Tensor) and temperature.dim():
        temperature = temperature.reshape(-1, 1).expand(rows.shape[0], k)
    logp = token_logprobs(repeated, index.reshape(-1, k), temperature=temperature, ignore_index=NO_IGNORE,
                          mask=None if mask is None else mask.reshape(-1, k))
    return logp.view(index.shape)


def selective_log_softmax_and_entropy(logits: torch.Tensor, index: torch.Tensor, entropy_requires_grad: bool = True,
                                      temperature=1.0, row_mask=None):
    """TRL's ``selective_log_softmax_and_entropy``: the log-prob at ``index`` and the entropy of
    ``softmax(logits / temperature)`` from one pass.

    Args:
        logits: ``[..., V]``. index: integer ``[...]``. row_mask: optional, shape of ``index``
            (0 = both outputs 0). entropy_requires_grad: False returns a detached entropy.
    Returns:
        ``(logp, entropy)``, fp32 ``[...]``.
    """
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index must have shape {tuple(logits.shape[:-1])}, got {tuple(index.shape)}")
    logp, entropy = token_logprobs(logits, index, temperature=temperature, ignore_index=NO_IGNORE,
                                   mask=_row_mask(row_mask, index), return_entropy=True)
    return logp, entropy if entropy_requires_grad else entropy.detach()


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """TRL's ``entropy_from_logits``: entropy of ``softmax(logits)`` per position, fp32 ``[...]``.
    ``chunk_size`` is accepted for the signature and unused (the kernel never holds ``[N, V]``)."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return token_logprobs(logits, labels, ignore_index=NO_IGNORE, return_entropy=True)[1]


def logprobs_of_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchrl ``RolloutFromModel.logprobs_of_labels``: log-probs of ``labels`` (``[B, T]``) under
    ``logits`` (``[B, T, V]``), no masking."""
    return token_logprobs(logits, labels, ignore_index=NO_IGNORE)
