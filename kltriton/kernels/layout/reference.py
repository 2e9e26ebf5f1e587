"""Reference backend of the ``layout`` family: PyTorch ops (see ``kltriton.kernels.layout`` for the contract).

Also the one route of a context-parallel shift (``following``: the labels and mask after this rank's slice, from the
next rank; ``ends``: this rank's positions that end a packed segment), which needs collectives first.
"""
import torch

from kltriton.kernels import OUT_OF_RANGE, SKIP, constants
from kltriton.kernels.epilogue import Rows
from kltriton.kernels.epilogue.reference import sequences
from kltriton.kernels.layout import composed_target_rows, record
from kltriton.kernels.loss.weights import aggregation_weights


def shift_left(tensor, fill, sequence_ends, following=None):
    """``tensor[..., t + 1]`` at position ``t`` along the last dim; ``fill`` where no next token exists. ``following``:
    the values after the last position (the next rank's first ones, ``tensor.shape[:-1]``), else ``fill``.
    ``sequence_ends``: the positions that end a sequence (a bool mask of ``tensor``'s shape), ``fill`` there."""
    shifted = torch.full_like(tensor, fill)
    shifted[..., :-1] = tensor[..., 1:]
    if following is not None:
        shifted[..., -1] = following
    if sequence_ends is not None:
        shifted = torch.where(sequence_ends, torch.full_like(shifted, fill), shifted)
    return shifted


def segment_ends(cu_seqlens, n):
    """``[n]`` bool: the positions that end a packed segment (an empty segment marks the position before it, the end
    of the segment before; offsets outside ``[1, n]`` mark nothing)."""
    offsets = cu_seqlens[1:].long()
    inside = (offsets >= 1) & (offsets <= n)
    slot = torch.where(inside, offsets - 1, torch.full_like(offsets, n))
    ends = torch.zeros(n + 1, dtype=torch.bool, device=cu_seqlens.device).scatter_(0, slot, True)[:n]
    ends[-1:] = True
    return ends


def target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags, following=(None, None),
           ends=None):
    packed = cu_seqlens is not None or ends is not None
    labels = labels2d.long().reshape(-1) if packed else labels2d.long()
    mask = None if mask2d is None else (mask2d != 0).reshape(labels.shape)
    n = labels.numel()
    if flags is not None and temperature is not None:
        record(flags, constants.BAD_TEMPERATURE, ~((temperature > 0) & torch.isfinite(temperature)).all())
    if flags is not None and cu_seqlens is not None:
        first, last = cu_seqlens[0], cu_seqlens[-1]
        record(flags, constants.BAD_CU_SEQLENS_ENDS, (first != 0) | (last != n),
               (("cu_first", first), ("cu_last", last)))
        record(flags, constants.BAD_CU_SEQLENS_ORDER, (cu_seqlens[1:] < cu_seqlens[:-1]).any())
    if shift and n:
        if ends is None and cu_seqlens is not None:
            ends = segment_ends(cu_seqlens, n)
        labels = shift_left(labels, ignore_index, ends, following[0])
        if mask is not None:
            mask = shift_left(mask, False, ends, following[1])
    scored = labels != ignore_index
    if mask is not None:
        scored = scored & mask
    in_range = (labels >= 0) & (labels < vocab)
    bad = (scored & ~in_range).reshape(-1)
    if flags is not None and n:
        first_bad = labels.reshape(-1).take(bad.to(torch.int8).argmax())  # (indexing by a tensor would read it)
        record(flags, constants.BAD_LABEL, bad.any(), (("label", first_bad),))
    return torch.where(scored, torch.where(in_range, labels, OUT_OF_RANGE), SKIP).reshape(-1)


def target_weights(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags, weights):
    tgt = target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags)
    num_seqs = labels2d.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    seqs = sequences(tgt, Rows(num_seqs, labels2d.shape[1], cu_seqlens))
    seqs = seqs._replace(horizon=weights.horizon, num_tokens=weights.num_tokens, num_seqs_agg=weights.num_seqs_agg)
    adv, dtype = weights.advantages, weights.dtype
    w = aggregation_weights(weights.aggregation, tgt != SKIP, seqs, dtype)
    adv = torch.zeros_like(w) if adv is None else (adv[seqs.seq_index] if weights.per_sequence else adv).to(dtype)
    return tgt, torch.stack([adv, w, w, w * weights.kl_coef, w * -weights.entropy_coef])


def scored_rows(rows, target, out):
    n = target.numel()
    out.zero_()
    out[:n] = torch.where((target >= 0)[:, None], rows.to(out.dtype), torch.zeros((), dtype=out.dtype,
                                                                                   device=out.device))
    return out


target_rows = composed_target_rows(target, scored_rows)
