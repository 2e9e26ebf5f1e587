"""Family ``stream``: softmax statistics of each row of logits, in one pass over the vocabulary.

Backends: ``reference.py`` (plain PyTorch, any float dtype incl. float64), ``triton.py`` (CUDA, or
CPU under ``TRITON_INTERPRET=1``), ``cpp.py`` (CPU, fp32 / bf16 / fp16). The statistics are declared
in ``kltriton.kernels.statistics`` (``StreamStats``). Each module provides:

``forward(logits, ref_logits, target, temperature, request) -> StreamStats``
    logits:      ``[..., V]`` float, any strides on the leading dims, last dim contiguous. ``N`` =
                 number of leading positions, in row-major order of the leading dims.
    ref_logits:  ``None`` or a tensor of the same shape (strides may differ), in its own float dtype
                 (e.g. fp32 under a bf16 policy; each is read as it is, never copied). Given iff
                 ``request`` has the ``REF`` bit.
    target:      ``[N]`` int64, contiguous: a label in ``[0, V)``, ``SKIP`` (outputs 0, logits
                 never read) or ``OUT_OF_RANGE`` (outputs NaN, logits never read).
    temperature: float64 tensor, 0-dim or ``[N]`` (one per row), ``> 0`` and finite (checked by
                 the caller); data, so a new value never recompiles. Every statistic of row ``n``
                 is of ``softmax(logits[n] / T[n])``.
    request:      request bits (``kltriton.kernels.constants``: ``ENTROPY``, ``REF``, ``FULL_KL``, ``FORWARD_KL``,
                 ``HEAD``; ``HEAD`` never with the reference bits).
    Returns ``StreamStats`` of ``[N]`` tensors in ``accumulation_dtype(logits.dtype)``, the statistics
    ``request`` does not ask for empty. ``logp`` and ``ref_logp`` are clamped to ``<= 0``. A row whose logits
    are all ``-inf`` has ``lse = -inf`` and NaN statistics (as torch); a NaN or ``+inf`` logit gives NaN
    statistics (never a silent 0). Logits masked with ``finfo.min`` or ``-1e30`` are normal input: every
    statistic is finite and exact wherever the float64 answer rounded to fp32 is (``x / T`` must be an
    fp32 number for the row's max).
    ``HEAD`` (no gradient): ``is_top1`` 1.0 where the label is the row's first maximum (``torch.argmax``'s rule, on
    the logits themselves: exact), else 0.0; ``sum_logits`` ``sum_v x_v / T`` times ``constants.LOGIT_SUM_SCALE``
    (``-inf`` for a ``-inf`` entry; finite for ``finfo.min`` ones); ``log_sum_sq_probs`` ``log sum_v p_v^2``;
    ``max_logit`` ``max_v x_v`` (before ``T``; exact). A row of all ``-inf`` logits has ``sum_logits = max_logit =
    -inf`` and NaN for the other two; a NaN or ``+inf`` logit gives NaN for the four.

``forward_labels(logits, ref_logits, labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, shift, flags,
temperature, request) -> (target, StreamStats)``
    ``forward`` at the target the ``layout`` family's ``target`` makes from the label side (its arguments, with
    ``vocab = logits.shape[-1]``), made in the same call: the C++ backend runs both kernels in one op (a call through
    ``torch.ops`` costs the host more than both kernels at small ``N``); the others call their two kernels.

``backward(logits, ref_logits, target, temperature, lse, ref_lse, basis) -> grad``
    The gradient w.r.t. ``logits`` on the basis of ``constants.GRADIENT_BASIS``:

        grad = c_label * onehot(target) - p * (c_p + c_p_logp * log p + c_p_logq * log q) - c_q * q

    ``basis``: ``kltriton.kernels.statistics.Basis`` of fp32 ``[N]`` coefficients already divided by ``T``
    (``statistics.gradient_basis`` turns the statistics' upstream gradients into them); ``p_logp`` / ``p_logq`` /
    ``q`` None when absent. ``ref_logits`` / ``ref_lse`` are given iff ``basis.reads_ref()`` (the reference is read
    only for the ``log q`` and ``q`` terms). Returns a contiguous tensor shaped like ``logits`` in ``logits.dtype``, zero on
    rows with ``target < 0`` and on rows whose ``lse`` is not finite (``-inf``: all ``-inf`` logits; NaN or
    ``+inf``: a NaN or ``+inf`` logit, or ``|x| / T`` beyond fp32), the same rule on every backend: their
    statistics are already NaN, so the loss shows it, and the other rows train unharmed. An entry with
    ``p == 0`` (a ``-inf`` logit, or ``finfo.min`` under a large ``lse``) gets no ``p`` term even where
    ``log p`` is ``-inf``.

``backward_upstream(logits, ref_logits, target, temperature, lse, ref_lse, upstream, out=None) -> grad``
    ``backward`` on the basis of the upstream gradients ``upstream`` (``Upstream``), computed per row inside the
    kernel (``statistics.gradient_basis``: no ``[N]`` ops around it). ``ref_logits`` / ``ref_lse`` are given iff
    ``upstream.reads_ref()``. ``out``: a contiguous tensor shaped and typed like ``logits`` to write the gradient
    into (it may be ``logits`` itself: the gradient in place of the logits), else a new one.
"""
from typing import NamedTuple, Optional

import torch

from kltriton.kernels.statistics import Basis, StreamStats


class Upstream(NamedTuple):
    """``backward_upstream``'s gradients: ``[N]`` fp32 upstream gradients of the differentiable statistics (None: no
    gradient) and the statistics' values their terms read (given with their gradient)."""
    logp: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    full_kl: Optional[torch.Tensor]
    forward_kl: Optional[torch.Tensor]
    entropy_value: Optional[torch.Tensor]
    full_kl_value: Optional[torch.Tensor]

    def reads_ref(self) -> bool:
        """Whether the gradient reads the reference logits (the full KL's and the forward KL's terms)."""
        return self.full_kl is not None or self.forward_kl is not None


__all__ = ["Basis", "StreamStats", "Upstream"]
