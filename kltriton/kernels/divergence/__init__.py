"""Family ``divergence``: the generalized Jensen-Shannon divergence between a student row (the policy logits ``x``,
``p = softmax(x / T)``) and a teacher row (the reference logits ``y``, ``q = softmax(y / T)``), and its gradient.

    JSD_beta(p, q) = beta * KL(q || m) + (1 - beta) * KL(p || m),   m = beta * q + (1 - beta) * p

(TRL's ``GKDTrainer.generalized_jsd_loss`` per token), for ``0 < beta < 1``; ``beta`` 0 and 1 are the forward and
reverse KL, statistics of the ``stream`` family (``forward_kl``, ``full_kl``). The mixture ``m`` needs both rows'
log-sum-exps before its first term, so the JSD is not a ``stream`` statistic (``docs/design.md``: it does not
merge from vocab pieces in one pass): it is this family's **second pass** over the row, after the ``stream``
forward gave ``lse`` and ``ref_lse``. Given those, every term is a plain sum over the vocabulary, so vocab tiles
(``LinearLogits``) and vocab shards (``kltriton.parallel``) just add their sums. Each backend module provides:

``forward(logits, ref_logits, target, temperature, lse, ref_lse, beta) -> (jsd, kl_student)``
    logits, ref_logits, target, temperature: as in ``kltriton.kernels.stream`` (``ref_logits`` required; either
        dtype). ``lse`` / ``ref_lse``: ``[N]`` fp32 log-sum-exps of ``x / T`` and ``y / T`` of the whole rows (a
        piece of a row sums its own entries with the whole row's log-sum-exps).
    beta: 0-dim float64 tensor in ``(0, 1)``: data, a new value never recompiles.
    Returns two ``[N]`` tensors in ``accumulation_dtype(logits.dtype)``: the JSD and ``KL(p || m)`` (the
    backward's centring term). 0 on ``SKIP`` rows, NaN on ``OUT_OF_RANGE`` rows and on rows whose ``lse`` or
    ``ref_lse`` is not finite (no distribution). Always finite otherwise (``0 <= JSD <= -log`` of the smaller
    weight), ``-inf`` / ``finfo.min`` logits included: an entry where ``p == 0`` (or ``q == 0``) adds no ``p``
    (``q``) term.

``backward(logits, ref_logits, target, temperature, lse, ref_lse, beta, kl_student, coef) -> grad``
    The gradient of ``coef * JSD / (1 - beta) * T`` w.r.t. ``logits``, i.e. with ``coef = g * (1 - beta) / T``
    (``[N]`` fp32) the gradient of ``g * JSD``:

        grad = coef * p * (log p - log m - KL(p || m))

    (``d JSD / d p_v = (1 - beta) (log p_v - log m_v)``: the teacher's term cancels). ``kl_student``: ``[N]`` fp32,
    the whole row's ``KL(p || m)`` from ``forward``. Returns a contiguous tensor shaped like ``logits`` in
    ``logits.dtype``; zero on rows with ``target < 0`` or a non-finite ``lse`` / ``ref_lse`` (the ``stream``
    family's rule), and where ``p == 0``.

``loss_forward(logits, ref_logits, target, temperature, kind, beta, weight, entropy, with_grad)``
    A divergence loss ``sum_n weight_n * D_n`` whose gradient is written in the forward (``composed.py``, the
    same on every backend: the ``stream`` forward, the JSD pass for ``"jsd"``, then the gradient pass).
"""
from kltriton.kernels.statistics import StreamStats

# The divergences of the family's loss: the name, and the ``stream`` statistic that is it (None: the JSD pass).
KINDS = {"forward_kl": "forward_kl", "reverse_kl": "full_kl", "jsd": None}

__all__ = ["KINDS", "StreamStats"]
