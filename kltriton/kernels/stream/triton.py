"""Triton backend of the ``stream`` family.

Forward: each lane (thread) keeps its own online max ``m`` of the raw logits and sums of
``2^((x - m) * log2(e) / T)`` over the values it loads, for the policy and the reference row in the
same loop; the lanes are merged once after the loop, so the vocab loop has no barrier. Nothing of
size ``[N, V]`` is written and a row is read once. Rows longer than ``CHUNK_BLOCKS`` tiles are split
across programs (a number that depends on ``V`` only: batch invariance) and merged by a small second
kernel. Backward recomputes the probabilities from the saved fp32 log-sum-exp on a (row, vocab
block) grid. See ``kltriton.kernels.stream`` for the contract and ``python -m benchmarks static``
for what each variant compiles to. The loss family's fused kernel (``kltriton.kernels.loss.triton``)
calls the same row helpers (``_chunk``, ``_store_stats``, ``_grad_block``). Absent optional tensors
are passed as ``None``: Triton specializes the kernel on them (a compile-time constant), so a
variant without a reference never carries its pointer or its code.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kltriton.kernels import constants
from kltriton.kernels.rows import as_rows3d, num_rows
from kltriton.kernels.stream import StreamStats

# Globals read inside a kernel must be tl.constexpr: a plain Python global compiles under the
# interpreter but is an error for the real compiler.
NEG_INF = tl.constexpr(float("-inf"))
SKIP = tl.constexpr(constants.SKIP)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Exponents are kept in base-2 units. exp2 of anything below W_FLOOR is 0 in fp32, so clamping a
# difference there changes no value and keeps 0 * -inf (a banned token) out of the sums.
W_FLOOR = tl.constexpr(-150.0)
NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)

# Launch settings (not yet tuned on hardware: see benchmarks/static.py for what they compile to).
NUM_WARPS = 8
ROWS_PER_THREAD = {4: 4, 2: 2}      # logits element bytes -> 16-byte loads per thread per iteration
ROWS_PER_THREAD_REF = {4: 2, 2: 2}  # the same with a reference row read in the same loop
CHUNK_BLOCKS = 8                    # vocab blocks per program: V > CHUNK_BLOCKS * BLOCK splits a row
BACKWARD_BLOCK = 4096               # vocab entries per backward program


class Launch(NamedTuple):
    constexprs: dict             # compile-time arguments besides the absent tensors
    options: dict                # num_warps, enable_fp_fusion
    elements_per_iteration: int  # vocab entries one program handles per loop iteration
    grid_split: int = 1          # programs per row


def _options():
    # Pinned: Triton 3.10 turns FP fusion off by default, and the kernels rely on FFMA.
    return dict(num_warps=NUM_WARPS, enable_fp_fusion=True)


def _forward_launch(vocab: int, elem_bytes: int, has_ref: bool) -> Launch:
    """Tile ``[ROWS, LANES, VEC]`` (VEC = one 16-byte load, LANES = threads) and the vocab split.

    Everything here depends on ``V`` and the dtype only, never on ``N``: a row's reduction order is
    the same in every batch (SPEC: batch invariance)."""
    vec = 16 // elem_bytes
    rows = (ROWS_PER_THREAD_REF if has_ref else ROWS_PER_THREAD)[elem_bytes]
    if vocab % vec:
        # Rows are not 16-byte aligned: scalar loads. A lane then holds VEC entries strided by LANES
        # rather than VEC adjacent ones, so the lane reductions stay inside a thread (no shuffles).
        rows, vec = rows * vec, 1
    lanes = min(32 * NUM_WARPS, max(1, triton.next_power_of_2(vocab) // (vec * rows)))
    block = rows * lanes * vec
    split = triton.cdiv(vocab, CHUNK_BLOCKS * block)
    return Launch(dict(ROWS=rows, LANES=lanes, VEC=vec, SPLIT=split, CHUNK=CHUNK_BLOCKS * block), _options(), block,
                  split)


def _backward_launch(vocab: int) -> Launch:
    block = min(BACKWARD_BLOCK, triton.next_power_of_2(max(vocab, 16)))
    return Launch(dict(BLOCK_V=block), _options(), block, triton.cdiv(vocab, block))


def _combine_launch(split: int) -> Launch:
    return Launch(dict(SPLIT=split, SPLIT_P2=triton.next_power_of_2(split)), dict(num_warps=1, enable_fp_fusion=True),
                  1)


def launches(vocab: int, elem_bytes: int):
    """(kernel name, Launch, with a reference row or None for both) of every kernel ``forward`` /
    ``backward`` launch for this vocab and logits element size (for ``benchmarks/static.py``)."""
    out = []
    for has_ref in (False, True):
        launch = _forward_launch(vocab, elem_bytes, has_ref)
        out.append(("_stream_forward_kernel", launch, has_ref))
        if launch.grid_split > 1:
            out.append(("_stream_combine_kernel", _combine_launch(launch.grid_split), has_ref))
    out.append(("_stream_backward_kernel", _backward_launch(vocab), None))
    return out


@triton.jit
def _row_offset(row, rows_per_outer, outer_stride, inner_stride):
    """Element offset of row ``row`` of an ``[A, B, V]`` view (``B = rows_per_outer``)."""
    # 32-bit division (row < N < 2^31), 64-bit offsets: a 64-bit division costs ~100 instructions.
    return (row // rows_per_outer).to(tl.int64) * outer_stride + (row % rows_per_outer).to(tl.int64) * inner_stride


@triton.jit
def _row_pointers(row, logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,
                  ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride):
    """Pointers to ``row`` of the policy and the reference ``[A, B, V]`` views (the policy's twice
    without a reference)."""
    x_row = logits_ptr + _row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
    y_row = x_row
    if ref_ptr is not None:
        y_row = ref_ptr + _row_offset(row, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
    return x_row, y_row


@triton.jit
def _label_logits(x_row, y_row, target, HAS_REF: tl.constexpr):
    """The label's policy and reference logits in fp32 (the policy's twice without a reference)."""
    x_label = tl.load(x_row + target).to(tl.float32)
    y_label = x_label
    if HAS_REF:
        y_label = tl.load(y_row + target).to(tl.float32)
    return x_label, y_label


@triton.jit
def _clamp_nonpositive(logp):
    # tl.minimum drops NaN by default (GPU min.f32 returns the other operand); keep it.
    return tl.minimum(logp, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _frame(m):
    """Finite stand-in of a running max: 0 while everything seen is ``-inf`` (its sums are 0)."""
    return tl.where(m == NEG_INF, 0.0, m)


@triton.jit
def _shift(f_old, f_new, c2, floor):
    """Base-2 exponent moving sums from frame ``f_old`` to ``f_new``, clamped into ``[floor, 0]``.

    It is ``<= 0`` whenever the old sums are non-zero (``f_new`` is the larger max); the clamp only
    touches the placeholder frame of an all ``-inf`` state and overflowing differences (``finfo.min``
    logits), so no ``inf * 0`` reaches the sums."""
    return tl.minimum(tl.maximum((f_old - f_new) * c2, floor), 0.0)


@triton.jit
def _rescale(m, s, t, my, sy, u, m_new, my_new, c2, WITH_ENTROPY: tl.constexpr, HAS_REF: tl.constexpr,
             WITH_FULL_KL: tl.constexpr):
    """Move a state (sums relative to ``_frame(m)``) to the frame of the larger max ``m_new``.

    State: ``s = sum 2^w``, ``t = sum 2^w * w``, ``u = sum 2^w * (w - w_ref)`` with
    ``w = (x - frame) * log2(e) / T`` (and the same for the reference: ``sy``)."""
    f_new = _frame(m_new)
    d = _shift(_frame(m), f_new, c2, W_FLOOR)
    alpha = tl.exp2(d)
    s_moved = s * alpha
    if WITH_ENTROPY:
        t = alpha * t + s_moved * d
    if HAS_REF:
        fy_new = _frame(my_new)
        sy = sy * tl.exp2(_shift(_frame(my), fy_new, c2, W_FLOOR))
        if WITH_FULL_KL:
            # No W_FLOOR for the reference: a far smaller log q is a large finite KL term.
            u = alpha * u + s_moved * (d - _shift(_frame(my), fy_new, c2, NEG_FLT_MAX))
    return s_moved, t, sy, u


@triton.jit
def _fold(x, y, m, s, t, my, sy, u, c2, WITH_ENTROPY: tl.constexpr, HAS_REF: tl.constexpr,
          WITH_FULL_KL: tl.constexpr):
    """Fold tiles ``x`` / ``y`` ``[ROWS, LANES, VEC]`` (fp32 logits, ``-inf`` = absent) into the
    per-lane states ``[LANES]``: each lane reduces only the values it holds, so no lane waits for
    another (no barrier in the vocab loop)."""
    m_new = tl.maximum(m, tl.max(tl.max(x, axis=2), axis=0))
    my_new = my
    if HAS_REF:
        my_new = tl.maximum(my, tl.max(tl.max(y, axis=2), axis=0))
    s, t, sy, u = _rescale(m, s, t, my, sy, u, m_new, my_new, c2, WITH_ENTROPY, HAS_REF, WITH_FULL_KL)
    w = (x - _frame(m_new)[None, :, None]) * c2
    if WITH_ENTROPY or WITH_FULL_KL:
        w = tl.maximum(w, W_FLOOR, propagate_nan=tl.PropagateNan.ALL)  # a NaN logit stays NaN
    e = tl.exp2(w)
    s += tl.sum(tl.sum(e, axis=2), axis=0)
    if WITH_ENTROPY:
        t += tl.sum(tl.sum(e * w, axis=2), axis=0)
    if HAS_REF:
        wy = (y - _frame(my_new)[None, :, None]) * c2
        sy += tl.sum(tl.sum(tl.exp2(wy), axis=2), axis=0)
        if WITH_FULL_KL:
            # A token the reference bans (wy = -inf) that the policy uses gives KL = inf.
            u += tl.sum(tl.sum(tl.where(e > 0, e * (w - wy), 0.0), axis=2), axis=0)
    return m_new, s, t, my_new, sy, u


@triton.jit
def _merge(m, s, t, my, sy, u, c2, WITH_ENTROPY: tl.constexpr, HAS_REF: tl.constexpr,
           WITH_FULL_KL: tl.constexpr):
    """Combine a vector of states (lanes, or vocab chunks) into one, in a fixed order."""
    m_all = tl.max(m, axis=0)
    my_all = m_all
    if HAS_REF:
        my_all = tl.max(my, axis=0)
    s, t, sy, u = _rescale(m, s, t, my, sy, u, m_all, my_all, c2, WITH_ENTROPY, HAS_REF, WITH_FULL_KL)
    return m_all, tl.sum(s, axis=0), tl.sum(t, axis=0), my_all, tl.sum(sy, axis=0), tl.sum(u, axis=0)


@triton.jit
def _chunk(x_row, y_row, lo, hi, c2, WITH_ENTROPY: tl.constexpr, HAS_REF: tl.constexpr,
           WITH_FULL_KL: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr):
    """State (scalars) of vocab entries ``[lo, hi)`` of one row: full tiles without a mask (16-byte
    loads wherever the row is 16-byte aligned), then one masked tail tile."""
    BLOCK: tl.constexpr = ROWS * LANES * VEC
    tile = (tl.arange(0, ROWS)[:, None, None] * (LANES * VEC) + tl.arange(0, LANES)[None, :, None] * VEC
            + tl.arange(0, VEC)[None, None, :])
    m = tl.full((LANES,), NEG_INF, tl.float32)
    s = tl.zeros((LANES,), tl.float32)
    t = tl.zeros((LANES,), tl.float32)
    my = tl.full((LANES,), NEG_INF, tl.float32)
    sy = tl.zeros((LANES,), tl.float32)
    u = tl.zeros((LANES,), tl.float32)
    full_end = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full_end, BLOCK):
        x = tl.load(x_row + start + tile).to(tl.float32)
        y = x  # stands for the reference tile when there is none (never used then)
        if HAS_REF:
            y = tl.load(y_row + start + tile).to(tl.float32)
        m, s, t, my, sy, u = _fold(x, y, m, s, t, my, sy, u, c2, WITH_ENTROPY, HAS_REF, WITH_FULL_KL)
    if full_end < hi:
        offs = full_end + tile
        x = tl.load(x_row + offs, mask=offs < hi, other=NEG_INF).to(tl.float32)
        y = x
        if HAS_REF:
            y = tl.load(y_row + offs, mask=offs < hi, other=NEG_INF).to(tl.float32)
        m, s, t, my, sy, u = _fold(x, y, m, s, t, my, sy, u, c2, WITH_ENTROPY, HAS_REF, WITH_FULL_KL)
    return _merge(m, s, t, my, sy, u, c2, WITH_ENTROPY, HAS_REF, WITH_FULL_KL)


@triton.jit
def _store_skipped(row, target, logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr):
    """A row that is not scored (never read): SKIP -> 0.0, OUT_OF_RANGE -> NaN (absent pointers: not stored)."""
    skipped = tl.where(target == SKIP, 0.0, float("nan"))
    tl.store(logp_ptr + row, skipped)
    if lse_ptr is not None:
        tl.store(lse_ptr + row, 0.0)
    if entropy_ptr is not None:
        tl.store(entropy_ptr + row, skipped)
    if ref_logp_ptr is not None:
        tl.store(ref_logp_ptr + row, skipped)
    if ref_lse_ptr is not None:
        tl.store(ref_lse_ptr + row, 0.0)
    if full_kl_ptr is not None:
        tl.store(full_kl_ptr + row, skipped)


@triton.jit
def _store_stats(row, x_label, y_label, m, s, t, my, sy, u, inv_temperature,
                 logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr):
    """Store a scored row's statistics from its merged state and return them: ``(logp, lse, entropy,
    ref_logp, ref_lse, full_kl)``. ``entropy`` / the reference pair / ``full_kl`` are computed when
    ``entropy_ptr`` / ``ref_logp_ptr`` / ``full_kl_ptr`` is given (0 otherwise); ``lse_ptr`` and
    ``ref_lse_ptr`` may be None (computed, not stored)."""
    f = _frame(m)
    log_s = tl.log(s)
    logp = _clamp_nonpositive((x_label - f) * inv_temperature - log_s)
    lse = f * inv_temperature + log_s
    tl.store(logp_ptr + row, logp)
    if lse_ptr is not None:
        tl.store(lse_ptr + row, lse)
    entropy = 0.0
    if entropy_ptr is not None:
        entropy = log_s - t / s * LN2
        tl.store(entropy_ptr + row, entropy)
    ref_logp = 0.0
    ref_lse = 0.0
    full_kl = 0.0
    if ref_logp_ptr is not None:
        fy = _frame(my)
        log_sy = tl.log(sy)
        ref_logp = _clamp_nonpositive((y_label - fy) * inv_temperature - log_sy)
        ref_lse = fy * inv_temperature + log_sy
        tl.store(ref_logp_ptr + row, ref_logp)
        if ref_lse_ptr is not None:
            tl.store(ref_lse_ptr + row, ref_lse)
        if full_kl_ptr is not None:
            full_kl = u / s * LN2 - log_s + log_sy
            tl.store(full_kl_ptr + row, full_kl)
    return logp, lse, entropy, ref_logp, ref_lse, full_kl


@triton.jit
def _temperature(temperature_ptr, temperature_stride, row):
    """(1 / T, log2(e) / T) in fp32 from the float64 temperature of ``row``."""
    inv = 1.0 / tl.load(temperature_ptr + row * temperature_stride)
    return inv.to(tl.float32), (inv * LOG2E).to(tl.float32)


@triton.jit
def _stream_forward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same, or None
    target_ptr,                 # [N] int64: label, SKIP or OUT_OF_RANGE
    logp_ptr, lse_ptr,          # [N] fp32 outputs
    entropy_ptr,                # [N] fp32 output, or None
    ref_logp_ptr, ref_lse_ptr,  # [N] fp32 outputs, or None (with ref_ptr)
    full_kl_ptr,                # [N] fp32 output, or None
    partial_ptr,                # [N, SPLIT, 6] fp32 per-chunk states (SPLIT > 1), or None
    vocab,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1): data, no recompile
    ROWS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr,
):
    """Grid ``(N, SPLIT)``: program ``(row, k)`` reduces vocab chunk ``k`` of ``row``. With one chunk it
    stores the statistics; otherwise the chunk's state, merged by ``_stream_combine_kernel``."""
    HAS_REF: tl.constexpr = ref_ptr is not None
    WITH_ENTROPY: tl.constexpr = entropy_ptr is not None
    WITH_FULL_KL: tl.constexpr = full_kl_ptr is not None
    row = tl.program_id(0)
    target = tl.load(target_ptr + row)
    if target >= 0:  # a skipped row is never read
        inv_temperature, c2 = _temperature(temperature_ptr, temperature_stride, row)
        x_row, y_row = _row_pointers(row, logits_ptr, logits_rows_per_outer, logits_outer_stride,
                                     logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride,
                                     ref_inner_stride)
        if SPLIT == 1:
            x_label, y_label = _label_logits(x_row, y_row, target, HAS_REF)  # issued before the loop
            m, s, t, my, sy, u = _chunk(x_row, y_row, 0, vocab, c2, WITH_ENTROPY, HAS_REF, WITH_FULL_KL,
                                        ROWS, LANES, VEC)
            _store_stats(row, x_label, y_label, m, s, t, my, sy, u, inv_temperature,
                         logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr)
        else:
            part = tl.program_id(1)
            lo = part * CHUNK
            m, s, t, my, sy, u = _chunk(x_row, y_row, lo, tl.minimum(lo + CHUNK, vocab), c2, WITH_ENTROPY,
                                        HAS_REF, WITH_FULL_KL, ROWS, LANES, VEC)
            out = partial_ptr + (row.to(tl.int64) * SPLIT + part) * 6
            tl.store(out, m)
            tl.store(out + 1, s)
            tl.store(out + 2, t)
            tl.store(out + 3, my)
            tl.store(out + 4, sy)
            tl.store(out + 5, u)
    elif SPLIT == 1:
        _store_skipped(row, target, logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr)


