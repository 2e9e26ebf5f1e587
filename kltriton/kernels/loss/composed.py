"""The ``loss`` family from a ``stream`` backend module: statistics, coefficients, gradient (two reads); and its
``forward_labels`` from a ``layout`` and a ``loss`` backend module.

``forward`` runs the stream module's forward, the ``[N]`` coefficients of ``terms.coefficients`` (the loss
types of ``terms.FUSED``), and the stream module's backward on the gradient basis,
all inside the forward call: the logits are read twice (statistics, then gradient) and the gradient
written once. The reference backend is this; the fused C++ and Triton kernels run it for what they do
not take.
"""
import torch

from kltriton import estimators
from kltriton.kernels import statistics
from kltriton.kernels.loss import row_inputs, statistics_request, terms


def forward(stream, logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator, entropy_grad,
            with_grad, with_entropy=True):
    """``stream``: the ``kltriton.kernels.stream`` backend module to compose (its ``forward`` / ``backward``)."""
    stats = stream.forward(logits, ref_logits, target, temperature,
                           statistics_request(ref_logits is not None, estimator, with_entropy))
    if not with_grad:
        return stats, logits.new_empty((0, logits.shape[-1]))
    est = estimators.parse(estimator) if estimator else None
    ref_logp = stats.ref_logp if ref_logits is not None else inputs.ref_logp
    g_logp, g_full_kl = terms.coefficients(loss_type, est, stats.logp, ref_logp, inputs, hyperparameters,
                                           stats.full_kl if est is not None and est.needs_ref_logits else None)
    grads = {"logp": g_logp, "entropy": inputs.w_ent if entropy_grad else None, "full_kl": g_full_kl}
    basis = statistics.gradient_basis(grads, stats, temperature)
    with_ref = basis.reads_ref()
    grad = stream.backward(logits, ref_logits if with_ref else None, target, temperature, stats.lse,
                           stats.ref_lse if with_ref else None, basis)
    return stats, grad.view(-1, logits.shape[-1])


def forward_labels(target_weights, loss_forward, loss_terms, logits, ref_logits, labels2d, mask2d, cu_seqlens,
                   checked_temperature, ignore_index, shift, flags, weights, temperature, old_logp, ref_logp,
                   hyperparameters, loss_type, estimator, entropy_grad, with_grad, with_entropy):
    """``forward_labels`` (the contract in ``kernels.loss``) as three calls of a backend: the ``layout`` family's
    ``target_weights``, then the ``loss`` family's ``forward`` and ``terms`` on its rows."""
    target, prepared = target_weights(labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index,
                                      logits.shape[-1], shift, flags, weights)
    inputs = row_inputs(prepared, old_logp, ref_logp)
    stats, grad = loss_forward(logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type,
                               estimator, entropy_grad, with_grad, with_entropy)
    return target, stats, grad, loss_terms(stats, target, inputs, hyperparameters, loss_type, estimator)


def accumulate_(stream, grad, logits, target, temperature, lse, basis):
    """``grad += `` the ``stream`` module's backward on ``basis`` for the rows with a nonzero coefficient (the
    others are left alone)."""
    rows = torch.nonzero((target >= 0) & torch.isfinite(lse) & ((basis.label != 0) | (basis.p != 0) | (
        (basis.p_logp != 0) if basis.p_logp is not None else False))).squeeze(-1)
    if rows.numel() == 0:
        return
    flat = logits.reshape(-1, logits.shape[-1])[rows]
    pick = type(basis)(*(None if c is None else c[rows] for c in basis))
    part = stream.backward(flat, None, target[rows], temperature if temperature.dim() == 0 else temperature[rows],
                           lse[rows], None, pick)
    grad.index_add_(0, rows, part.view(-1, grad.shape[-1]).to(grad.dtype))
