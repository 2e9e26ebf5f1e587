"""A divergence loss whose gradient is written in the forward, from a backend's ``stream`` and ``divergence``
kernels (the same composition on every backend).

Forward and reverse KL: the ``stream`` forward with the statistic (``forward_kl`` / ``full_kl``), then the
``stream`` backward on its gradient basis for the per-row weights. JSD: the ``stream`` forward for both log-sum-
exps, the JSD pass, then the JSD gradient. All inside the forward call, so the backward only scales the saved
gradient by the upstream one (``kltriton.ops.divergence``); for ``LinearLogits`` (``tiles.bind_divergence``) that
spares the backward's recomputation of the logits tiles.
"""
from kltriton.kernels import statistics
from kltriton.kernels.divergence import KINDS


def statistics_request(kind: str, entropy: bool) -> int:
    """The ``stream`` request of a ``kind`` divergence (the JSD needs both log-sum-exps only)."""
    stat = KINDS[kind]
    return statistics.request(entropy=entropy, ref=True, full_kl=stat == "full_kl", forward_kl=stat == "forward_kl")


def bind(stream, forward, backward):
    """``loss_forward`` on the ``stream`` backend module ``stream`` and a ``divergence`` backend's JSD
    ``forward`` / ``backward``."""

    def loss_forward(logits, ref_logits, target, temperature, kind, beta, weight, entropy, with_grad):
        """``(StreamStats, divergence [N], grad)``: the ``stream`` statistics of ``statistics_request(kind, entropy)``, the
        per-row divergence, and the gradient of ``sum_n weight_n * divergence_n`` w.r.t. ``logits`` as a
        contiguous ``[N, V]`` in ``logits.dtype`` (``[0, V]`` without ``with_grad``)."""
        vocab = logits.shape[-1]
        stat = KINDS[kind]
        stats = stream.forward(logits, ref_logits, target, temperature, statistics_request(kind, entropy))
        if stat is None:
            divergence, kl_student = forward(logits, ref_logits, target, temperature, stats.lse, stats.ref_lse, beta)
        else:
            divergence = getattr(stats, stat)
        if not with_grad:
            return stats, divergence, logits.new_empty((0, vocab))
        if stat is None:
            coef = (weight.double() * (1.0 - beta) / temperature).float()
            grad = backward(logits, ref_logits, target, temperature, stats.lse, stats.ref_lse, beta, kl_student, coef)
        else:
            basis = statistics.gradient_basis({stat: weight}, stats, temperature)
            grad = stream.backward(logits, ref_logits if basis.reads_ref() else None, target, temperature, stats.lse,
                                   stats.ref_lse if basis.reads_ref() else None, basis)
        return stats, divergence, grad.reshape(-1, vocab)

    return loss_forward