@triton.jit
def _stream_combine_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same, or None
    target_ptr, logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr,  # as the forward
    partial_ptr,                # [N, SPLIT, 6] fp32 per-chunk states
    temperature_ptr, temperature_stride,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
):
    """Grid ``(N,)``: merge a row's ``SPLIT`` chunk states in chunk order and store its statistics."""
    HAS_REF: tl.constexpr = ref_ptr is not None
    row = tl.program_id(0)
    target = tl.load(target_ptr + row)
    if target >= 0:
        inv_temperature, c2 = _temperature(temperature_ptr, temperature_stride, row)
        x_row, y_row = _row_pointers(row, logits_ptr, logits_rows_per_outer, logits_outer_stride,
                                     logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride,
                                     ref_inner_stride)
        x_label, y_label = _label_logits(x_row, y_row, target, HAS_REF)
        part = tl.arange(0, SPLIT_P2)
        real = part < SPLIT  # padding parts are empty states: max -inf, sums 0
        parts = partial_ptr + (row.to(tl.int64) * SPLIT + part) * 6
        m, s, t, my, sy, u = _merge(tl.load(parts, mask=real, other=NEG_INF), tl.load(parts + 1, mask=real, other=0.0),
                                    tl.load(parts + 2, mask=real, other=0.0),
                                    tl.load(parts + 3, mask=real, other=NEG_INF),
                                    tl.load(parts + 4, mask=real, other=0.0), tl.load(parts + 5, mask=real, other=0.0),
                                    c2, entropy_ptr is not None, HAS_REF, full_kl_ptr is not None)
        _store_stats(row, x_label, y_label, m, s, t, my, sy, u, inv_temperature,
                     logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr)
    else:
        _store_skipped(row, target, logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr)


