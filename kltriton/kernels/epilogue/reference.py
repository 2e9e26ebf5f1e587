"""Reference backend of the ``epilogue`` family: PyTorch ops, any float dtype (see ``kltriton.kernels.epilogue``)."""
import torch

from kltriton import estimators
from kltriton.kernels import SKIP
from kltriton.kernels.epilogue import KlReward
from kltriton.kernels.loss.weights import Sequences


def sequences(target, rows) -> Sequences:
    """The rows' ``Sequences`` (each position's sequence and place) of a ``Rows``."""
    n, device = target.numel(), target.device
    position = torch.arange(n, device=device)
    if rows.cu_seqlens is not None:
        seq_index = torch.searchsorted(rows.cu_seqlens[1:].long().contiguous(), position, right=True)
    else:
        seq_index = position // max(rows.seq_len, 1)
    return Sequences(seq_index.clamp(max=max(rows.num_seqs - 1, 0)), rows.num_seqs, position=position)


def _reference(ref_logp, ref_given, target, dtype):
    ref = ref_logp.to(dtype)
    return torch.where(target >= 0, ref, torch.zeros_like(ref)) if ref_given else ref


def shape_rewards(kl, target, sequences: Sequences, coef, rewards, scores, score_clip):
    """``(reward [N], kl_per_seq [num_seqs], count [num_seqs])`` from the per-token ``kl``: ``rewards - coef * kl``
    plus each sequence's clipped score at its last position with ``target != SKIP`` (whichever rank holds it, under a
    sequence group), and the mean ``kl`` over those positions. Differentiable w.r.t. ``kl``."""
    scored = target != SKIP  # OUT_OF_RANGE positions count: their NaN must show in the mean
    total, count = sequences.sum(torch.stack([torch.where(scored, kl, torch.zeros_like(kl)), scored.to(kl.dtype)]),
                                 replicated=True).unbind()
    # kl is 0 at unscored positions, so a given per-token reward passes through there unchanged (torchrl
    # KLComputation, verl apply_kl_penalty); without one the reward is 0 there.
    reward = -coef.to(kl.dtype) * kl
    if rewards is not None:
        reward = rewards.reshape(-1).to(kl.dtype) + reward
    if scores is not None:
        bonus = scores.reshape(-1).to(kl.dtype).clamp(-score_clip, score_clip)
        reward = reward + torch.where(sequences.last(scored), bonus[sequences.seq_index], torch.zeros_like(reward))
    return reward, total / count.clamp(min=1), count


def kl_reward(values, ref_logp, ref_given, target, rows, estimator, kl_clamp, shaping, score_clip) -> KlReward:
    logp = values.logp
    ref = _reference(ref_logp, ref_given, target, logp.dtype)
    kl = estimators.parse(estimator).value(logp, ref, values.full_kl, kl_clamp)
    none = logp.new_empty(0)
    if shaping is None:
        return KlReward(kl, ref if ref_given else none, none, none, none)
    reward, kl_per_seq, count = shape_rewards(kl, target, sequences(target, rows), shaping.coef, shaping.rewards,
                                              shaping.scores, score_clip)
    return KlReward(kl, ref if ref_given else none, reward, kl_per_seq, count)


def kl_reward_backward(values, ref_logp, ref_given, target, rows, estimator, kl_clamp, coef, count, g_kl, g_reward,
                       g_kl_per_seq):
    logp = values.logp
    g = torch.zeros_like(logp) if g_kl is None else g_kl.to(logp.dtype)
    if g_reward is not None:
        g = g - coef.to(logp.dtype) * g_reward
    if g_kl_per_seq is not None:
        share = (g_kl_per_seq / count.clamp(min=1))[sequences(target, rows).seq_index]
        g = g + torch.where(target != SKIP, share.to(logp.dtype), torch.zeros_like(g))
    est = estimators.parse(estimator)
    none = logp.new_empty(0)
    if est.needs_ref_logits:
        slope = (values.full_kl.abs() <= kl_clamp).to(logp.dtype)
        return none, torch.where(g == 0, torch.zeros_like(g), g * slope)
    d = logp - _reference(ref_logp, ref_given, target, logp.dtype)
    slope = est.slope(d, kl_clamp)
    return torch.where(g == 0, torch.zeros_like(g), g * slope), none
