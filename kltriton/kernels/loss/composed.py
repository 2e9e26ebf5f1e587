"""The ``loss`` family from the ``stream`` family of one backend: statistics, coefficients, gradient.

``forward`` runs the stream forward kernel, the ``[N]`` coefficients of ``terms.coefficients``, and
the stream backward kernel with those coefficients, all inside the forward call: the logits are read
twice (statistics, then gradient) and the gradient written once. The reference backend is this; the
C++ and Triton fused kernels do it in one pass per row and fall back here (C++: a reference in another
dtype; Triton: no gradient wanted, the stream forward alone).
"""
from kltriton import dispatch
from kltriton.kernels.loss import LossStats, terms


def forward(stream_backend, logits, ref_logits, target, temperature, rows, bounds, loss_type, estimator,
            entropy_grad, with_grad):
    kernels = dispatch.implementation("stream", stream_backend)
    full = terms.split_estimator(estimator)[0] == "full"
    stats = kernels.forward(logits, ref_logits, target, temperature, True, full)
    out = LossStats(stats.logp, stats.entropy, stats.ref_logp, stats.full_kl)
    if not with_grad:
        return out, logits.new_empty((0, logits.shape[-1]))
    ref_logp = stats.ref_logp if ref_logits is not None else rows.ref_logp
    g_logp, g_entropy, g_full_kl = terms.coefficients(loss_type, estimator, stats.logp, ref_logp, rows.old_logp,
                                                      rows.advantages, rows.w_pg, rows.w_kl, rows.w_ent, bounds)
    grad = kernels.backward(logits, ref_logits if full else None, target, temperature, stats.lse,
                            stats.ref_lse if full else None, g_logp.contiguous(),
                            g_entropy.contiguous() if entropy_grad else None, stats.entropy if entropy_grad else None,
                            g_full_kl.contiguous() if full else None, stats.full_kl if full else None)
    return out, grad.view(-1, logits.shape[-1])
