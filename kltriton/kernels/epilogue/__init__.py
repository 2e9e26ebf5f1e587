"""Family ``epilogue``: the ``[N]`` arithmetic after the statistics, one kernel instead of a string of ``[N]`` tensor
ops (on a GPU each is a launch): the per-token KL estimator, reward shaping and each sequence's mean KL.

Backends: ``reference.py`` (PyTorch ops, any float dtype), ``cpp.py`` (CPU), ``triton.py`` (CUDA, or CPU under
``TRITON_INTERPRET=1``). Each provides:

``kl_reward(values, ref_logp, ref_given, target, rows, estimator, kl_clamp, shaping, score_clip) -> KlReward``
    values:    ``KlValues(logp, full_kl)``: the policy's ``[N]`` log-probs (0 where not scored, NaN at
               ``OUT_OF_RANGE``) and its full KL (``[N]``, for ``estimator="full"``; else None).
    ref_logp:  ``[N]`` the reference's log-probs: its statistics' (``ref_given`` False: 0 where not scored), or given
               by the caller (``ref_given`` True: any float dtype, read as 0 where ``target < 0``).
    target:    ``[N]`` int64 (``kltriton.kernels.layout``).
    rows:      ``Rows(num_seqs, seq_len, cu_seqlens)``: sequence ``s`` is the segment ``cu_seqlens[s]:cu_seqlens[s + 1]``
               or, without ``cu_seqlens``, positions ``s * seq_len`` to ``(s + 1) * seq_len`` (offsets outside
               ``[0, N]`` are clamped: nothing is read out of bounds).
    estimator: a canonical estimator name (``kltriton.estimators``: ``"k1"``, ``"abs"``, ``"k2"``, ``"k3"``, ``"full"``,
               the straight-through ``"k1+"``, ``"abs+"``, ``"k3+"``).
    kl_clamp:  the value is clamped to ``[-kl_clamp, kl_clamp]`` (``inf``: no clamp).
    shaping:   None, or ``Shaping(coef, rewards, scores)``: ``coef`` 0-dim, ``rewards`` ``[N]`` or None, ``scores``
               ``[num_seqs]`` or None; ``score_clip``: the scores are clipped to ``[-score_clip, score_clip]`` (``inf``:
               not clipped).
    Returns ``KlReward(kl, ref_logp, reward, kl_per_seq, count)`` (fp32; float64 from float64 inputs on the reference
    backend): ``kl [N]`` (0 where not scored: both log-probs are 0 there); ``ref_logp [N]`` the given reference
    log-probs, 0 where ``target < 0`` (``[0]`` when not given); with ``shaping``, ``reward = rewards - coef * kl`` plus
    ``clip(scores[s], -score_clip, score_clip)`` at the last position of sequence ``s`` with ``target != SKIP``,
    ``kl_per_seq [num_seqs]`` the mean ``kl`` over those positions (0 without any) and ``count [num_seqs]`` their
    number (``[0]`` each without ``shaping``).

``kl_reward_backward(values, ref_logp, ref_given, target, rows, estimator, kl_clamp, coef, count, g_kl, g_reward,
g_kl_per_seq) -> (g_logp, g_full_kl)``
    The gradient w.r.t. ``values`` of upstream gradients of ``kl``, ``reward`` and ``kl_per_seq`` (None: none):
    ``g = g_kl - coef * g_reward + g_kl_per_seq[s] / max(count[s], 1)`` (the last term where ``target != SKIP``) times
    the estimator's derivative (``Estimator.slope``; ``full``: 1 where the clamp does not hold). One of the two is
    ``[0]``: ``g_full_kl`` for ``full``, else ``g_logp``.
"""
from typing import NamedTuple, Optional

import torch


class KlValues(NamedTuple):
    logp: torch.Tensor
    full_kl: Optional[torch.Tensor]


class Rows(NamedTuple):
    num_seqs: int
    seq_len: int
    cu_seqlens: Optional[torch.Tensor]


class Shaping(NamedTuple):
    coef: torch.Tensor
    rewards: Optional[torch.Tensor]
    scores: Optional[torch.Tensor]


class KlReward(NamedTuple):
    kl: torch.Tensor
    ref_logp: torch.Tensor
    reward: torch.Tensor
    kl_per_seq: torch.Tensor
    count: torch.Tensor
