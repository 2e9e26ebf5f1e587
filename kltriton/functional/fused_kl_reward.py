"""``fused_kl_reward``: KL-shaped per-token rewards, the function RLHF trainers call.

The KL comes from the same single pass as ``token_kl``; the estimator, the reward shaping and the
per-sequence means are one ``[N]`` kernel after it (the ``epilogue`` family: no Python loop over
sequences, no host sync, no second pass over the logits), with its own backward.
"""
import math
from typing import NamedTuple, Optional

import torch

from kltriton import estimators
from kltriton._values import check_float, runtime_scalar
from kltriton.front_door import enter, local_rows
from kltriton.functional.token_kl import kl_of_call
from kltriton.kernels.epilogue import Shaping
from kltriton.kernels.epilogue.reference import shape_rewards
from kltriton.kernels.loss.weights import Sequences


class KLReward(NamedTuple):
    reward: torch.Tensor        # S fp32
    kl: torch.Tensor            # S fp32
    logprobs: torch.Tensor      # S fp32
    ref_logprobs: torch.Tensor  # S fp32
    kl_per_seq: torch.Tensor    # [num_seqs] fp32


def _check_coef(coef, device):
    if isinstance(coef, torch.Tensor):
        if not coef.dtype.is_floating_point:
            raise TypeError(f"coef must be a float or a 0-dim floating tensor, got {coef.dtype}")
        if coef.dim() != 0:
            raise ValueError(f"coef must be a float or a 0-dim tensor, got shape {tuple(coef.shape)}")
        if coef.device != device:
            raise ValueError(f"coef is on {coef.device} but logits are on {device}")
        return coef.detach()
    if isinstance(coef, bool) or not isinstance(coef, (int, float)):
        raise TypeError(f"coef must be a float or a 0-dim tensor, got {type(coef).__name__}")
    return runtime_scalar(check_float("coef", coef), device)


def _check_rewards(rewards, shape, device):
    if rewards is None:
        return None
    shape = tuple(shape)
    if not isinstance(rewards, torch.Tensor) or not rewards.dtype.is_floating_point:
        raise TypeError("rewards must be a floating tensor")
    if tuple(rewards.shape) not in (shape, shape + (1,)):
        raise ValueError(f"rewards must have shape {shape} or {shape + (1,)}, got {tuple(rewards.shape)}")
    if rewards.device != device:
        raise ValueError(f"rewards is on {rewards.device} but logits are on {device}")
    return rewards.detach()


def _check_scores(scores, num_seqs, device, score_clip):
    score_clip = check_float("score_clip", score_clip, above=0.0, allow_none=True)
    if scores is None:
        return None, score_clip
    if not isinstance(scores, torch.Tensor) or not scores.dtype.is_floating_point:
        raise TypeError("scores must be a floating tensor of shape [num_seqs]")
    if scores.numel() != num_seqs or scores.dim() > 2:
        raise ValueError(f"scores must have shape [num_seqs] = [{num_seqs}], got {tuple(scores.shape)}")
    if scores.device != device:
        raise ValueError(f"scores is on {scores.device} but logits are on {device}")
    return scores.detach(), score_clip


