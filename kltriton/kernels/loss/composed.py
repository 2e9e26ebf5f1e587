"""The ``loss`` family from the ``stream`` family of one backend: statistics, coefficients, gradient.

``forward`` runs the stream forward kernel, differentiates ``terms.objective`` w.r.t. the ``[N]``
statistics with autograd (``O(N)``), and runs the stream backward kernel with those coefficients,
all inside the forward call: the logits are read twice (statistics, then gradient) and the
gradient written once. The C++ backend does the same in one pass per row.
"""
import torch

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
    scored = target >= 0

    def loss_of(logp, entropy, full_kl):
        token = terms.token_terms(loss_type, estimator, logp, entropy, ref_logp, full_kl, rows.old_logp,
                                  rows.advantages, bounds, scored)
        return terms.objective(token, entropy, rows.w_pg, rows.w_kl, rows.w_ent).sum()

    # torch.func, not torch.autograd: a custom op's kernel runs below the Autograd dispatch key.
    g_logp, g_entropy, g_full_kl = torch.func.grad(loss_of, argnums=(0, 1, 2))(
        stats.logp.detach(), stats.entropy.detach(), stats.full_kl.detach())
    grad = kernels.backward(logits, ref_logits if full else None, target, temperature, stats.lse,
                            stats.ref_lse if full else None, g_logp.contiguous(),
                            g_entropy.contiguous() if entropy_grad else None, stats.entropy if entropy_grad else None,
                            g_full_kl.contiguous() if full else None, stats.full_kl if full else None)
    return out, grad.view(-1, logits.shape[-1])
