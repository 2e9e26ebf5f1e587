"""The policy loss's ``[N]`` arithmetic around the formulas of ``terms.py``: per-row aggregation weights (verl's
``agg_loss``), rollout importance-sampling weights, TRL's off-policy mask, verl geo_mean's reading of given weights,
and the metrics. Plain PyTorch on ``[N]`` tensors (no logits), the same for both routes of ``policy_loss``; autograd
differentiates whatever flows through it.
"""
from typing import NamedTuple, Optional

import torch

from kltriton import collectives
from kltriton._values import runtime_scalar

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class Sequences(NamedTuple):
    """Which sequence each row belongs to, how the sequence-mean aggregations count them, and the sequence group.

    Every reduction over the rows of a sequence or of the batch goes through the methods below: with ``group`` (a
    sequence group: the ranks each hold a contiguous slice of every sequence) each is ONE all-reduce over the group
    (a stack of several quantities in the same one), so the result is that of the whole sequences on every rank;
    without, this rank's rows are the sequences."""
    seq_index: Optional[torch.Tensor]      # [N] int64 (None: only the batch totals are used)
    num_seqs: int
    horizon: Optional[torch.Tensor] = None     # 0-dim: seq-mean-token-sum-norm's divisor
    num_tokens: Optional[torch.Tensor] = None  # 0-dim: token-mean's denominator instead of the count (verl)
    num_seqs_agg: Optional[torch.Tensor] = None  # 0-dim: seq-mean's denominator instead of the count (verl, TRL)
    group: object = None                   # the sequence group (a ProcessGroup), None: this rank's rows alone
    position: Optional[torch.Tensor] = None  # [N] each row's place along its sequence (global under a group)

    def sum(self, values, replicated: bool = False):
        """``[..., num_seqs]``: the sum of ``values [..., N]`` over each sequence's rows (the caller masks them),
        every rank's rows under a group. Differentiable: by default each rank's upstream gradient is that of its
        own part of a loss summed over the ranks (the gradient is summed over the ranks in the backward);
        ``replicated``: a result every rank uses alike (its gradient passes as it is)."""
        out = torch.zeros((*values.shape[:-1], self.num_seqs), dtype=values.dtype, device=values.device)
        return self.across(out.index_add(values.dim() - 1, self.seq_index, values), replicated)

    def total(self, values, replicated: bool = False):
        """``values [..., N]`` summed over the rows (of every rank under a group): ``[...]``."""
        return self.across(values.sum(-1), replicated)

    def maximum(self, values):
        """The elementwise maximum of ``values`` over the group's ranks (no gradient)."""
        if self.group is None:
            return values

        return collectives.all_reduce_max(values.detach().contiguous(), self.group)

    def last(self, rows):
        """``[N]`` bool: the last of ``rows`` in each sequence (on whichever rank holds it)."""
        key = torch.where(rows, self.position, torch.full_like(self.position, -1))
        last = torch.full((self.num_seqs,), -1, dtype=key.dtype, device=key.device).scatter_reduce(
            0, self.seq_index, key, reduce="amax", include_self=True)
        return rows & (self.position == self.maximum(last)[self.seq_index])

    def of_each(self, values, fill: float):
        """``[num_seqs]`` of a quantity that is the same on every row of a sequence (``values [N]``, no gradient),
        read where the sequence has a row (on any rank); ``fill`` for a sequence without rows."""
        low = torch.full((self.num_seqs,), float("-inf"), dtype=values.dtype, device=values.device)
        seen = self.maximum(low.scatter(0, self.seq_index, values.detach()))
        return torch.where(seen == float("-inf"), torch.full_like(seen, fill), seen)

    def across(self, out, replicated: bool = False):
        """``out`` (any shape) summed over the group's ranks (as ``sum``)."""
        if self.group is None:
            return out

        return collectives.sum_over_ranks(out, self.group) if replicated else collectives.sum_of_parts(out, self.group)


class RowCounts(NamedTuple):
    """A set of rows counted per sequence and in all (every rank's rows under a group)."""
    per_seq: torch.Tensor   # [num_seqs]
    tokens: torch.Tensor    # 0-dim


def row_counts(rows, sequences: Sequences, dtype) -> RowCounts:
    """``rows`` (``[N]`` bool) counted: ONE all-reduce of ``num_seqs`` values under a group."""
    per_seq = sequences.sum(rows.to(dtype))
    return RowCounts(per_seq, per_seq.sum())