def fused_kl_reward(
    logits: torch.Tensor,
    ref: torch.Tensor,
    labels: torch.Tensor,
    *,
    coef=0.1,
    estimator: str = "k1",
    kl_clamp: Optional[float] = None,
    scores: Optional[torch.Tensor] = None,
    rewards: Optional[torch.Tensor] = None,
    score_clip: Optional[float] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    shift_labels: bool = False,
    backend: Optional[str] = None,
    process_group=None,
    vocab_start: Optional[int] = None,
    truncation=None,
    sequence_group=None,
) -> KLReward:
    """KL-shaped per-token rewards: ``reward = rewards - coef * kl`` plus the clipped sequence score
    at the last scored position of each sequence.

    Args:
        logits, ref, labels, estimator, kl_clamp, temperature, ignore_index, mask,
            cu_seqlens, shift_labels, backend, process_group, vocab_start: as in ``token_kl``.
        coef: KL coefficient, a float or a 0-dim tensor (read on the device, no host sync).
        scores: optional ``[num_seqs]`` sequence-level scores (reward model outputs).
        rewards: optional per-token rewards of shape ``S`` or ``S + [1]`` (torchrl's layout).
        score_clip: clip ``scores`` to ``[-score_clip, score_clip]`` before adding them.
        truncation: a ``kltriton.Truncation`` for the policy side, as in ``token_kl``. A position whose label is
            outside the kept set (``logprobs = -inf``: the engine could not have sampled it from these logits)
            gets ``kl = 0``: its reward is the given ``rewards`` (and the score), never an infinite penalty, and
            no other position changes.
        sequence_group: context parallel, as in ``token_logprobs``: each rank holds a contiguous slice of every
            sequence (``[B, T_r]``, or ``[N_r]`` of the packed stream with the global ``cu_seqlens``). The per-token
            outputs are this rank's positions'; ``kl_per_seq`` is the whole sequences' on every rank (one all-reduce
            of ``2 num_seqs`` values), and each score is added at its sequence's last scored position on the rank
            that holds it (one all-reduce of ``num_seqs`` int64). ``kl_per_seq``'s gradient is that of a function
            computed alike on every rank (it reaches each rank's own positions, no collective in the backward).

    Sequences are the rows of a ``[B, T]`` layout, the segments of ``cu_seqlens``, or the whole
    flat ``[N]`` layout.

    Returns:
        ``KLReward(reward, kl, logprobs, ref_logprobs, kl_per_seq)``: fp32 ``S`` tensors (``kl``,
        ``logprobs``, ``ref_logprobs`` are 0 where not scored; ``reward`` there is the given
        ``rewards`` unchanged, or 0) and ``kl_per_seq [num_seqs]``, the mean ``kl`` over each sequence's scored
        positions (0 if it has none). Gradient flows to the policy ``logits`` through ``kl``.
    """
    call = enter(logits, labels, ref=ref, temperature=temperature, ignore_index=ignore_index, mask=mask,
                 cu_seqlens=cu_seqlens, shift_labels=shift_labels, backend=backend, process_group=process_group,
                 vocab_start=vocab_start, truncation=truncation, sequence_group=sequence_group)
    estimator = estimators.parse(estimator, ref_logits=call.ref is not None)
    kl_clamp = estimators.check_kl_clamp(kl_clamp)
    layout = call.layout
    coef = _check_coef(local_rows(coef, "coef"), call.device)
    rewards = _check_rewards(None if rewards is None else local_rows(rewards, "rewards"), layout.shape, call.device)
    scores, score_clip = _check_scores(None if scores is None else local_rows(scores, "scores"), layout.num_seqs,
                                       call.device, score_clip)
    shaping = Shaping(coef, None if rewards is None else rewards.reshape(-1),
                      None if scores is None else scores.reshape(-1))
    whole = call.truncation is None and call.sequence_group is None  # the epilogue op shapes the rewards itself
    out, logp, ref_logp = kl_of_call(call, estimator, kl_clamp, shaping if whole else None, score_clip)
    kl, reward, kl_per_seq = out.kl, out.reward, out.kl_per_seq
    if not whole:  # a truncation drops the KL outside the kept set first; a sequence group sums over its ranks
        if call.truncation is not None:
            kl = torch.where(logp == float("-inf"), torch.zeros_like(kl), kl)
        sequences = Sequences(layout.seq_index, layout.num_seqs, group=call.sequence_group, position=layout.position)
        reward, kl_per_seq, _ = shape_rewards(kl, layout.target, sequences, coef, shaping.rewards, shaping.scores,
                                              math.inf if score_clip is None else score_clip)
    shaped = layout.shaped
    return KLReward(shaped(reward), shaped(kl), shaped(logp), shaped(ref_logp), kl_per_seq)
