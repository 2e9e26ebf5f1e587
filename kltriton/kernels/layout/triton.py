"""Triton backend of the ``layout`` family (see ``kltriton.kernels.layout`` for the contract).

Grid ``(cdiv(N, BLOCK),)``: each program turns ``BLOCK`` positions into targets. With ``cu_seqlens`` and a shift, a
position ends its segment when ``n + 1`` is one of the offsets, found by a binary search of ``cu_seqlens`` (``log2`` of
its length loads per position; no table of segment ends is built). Checks are ORed into the device's flag vector with
atomics (a bad label is stored by whichever program saw one), so nothing is read on the host.
"""
import torch
import triton
import triton.language as tl

from kltriton.kernels import constants
from kltriton.kernels import triton_rows as rows

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
    target = tl.where(scored, tl.where(in_range, label, OUT_OF_RANGE), SKIP)
    tl.store(target_ptr + offs, target, mask=inside)
    if flags_ptr is not None:
        bad = scored & ~in_range
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            tl.atomic_or(flags_ptr + FLAG_BITS, tl.full([], BAD_LABEL, tl.int64))
            tl.store(flags_ptr + FLAG_LABEL, tl.max(tl.where(bad, label, -(2 ** 62)), axis=0))
        if temperature_ptr is not None:
            t = tl.load(temperature_ptr + offs, mask=offs < temperature_numel, other=1.0)
            if tl.max(((t <= 0) | (t != t) | (tl.abs(t) == float("inf"))).to(tl.int32), axis=0) > 0:
                tl.atomic_or(flags_ptr + FLAG_BITS, tl.full([], BAD_TEMPERATURE, tl.int64))
        if cu_ptr is not None and tl.program_id(0) == 0:
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


def target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags):
    n = labels2d.numel()
    out = torch.empty(n, dtype=torch.int64, device=labels2d.device)
    if n == 0 and flags is None:
        return out
    if mask2d is not None and mask2d.dtype == torch.bool:
        mask2d = mask2d.view(torch.uint8)
    num_offsets = 0 if cu_seqlens is None else cu_seqlens.numel()
    temperature = None if temperature is None or flags is None else temperature
    _target_kernel[(max(1, triton.cdiv(n, BLOCK)),)](
        labels2d, max(1, labels2d.shape[1]), labels2d.stride(0), labels2d.stride(1),
        mask2d, *((0, 0) if mask2d is None else mask2d.stride()),
        cu_seqlens, num_offsets, max(1, num_offsets).bit_length(),
        temperature, 0 if temperature is None else temperature.numel(),
        out, flags, n, ignore_index, vocab, SHIFT=bool(shift), BLOCK=BLOCK,
    )
    return out
