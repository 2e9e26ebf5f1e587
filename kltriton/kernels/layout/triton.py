"""Triton backend of the ``layout`` family (see ``kltriton.kernels.layout`` for the contract).

``_target_kernel``, grid ``(cdiv(N, BLOCK),)``: each program turns ``BLOCK`` positions into targets. With
``cu_seqlens`` and a shift, a position ends its segment when ``n + 1`` is one of the offsets, found by a binary search
of ``cu_seqlens`` (``log2`` of its length loads per position; no table of segment ends is built). Checks are ORed into
the device's flag vector with atomics (a bad label is stored by whichever program saw one), so nothing is read on the
host. ``_weights_kernel``, grid ``(1,)``: the same targets and checks, then the rows' weights, which need every
sequence's count first: one program walks the sequences twice (the targets are recomputed, not read back).
"""
import torch
import triton
import triton.language as tl

from kltriton.kernels import constants
from kltriton.kernels import triton_rows as rows
from kltriton.kernels.layout import composed_target_rows

BLOCK = 1024
SKIP = tl.constexpr(constants.SKIP)
OUT_OF_RANGE = tl.constexpr(constants.OUT_OF_RANGE)
BAD_LABEL = tl.constexpr(constants.BAD_LABEL)
BAD_CU_SEQLENS_ENDS = tl.constexpr(constants.BAD_CU_SEQLENS_ENDS)
BAD_CU_SEQLENS_ORDER = tl.constexpr(constants.BAD_CU_SEQLENS_ORDER)
BAD_TEMPERATURE = tl.constexpr(constants.BAD_TEMPERATURE)
FLAG_BITS = tl.constexpr(constants.FLAG_SLOTS.index("bits"))
FLAG_LABEL = tl.constexpr(constants.FLAG_SLOTS.index("label"))
FLAG_CU_FIRST = tl.constexpr(constants.FLAG_SLOTS.index("cu_first"))
FLAG_CU_LAST = tl.constexpr(constants.FLAG_SLOTS.index("cu_last"))


@triton.jit
def _segment_end(offs, cu_ptr, num_offsets, search_steps):
    """Whether ``offs + 1`` is one of ``cu_seqlens[1:]`` (``num_offsets`` entries in all)."""
    at = rows.first_offset_at_least(offs + 1, cu_ptr, num_offsets, search_steps)
    found = tl.load(cu_ptr + at, mask=at < num_offsets, other=-1).to(tl.int64)
    return (at < num_offsets) & (found == offs + 1)


@triton.jit
def _targets(offs, inside, labels_ptr, labels_cols, labels_stride_r, labels_stride_c, mask_ptr, mask_stride_r,
             mask_stride_c, cu_ptr, num_offsets, search_steps, n, ignore_index, vocab, SHIFT: tl.constexpr):
    """``(target, bad)`` at ``offs``: the targets, and where a scored label lies outside ``[0, vocab)`` (with the
    label in ``label``)."""
    last = offs < 0
    if SHIFT:
        if cu_ptr is None:
            last = offs % labels_cols == labels_cols - 1
        else:
            last = (offs == n - 1) | _segment_end(offs, cu_ptr, num_offsets, search_steps)
    src = offs + 1 if SHIFT else offs
    read = inside & ~last
    row = src // labels_cols
    col = src % labels_cols
    label = tl.load(labels_ptr + row * labels_stride_r + col * labels_stride_c, mask=read, other=0).to(tl.int64)
    scored = read & (label != ignore_index)
    if mask_ptr is not None:
        scored = scored & (tl.load(mask_ptr + row * mask_stride_r + col * mask_stride_c, mask=read, other=0) != 0)
    in_range = (label >= 0) & (label < vocab)
    return tl.where(scored, tl.where(in_range, label, OUT_OF_RANGE), SKIP), scored & ~in_range, label


@triton.jit
def _flag_labels(bad, label, flags_ptr):
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.atomic_or(flags_ptr + FLAG_BITS, tl.full([], BAD_LABEL, tl.int64))
        tl.store(flags_ptr + FLAG_LABEL, tl.max(tl.where(bad, label, -(2 ** 62)), axis=0))