def aggregation_weights(aggregation: str, rows, sequences: Sequences, dtype, *, own_denominators: bool = True,
                        counts: Optional[RowCounts] = None):
    """``[N]`` weights with ``agg(x) = sum_n w[n] * x[n]`` (verl ``agg_loss``) over the rows where ``rows``;
    ``own_denominators=False`` counts the tokens and sequences instead of ``sequences``' given ones. ``counts``:
    ``row_counts(rows)`` when the caller has them (else counted here, except for ``token-sum``)."""
    valid = rows.to(dtype)
    num_tokens = sequences.num_tokens if own_denominators else None
    num_seqs_agg = sequences.num_seqs_agg if own_denominators else None
    if aggregation == "token-sum":
        return valid
    counts = row_counts(rows, sequences, dtype) if counts is None else counts
    if aggregation == "token-mean":
        return valid / (counts.tokens.clamp(min=1) if num_tokens is None else num_tokens.to(dtype))
    per_seq = counts.per_seq
    count = (per_seq > 0).to(dtype).sum().clamp(min=1) if num_seqs_agg is None else num_seqs_agg.to(dtype)
    if aggregation == "seq-mean-token-mean":
        return valid / per_seq.clamp(min=1)[sequences.seq_index] / count
    weights = valid / count
    return weights / sequences.horizon.to(dtype) if aggregation == "seq-mean-token-sum-norm" else weights


def default_horizon(shape, cu_seqlens, device, split=None) -> torch.Tensor:
    """The padded length: ``T`` of ``[B, T]``, the longest packed segment, or ``N`` for one flat sequence (0-dim
    float64); under a sequence ``split`` (``collectives.SequenceSplit``) the global ``T`` / ``N``."""
    if len(shape) < 2 and cu_seqlens is not None and cu_seqlens.numel() > 1:
        return (cu_seqlens[1:] - cu_seqlens[:-1]).max().to(torch.float64)
    length = (shape[-1] if len(shape) >= 2 else shape.numel()) if split is None else split.total
    if isinstance(length, torch.Tensor):  # a split's total learned on the device
        length = length.to(torch.float64)
        return length if len(shape) >= 2 else length.clamp(min=1)

    return runtime_scalar(length if len(shape) >= 2 else max(length, 1), device)


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
        log_w = sequences.sum(diff.detach())[sequences.seq_index]
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
    total, count = sequences.sum(torch.stack([torch.where(scored, kl, torch.zeros_like(kl)), scored.to(kl.dtype)]))
    return (adv >= 0) | ((total / count.clamp(min=1))[sequences.seq_index] <= threshold)


def geometric_mean_per_sequence(weights, scored, sequences: Sequences):
    """verl geo_mean's reading of token IS weights: ``exp(mean over the sequence of log(w + 1e-10))``."""
    logs = torch.where(scored, torch.log(weights + 1e-10), torch.zeros_like(weights))
    total, count = sequences.sum(torch.stack([logs, scored.to(weights.dtype)]))
    return torch.exp(total / count.clamp(min=1))[sequences.seq_index]


# --- metrics ------------------------------------------------------------------------------------

def metrics(token, scored, entropy, importance: Optional[ImportanceWeights], sums: dict, given: dict,
            sequences: Sequences) -> dict:
    """The policy loss's metrics (0-dim fp32, detached, no host sync) from its per-token terms (``terms.TokenTerms``),
    ``sums`` (name -> ``(numerator, denominator or None)``, 0-dim sums over this rank's rows: the metric is their
    quotient over every rank's rows) and ``given`` (name -> 0-dim tensor, as it is). Under a sequence group every
    metric is the whole batch's: the sums in ONE all-reduce, the ratio's extremes in one more. The per-token means
    are one masked sum of the stacked terms (a handful of ops per call, not a handful per metric)."""
    means = {"clipfrac": token.clipped, "clipfrac_lower": token.clipped_lower, "ppo_kl": -token.log_ratio,
             "kl_mean": token.kl.detach(), "entropy_mean": entropy.detach()}
    if importance is not None:
        means.update(is_weight_mean=importance.weights, is_masked_frac=importance.outside,
                     mismatch_k3=torch.expm1(importance.log_ratio) - importance.log_ratio)
    stacked = torch.stack([value.detach().float() for value in means.values()] + [scored.float()])  # [M + 1, N]
    parts = [torch.where(scored, stacked, 0.0).sum(dim=-1)]
    for numerator, denominator in sums.values():
        parts += [numerator.detach().float().reshape(1)]
        parts += [] if denominator is None else [denominator.detach().float().reshape(1)]
    totals = iter(sequences.across(torch.cat(parts)).unbind())
    out = {name: next(totals) for name in means}
    count = next(totals)
    out = {name: value / count.clamp(min=1) for name, value in out.items()}
    for name, (_, denominator) in sums.items():
        numerator = next(totals)
        out[name] = numerator if denominator is None else numerator / next(totals).clamp(min=1)
    # the ratio's largest and (negated) smallest scored value; a -inf column keeps an empty batch reducible
    ratio = token.ratio.detach().float()
    signed = torch.where(scored, torch.stack([ratio, -ratio]), float("-inf"))
    high, low = sequences.maximum(torch.cat([signed, signed.new_full((2, 1), float("-inf"))], dim=1).amax(dim=1))
    zero = torch.zeros((), dtype=torch.float32, device=scored.device)
    out["ratio_max"] = torch.where(count > 0, high, zero)
    out["ratio_min"] = torch.where(count > 0, -low, zero)
    out.update({name: value.detach().float() for name, value in given.items()})
    return out
