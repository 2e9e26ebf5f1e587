"""The policy-loss formulas in PyTorch (``[N]`` work): verl 0.9 ``core_algos`` semantics, declared once.

Every path uses them for the loss value and the metrics; the two-pass route differentiates them by
autograd. For the loss types of ``FUSED`` (a row's derivative depends on that row alone) the derivative
w.r.t. the per-row log-prob is also written out three times: ``SLOPES`` here (the reference backend's),
``row_g_logp`` in ``csrc/loss_coefficients.h`` and ``_row_g_logp`` in ``kltriton/kernels/loss/triton.py``;
``tests/kernels/test_loss_coefficients.py`` holds the three against each other and against autograd
through ``objective``.

``hyperparameters`` is the float64 vector of the ``loss`` family, slots ``constants.HYPERPARAMETERS``:
``ratio_low = 1 - clip_low``, ``ratio_high = 1 + clip_high``, ``dual_clip`` (``inf`` off), ``kl_clamp``
(``inf`` off).
"""
from typing import NamedTuple, Optional

import torch

from kltriton import estimators
from kltriton.kernels import constants

LOSS_TYPES = ("ppo", "gspo", "cispo")
# Loss types whose derivative w.r.t. a row's log-prob depends on that row alone: the fused kernels.
FUSED = ("ppo", "cispo")
LOG_RATIO_CLAMP = constants.LOG_RATIO_CLAMP
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps the log of the GSPO token ratio at 10
SLOT = {name: i for i, name in enumerate(constants.HYPERPARAMETERS)}


def hyperparameters(device, **values) -> torch.Tensor:
    """The float64 hyperparameter vector from ``values`` by slot name (each a 0-dim float64 tensor or a
    float); a slot not given is ``inf`` (off)."""
    unknown = set(values) - set(SLOT)
    if unknown:
        raise KeyError(f"unknown hyperparameters {sorted(unknown)}; slots: {constants.HYPERPARAMETERS}")
    inf = torch.full((), float("inf"), dtype=torch.float64, device=device)
    return torch.stack([torch.as_tensor(values.get(name, inf), dtype=torch.float64, device=device)
                        for name in constants.HYPERPARAMETERS])


class TokenTerms(NamedTuple):
    pg: torch.Tensor             # [N] policy-gradient loss per token (before weights)
    ratio: torch.Tensor          # [N] importance ratio (per sequence for gspo, broadcast)
    kl: torch.Tensor             # [N] KL estimator value (0 without a reference)
    clipped: torch.Tensor        # [N] bool: the clipped branch was taken (verl pg_clipfrac)
    clipped_lower: torch.Tensor  # [N] bool: the dual clip was taken (verl pg_clipfrac_lower)
    log_ratio: torch.Tensor      # [N] logp - old (clamped like verl's ppo_kl)


def kl_term(estimator: Optional[estimators.Estimator], logp, ref_logp, full_kl, kl_clamp):
    """The estimator's value clamped to ``[-kl_clamp, kl_clamp]`` (a 0-dim tensor, ``inf``: off); 0 without an
    estimator."""
    if estimator is None:
        return torch.zeros_like(logp)
    return estimator.value(logp, ref_logp, full_kl, kl_clamp)


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


def token_terms(loss_type, estimator, logp, ref_logp, full_kl, old, adv, hp, scored, seq_index=None,
                num_seqs=1) -> TokenTerms:
    """Per-token terms on ``[N]`` tensors; ``old`` None means on-policy (``old = logp.detach()``)."""
    hp = hp.to(logp.dtype)
    low, high, dual, kl_clamp = (hp[SLOT[name]] for name in ("ratio_low", "ratio_high", "dual_clip", "kl_clamp"))
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


def _ppo_slope(logp, old, adv, hp):
    """``d pg / d logp`` of ``ppo`` per row. At an exact tie of the max / min the unclipped branch takes the whole
    gradient (autograd would split it; equal where both branches have the same slope)."""
    low, high, dual = (hp[SLOT[name]] for name in ("ratio_low", "ratio_high", "dual_clip"))
    d = logp - old
    ratio = torch.exp(torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, low, high)
    zero = torch.zeros_like(logp)
    g_ratio = torch.where(pg1 >= pg2, -adv, zero)
    g_ratio = torch.where((adv < 0) & (torch.maximum(pg1, pg2) > -adv * dual), zero, g_ratio)  # the dual clip holds
    return g_ratio * torch.where(d.abs() <= LOG_RATIO_CLAMP, ratio, zero)


def _cispo_slope(logp, old, adv, hp):
    """``d pg / d logp`` of ``cispo``: ``-sg(clip(ratio)) * A``."""
    ratio = torch.exp(torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return -torch.clamp(ratio, hp[SLOT["ratio_low"]], hp[SLOT["ratio_high"]]) * adv


# d pg / d logp per row of the loss types in FUSED, written out (the C++ and Triton kernels compute the same).
SLOPES = {"ppo": _ppo_slope, "cispo": _cispo_slope}
assert set(SLOPES) == set(FUSED)


def coefficients(loss_type, estimator: Optional[estimators.Estimator], logp, ref_logp, inputs, hp):
    """``(d loss / d logp, d loss / d full_kl)`` per row (``[N]``) for a loss type of ``FUSED``; ``d loss / d entropy``
    is ``inputs.w_ent``. ``tests/kernels/test_loss_coefficients.py`` holds it against autograd through
    ``objective`` and against the C++ and Triton kernels."""
    hp = hp.to(logp.dtype)
    old = logp if inputs.old_logp is None else inputs.old_logp
    g_logp = inputs.w_pg * SLOPES[loss_type](logp, old, inputs.advantages, hp)
    g_full_kl = inputs.w_kl if estimator is not None and estimator.needs_ref_logits else None
    if estimator is not None and not estimator.needs_ref_logits:
        g_logp = g_logp + inputs.w_kl * estimator.slope(logp - ref_logp, hp[SLOT["kl_clamp"]])
    return g_logp, g_full_kl
