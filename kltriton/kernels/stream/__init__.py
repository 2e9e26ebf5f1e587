"""Family ``stream``: softmax statistics of each row of logits, in one pass over the vocabulary.

Backends: ``reference.py`` (plain PyTorch, any float dtype incl. float64), ``triton.py`` (CUDA, or
CPU under ``TRITON_INTERPRET=1``), ``cpp.py`` (CPU, fp32 / bf16 / fp16). Each module provides:

``forward(logits, ref_logits, target, temperature, with_entropy, with_full_kl) -> StreamStats``
    logits:      ``[..., V]`` float, any strides on the leading dims, last dim contiguous. ``N`` =
                 number of leading positions, in row-major order of the leading dims.
    ref_logits:  ``None`` or a tensor of the same shape (strides may differ), in its own float dtype
                 (e.g. fp32 under a bf16 policy; each is read as it is, never copied).
    target:      ``[N]`` int64, contiguous: a label in ``[0, V)``, ``SKIP`` (outputs 0, logits
                 never read) or ``OUT_OF_RANGE`` (outputs NaN, logits never read).
    temperature: float64 tensor, 0-dim or ``[N]`` (one per row), ``> 0`` and finite (checked by
                 the caller); data, so a new value never recompiles. Every statistic of row ``n``
                 is of ``softmax(logits[n] / T[n])``.
    Returns ``StreamStats`` of ``[N]`` tensors in ``accumulation_dtype(logits.dtype)``:
    ``entropy`` is empty unless ``with_entropy``; ``ref_logp`` / ``ref_lse`` are empty without
    ``ref_logits``; ``full_kl`` (``sum_v p_v (log p_v - log q_v)``) is empty unless
    ``with_full_kl`` (which needs ``ref_logits``). ``logp`` and ``ref_logp`` are clamped to ``<= 0``.
    A row whose logits are all ``-inf`` has ``lse = -inf`` and NaN statistics (as torch); a NaN or
    ``+inf`` logit gives NaN statistics (never a silent 0). Logits masked with ``finfo.min`` or
    ``-1e30`` are normal input: every statistic is finite and exact wherever the float64 answer
    rounded to fp32 is (``x / T`` must be an fp32 number for the row's max).

``backward(logits, ref_logits, target, temperature, lse, ref_lse, g_logp, g_entropy, entropy,
g_full_kl, full_kl) -> grad``
    Gradient w.r.t. ``logits`` of ``sum(g_logp * logp + g_entropy * entropy + g_full_kl * full_kl)``:

        grad = (g_logp * (onehot - p) - g_entropy * p * (log p + H)
                + g_full_kl * p * (log p - log q - KL)) / T

    ``g_*`` are ``[N]`` in the statistics' dtype. ``g_entropy`` / ``entropy`` and ``g_full_kl`` /
    ``full_kl`` / ``ref_logits`` / ``ref_lse`` are ``None`` when that term is absent. Returns a
    contiguous tensor shaped like ``logits`` in ``logits.dtype``, zero on rows with ``target < 0``
    and on rows whose ``lse`` is not finite (``-inf``: all ``-inf`` logits; NaN or ``+inf``: a NaN
    or ``+inf`` logit, or ``|x| / T`` beyond fp32), the same rule on every backend: their
    statistics are already NaN, so the loss shows it, and the other rows train unharmed.
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
