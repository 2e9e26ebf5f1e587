"""Merge per-shard softmax statistics into the statistics of the whole row (pure ``[K, N]`` PyTorch).

A row of logits split into ``K`` contiguous pieces of the vocabulary (the vocab shards of
tensor-parallel ranks, or the vocab tiles of a kernel) gives each piece ``k`` its *local*
statistics, computed as if the piece were the whole row: ``lse_k`` (log-sum-exp of its logits / T),
``H_k`` (entropy of its local softmax), ``KL_k`` (exact KL of its local policy vs reference
softmax), ``rlse_k`` and the label's local log-probs. With ``w_k = exp(lse_k - lse)`` (the piece's
share of the probability mass) and ``lse = logsumexp_k lse_k``:

    entropy = sum_k w_k * (H_k - (lse_k - lse))
    full_kl = sum_k w_k * (KL_k + (lse_k - lse) - (rlse_k - rlse))
    logp    = logp_k + (lse_k - lse)          on the piece k that holds the label

Every term is centred on the global value (``lse_k - lse <= 0``), so no large logsumexp cancels
against another: the merge keeps the accuracy of the pieces. The order of the sum over ``k`` is fixed
(the order of the pieces), so a row's result never depends on other rows.
"""
from typing import Optional

import torch

from kltriton.kernels.stream import StreamStats

# ``label_logp`` of a piece that does not hold the label (a real log-prob is <= 0 or NaN).
NOT_HERE = float("inf")


def _weighted_sum(w: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_k w_k * values_k`` with a piece of zero mass contributing 0 even where its value is
    ``inf``/NaN (an all ``-inf`` piece: the kernels give NaN statistics there). NaN weights propagate."""
    return torch.where(w == 0, torch.zeros((), dtype=w.dtype, device=w.device), w * values).sum(0)


def _label_logp(label_logp: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Global log-prob of the label from the piece that holds it; NaN where no piece does.
    A piece without mass (``shift = -inf``, its local log-probs NaN) gives its label ``-inf``."""
    here = label_logp != NOT_HERE
    zero = torch.zeros((), dtype=shift.dtype, device=shift.device)
    held = torch.where(shift == float("-inf"), shift, label_logp + shift)
    value = torch.where(here, held, zero).sum(0).clamp(max=0)
    return torch.where(here.any(0), value, torch.full((), float("nan"), dtype=shift.dtype, device=shift.device))


def merge_shards(
    lse: torch.Tensor,                             # [K, N] local logsumexp(logits / T) of each piece
    label_logp: torch.Tensor,                      # [K, N] local log-prob of the label, NOT_HERE off its piece
    entropy: Optional[torch.Tensor] = None,        # [K, N] local entropy
    ref_lse: Optional[torch.Tensor] = None,        # [K, N] local reference logsumexp
    ref_label_logp: Optional[torch.Tensor] = None,  # [K, N] local reference log-prob, NOT_HERE off its piece
    full_kl: Optional[torch.Tensor] = None,        # [K, N] local KL(p_k || q_k) (needs ref_lse)
) -> StreamStats:
    """Statistics of whole rows from the statistics of their ``K`` vocabulary pieces.

    Returns ``StreamStats`` of ``[N]`` tensors (``entropy`` / ``ref_*`` / ``full_kl`` empty ``[0]``
    when not given), in the dtype of ``lse``. A row whose label lies in no piece gets a NaN
    ``logp`` (and ``ref_logp``); a row whose pieces are all ``-inf`` gets ``lse = -inf`` and NaN
    statistics, as the kernels do for a whole row.
    """
    empty = lambda: lse.new_empty(0)  # noqa: E731 - distinct tensors: an autograd output must not alias another
    total = torch.logsumexp(lse, 0)
    shift = lse - total           # log w_k
    w = shift.exp()
    logp = _label_logp(label_logp, shift)
    h = _weighted_sum(w, entropy - shift) if entropy is not None else empty()
    if ref_lse is None:
        return StreamStats(logp, total, h, empty(), empty(), empty())
    ref_total = torch.logsumexp(ref_lse, 0)
    ref_shift = ref_lse - ref_total
    ref_logp = _label_logp(ref_label_logp, ref_shift)
    kl = _weighted_sum(w, full_kl + shift - ref_shift) if full_kl is not None else empty()
    return StreamStats(logp, total, h, ref_logp, ref_total, kl)