@triton.jit
def _grad_block(x, y, offs, target, lse, g_logp, entropy, g_entropy, ref_lse, full_kl, g_full_kl, inv_temperature,
                WITH_ENTROPY: tl.constexpr, WITH_FULL_KL: tl.constexpr):
    """Gradient (fp32) w.r.t. the logits ``x`` at vocab positions ``offs`` of a row with a finite ``lse``:
    ``(g_logp * (onehot - p) - g_entropy * p * (log p + H) + g_full_kl * p * (log p - log q - KL)) / T``
    (``y``: the reference logits, read only ``WITH_FULL_KL``)."""
    log_p = x * inv_temperature - lse
    p = tl.exp(log_p)
    grad = g_logp * (tl.where(offs == target.to(tl.int32), 1.0, 0.0) - p)
    if WITH_ENTROPY:
        # p == 0 (x = -inf, or x = finfo.min under a large lse): no mass, no gradient, even
        # where log_p is -inf.
        grad -= g_entropy * tl.where(p == 0, 0.0, p * (log_p + entropy))
    if WITH_FULL_KL:
        log_q = y * inv_temperature - ref_lse
        grad += g_full_kl * tl.where(p == 0, 0.0, p * (log_p - log_q - full_kl))
    return grad * inv_temperature


@triton.jit
def _stream_backward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same, or None
    grad_ptr,                   # [N, V] contiguous output, logits dtype
    target_ptr,                 # [N] int64
    lse_ptr, g_logp_ptr,        # [N] fp32
    entropy_ptr, g_entropy_ptr,  # [N] fp32, or None (no entropy term)
    ref_lse_ptr, full_kl_ptr, g_full_kl_ptr,  # [N] fp32, or None (no full-KL term, with ref_ptr)
    vocab,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1): data, no recompile
    BLOCK_V: tl.constexpr,
):
    """Grid ``(N, cdiv(V, BLOCK_V))``: one vocab block of one row per program, no reduction."""
    WITH_ENTROPY: tl.constexpr = g_entropy_ptr is not None
    WITH_FULL_KL: tl.constexpr = g_full_kl_ptr is not None
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = offs < vocab
    inv_temperature, _ = _temperature(temperature_ptr, temperature_stride, row)
    grad_row = grad_ptr + row.to(tl.int64) * vocab
    target = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    # Skipped rows and rows without a finite lse (all -inf logits: -inf; a NaN or +inf logit:
    # NaN; |logits| / T beyond fp32: +-inf) get a zero gradient, as on every backend.
    live = (target >= 0) & (lse > NEG_INF) & (lse < float("inf"))
    if live:
        g_logp = tl.load(g_logp_ptr + row)
        x_row = logits_ptr + _row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
        x = tl.load(x_row + offs, mask=in_vocab, other=NEG_INF).to(tl.float32)
        entropy = 0.0
        g_entropy = 0.0
        if WITH_ENTROPY:
            entropy = tl.load(entropy_ptr + row)
            g_entropy = tl.load(g_entropy_ptr + row)
        y = x
        ref_lse = 0.0
        full_kl = 0.0
        g_full_kl = 0.0
        if WITH_FULL_KL:
            ref_lse = tl.load(ref_lse_ptr + row)
            full_kl = tl.load(full_kl_ptr + row)
            g_full_kl = tl.load(g_full_kl_ptr + row)
            y_row = ref_ptr + _row_offset(row, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
            y = tl.load(y_row + offs, mask=in_vocab, other=NEG_INF).to(tl.float32)
        grad = _grad_block(x, y, offs, target, lse, g_logp, entropy, g_entropy, ref_lse, full_kl, g_full_kl,
                           inv_temperature, WITH_ENTROPY, WITH_FULL_KL)
        tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)
    else:
        tl.store(grad_row + offs, tl.zeros((BLOCK_V,), grad_ptr.dtype.element_ty), mask=in_vocab)