@triton.jit
def _flag_temperatures(offs, temperature_ptr, temperature_numel, flags_ptr):
    t = tl.load(temperature_ptr + offs, mask=offs < temperature_numel, other=1.0)
    if tl.max(((t <= 0) | (t != t) | (tl.abs(t) == float("inf"))).to(tl.int32), axis=0) > 0:
        tl.atomic_or(flags_ptr + FLAG_BITS, tl.full([], BAD_TEMPERATURE, tl.int64))


@triton.jit
def _flag_offsets(cu_ptr, num_offsets, n, flags_ptr, BLOCK: tl.constexpr):
    """``cu_seqlens`` starts at 0, ends at ``n`` and never decreases, else its bits."""
    first = tl.load(cu_ptr).to(tl.int64)
    final = tl.load(cu_ptr + num_offsets - 1).to(tl.int64)
    if (first != 0) | (final != n):
        tl.atomic_or(flags_ptr + FLAG_BITS, tl.full([], BAD_CU_SEQLENS_ENDS, tl.int64))
        tl.store(flags_ptr + FLAG_CU_FIRST, first)
        tl.store(flags_ptr + FLAG_CU_LAST, final)
    descending = tl.full([], 0, tl.int32)
    for start in range(1, num_offsets, BLOCK):
        at = start + tl.arange(0, BLOCK)
        here = at < num_offsets
        now = tl.load(cu_ptr + at, mask=here, other=0).to(tl.int64)
        before = tl.load(cu_ptr + at - 1, mask=here, other=0).to(tl.int64)
        descending += tl.sum((here & (now < before)).to(tl.int32), axis=0)
    if descending > 0:
        tl.atomic_or(flags_ptr + FLAG_BITS, tl.full([], BAD_CU_SEQLENS_ORDER, tl.int64))


