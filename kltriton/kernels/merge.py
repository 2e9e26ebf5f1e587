"""Merge per-row softmax statistics of disjoint vocabulary parts into the full-vocabulary ones.

Shared by the ``linear`` family (vocab tiles of one row) and vocab-parallel ops (shards on ranks):
each part ``k`` of row ``n`` has its own log-sum-exp ``L_k`` of ``logits / T`` over the part, and the
entropy ``H_k`` / exact KL ``KL_k`` of the softmax restricted to the part (what the ``stream``
family returns for a ``[N, V_part]`` tile). With ``L = logsumexp_k L_k`` and weights
``w_k = exp(L_k - L)`` (the part's probability mass):

    H  = sum_k w_k (H_k + L - L_k)
    KL = sum_k w_k (KL_k + (L_k - L) - (R_k - R))     (R_k, R: the reference's log-sum-exps)

A part with no mass (``L_k = -inf``) contributes 0 whatever its (NaN) statistics. The label's
log-prob is ``logits[label] / T - L``, from the part that holds the label.
"""
from typing import NamedTuple, Optional

import torch


class Merged(NamedTuple):
    lse: torch.Tensor                 # [N]
    entropy: Optional[torch.Tensor]   # [N] or None
    ref_lse: Optional[torch.Tensor]   # [N] or None
    full_kl: Optional[torch.Tensor]   # [N] or None


def merge_partials(lse, entropy=None, ref_lse=None, full_kl=None) -> Merged:
    """Full-vocabulary statistics from ``[K, N]`` per-part ones (``full_kl`` needs ``ref_lse``).

    Rows whose parts all have ``L_k = -inf`` get ``lse = -inf`` and NaN entropy / KL (as the
    ``stream`` family gives for an all ``-inf`` row).
    """
    total = torch.logsumexp(lse, 0)
    live = lse > float("-inf")
    weight = torch.exp(torch.where(live, lse - total, float("-inf")))
    dead_row = total == float("-inf")

    def weighted(values):
        terms = torch.where(live, weight * values, torch.zeros((), dtype=values.dtype, device=values.device))
        return terms.sum(0).masked_fill(dead_row, float("nan"))

    merged_entropy = None if entropy is None else weighted(entropy + (total - lse))
    merged_ref_lse = None if ref_lse is None else torch.logsumexp(ref_lse, 0)
    merged_kl = None
    if full_kl is not None:
        merged_kl = weighted(full_kl + (lse - total) - (ref_lse - merged_ref_lse))
    return Merged(total, merged_entropy, merged_ref_lse, merged_kl)
