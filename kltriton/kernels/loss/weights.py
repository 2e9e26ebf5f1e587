"""The policy loss's ``[N]`` arithmetic around the formulas of ``terms.py``: per-row aggregation weights (verl's
``agg_loss``), rollout importance-sampling weights, TRL's off-policy mask, verl geo_mean's reading of given weights,
and the metrics. Plain PyTorch on ``[N]`` tensors (no logits), the same for both routes of ``policy_loss``; autograd
differentiates whatever flows through it.
"""
from typing import NamedTuple, Optional

import torch

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class Sequences(NamedTuple):
    """Which sequence each row belongs to, and how the sequence-mean aggregations count them."""
    seq_index: torch.Tensor            # [N] int64
    num_seqs: int
    horizon: torch.Tensor              # 0-dim: seq-mean-token-sum-norm's divisor
    num_tokens: Optional[torch.Tensor]     # 0-dim: token-mean's denominator instead of the count (verl)
    num_seqs_agg: Optional[torch.Tensor]   # 0-dim: seq-mean's denominator instead of the count (verl, TRL)


def aggregation_weights(aggregation: str, rows, sequences: Sequences, dtype, *, own_denominators: bool = True):
    """``[N]`` weights with ``agg(x) = sum_n w[n] * x[n]`` (verl ``agg_loss``) over the rows where ``rows``;
    ``own_denominators=False`` counts the local tokens and sequences instead of ``sequences``' given ones."""
    valid = rows.to(dtype)
    num_tokens = sequences.num_tokens if own_denominators else None
    num_seqs_agg = sequences.num_seqs_agg if own_denominators else None
    if aggregation == "token-sum":
        return valid
    if aggregation == "token-mean":
        return valid / (valid.sum().clamp(min=1) if num_tokens is None else num_tokens.to(dtype))
    counts = torch.zeros(sequences.num_seqs, dtype=dtype, device=valid.device).index_add_(0, sequences.seq_index,
                                                                                         valid)
    count = (counts > 0).to(dtype).sum().clamp(min=1) if num_seqs_agg is None else num_seqs_agg.to(dtype)
    if aggregation == "seq-mean-token-mean":
        return valid / counts.clamp(min=1)[sequences.seq_index] / count
    weights = valid / count
    return weights / sequences.horizon.to(dtype) if aggregation == "seq-mean-token-sum-norm" else weights


def default_horizon(shape, cu_seqlens, device) -> torch.Tensor:
    """The padded length: ``T`` of ``[B, T]``, the longest packed segment, or ``N`` for one flat sequence (0-dim
    float64)."""
    if len(shape) >= 2:
        return torch.ones((), dtype=torch.float64, device=device) * shape[-1]
    if cu_seqlens is not None and cu_seqlens.numel() > 1:
        return (cu_seqlens[1:] - cu_seqlens[:-1]).max().to(torch.float64)
    return torch.ones((), dtype=torch.float64, device=device) * max(shape.numel(), 1)


class ImportanceWeights(NamedTuple):
    weights: torch.Tensor   # [N] the policy term's factor
    outside: torch.Tensor   # [N] bool: the ratio fell outside [is_min, is_cap]
    log_ratio: torch.Tensor  # [N] old - rollout (0 where not scored or NaN)


def importance_weights(old, rollout, is_mode, is_cap, is_min, scored, sequences: Sequences) -> ImportanceWeights:
    """Rollout importance sampling (TRL's vLLM correction): the ratio ``exp(old - rollout)`` per token or per
    sequence, clamped to ``[is_min, is_cap]`` (``*_truncate``) or zeroed outside it (``*_mask``); without ``is_mode``
    the weights are 1 and only the metrics read the ratio."""
    diff = torch.where(scored & ~torch.isnan(old - rollout), old - rollout, torch.zeros_like(old))
    log_w = diff
    if is_mode is not None and is_mode.startswith("sequence"):
        per_seq = torch.zeros(sequences.num_seqs, dtype=diff.dtype, device=diff.device).index_add_(
            0, sequences.seq_index, diff)
        log_w = per_seq[sequences.seq_index]
    w = torch.exp(log_w)
    high = float("inf") if is_cap is None else is_cap
    low = float("-inf") if is_min is None else is_min
    outside = ((w > high) | (w < low)) & scored
    if is_mode is None:
        weights = torch.ones_like(w)
    elif is_mode.endswith("truncate"):
        weights = torch.clamp(w, min=is_min, max=is_cap)
    else:
        weights = torch.where((w > high) | (w < low), torch.zeros_like(w), w)
    return ImportanceWeights(weights, outside, diff)


