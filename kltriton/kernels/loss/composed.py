"""The ``loss`` family from a ``stream`` backend module: statistics, coefficients, gradient (two reads).

``forward`` runs the stream module's forward, the ``[N]`` coefficients of ``terms.coefficients`` (the loss
types of ``terms.FUSED``), and the stream module's backward on the gradient basis,
all inside the forward call: the logits are read twice (statistics, then gradient) and the gradient
written once. The reference backend is this; the fused C++ and Triton kernels run it for what they do
not take.
"""
from kltriton import estimators
from kltriton.kernels import statistics
from kltriton.kernels.loss import terms, wanted


def forward(stream, logits, ref_logits, target, temperature, inputs, hp, loss_type, estimator, entropy_grad,
            with_grad):
    """``stream``: the ``kltriton.kernels.stream`` backend module to compose (its ``forward`` / ``backward``)."""
    stats = stream.forward(logits, ref_logits, target, temperature, wanted(ref_logits is not None, estimator))
    if not with_grad:
        return stats, logits.new_empty((0, logits.shape[-1]))
    est = estimators.parse(estimator) if estimator else None
    ref_logp = stats.ref_logp if ref_logits is not None else inputs.ref_logp
    g_logp, g_full_kl = terms.coefficients(loss_type, est, stats.logp, ref_logp, inputs, hp)
    grads = {"logp": g_logp, "entropy": inputs.w_ent if entropy_grad else None, "full_kl": g_full_kl}
    basis = statistics.gradient_basis(grads, stats, temperature)
    with_ref = basis.reads_ref()
    grad = stream.backward(logits, ref_logits if with_ref else None, target, temperature, stats.lse,
                           stats.ref_lse if with_ref else None, basis)
    return stats, grad.view(-1, logits.shape[-1])
