"""The per-token policy-loss formulas in PyTorch (``[N]`` work): verl 0.9 ``core_algos`` semantics.

Used for the loss value and the metrics by every path, and differentiated by autograd for ``gspo``.
``coefficients`` is the hand-derived gradient of ``objective`` for the token-level losses (the
reference backend and ``composed.py`` use it; the fused kernels compute the same per row: C++
``row_coefficients`` in ``csrc/loss_forward.cpp``, Triton ``_row_coefficients`` in
``kltriton/kernels/loss/triton.py``); the tests hold every backend against float64 oracles
differentiated by autograd.

``bounds`` is the float64 ``[4]`` tensor of the ``loss`` family: ``1 - clip_low``, ``1 + clip_high``,
dual clip (``inf`` off), KL clamp (``inf`` off).
"""
from typing import NamedTuple

import torch

from kltriton import estimators

LOSS_TYPES = ("ppo", "gspo", "cispo")
LOG_RATIO_CLAMP = 20.0  # verl clamps log(ratio) to [-20, 20] before exp (vanilla, cispo)
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps the log of the GSPO token ratio at 10


class TokenTerms(NamedTuple):
    pg: torch.Tensor             # [N] policy-gradient loss per token (before weights)
    ratio: torch.Tensor          # [N] importance ratio (per sequence for gspo, broadcast)
    kl: torch.Tensor             # [N] KL estimator value (0 without a reference)
    clipped: torch.Tensor        # [N] bool: the clipped branch was taken (verl pg_clipfrac)
    clipped_lower: torch.Tensor  # [N] bool: the dual clip was taken (verl pg_clipfrac_lower)
    log_ratio: torch.Tensor      # [N] logp - old (clamped like verl's ppo_kl)


def split_estimator(estimator: str):
    """``(base, straight_through)`` of ``"k3+"``-style names (``""``: no KL term)."""
    if estimator.endswith("+"):
        return estimator[:-1], True
    return estimator, False


def kl_term(estimator, logp, ref_logp, full_kl, kl_clamp):
    """The estimator's value (clamped to ``[-kl_clamp, kl_clamp]``); ``"+"`` names take the gradient of
    ``k2`` (verl ``kl_penalty``)."""
    base, straight = split_estimator(estimator)
    if base == "":
        return torch.zeros_like(logp)
    kl = estimators.value(base, None, logp, ref_logp, full_kl)
    kl = torch.clamp(kl, min=-kl_clamp, max=kl_clamp)
    if straight:
        d = logp - ref_logp
        k2 = 0.5 * d * d
        kl = k2 - k2.detach() + kl.detach()
    return kl


def _ratio(logp, old):
    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio), log_ratio


def ppo(logp, old, adv, low, high, dual):
    """verl ``compute_policy_loss_vanilla``: clipped surrogate, dual clip for negative advantages."""
    ratio, log_ratio = _ratio(logp, old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, low, high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * dual
    negative = adv < 0
    pg = torch.where(negative, torch.minimum(clip1, pg3), clip1)
    return pg, ratio, pg2 > pg1, (clip1 > pg3) & negative, log_ratio


def cispo(logp, old, adv, low, high):
    """verl ``compute_policy_loss_cispo``: ``-sg(clip(ratio)) * A * logp``."""
    ratio, log_ratio = _ratio(logp, old)
    clipped = torch.clamp(ratio, low, high)
    pg = -clipped.detach() * adv * logp
    return pg, ratio, ratio != clipped, torch.zeros_like(ratio, dtype=torch.bool), log_ratio


def gspo(logp, old, adv, low, high, scored, seq_index, num_seqs):
    """verl ``compute_policy_loss_gspo``: the token ratio ``sg(s_i) * p / sg(p)`` with ``s_i`` the
    geometric mean ratio of the sequence's scored tokens."""
    log_ratio = torch.where(scored, logp - old, torch.zeros_like(logp))
    zeros = torch.zeros(num_seqs, dtype=logp.dtype, device=logp.device)
    counts = zeros.index_add(0, seq_index, scored.to(logp.dtype)).clamp(min=1)
    seq_log_ratio = zeros.index_add(0, seq_index, log_ratio) / counts
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()[seq_index]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, low, high)
    return torch.maximum(pg1, pg2), ratio, pg2 > pg1, torch.zeros_like(scored), log_ratio


def token_terms(loss_type, estimator, logp, entropy, ref_logp, full_kl, old, adv, bounds, scored,
                seq_index=None, num_seqs=1) -> TokenTerms:
    """Per-token terms on ``[N]`` tensors; ``old`` None means on-policy (``old = logp.detach()``)."""
    del entropy  # the entropy enters the objective as it is
    bounds = bounds.to(logp.dtype)
    low, high, dual, kl_clamp = bounds[0], bounds[1], bounds[2], bounds[3]
    old = logp.detach() if old is None else old
    if loss_type == "ppo":
        pg, ratio, clipped, lower, log_ratio = ppo(logp, old, adv, low, high, dual)
    elif loss_type == "cispo":
        pg, ratio, clipped, lower, log_ratio = cispo(logp, old, adv, low, high)
    else:
        pg, ratio, clipped, lower, log_ratio = gspo(logp, old, adv, low, high, scored, seq_index, num_seqs)
    kl = kl_term(estimator, logp, ref_logp, full_kl, kl_clamp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return TokenTerms(torch.where(scored, pg, zero), torch.where(scored, ratio, zero), torch.where(scored, kl, zero),
                      clipped & scored, lower & scored, torch.where(scored, log_ratio, zero))


def objective(terms: TokenTerms, entropy, w_pg, w_kl, w_ent):
    """``[N]``: ``w_pg * pg + w_kl * kl + w_ent * entropy``; the loss is its sum."""
    return w_pg * terms.pg + w_kl * terms.kl + w_ent * entropy


def coefficients(loss_type, estimator, logp, ref_logp, old, adv, w_pg, w_kl, w_ent, bounds):
    """``(d loss / d logp, d loss / d entropy, d loss / d full_kl)`` per row: the derivative of
    ``objective`` for ``ppo`` / ``cispo``, written out (the fused C++ and Triton kernels compute the
    same per row). At an exact tie of the max / min the unclipped branch takes
    the whole gradient (autograd would split it; equal where both branches have the same slope)."""
    bounds = bounds.to(logp.dtype)
    low, high, dual, kl_clamp = bounds[0], bounds[1], bounds[2], bounds[3]
    old = logp if old is None else old
    d = logp - old
    ratio = torch.exp(torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = torch.clamp(ratio, low, high)
    zero = torch.zeros_like(logp)
    if loss_type == "ppo":
        pg1, pg2 = -adv * ratio, -adv * clipped
        g_ratio = torch.where(pg1 >= pg2, -adv, zero)
        g_ratio = torch.where((adv < 0) & (torch.maximum(pg1, pg2) > -adv * dual), zero, g_ratio)
        g_logp = w_pg * g_ratio * torch.where(d.abs() <= LOG_RATIO_CLAMP, ratio, zero)
    else:
        g_logp = -w_pg * clipped * adv
    base, straight = split_estimator(estimator)
    g_full_kl = w_kl if base == "full" else zero
    if base not in ("", "full"):
        dk = logp - ref_logp
        value = estimators.value(base, None, logp, ref_logp, None)
        slope = {"k1": torch.ones_like(dk), "abs": torch.sign(dk), "k2": dk, "k3": -torch.expm1(-dk)}[base]
        slope = dk if straight else torch.where(value.abs() > kl_clamp, zero, slope)
        g_logp = g_logp + w_kl * slope
    return g_logp, w_ent, g_full_kl
