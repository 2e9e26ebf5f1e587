"""Triton backend of the ``invariant`` family (contract: ``kltriton.kernels.invariant``), CUDA or CPU under
``TRITON_INTERPRET=1``.

Two kernels on a ``(row, chunk)`` grid: ``_maxima_kernel`` stores each chunk's largest entry, ``_sums_kernel`` each
chunk's fixed-point sums given the row's maximum (the largest of its chunks'); PyTorch takes the maximum and the
int64 sum over the chunks. Every entry's ``exp2`` is the same code wherever it sits (masked lanes read ``-inf``), and
integer sums are exact in any order, so the chunking (``launch``) changes no bit.
"""
import torch
import triton
import triton.language as tl

from kltriton.kernels import accumulation_dtype, constants
from kltriton.kernels import triton_rows as rows
from kltriton.kernels.invariant import sum_count
from kltriton.kernels.row_views import num_rows

UNIT = tl.constexpr(float(2 ** constants.FIXED_POINT_BITS))
INF = tl.constexpr(float("inf"))
NEG_LN2 = tl.constexpr(-0.6931471805599453)
BLOCK = 1024          # entries per loop iteration of a program
CHUNK_BLOCKS = 16     # iterations per program: V > CHUNK_BLOCKS * BLOCK splits a row across programs
NUM_WARPS = 4


def launch(vocab: int):
    """``(BLOCK, CHUNK, SPLIT)`` of a row of ``vocab`` entries."""
    block = min(BLOCK, triton.next_power_of_2(max(vocab, 16)))
    chunk = CHUNK_BLOCKS * block
    return block, chunk, triton.cdiv(vocab, chunk)


def launches(vocab: int, elem_bytes: int):
    """(kernel name, Launch, variant name, absent arguments) of every kernel this family launches (for
    ``benchmarks/static.py``)."""
    block, chunk, split = launch(vocab)
    options = dict(num_warps=NUM_WARPS, enable_fp_fusion=True)
    out = []
    for floor in (False, True):
        absent = [] if floor else ["floor_ptr"]
        suffix = "+floor" if floor else ""
        out.append(("_maxima_kernel", rows.Launch(dict(BLOCK=block, CHUNK=chunk), options, block, split),
                    "max" + suffix, absent))
        for entropy in (False, True):
            constexprs = dict(BLOCK=block, CHUNK=chunk, ENTROPY=entropy)
            out.append(("_sums_kernel", rows.Launch(constexprs, options, block, split),
                        "sums" + ("+ent" if entropy else "") + suffix, absent + ([] if entropy else ["weighted_ptr"])))
    return out


@triton.jit
def _read(x_row, offs, vocab, floor_ptr, row):
    """The entries ``offs`` of a row as fp32, ``-inf`` past the end and below the floor."""
    x = tl.load(x_row + offs, mask=offs < vocab, other=rows.NEG_INF).to(tl.float32)
    if floor_ptr is not None:
        x = tl.where(x < tl.load(floor_ptr + row), rows.NEG_INF, x)
    return x


@triton.jit
def _maxima_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    target_ptr,                 # [N] int64: rows with target >= 0 are read
    floor_ptr,                  # [N] fp32, or None
    partial_ptr,                # [N, SPLIT] fp32 out: each chunk's largest entry (+inf: a NaN or +inf read)
    vocab, split,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    lanes = tl.full((BLOCK,), float("-inf"), tl.float32)
    if tl.load(target_ptr + row) >= 0:
        x_row = logits_ptr + rows.row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
        for start in range(part * CHUNK, tl.minimum(part * CHUNK + CHUNK, vocab), BLOCK):
            x = _read(x_row, start + tl.arange(0, BLOCK), vocab, floor_ptr, row)
            lanes = tl.maximum(lanes, tl.where(x != x, INF, x))  # NaN: +inf, a bad row
    tl.store(partial_ptr + row.to(tl.int64) * split + part, tl.max(lanes, axis=0))


@triton.jit
def _sums_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    target_ptr,                 # [N] int64
    floor_ptr,                  # [N] fp32, or None
    row_max_ptr,                # [N] fp32: the row's maximum (over every shard)
    mass_ptr,                   # [N, SPLIT] int64 out: each chunk's mass sum
    weighted_ptr,               # [N, SPLIT] int64 out: its weighted sum (ENTROPY), or None
    vocab, split,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1)
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, ENTROPY: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    m = tl.load(row_max_ptr + row)
    mass = tl.zeros((BLOCK,), tl.int64)
    weighted = tl.zeros((BLOCK,), tl.int64)
    if (tl.load(target_ptr + row) >= 0) & (m > rows.NEG_INF) & (m < INF):
        x_row = logits_ptr + rows.row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
        _, scale = rows.temperature_of(temperature_ptr, temperature_stride, row)  # log2(e) / T
        for start in range(part * CHUNK, tl.minimum(part * CHUNK + CHUNK, vocab), BLOCK):
            z = (_read(x_row, start + tl.arange(0, BLOCK), vocab, floor_ptr, row) - m) * scale  # <= 0, base 2
            e = tl.exp2(z)                                                                       # in [0, 1]
            mass += (e * UNIT).to(tl.int64)
            if ENTROPY:
                w = tl.where(e > 0, e * (z * NEG_LN2), 0.0)                                       # in [0, 1/e]
                weighted += (w * UNIT).to(tl.int64)
    at = row.to(tl.int64) * split + part
    tl.store(mass_ptr + at, tl.sum(mass, axis=0))
    if ENTROPY:
        tl.store(weighted_ptr + at, tl.sum(weighted, axis=0))


def _grid(logits):
    n, vocab = num_rows(logits), logits.shape[-1]
    block, chunk, split = launch(vocab)
    return n, vocab, block, chunk, split


def maxima(logits, target, floor):
    n, vocab, block, chunk, split = _grid(logits)
    partial = torch.empty((n, split), dtype=torch.float32, device=logits.device)
    if n:
        _maxima_kernel[(n, split)](*rows.view_args(logits), target, floor, partial, vocab, split, BLOCK=block,
                                   CHUNK=chunk, num_warps=NUM_WARPS, enable_fp_fusion=True)
    return partial.amax(1).to(accumulation_dtype(logits.dtype))


def sums(logits, target, temperature, row_max, floor, request):
    n, vocab, block, chunk, split = _grid(logits)
    k = sum_count(request)
    partial = torch.empty((k, n, split), dtype=torch.int64, device=logits.device)
    if n:
        entropy = bool(request & constants.ENTROPY)
        _sums_kernel[(n, split)](*rows.view_args(logits), target, floor, row_max.float().contiguous(), partial[0],
                                 partial[1] if entropy else None, vocab, split, temperature,
                                 1 if temperature.dim() else 0, BLOCK=block, CHUNK=chunk, ENTROPY=entropy,
                                 num_warps=NUM_WARPS, enable_fp_fusion=True)
    return partial.sum(-1)


def forward(logits, target, temperature, floor, request):
    row_max = maxima(logits, target, floor)
    return row_max, sums(logits, target, temperature, row_max, floor, request)
