"""Reference backend of the ``loss`` family: the stream reference kernels composed (``composed.py``).

Any float dtype (float64 logits give a float64 oracle). ``scale_`` always multiplies (it reads and
writes the gradient even when the upstream gradient is 1).
"""
import torch

from kltriton import estimators
from kltriton.kernels import SKIP, constants
from kltriton.kernels.loss import LossTerms, composed, reference_logp, terms as formulas, weights
from kltriton.kernels.layout import reference as layout
from kltriton.kernels.stream import reference as stream


def forward(logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator, entropy_grad, with_grad,
            with_entropy=True):
    return composed.forward(stream, logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator,
                            entropy_grad, with_grad, with_entropy)


def forward_labels(logits, ref_logits, *args):
    return composed.forward_labels(layout.target_weights, forward, terms, logits, ref_logits, *args)


def accumulate_(grad, logits, target, temperature, lse, basis):
    composed.accumulate_(stream, grad, logits, target, temperature, lse, basis)


def scale_(grad, upstream):
    grad.mul_(upstream.to(grad.dtype))


def terms(stats, target, inputs, hyperparameters, loss_type, estimator) -> LossTerms:
    est = estimators.parse(estimator) if estimator else None
    logp, scored = stats.logp, target != SKIP
    ref = reference_logp(stats, inputs)
    if ref is not None and stats.ref_logp.shape != logp.shape:  # given: 0 where not scored
        ref = torch.where(scored, ref.to(logp.dtype), torch.zeros_like(logp))
    full_kl = stats.full_kl if est is not None and est.needs_ref_logits else None
    token = formulas.token_terms(loss_type, est, logp, ref, full_kl, inputs.old_logp, inputs.advantages,
                                 hyperparameters, scored)
    entropy = stats.entropy if stats.entropy.shape == logp.shape else torch.zeros_like(logp)
    entropy = torch.where(scored, entropy, torch.zeros_like(entropy))
    w_agg = inputs.w_pg if inputs.w_agg is None else inputs.w_agg
    sums = {"pg_loss": ((inputs.w_pg * token.pg).sum(), None), "kl_loss": ((w_agg * token.kl).sum(), None),
            "entropy_loss": ((w_agg * entropy).sum(), None)}
    metrics = weights.metrics(token, scored, entropy, None, sums, {}, weights.Sequences(None, 1))
    loss = formulas.objective(token, entropy, inputs.w_pg, inputs.w_kl, inputs.w_ent).sum()
    return LossTerms(loss, token.kl, token.ratio, torch.stack([metrics[name] for name in constants.LOSS_METRICS]))
