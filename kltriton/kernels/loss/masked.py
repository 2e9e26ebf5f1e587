"""The ``loss`` family with TRL's entropy mask (``top_entropy_quantile``): the policy-gradient term counts only
on the rows whose entropy is at least the batch's ``quantile`` of the scored rows' entropies, which no row
knows before every row's statistics are in.

Passes over the logits (``forward``; ``linear_forward`` for ``LinearLogits``, where a pass is its GEMMs):

1. the backend's fused loss kernel with the policy-gradient weights set to 0: every row's statistics and the
   gradient of the terms the mask leaves alone (the KL term), one read of every row;
2. ``terms.entropy_keep`` on the ``[N]`` entropies: the quantile and the kept rows (no host sync);
3. the policy-gradient term's gradient added on the kept rows only (``accumulate_``: a row with zero
   coefficients is not read), with the coefficients of ``terms.SLOPES``.

So the logits are read ``1 + kept fraction`` times (TRL's ``top_entropy_quantile = 0.2``: 1.2), the gradient
written once and updated on the kept rows. The entropy bonus is not taken here (``policy_loss`` sends a masked
entropy bonus to the two-pass route: its token-mean renormalizes over the kept rows).
"""
import torch

from kltriton.kernels import SKIP, statistics
from kltriton.kernels.loss import terms


def _kept_slopes(loss_type, stats, target, inputs, hyperparameters, quantile):
    """``(keep, threshold, g_logp)``: the mask, its quantile, and ``d loss / d logp`` of the masked term."""
    keep, threshold = terms.entropy_keep(stats.entropy, target >= 0, quantile.to(torch.float32))
    logp = stats.logp
    old = logp if inputs.old_logp is None else inputs.old_logp
    slope = terms.SLOPES[loss_type](logp, old, inputs.advantages, hyperparameters.to(logp.dtype))
    g_logp = torch.where(keep, inputs.w_pg * slope, torch.zeros_like(slope))
    return keep, threshold, g_logp


def forward(impl, logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator, with_grad, quantile):
    """``(StreamStats, grad, keep, threshold)`` of the ``loss`` family with the entropy mask; ``impl`` a ``loss``
    backend module (``forward`` and ``accumulate_``), ``quantile`` a 0-dim tensor. The loss is
    ``sum(objective)`` with ``w_pg * keep``."""
    unmasked = inputs._replace(w_pg=torch.zeros_like(inputs.w_pg))
    stats, grad = impl.forward(logits, ref_logits, target, temperature, unmasked, hyperparameters, loss_type, estimator, False,
                               with_grad, True)
    keep, threshold, g_logp = _kept_slopes(loss_type, stats, target, inputs, hyperparameters, quantile)
    if with_grad:
        basis = statistics.gradient_basis({"logp": g_logp}, stats, temperature)
        impl.accumulate_(grad, logits, target, temperature, stats.lse, basis)
    return stats, grad, keep, threshold


def linear_forward(impl, policy, ref, target, temperature, inputs, hyperparameters, loss_type, estimator, want_x, want_weight,
                   want_bias, tile_elements, quantile):
    """``(StreamStats, d_x, d_weight, d_bias, keep, threshold)``: ``forward`` for the ``linear`` family
    (``impl``: a ``linear`` backend module); pass 3 recomputes the logits tiles of the kept rows only."""
    unmasked = inputs._replace(w_pg=torch.zeros_like(inputs.w_pg))
    stats, *grads = impl.loss_forward(policy, ref, target, temperature, unmasked, hyperparameters, loss_type, estimator, False,
                                      want_x, want_weight, want_bias, tile_elements, True)
    keep, threshold, g_logp = _kept_slopes(loss_type, stats, target, inputs, hyperparameters, quantile)
    if want_x or want_weight or want_bias:
        basis = statistics.gradient_basis({"logp": g_logp}, stats, temperature)
        kept = torch.where(keep, target, torch.full_like(target, SKIP))
        more = impl.backward(policy, None, kept, temperature, stats.lse, None, basis, want_x, want_weight, want_bias,
                             tile_elements)
        grads = [g if m is None else g + m for g, m in zip(grads, more)]
    return (stats, *grads, keep, threshold)
