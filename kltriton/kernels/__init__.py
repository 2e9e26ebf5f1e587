"""Backend kernels: the row-streaming softmax statistics every public op is built from.

Each backend module (``kltriton.reference``, ``kltriton.kernels.triton_stream``,
``kltriton.kernels.cpp_stream``) provides the same two functions. The public ops
(``kltriton/ops/*.py``) turn labels / masks / packed layouts into a flat ``target`` and
apply the KL estimators and reward shaping on the ``[N]`` results, so a backend only
has to stream over the vocabulary.

``forward(logits, ref_logits, target, temperature, with_entropy, with_full_kl)``
    logits:      ``[..., V]`` float (fp32 / bf16 / fp16; the reference also takes fp64),
                 any strides on the leading dims, last dim contiguous. ``N`` = number of
                 leading positions, in row-major order of the leading dims.
    ref_logits:  ``None`` or a tensor of the same shape (strides may differ).
    target:      ``[N]`` int64, contiguous. ``>= 0``: the label to score (always ``< V``);
                 ``-1``: skipped row (outputs 0, logits never read); ``-2``: a label outside
                 ``[0, V)`` (outputs NaN, logits never read).
    temperature: 0-dim float64 tensor (or python float) ``> 0``; every statistic is of
                 ``softmax(logits / T)``.
    Returns a ``StreamStats`` of fp32 ``[N]`` tensors (float64 from the reference given float64
    logits). ``entropy`` is empty unless
    ``with_entropy``; ``ref_logp`` / ``ref_lse`` are empty without ``ref_logits``;
    ``full_kl`` (``sum_v p_v (log p_v - log q_v)``) is empty unless ``with_full_kl``
    (which needs ``ref_logits``). ``logp`` and ``ref_logp`` are clamped to ``<= 0``.

``backward(logits, ref_logits, target, temperature, lse, ref_lse, g_logp, g_entropy,
entropy, g_full_kl, full_kl)``
    Gradient w.r.t. ``logits`` of ``sum(g_logp * logp + g_entropy * entropy + g_full_kl * full_kl)``:

        grad = (g_logp * (onehot - p) - g_entropy * p * (log p + H)
                + g_full_kl * p * (log p - log q - KL)) / T

    ``g_entropy`` / ``entropy`` and ``g_full_kl`` / ``full_kl`` / ``ref_logits`` / ``ref_lse``
    may be ``None`` when that term is absent. Returns a tensor shaped like ``logits`` in
    ``logits.dtype`` (contiguous), zero on rows with ``target < 0``.
"""
from typing import NamedTuple

import torch


class StreamStats(NamedTuple):
    logp: torch.Tensor      # [N] log p(label)
    lse: torch.Tensor       # [N] logsumexp(logits / T), saved for backward
    entropy: torch.Tensor   # [N] or [0]
    ref_logp: torch.Tensor  # [N] or [0]
    ref_lse: torch.Tensor   # [N] or [0]
    full_kl: torch.Tensor   # [N] or [0]
