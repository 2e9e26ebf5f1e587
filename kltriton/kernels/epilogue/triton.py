"""Triton backend of the ``epilogue`` family (see ``kltriton.kernels.epilogue`` for the contract).

Without reward shaping the KL is elementwise (grid ``(cdiv(N, BLOCK),)``). With it, one program per sequence (grid
``(num_seqs,)``) walks its positions twice in order: the sums and the last scored position, then the per-token values
with the score added there, so the sequence means are deterministic (no atomics). The backward is elementwise; a
position's sequence is ``n // seq_len``, or a binary search of ``cu_seqlens`` (``triton_rows.first_offset_at_least``).
"""
import torch
import triton
import triton.language as tl

from kltriton import estimators
from kltriton.kernels import constants
from kltriton.kernels import triton_rows as rows
from kltriton.kernels.epilogue import KlReward

BLOCK = 1024
SKIP = tl.constexpr(constants.SKIP)


@triton.jit
def _token_kl(offs, inside, logp_ptr, full_kl_ptr, ref_ptr, target_ptr, kl_clamp, REF_GIVEN: tl.constexpr,
              ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr):
    """``(kl, slope, ref, target)`` at ``offs`` (float64; ``slope`` d kl / d logp, or d kl / d full_kl for ``full``)."""
    target = tl.load(target_ptr + offs, mask=inside, other=SKIP)
    ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(tl.float64)
    if REF_GIVEN:
        ref = tl.where(target >= 0, ref, 0.0)
    if ESTIMATOR == "full":
        full_kl = tl.load(full_kl_ptr + offs, mask=inside, other=0.0).to(tl.float64)
        slope = tl.where(tl.abs(full_kl) > kl_clamp, 0.0, 1.0)
        value = rows.clamp(full_kl, -kl_clamp, kl_clamp)
    else:
        logp = tl.load(logp_ptr + offs, mask=inside, other=0.0).to(tl.float64)
        value, slope = rows.kl_estimate(logp - ref, kl_clamp, ESTIMATOR, STRAIGHT)
    return value, slope, ref, target


@triton.jit
def _kl_kernel(logp_ptr, full_kl_ptr, ref_ptr, target_ptr, kl_ptr, ref_out_ptr, n, kl_clamp,
               REF_GIVEN: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK),)``: the per-token KL (and the given reference log-probs, 0 where not scored)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    kl, _, ref, _ = _token_kl(offs, inside, logp_ptr, full_kl_ptr, ref_ptr, target_ptr, kl_clamp, REF_GIVEN,
                              ESTIMATOR, STRAIGHT)
    tl.store(kl_ptr + offs, kl.to(tl.float32), mask=inside)
    if REF_GIVEN:
        tl.store(ref_out_ptr + offs, ref.to(tl.float32), mask=inside)