@triton.jit
def _target_kernel(
    labels_ptr, labels_cols, labels_stride_r, labels_stride_c,  # [R, C] any integer dtype
    mask_ptr, mask_stride_r, mask_stride_c,                     # [R, C] uint8 / integer, or None
    cu_ptr, num_offsets, search_steps,                          # [num_seqs + 1] int32 / int64, or None
    temperature_ptr, temperature_numel,                         # float64 0-dim or [N] (checked only), or None
    target_ptr,                                                 # [N] int64 output
    flags_ptr,                                                  # [len(FLAG_SLOTS)] int64, or None (no checks)
    n, ignore_index, vocab,
    SHIFT: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    target, bad, label = _targets(offs, inside, labels_ptr, labels_cols, labels_stride_r, labels_stride_c, mask_ptr,
                                  mask_stride_r, mask_stride_c, cu_ptr, num_offsets, search_steps, n, ignore_index,
                                  vocab, SHIFT)
    tl.store(target_ptr + offs, target, mask=inside)
    if flags_ptr is not None:
        _flag_labels(bad, label, flags_ptr)
        if temperature_ptr is not None:
            _flag_temperatures(offs, temperature_ptr, temperature_numel, flags_ptr)
        if cu_ptr is not None and tl.program_id(0) == 0:
            _flag_offsets(cu_ptr, num_offsets, n, flags_ptr, BLOCK)


@triton.jit
def _weights_kernel(
    labels_ptr, labels_cols, labels_stride_r, labels_stride_c, mask_ptr, mask_stride_r, mask_stride_c,
    cu_ptr, num_offsets, search_steps, temperature_ptr, temperature_numel, target_ptr, flags_ptr,  # as _target_kernel
    adv_ptr,                    # [N], or [num_seqs] with PER_SEQUENCE, or None (0)
    num_tokens_ptr, num_seqs_agg_ptr, horizon_ptr,  # 0-dim denominators (None: counted) and the horizon
    out_ptr,                    # [5, N] fp32: advantage, aggregation weight, w_pg, w_kl, w_ent
    n, ignore_index, vocab, num_seqs, kl_coef, entropy_coef,
    SHIFT: tl.constexpr, AGGREGATION: tl.constexpr, PER_SEQUENCE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid ``(1,)``: the targets and checks of ``_target_kernel`` with the scored positions counted per sequence,
    then every row's weights (verl's ``agg_loss``; ``kltriton.kernels.loss.weights.aggregation_weights``)."""
    seq_len = labels_cols
    total = tl.zeros((), tl.float64)
    nonempty = tl.zeros((), tl.float64)
    for seq in range(0, num_seqs):
        start, end = rows.sequence_bounds(seq, n, seq_len, cu_ptr)
        count = tl.zeros((), tl.float64)
        for lo in range(start, end, BLOCK):
            offs = lo + tl.arange(0, BLOCK)
            inside = offs < end
            target, bad, label = _targets(offs, inside, labels_ptr, labels_cols, labels_stride_r, labels_stride_c,
                                          mask_ptr, mask_stride_r, mask_stride_c, cu_ptr, num_offsets, search_steps, n,
                                          ignore_index, vocab, SHIFT)
            tl.store(target_ptr + offs, target, mask=inside)
            count += tl.sum((inside & (target != SKIP)).to(tl.float64), axis=0)
            if flags_ptr is not None:
                _flag_labels(bad, label, flags_ptr)
        total += count
        nonempty += tl.where(count > 0, 1.0, 0.0)
    if flags_ptr is not None:
        if temperature_ptr is not None:
            for lo in range(0, temperature_numel, BLOCK):
                _flag_temperatures(lo + tl.arange(0, BLOCK), temperature_ptr, temperature_numel, flags_ptr)
        if cu_ptr is not None:
            _flag_offsets(cu_ptr, num_offsets, n, flags_ptr, BLOCK)
    sequences = tl.maximum(nonempty, 1.0)
    if num_seqs_agg_ptr is not None:
        sequences = tl.load(num_seqs_agg_ptr).to(tl.float64)
    for seq in range(0, num_seqs):
        start, end = rows.sequence_bounds(seq, n, seq_len, cu_ptr)
        count = tl.zeros((), tl.float64)
        if AGGREGATION == "seq-mean-token-mean":
            for lo in range(start, end, BLOCK):
                offs = lo + tl.arange(0, BLOCK)
                inside = offs < end
                target, _, _ = _targets(offs, inside, labels_ptr, labels_cols, labels_stride_r, labels_stride_c,
                                        mask_ptr, mask_stride_r, mask_stride_c, cu_ptr, num_offsets, search_steps, n,
                                        ignore_index, vocab, SHIFT)
                count += tl.sum((inside & (target != SKIP)).to(tl.float64), axis=0)
        for lo in range(start, end, BLOCK):
            offs = lo + tl.arange(0, BLOCK)
            inside = offs < end
            target, _, _ = _targets(offs, inside, labels_ptr, labels_cols, labels_stride_r, labels_stride_c, mask_ptr,
                                    mask_stride_r, mask_stride_c, cu_ptr, num_offsets, search_steps, n, ignore_index,
                                    vocab, SHIFT)
            valid = tl.where(target != SKIP, 1.0, 0.0).to(tl.float64)
            if AGGREGATION == "token-mean":
                if num_tokens_ptr is not None:
                    w = valid / tl.load(num_tokens_ptr).to(tl.float64)
                else:
                    w = valid / tl.maximum(total, 1.0)
            elif AGGREGATION == "token-sum":
                w = valid
            elif AGGREGATION == "seq-mean-token-sum":
                w = valid / sequences
            elif AGGREGATION == "seq-mean-token-mean":
                w = valid / tl.maximum(count, 1.0) / sequences
            else:
                w = valid / sequences / tl.load(horizon_ptr).to(tl.float64)
            w32 = w.to(tl.float32)
            adv = tl.zeros((BLOCK,), tl.float32)
            if adv_ptr is not None:
                if PER_SEQUENCE:
                    adv = tl.load(adv_ptr + seq + offs * 0, mask=inside, other=0.0).to(tl.float32)
                else:
                    adv = tl.load(adv_ptr + offs, mask=inside, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs, adv, mask=inside)
            tl.store(out_ptr + n + offs, w32, mask=inside)
            tl.store(out_ptr + 2 * n + offs, w32, mask=inside)
            tl.store(out_ptr + 3 * n + offs, (w32.to(tl.float64) * kl_coef).to(tl.float32), mask=inside)
            tl.store(out_ptr + 4 * n + offs, (w32.to(tl.float64) * -entropy_coef).to(tl.float32), mask=inside)


@triton.jit
def _scored_rows_kernel(rows_ptr, rows_stride_r, rows_stride_c, target_ptr, out_ptr, n_rows, width,
                        BLOCK: tl.constexpr):
    """Grid ``(out rows,)``: ``out[n] = rows[n]`` where ``n < N`` and ``target[n] >= 0``, else 0."""
    n = tl.program_id(0).to(tl.int64)
    scored = n < 0  # False; target None: no rows to copy
    src = tl.minimum(n, n_rows - 1)  # a row past N reads row N - 1 (in bounds) and writes zeros
    if target_ptr is not None:
        scored = (n < n_rows) & (tl.load(target_ptr + src) >= 0)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < width
        value = tl.zeros((BLOCK,), tl.float32)
        if target_ptr is not None:
            value = tl.load(rows_ptr + src * rows_stride_r + offs * rows_stride_c, mask=inside, other=0.0)
        tl.store(out_ptr + n * width + offs, tl.where(scored, value, 0.0).to(out_ptr.dtype.element_ty), mask=inside)


def scored_rows(rows, target, out):
    if out.shape[0]:
        _scored_rows_kernel[(out.shape[0],)](rows, rows.stride(0), rows.stride(1), target if target.numel() else None,
                                             out, target.numel(), out.shape[1], BLOCK=256)
    return out


def _common(labels2d, mask2d, cu_seqlens, temperature, flags):
    """The arguments ``_target_kernel`` and ``_weights_kernel`` share, up to the target."""
    if mask2d is not None and mask2d.dtype == torch.bool:
        mask2d = mask2d.view(torch.uint8)
    num_offsets = 0 if cu_seqlens is None else cu_seqlens.numel()
    temperature = None if temperature is None or flags is None else temperature
    return (labels2d, max(1, labels2d.shape[1]), labels2d.stride(0), labels2d.stride(1),
            mask2d, *((0, 0) if mask2d is None else mask2d.stride()),
            cu_seqlens, num_offsets, max(1, num_offsets).bit_length(),
            temperature, 0 if temperature is None else temperature.numel())


def target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags):
    n = labels2d.numel()
    out = torch.empty(n, dtype=torch.int64, device=labels2d.device)
    if n == 0 and flags is None:
        return out
    _target_kernel[(max(1, triton.cdiv(n, BLOCK)),)](
        *_common(labels2d, mask2d, cu_seqlens, temperature, flags), out, flags, n, ignore_index, vocab,
        SHIFT=bool(shift), BLOCK=BLOCK)
    return out


def target_weights(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags, weights):
    if weights.dtype != torch.float32:
        raise TypeError(f"the layout family's {__name__.rsplit('.', 1)[-1]} backend makes float32 weights, not "
                        f"{weights.dtype} (float64 runs on the reference backend)")
    n, device = labels2d.numel(), labels2d.device
    out, prepared = torch.empty(n, dtype=torch.int64, device=device), torch.empty((5, n), dtype=torch.float32,
                                                                                  device=device)
    num_seqs = labels2d.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    _weights_kernel[(1,)](
        *_common(labels2d, mask2d, cu_seqlens, temperature, flags), out, flags, weights.advantages,
        weights.num_tokens, weights.num_seqs_agg, weights.horizon, prepared, n, ignore_index, vocab, num_seqs,
        weights.kl_coef, weights.entropy_coef, SHIFT=bool(shift), AGGREGATION=weights.aggregation,
        PER_SEQUENCE=bool(weights.per_sequence), BLOCK=BLOCK)
    return out, prepared


target_rows = composed_target_rows(target, scored_rows)
