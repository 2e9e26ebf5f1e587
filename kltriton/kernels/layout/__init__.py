"""Family ``layout``: labels, mask, ``ignore_index``, ``shift_labels`` and packed segments into the per-row
``target`` every other family reads (a label in ``[0, V)``, ``SKIP`` or ``OUT_OF_RANGE``), in one kernel, and the
inputs' value checks recorded on the device instead of read on the host.

Backends: ``reference.py`` (PyTorch ops; also the context-parallel shift across ranks), ``cpp.py`` (CPU), ``triton.py``
(CUDA, or CPU under ``TRITON_INTERPRET=1``). Each provides:

``target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags) -> target``
    labels2d:    ``[R, C]`` integer tensor (any integer dtype, any strides): the labels of the logits' leading shape
                 viewed as rows of sequences (``[B, T]``; ``[1, N]`` for flat or packed positions).
    mask2d:      ``None`` or a bool / integer ``[R, C]`` tensor (any strides): 0 = not scored.
    cu_seqlens:  ``None`` or int32 / int64 ``[num_seqs + 1]`` offsets of packed segments (``R == 1``).
    temperature: ``None`` or a float64 tensor, 0-dim or ``[N]``: only checked (``> 0`` and finite).
    shift:       position ``n`` is scored on the label and mask of ``n + 1`` of the same sequence (the next column;
                 with ``cu_seqlens``, the next position unless ``n`` ends its segment); the last position of each
                 sequence is ``SKIP``.
    flags:       ``None`` (no checks) or the device's int64 flag vector (``constants.FLAG_SLOTS``): the kernel ORs
                 the ``constants.BAD_*`` bits of what it finds (a scored label outside ``[0, vocab)``, malformed
                 ``cu_seqlens``, a temperature that is not ``> 0`` and finite) and stores a bad label and
                 ``cu_seqlens``' ends.
    Returns ``target [N]`` int64, ``N = R * C``: ``SKIP`` where the label is ``ignore_index`` or masked (or the
    shift has no next position), ``OUT_OF_RANGE`` where a scored label lies outside ``[0, vocab)``, else the label.
    Nothing is ever read out of bounds, whatever the values.

``target_weights(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags, weights) ->
(target, prepared)``
    ``target`` and, from it, the per-row inputs of a loss (one kernel): ``prepared [5, N]`` (``weights.dtype``) holds each row's
    advantage (``weights.advantages``, ``[N]`` or ``[num_seqs]`` broadcast over its sequence with ``per_sequence``;
    0 when None), its aggregation weight (verl's ``agg_loss`` of ``weights.aggregation``, one of
    ``constants.AGGREGATIONS``, as weights over the positions with ``target != SKIP``; the sequences are the rows of
    ``labels2d`` or the packed segments; ``num_tokens`` / ``num_seqs_agg`` given 0-dim denominators or None: counted,
    ``num_seqs_agg`` then the sequences with a scored position, at least 1; ``horizon`` 0-dim), and the weights of a
    loss's policy, KL and entropy terms: that weight times 1, ``kl_coef`` and ``-entropy_coef``.

``target_rows(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags, rows, out) -> (target,
out)``
    ``target``, then ``scored_rows(rows, target, out)`` (the label side of a one-tile projection and its GEMM operand):
    one op on the cpp backend, the two calls on the others (``composed_target_rows``).

``scored_rows(rows, target, out) -> out``
    ``out[n] = rows[n]`` (converted to ``out``'s dtype) where ``n < N`` and ``target[n] >= 0``, else 0, for every row
    of ``out [>= N, H]`` (contiguous) from ``rows [N, H]`` (any strides): the scored positions' hidden states in a
    projection's fixed-shape tile, the others zero (a non-finite hidden state at an unscored position is never read).
"""
from typing import NamedTuple, Optional

import torch

from kltriton.kernels import constants

_SLOT = {name: i for i, name in enumerate(constants.FLAG_SLOTS)}


class RowWeights(NamedTuple):
    """``target_weights``' request (see above)."""
    aggregation: str
    num_tokens: Optional[torch.Tensor]
    num_seqs_agg: Optional[torch.Tensor]
    horizon: Optional[torch.Tensor]
    advantages: Optional[torch.Tensor]
    per_sequence: bool
    kl_coef: float
    entropy_coef: float
    dtype: torch.dtype = torch.float32  # of ``prepared``: float64 on the reference backend (float64 logits) only


def record(flags, bit, condition, slots=()):
    """``flags[bits] |= bit`` where ``condition`` (0-dim bool) holds, and ``slots`` (name -> 0-dim value) stored: a
    check recorded by PyTorch ops, without a host read (the reference backend's, and ``_inputs.checked_ids``')."""
    hit = condition.to(torch.int64)
    flags[_SLOT["bits"]] = flags[_SLOT["bits"]] | (hit * bit)
    for name, value in slots:
        flags[_SLOT[name]] = torch.where(condition, value.to(torch.int64), flags[_SLOT[name]])


def composed_target_rows(target, scored_rows):
    """``target_rows`` of a backend as its ``target``, then its ``scored_rows``."""

    def target_rows(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags, rows, out):
        made = target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags)
        return made, scored_rows(rows, made, out)

    return target_rows
