"""Family ``stream``: softmax statistics of each row of logits, in one pass over the vocabulary.

Backends: ``reference.py`` (plain PyTorch, any float dtype incl. float64), ``triton.py`` (CUDA, or
CPU under ``TRITON_INTERPRET=1``), ``cpp.py`` (CPU, fp32 / bf16 / fp16). Each module provides:

``forward(logits, ref_logits, target, temperature, with_entropy, with_full_kl) -> StreamStats``
    logits:      ``[..., V]`` float, any strides on the leading dims, last dim contiguous. ``N`` =
                 number of leading positions, in row-major order of the leading dims.
    ref_logits:  ``None`` or a tensor of the same shape and dtype (strides may differ).
    target:      ``[N]`` int64, contiguous: a label in ``[0, V)``, ``SKIP`` (outputs 0, logits
                 never read) or ``OUT_OF_RANGE`` (outputs NaN, logits never read).
    temperature: 0-dim float64 tensor ``> 0`` and finite (data, so a new value never recompiles);
                 every statistic is of ``softmax(logits / T)``.
    Returns ``StreamStats`` of ``[N]`` tensors in ``accumulation_dtype(logits.dtype)``:
    ``entropy`` is empty unless ``with_entropy``; ``ref_logp`` / ``ref_lse`` are empty without
    ``ref_logits``; ``full_kl`` (``sum_v p_v (log p_v - log q_v)``) is empty unless
    ``with_full_kl`` (which needs ``ref_logits``). ``logp`` and ``ref_logp`` are clamped to ``<= 0``.
    A row whose logits are all ``-inf`` has ``lse = -inf`` and NaN statistics (as torch).

``backward(logits, ref_logits, target, temperature, lse, ref_lse, g_logp, g_entropy, entropy,
g_full_kl, full_kl) -> grad``
    Gradient w.r.t. ``logits`` of ``sum(g_logp * logp + g_entropy * entropy + g_full_kl * full_kl)``:

        grad = (g_logp * (onehot - p) - g_entropy * p * (log p + H)
                + g_full_kl * p * (log p - log q - KL)) / T

    ``g_*`` are ``[N]`` in the statistics' dtype. ``g_entropy`` / ``entropy`` and ``g_full_kl`` /
    ``full_kl`` / ``ref_logits`` / ``ref_lse`` are ``None`` when that term is absent. Returns a
    contiguous tensor shaped like ``logits`` in ``logits.dtype``, zero on rows with ``target < 0``
    or a non-finite ``lse``.
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