@triton.jit
def _reward_kernel(logp_ptr, full_kl_ptr, ref_ptr, target_ptr, kl_ptr, ref_out_ptr, reward_ptr, per_seq_ptr,
                   count_ptr, coef_ptr, rewards_ptr, scores_ptr, n, seq_len, cu_ptr, kl_clamp, score_clip,
                   REF_GIVEN: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(num_seqs,)``: one sequence per program, its positions in order (the sums and the last scored position,
    then the per-token KL and reward, the score at that position)."""
    seq = tl.program_id(0)
    start, end = rows.sequence_bounds(seq, n, seq_len, cu_ptr)
    total = tl.zeros((), tl.float64)
    count = tl.zeros((), tl.int64)
    last = tl.zeros((), tl.int64) - 1
    for lo in range(start, end, BLOCK):
        offs = lo + tl.arange(0, BLOCK)
        inside = offs < end
        kl, _, _, target = _token_kl(offs, inside, logp_ptr, full_kl_ptr, ref_ptr, target_ptr, kl_clamp, REF_GIVEN,
                                     ESTIMATOR, STRAIGHT)
        scored = inside & (target != SKIP)  # an OUT_OF_RANGE position counts: its NaN shows in the mean
        total += tl.sum(tl.where(scored, kl, 0.0), axis=0)
        count += tl.sum(scored.to(tl.int64), axis=0)
        last = tl.maximum(last, tl.max(tl.where(scored, offs, -1), axis=0))
    tl.store(per_seq_ptr + seq, (total / tl.maximum(count, 1).to(tl.float64)).to(tl.float32))
    tl.store(count_ptr + seq, count.to(tl.float32))
    coef = tl.load(coef_ptr).to(tl.float64)
    bonus = 0.0
    if scores_ptr is not None:
        bonus = rows.clamp(tl.load(scores_ptr + seq).to(tl.float64), -score_clip, score_clip)
    for lo in range(start, end, BLOCK):
        offs = lo + tl.arange(0, BLOCK)
        inside = offs < end
        kl, _, ref, _ = _token_kl(offs, inside, logp_ptr, full_kl_ptr, ref_ptr, target_ptr, kl_clamp, REF_GIVEN,
                                  ESTIMATOR, STRAIGHT)
        kl32 = kl.to(tl.float32)
        reward = -coef * kl32.to(tl.float64)
        if rewards_ptr is not None:
            reward += tl.load(rewards_ptr + offs, mask=inside, other=0.0).to(tl.float64)
        reward = tl.where(offs == last, (reward.to(tl.float32)).to(tl.float64) + bonus, reward)
        tl.store(kl_ptr + offs, kl32, mask=inside)
        tl.store(reward_ptr + offs, reward.to(tl.float32), mask=inside)
        if REF_GIVEN:
            tl.store(ref_out_ptr + offs, ref.to(tl.float32), mask=inside)


@triton.jit
def _backward_kernel(logp_ptr, full_kl_ptr, ref_ptr, target_ptr, g_kl_ptr, g_reward_ptr, g_per_seq_ptr, count_ptr,
                     coef_ptr, out_ptr, n, seq_len, num_seqs, cu_ptr, search_steps, kl_clamp,
                     REF_GIVEN: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK),)``: ``(g_kl - coef g_reward + g_kl_per_seq[s] / count[s]) * d kl / d value``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    _, slope, _, target = _token_kl(offs, inside, logp_ptr, full_kl_ptr, ref_ptr, target_ptr, kl_clamp, REF_GIVEN,
                                    ESTIMATOR, STRAIGHT)
    g = tl.zeros((BLOCK,), tl.float64)
    if g_kl_ptr is not None:
        g += tl.load(g_kl_ptr + offs, mask=inside, other=0.0).to(tl.float64)
    if g_reward_ptr is not None:
        g -= tl.load(coef_ptr).to(tl.float64) * tl.load(g_reward_ptr + offs, mask=inside, other=0.0).to(tl.float64)
    if g_per_seq_ptr is not None:
        if cu_ptr is not None:
            seq = rows.first_offset_at_least(offs + 1, cu_ptr, num_seqs + 1, search_steps) - 1
        else:
            seq = offs // seq_len
        seq = tl.minimum(tl.maximum(seq, 0), num_seqs - 1)
        share = tl.load(g_per_seq_ptr + seq, mask=inside, other=0.0).to(tl.float64) / tl.maximum(
            tl.load(count_ptr + seq, mask=inside, other=1.0).to(tl.float64), 1.0)
        g += tl.where(inside & (target != SKIP), share, 0.0)
    tl.store(out_ptr + offs, tl.where(g == 0, 0.0, g * slope).to(tl.float32), mask=inside)


def _estimator(name):
    est = estimators.parse(name)
    return dict(ESTIMATOR=est.base, STRAIGHT=est.straight_through)


def kl_reward(values, ref_logp, ref_given, target, rows_, estimator, kl_clamp, shaping, score_clip) -> KlReward:
    n, device = target.numel(), target.device
    new = lambda size: torch.empty(size, dtype=torch.float32, device=device)  # noqa: E731
    shaped = shaping is not None
    kl, ref_out = new(n), new(n if ref_given else 0)
    reward, per_seq, count = (new(n), new(rows_.num_seqs), new(rows_.num_seqs)) if shaped else (new(0),) * 3
    common = (values.logp, values.full_kl, ref_logp, target, kl, ref_out)
    constexprs = dict(REF_GIVEN=bool(ref_given), **_estimator(estimator), BLOCK=BLOCK)
    if not shaped:
        if n:
            _kl_kernel[(triton.cdiv(n, BLOCK),)](*common, n, kl_clamp, **constexprs)
    elif rows_.num_seqs:
        _reward_kernel[(rows_.num_seqs,)](*common, reward, per_seq, count, shaping.coef, shaping.rewards,
                                          shaping.scores, n, rows_.seq_len, rows_.cu_seqlens, kl_clamp, score_clip,
                                          **constexprs)
    return KlReward(kl, ref_out, reward, per_seq, count)


def kl_reward_backward(values, ref_logp, ref_given, target, rows_, estimator, kl_clamp, coef, count, g_kl, g_reward,
                       g_kl_per_seq):
    n = target.numel()
    full = estimators.parse(estimator).needs_ref_logits
    out = torch.empty(n, dtype=torch.float32, device=target.device)
    none = out.new_empty(0)
    if n:
        steps = (rows_.num_seqs + 1).bit_length()
        _backward_kernel[(triton.cdiv(n, BLOCK),)](
            values.logp, values.full_kl, ref_logp, target, g_kl, g_reward, g_kl_per_seq, count, coef, out, n,
            max(rows_.seq_len, 1), rows_.num_seqs, rows_.cu_seqlens, steps, kl_clamp, REF_GIVEN=bool(ref_given),
            **_estimator(estimator), BLOCK=BLOCK)
    return (none, out) if full else (out, none)