def _view_args(tensor):
    """(tensor, B, outer stride, inner stride) of the ``[A, B, V]`` row view; all None for None."""
    if tensor is None:
        return None, 1, 0, 0
    rows3d = as_rows3d(tensor)
    return rows3d, rows3d.shape[1], rows3d.stride(0), rows3d.stride(1)


def forward(logits, ref_logits, target, temperature, with_entropy, with_full_kl) -> StreamStats:
    n, vocab = num_rows(logits), logits.shape[-1]
    new = lambda wanted: torch.empty(n if wanted else 0, dtype=torch.float32, device=logits.device)  # noqa: E731
    has_ref = ref_logits is not None
    stats = StreamStats(new(True), new(True), new(with_entropy), new(has_ref), new(has_ref), new(with_full_kl))
    if n == 0:
        return stats
    when = lambda wanted, tensor: tensor if wanted else None  # noqa: E731
    launch = _forward_launch(vocab, logits.element_size(), has_ref)
    split = launch.grid_split
    partial = torch.empty((n, split, 6), dtype=torch.float32, device=logits.device) if split > 1 else None
    views = (*_view_args(logits), *_view_args(ref_logits))
    outputs = (target, stats.logp, stats.lse, when(with_entropy, stats.entropy), when(has_ref, stats.ref_logp),
               when(has_ref, stats.ref_lse), when(with_full_kl, stats.full_kl), partial)
    temperature_args = (temperature, 1 if temperature.dim() else 0)
    _stream_forward_kernel[(n, split)](*views, *outputs, vocab, *temperature_args, **launch.constexprs,
                                       **launch.options)
    if split > 1:
        combine = _combine_launch(split)
        _stream_combine_kernel[(n,)](*views, *outputs, *temperature_args, **combine.constexprs, **combine.options)
    return stats


def backward(logits, ref_logits, target, temperature, lse, ref_lse, g_logp, g_entropy, entropy,
             g_full_kl, full_kl) -> torch.Tensor:
    n, vocab = num_rows(logits), logits.shape[-1]
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if n == 0:
        return grad
    with_full_kl = g_full_kl is not None
    launch = _backward_launch(vocab)
    _stream_backward_kernel[(n, launch.grid_split)](
        *_view_args(logits), *_view_args(ref_logits if with_full_kl else None), grad, target,
        lse, g_logp, entropy if g_entropy is not None else None, g_entropy,
        ref_lse if with_full_kl else None, full_kl if with_full_kl else None, g_full_kl,
        vocab, temperature, 1 if temperature.dim() else 0, **launch.constexprs, **launch.options,
    )
    return grad