def off_policy_keep(adv, logp, sampling, threshold, scored, sequences: Sequences):
    """TRL's off-policy sequence mask (DeepSeek-V3.2): keep a token when its advantage is ``>= 0`` or its sequence's
    mean ``sampling - logp`` (NaN counted as 0) is at most ``threshold``."""
    kl = torch.nan_to_num(sampling - logp.detach(), nan=0.0)
    zeros = torch.zeros(sequences.num_seqs, dtype=kl.dtype, device=kl.device)
    total = zeros.index_add(0, sequences.seq_index, torch.where(scored, kl, torch.zeros_like(kl)))
    count = zeros.index_add(0, sequences.seq_index, scored.to(kl.dtype)).clamp(min=1)
    return (adv >= 0) | ((total / count)[sequences.seq_index] <= threshold)


def geometric_mean_per_sequence(weights, scored, sequences: Sequences):
    """verl geo_mean's reading of token IS weights: ``exp(mean over the sequence of log(w + 1e-10))``."""
    logs = torch.where(scored, torch.log(weights + 1e-10), torch.zeros_like(weights))
    zeros = torch.zeros(sequences.num_seqs, dtype=weights.dtype, device=weights.device)
    count = zeros.index_add(0, sequences.seq_index, scored.to(weights.dtype)).clamp(min=1)
    return torch.exp(zeros.index_add(0, sequences.seq_index, logs) / count)[sequences.seq_index]


# --- metrics ------------------------------------------------------------------------------------

def masked_mean(values, scored, count):
    return torch.where(scored, values, torch.zeros_like(values)).sum() / count


def _masked_extreme(values, scored, reduce, neutral):
    """``reduce`` (``amax`` / ``amin``) over the scored entries; ``neutral`` where there are none (an empty
    batch included: a reduction of zero elements has no value)."""
    fill = torch.full((1,), neutral, dtype=values.dtype, device=values.device)
    return reduce(torch.cat([torch.where(scored, values, fill), fill]))


def metrics(token, scored, entropy, importance: Optional[ImportanceWeights], extra: dict) -> dict:
    """The policy loss's metrics (0-dim fp32, detached, no host sync) from its per-token terms (``terms.TokenTerms``)
    and ``extra`` (name -> 0-dim tensor)."""
    count = scored.float().sum().clamp(min=1)
    any_scored = scored.any()
    zero = torch.zeros((), dtype=torch.float32, device=scored.device)
    ratio = token.ratio.float()
    out = {
        "clipfrac": masked_mean(token.clipped.float(), scored, count),
        "clipfrac_lower": masked_mean(token.clipped_lower.float(), scored, count),
        "ppo_kl": masked_mean(-token.log_ratio.float(), scored, count),
        "kl_mean": masked_mean(token.kl.float().detach(), scored, count),
        "entropy_mean": masked_mean(entropy.float().detach(), scored, count),
        "ratio_max": torch.where(any_scored, _masked_extreme(ratio, scored, torch.amax, float("-inf")), zero),
        "ratio_min": torch.where(any_scored, _masked_extreme(ratio, scored, torch.amin, float("inf")), zero),
    }
    if importance is not None:
        out["is_weight_mean"] = masked_mean(importance.weights.float(), scored, count)
        out["is_masked_frac"] = masked_mean(importance.outside.float(), scored, count)
        out["mismatch_k3"] = masked_mean((torch.expm1(importance.log_ratio) - importance.log_ratio).float(), scored,
                                         count)
    out.update({name: value.float() for name, value in extra.items()})
    return {k: v.detach() for k, v in out.items()}
