"""Triton row helpers shared by every Triton kernel family (as cut-cross-entropy's ``tl_utils.py``).

One row of logits ``x`` (and optionally reference logits ``y``) is streamed over its vocabulary into a
per-lane *state* tuple, merged, and finalized into the statistics of ``kltriton.kernels.statistics`` in
their order (``constants.STATISTICS``). The state, with ``h = x H - frame H`` (``H = 2^-33``: ``(x - frame) H``
exactly rounded, never overflowing), ``w = h * log2(e) / (T H)`` (the bits of ``(x - frame) * log2(e) / T``) and
the frame the running max (``_frame``):

    (m, s, t, my, sy, u, v, b, z, q): m / my the running maxima of x / y, s = sum 2^w, t = sum 2^w * w,
                             sy = sum 2^wy, u = sum 2^w * (h - hy), v = sum 2^wy * (hy - h),
                             b = the max of x before the label, z = sum x H, q = sum 2^2w (the head's three)

The KL sums ``u`` and ``v`` are in the units of ``h``, not in the base-2 units of ``w``: a ``finfo.min`` logit
under the other side's mass has a ``w`` beyond fp32, yet the row's KL (the sum over ``s``) may be finite in fp32
(about 4.8e36); in units of ``h`` a lane's sum of up to ``V`` such terms stays in fp32 (terms below ``2^-93``
vanish, far below the KL's rounding). The factor ``1 / (T H)`` is applied once, in ``finalize``.

Each lane keeps its own state over the values it loads, so the vocab loop has no barrier; lanes (and
vocab chunks of a split row) are merged once, in a fixed order. ``WANT`` (a constexpr) holds the request
bits of ``constants``: the terms a kernel variant carries. The backward's element math (``grad_block``)
is on the gradient basis of ``constants.GRADIENT_BASIS``, so it knows no statistic.

Launch settings (``Launch``, ``forward_tile``, ``backward_block``) depend on ``V`` and the dtype only,
never on ``N``: a row's reduction order is the same in every batch (batch invariance).
"""
from typing import NamedTuple

import triton
import triton.language as tl

from kltriton.kernels import constants
from kltriton.kernels.row_views import as_rows3d

# Globals read inside a kernel must be tl.constexpr: a plain Python global compiles under the
# interpreter but is an error for the real compiler.
NEG_INF = tl.constexpr(float("-inf"))
SKIP = tl.constexpr(constants.SKIP)
WANT_ENTROPY = tl.constexpr(constants.ENTROPY)
WANT_REF = tl.constexpr(constants.REF)
WANT_FULL_KL = tl.constexpr(constants.FULL_KL)
WANT_FORWARD_KL = tl.constexpr(constants.FORWARD_KL)
WANT_HEAD = tl.constexpr(constants.HEAD)
BASIS_P_LOGP = tl.constexpr(constants.P_LOGP)
BASIS_P_LOGQ = tl.constexpr(constants.P_LOGQ)
BASIS_Q = tl.constexpr(constants.Q)
# Positions of the statistics in a ``finalize`` tuple, and rows of the stacked gradient basis
# (``[len(GRADIENT_BASIS), N]``).
STAT_LOGP = tl.constexpr([name for name, _ in constants.STATISTICS].index("logp"))
STAT_LSE = tl.constexpr([name for name, _ in constants.STATISTICS].index("lse"))
STAT_ENTROPY = tl.constexpr([name for name, _ in constants.STATISTICS].index("entropy"))
STAT_REF_LOGP = tl.constexpr([name for name, _ in constants.STATISTICS].index("ref_logp"))
STAT_REF_LSE = tl.constexpr([name for name, _ in constants.STATISTICS].index("ref_lse"))
STAT_FULL_KL = tl.constexpr([name for name, _ in constants.STATISTICS].index("full_kl"))
NUM_STATISTICS = tl.constexpr(len(constants.STATISTICS))
TERM = {term: tl.constexpr(i) for i, term in enumerate(constants.GRADIENT_BASIS)}
TERM_LABEL, TERM_P = TERM["label"], TERM["p"]
TERM_P_LOGP, TERM_P_LOGQ, TERM_Q = TERM["p_logp"], TERM["p_logq"], TERM["q"]
NUM_TERMS = tl.constexpr(len(constants.GRADIENT_BASIS))  # a row's coefficients in the stacked basis
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Exponents are kept in base-2 units. exp2 of anything below W_FLOOR is 0 in fp32, so clamping a
# difference there changes no value and keeps 0 * -inf (a banned token) out of the sums.
W_FLOOR = tl.constexpr(-150.0)
H = tl.constexpr(2.0 ** -33)  # the scale of h (see above)
STATE_SIZE = 10  # elements of a state tuple (the split forward's partial buffer is [N, SPLIT, STATE_SIZE])

# Launch settings (not yet tuned on hardware: see benchmarks/static.py for what they compile to).
NUM_WARPS = 8
SUBTILES_PER_THREAD = {4: 4, 2: 2}      # logits element bytes -> 16-byte loads per thread per iteration
SUBTILES_PER_THREAD_REF = {4: 2, 2: 2}  # the same with a reference row read in the same loop
CHUNK_BLOCKS = 8                        # vocab blocks per program: V > CHUNK_BLOCKS * BLOCK splits a row
BACKWARD_BLOCK = 4096                   # vocab entries per backward program / gradient block


class Launch(NamedTuple):
    constexprs: dict             # compile-time arguments besides the absent tensors
    options: dict                # num_warps, enable_fp_fusion
    elements_per_iteration: int  # vocab entries one program handles per loop iteration
    grid_split: int = 1          # programs per row


def options():
    # Pinned: Triton 3.10 turns FP fusion off by default, and the kernels rely on FFMA.
    return dict(num_warps=NUM_WARPS, enable_fp_fusion=True)


def forward_tile(vocab: int, elem_bytes: int, has_ref: bool) -> Launch:
    """Tile ``[SUBTILES, LANES, VEC]`` (VEC = one 16-byte load, LANES = threads) and the vocab split."""
    vec = 16 // elem_bytes
    subtiles = (SUBTILES_PER_THREAD_REF if has_ref else SUBTILES_PER_THREAD)[elem_bytes]
    if vocab % vec:
        # Rows are not 16-byte aligned: scalar loads. A lane then holds VEC entries strided by LANES
        # rather than VEC adjacent ones, so the lane reductions stay inside a thread (no shuffles).
        subtiles, vec = subtiles * vec, 1
    lanes = min(32 * NUM_WARPS, max(1, triton.next_power_of_2(vocab) // (vec * subtiles)))
    block = subtiles * lanes * vec
    split = triton.cdiv(vocab, CHUNK_BLOCKS * block)
    return Launch(dict(SUBTILES=subtiles, LANES=lanes, VEC=vec, SPLIT=split, CHUNK=CHUNK_BLOCKS * block), options(),
                  block, split)


def backward_block(vocab: int) -> int:
    return min(BACKWARD_BLOCK, triton.next_power_of_2(max(vocab, 16)))


def view_args(tensor):
    """(tensor, B, outer stride, inner stride) of the ``[A, B, V]`` row view; all None for None."""
    if tensor is None:
        return None, 1, 0, 0
    rows3d = as_rows3d(tensor)
    return rows3d, rows3d.shape[1], rows3d.stride(0), rows3d.stride(1)


# --- addressing and row parameters ----------------------------------------------------------------

@triton.jit
def row_offset(row, rows_per_outer, outer_stride, inner_stride):
    """Element offset of row ``row`` of an ``[A, B, V]`` view (``B = rows_per_outer``)."""
    # 32-bit division (row < N < 2^31), 64-bit offsets: a 64-bit division costs ~100 instructions.
    return (row // rows_per_outer).to(tl.int64) * outer_stride + (row % rows_per_outer).to(tl.int64) * inner_stride


@triton.jit
def row_pointers(row, logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,
                 ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride):
    """Pointers to ``row`` of the policy and the reference ``[A, B, V]`` views (the policy's twice
    without a reference)."""
    x_row = logits_ptr + row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
    y_row = x_row
    if ref_ptr is not None:
        y_row = ref_ptr + row_offset(row, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
    return x_row, y_row


@triton.jit
def label_logits(x_row, y_row, target, HAS_REF: tl.constexpr):
    """The label's policy and reference logits in fp32 (the policy's twice without a reference)."""
    x_label = tl.load(x_row + target).to(tl.float32)
    y_label = x_label
    if HAS_REF:
        y_label = tl.load(y_row + target).to(tl.float32)
    return x_label, y_label


@triton.jit
def temperature_of(temperature_ptr, temperature_stride, row):
    """(1 / T, log2(e) / T) in fp32 from the float64 temperature of ``row``."""
    inv = 1.0 / tl.load(temperature_ptr + row * temperature_stride)
    return inv.to(tl.float32), (inv * LOG2E).to(tl.float32)


@triton.jit
def program_row(target_ptr, temperature_ptr, temperature_stride, logits_ptr, logits_rows_per_outer,
                logits_outer_stride, logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride,
                ref_inner_stride):
    """What a row kernel reads first of its program's row (grid axis 0): ``(row, target, 1 / T, log2(e) / T, x_row,
    y_row)``, the row's label (``< 0``: not scored, its logits are not to be read), its temperature
    (``temperature_of``) and the pointers to its policy and reference logits (``row_pointers``)."""
    row = tl.program_id(0)
    inv_temperature, log2e_over_t = temperature_of(temperature_ptr, temperature_stride, row)
    x_row, y_row = row_pointers(row, logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,
                                ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
    return row, tl.load(target_ptr + row), inv_temperature, log2e_over_t, x_row, y_row


@triton.jit
def clamp(value, low, high):
    """``min(max(value, low), high)``, NaN kept (as ``torch.clamp``)."""
    return tl.minimum(tl.maximum(value, low, propagate_nan=tl.PropagateNan.ALL), high,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nonnegative(value):
    """A divergence's value, its rounding below 0 (nearly identical distributions) read as 0 (-0 as +0), NaN
    kept."""
    return tl.where(value <= 0.0, 0.0, value)


@triton.jit
def _clamp_nonpositive(logp):
    # tl.minimum drops NaN by default (GPU min.f32 returns the other operand); keep it.
    return tl.minimum(logp, 0.0, propagate_nan=tl.PropagateNan.ALL)


# --- the streaming state ----------------------------------------------------------------------------

@triton.jit
def _frame(m):
    """Finite stand-in of a running max: 0 while everything seen is ``-inf`` (its sums are 0)."""
    return tl.where(m == NEG_INF, 0.0, m)


@triton.jit
def _shift(f_old, f_new, log2e_over_t, floor):
    """Base-2 exponent moving sums from frame ``f_old`` to ``f_new``, clamped into ``[floor, 0]``.

    It is ``<= 0`` whenever the old sums are non-zero (``f_new`` is the larger max); the clamp only
    touches the placeholder frame of an all ``-inf`` state and overflowing differences (``finfo.min``
    logits), so no ``inf * 0`` reaches the sums."""
    return tl.minimum(tl.maximum((f_old - f_new) * log2e_over_t, floor), 0.0)


@triton.jit
def empty_state(LANES: tl.constexpr):
    """The state of no values, one per lane: maxima ``-inf``, sums 0."""
    inf = tl.full((LANES,), NEG_INF, tl.float32)
    zero = tl.zeros((LANES,), tl.float32)
    return inf, zero, zero, inf, zero, zero, zero, inf, zero, zero


@triton.jit
def _scaled(x, frame):
    """``(x - frame) H`` exactly rounded, never overflowing (``x - frame`` may: ``-finfo.max - finfo.max``)."""
    return x * H - frame * H


@triton.jit
def _rescale(state, m_new, my_new, log2e_over_t, WANT: tl.constexpr):
    """The sums of ``state`` moved to the frames of the larger maxima ``m_new`` / ``my_new``. A lane whose old
    mass vanishes in the move (``alpha = 0``) keeps no KL term, even an infinite one."""
    m, s, t, my, sy, u, v, b, z, q = state
    f_new = _frame(m_new)
    d = _shift(_frame(m), f_new, log2e_over_t, W_FLOOR)
    alpha = tl.exp2(d)
    s_moved = s * alpha
    if WANT_HEAD & WANT:
        q = q * (alpha * alpha)  # 2^2w moves by the square of 2^w's factor
    if WANT_ENTROPY & WANT:
        t = alpha * t + s_moved * d
    if WANT_REF & WANT:
        fy_new = _frame(my_new)
        dy = _shift(_frame(my), fy_new, log2e_over_t, W_FLOOR)
        alpha_y = tl.exp2(dy)
        sy = sy * alpha_y
        dh = _scaled(_frame(m), f_new)  # the frames' moves in the units of h: finite, <= 0
        dyh = _scaled(_frame(my), fy_new)
        if WANT_FULL_KL & WANT:
            u = tl.where(alpha > 0, alpha * u + s_moved * (dh - dyh), 0.0)
        if WANT_FORWARD_KL & WANT:
            v = tl.where(alpha_y > 0, alpha_y * v + sy * (dyh - dh), 0.0)
    return m_new, s_moved, t, my_new, sy, u, v, b, z, q


@triton.jit
def fold(x, y, state, log2e_over_t, WANT: tl.constexpr, before_label=None, present=None):
    """Fold tiles ``x`` / ``y`` ``[SUBTILES, LANES, VEC]`` (fp32 logits, ``-inf`` = absent) into the per-lane
    ``state`` ``[LANES]``: each lane reduces only the values it holds, so no lane waits for another. The head's
    terms (``WANT_HEAD``) read which entries lie before the row's label (``before_label``) and which are present
    (``present``): for a full tile (``present`` None) ``before_label`` is one bool, the whole tile or none of it
    (the label's own tile adds to ``b`` through ``_max_before_label``), no mask per entry; for the tail, two masks."""
    x_max = tl.max(tl.max(x, axis=2), axis=0)
    m_new = tl.maximum(state[0], x_max)
    my_new = state[3]
    if WANT_REF & WANT:
        my_new = tl.maximum(state[3], tl.max(tl.max(y, axis=2), axis=0))
    m, s, t, my, sy, u, v, b, z, q = _rescale(state, m_new, my_new, log2e_over_t, WANT)
    h = _scaled(x, _frame(m)[None, :, None])
    w = h * (log2e_over_t / H)  # the bits of (x - frame) * log2e_over_t
    if WANT_ENTROPY & WANT:
        w = tl.maximum(w, W_FLOOR, propagate_nan=tl.PropagateNan.ALL)  # a NaN logit stays NaN
    e = tl.exp2(w)
    s += tl.sum(tl.sum(e, axis=2), axis=0)
    if WANT_ENTROPY & WANT:
        t += tl.sum(tl.sum(e * w, axis=2), axis=0)
    if WANT_REF & WANT:
        hy = _scaled(y, _frame(my)[None, :, None])
        ey = tl.exp2(hy * (log2e_over_t / H))
        sy += tl.sum(tl.sum(ey, axis=2), axis=0)
        if WANT_FULL_KL & WANT:
            # A token the reference bans (hy = -inf) that the policy uses gives KL = inf.
            u += tl.sum(tl.sum(tl.where(e > 0, e * (h - hy), 0.0), axis=2), axis=0)
        if WANT_FORWARD_KL & WANT:
            # A token the policy bans (h = -inf) that the reference uses gives KL(q || p) = inf.
            v += tl.sum(tl.sum(tl.where(ey > 0, ey * (hy - h), 0.0), axis=2), axis=0)
    if WANT_HEAD & WANT:
        # x H: no overflow (finfo.min). An absent entry (the tail's, loaded as -inf) would add -inf: masked.
        if present is None:
            b = tl.where(before_label, tl.maximum(b, x_max), b)
            z += tl.sum(tl.sum(x * H, axis=2), axis=0)
        else:
            b = tl.maximum(b, tl.max(tl.max(tl.where(before_label, x, NEG_INF), axis=2), axis=0))
            z += tl.sum(tl.sum(tl.where(present, x * H, 0.0), axis=2), axis=0)
        q += tl.sum(tl.sum(e * e, axis=2), axis=0)
    return m, s, t, my, sy, u, v, b, z, q


@triton.jit
def merge(state, log2e_over_t, WANT: tl.constexpr):
    """Combine a vector of states (lanes, or vocab chunks) into one scalar state, in a fixed order."""
    m_all = tl.max(state[0], axis=0)
    my_all = m_all
    if WANT_REF & WANT:
        my_all = tl.max(state[3], axis=0)
    m, s, t, my, sy, u, v, b, z, q = _rescale(state, m_all, my_all, log2e_over_t, WANT)
    return (m, tl.sum(s, axis=0), tl.sum(t, axis=0), my, tl.sum(sy, axis=0), tl.sum(u, axis=0), tl.sum(v, axis=0),
            tl.max(b, axis=0), tl.sum(z, axis=0), tl.sum(q, axis=0))


@triton.jit
def below_floor_absent(x, floor):
    """``x`` with the logits below ``floor`` read as ``-inf`` (the truncation family's kept set); ``floor`` None:
    ``x`` (a compile-time choice). A NaN floor (a NaN or ``+inf`` logit in the row) masks nothing."""
    if floor is not None:
        x = tl.where(x < floor, NEG_INF, x)
    return x


@triton.jit
def stream_chunk(x_row, y_row, lo, hi, log2e_over_t, WANT: tl.constexpr, SUBTILES: tl.constexpr, LANES: tl.constexpr,
                 VEC: tl.constexpr, floor=None, label=None):
    """Merged state of vocab entries ``[lo, hi)`` of one row: full tiles without a mask (16-byte loads
    wherever the row is 16-byte aligned), then one masked tail tile. ``floor`` (fp32, or None): the policy's
    logits below it are read as ``-inf`` (``below_floor_absent``). ``label``: the row's (the head's is_top1)."""
    BLOCK: tl.constexpr = SUBTILES * LANES * VEC
    tile = (tl.arange(0, SUBTILES)[:, None, None] * (LANES * VEC) + tl.arange(0, LANES)[None, :, None] * VEC
            + tl.arange(0, VEC)[None, None, :])
    state = empty_state(LANES)
    full_end = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full_end, BLOCK):
        x = below_floor_absent(tl.load(x_row + start + tile).to(tl.float32), floor)
        y = x  # stands for the reference tile when there is none (never used then)
        if WANT_REF & WANT:
            y = tl.load(y_row + start + tile).to(tl.float32)
        before_label = None
        if WANT_HEAD & WANT:
            before_label = start + BLOCK <= label
        state = fold(x, y, state, log2e_over_t, WANT, before_label)
    if WANT_HEAD & WANT:
        if (lo <= label) & (label < full_end):  # a full tile holds the label
            b = tl.maximum(state[7], _max_before_label(x_row, label - (label - lo) % BLOCK, label, tile, floor))
            state = state[:7] + (b,) + state[8:]
    if full_end < hi:
        offs = full_end + tile
        x = below_floor_absent(tl.load(x_row + offs, mask=offs < hi, other=NEG_INF).to(tl.float32), floor)
        y = x
        if WANT_REF & WANT:
            y = tl.load(y_row + offs, mask=offs < hi, other=NEG_INF).to(tl.float32)
        before_label = None
        if WANT_HEAD & WANT:
            before_label = offs < label
        state = fold(x, y, state, log2e_over_t, WANT, before_label, offs < hi)
    return merge(state, log2e_over_t, WANT)


@triton.jit
def _max_before_label(x_row, start, label, tile, floor=None):
    """Per lane ``[LANES]``, the largest logit of the tile at ``start`` before ``label`` (``-inf``: none): the loop
    folds the label's own tile without a mask per entry, this reads its entries before the label again (from L2)."""
    offs = start + tile
    x = below_floor_absent(tl.load(x_row + offs, mask=offs < label, other=NEG_INF).to(tl.float32), floor)
    return tl.max(tl.max(x, axis=2), axis=0)


@triton.jit
def store_state(ptr, state):
    """A merged (scalar) state to ``ptr[0:STATE_SIZE]``."""
    for i in tl.static_range(len(state)):
        tl.store(ptr + i, state[i])


@triton.jit
def load_states(ptr, real):
    """A vector of states from ``ptr[k * STATE_SIZE + i]`` (``ptr`` a block of pointers, one per state);
    entries where ``real`` is False are empty states."""
    return (tl.load(ptr, mask=real, other=NEG_INF), tl.load(ptr + 1, mask=real, other=0.0),
            tl.load(ptr + 2, mask=real, other=0.0), tl.load(ptr + 3, mask=real, other=NEG_INF),
            tl.load(ptr + 4, mask=real, other=0.0), tl.load(ptr + 5, mask=real, other=0.0),
            tl.load(ptr + 6, mask=real, other=0.0), tl.load(ptr + 7, mask=real, other=NEG_INF),
            tl.load(ptr + 8, mask=real, other=0.0), tl.load(ptr + 9, mask=real, other=0.0))


@triton.jit
def finalize(state, x_label, y_label, inv_temperature, WANT: tl.constexpr):
    """A scored row's statistics from its merged state, in ``constants.STATISTICS`` order: ``(logp, lse,
    entropy, ref_logp, ref_lse, full_kl, forward_kl, is_top1, sum_logits, log_sum_sq_probs, max_logit)``; those
    ``WANT`` does not ask for are 0."""
    m, s, t, my, sy, u, v, b, z, q = state
    f = _frame(m)
    log_s = tl.log(s)
    logp = _clamp_nonpositive((x_label - f) * inv_temperature - log_s)
    lse = f * inv_temperature + log_s
    entropy = 0.0
    if WANT_ENTROPY & WANT:
        entropy = log_s - t / s * LN2
    ref_logp = 0.0
    ref_lse = 0.0
    full_kl = 0.0
    forward_kl = 0.0
    if WANT_REF & WANT:
        fy = _frame(my)
        log_sy = tl.log(sy)
        ref_logp = _clamp_nonpositive((y_label - fy) * inv_temperature - log_sy)
        ref_lse = fy * inv_temperature + log_sy
        if WANT_FULL_KL & WANT:
            full_kl = nonnegative(u / s * (inv_temperature / H) - log_s + log_sy)
        if WANT_FORWARD_KL & WANT:
            forward_kl = nonnegative(v / sy * (inv_temperature / H) - log_sy + log_s)
    is_top1 = 0.0
    sum_logits = 0.0
    log_sum_sq_probs = 0.0
    max_logit = 0.0
    if WANT_HEAD & WANT:
        # argmax's rule: the label is the first maximum. No distribution (s = 0: all -inf; NaN: a NaN or +inf
        # logit): NaN, but the sum and the max of all -inf logits are -inf.
        has_mass = (s > 0) & (s < float("inf"))
        is_top1 = tl.where(has_mass, tl.where((x_label >= m) & (x_label > b), 1.0, 0.0), float("nan"))
        total = z.to(tl.float64) * inv_temperature.to(tl.float64)  # in units of h (H: constants.LOGIT_SUM_SCALE)
        sum_logits = tl.where(s >= 0, total.to(tl.float32), float("nan"))
        log_sum_sq_probs = tl.log(q) - 2.0 * log_s
        max_logit = tl.where(s >= 0, m, float("nan"))
    return (logp, lse, entropy, ref_logp, ref_lse, full_kl, forward_kl, is_top1, sum_logits, log_sum_sq_probs,
            max_logit)


@triton.jit
def store_stats(row, values, logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr,
                forward_kl_ptr=None, is_top1_ptr=None, sum_logits_ptr=None, log_sum_sq_probs_ptr=None,
                max_logit_ptr=None):
    """``values`` to the present outputs' ``ptr + row``, both in ``constants.STATISTICS`` order (absent ones are None;
    passed one by one: Triton 3.6 cannot pass a tuple that holds None to a function, and a custom op's outputs may
    not be views of one stacked buffer). A statistic added later takes a trailing ``..._ptr=None`` parameter, so
    kernels that never produce it need no change."""
    pointers = (logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr, forward_kl_ptr, is_top1_ptr,
                sum_logits_ptr, log_sum_sq_probs_ptr, max_logit_ptr)
    for i in tl.static_range(NUM_STATISTICS):
        if pointers[i] is not None:
            tl.store(pointers[i] + row, values[i])


@triton.jit
def skipped_stats(target):
    """The statistics of a row that is not scored (never read): ``SKIP`` -> 0, ``OUT_OF_RANGE`` -> NaN;
    the log-sum-exps 0."""
    skipped = tl.where(target == SKIP, 0.0, float("nan"))
    return skipped, 0.0, skipped, skipped, 0.0, skipped, skipped, skipped, skipped, skipped, skipped


# --- per-token KL estimators and packed sequences ---------------------------------------------------------------

@triton.jit
def kl_estimate(dk, kl_clamp, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr):
    """``(value, slope)`` (float64) of a per-token KL estimator on ``dk = logp - ref_logp`` (float64), the value
    clamped to ``[-kl_clamp, kl_clamp]`` and ``slope`` its derivative w.r.t. ``logp`` (0 where the clamp holds;
    ``STRAIGHT``, verl's ``"k3+"``: the derivative of ``k2``, ``dk``). ``kltriton.estimators``; C++ ``kl_estimate``."""
    if ESTIMATOR == "k1":
        value = dk
        slope = tl.zeros_like(dk) + 1.0
    elif ESTIMATOR == "abs":
        value = tl.abs(dk)
        slope = tl.where(dk > 0, 1.0, tl.where(dk < 0, -1.0, 0.0))
    elif ESTIMATOR == "k2":
        value = 0.5 * dk * dk
        slope = dk
    elif ESTIMATOR == "k3":  # exp(-dk) - 1 + dk (float64: exact enough for an fp32 result without expm1)
        slope = 1.0 - tl.exp(-dk)
        value = dk - slope
    else:
        tl.static_assert(False, "kl_estimate has no per-token value for this KL estimator")
    slope = tl.where(tl.abs(value) > kl_clamp, 0.0, slope)
    value = clamp(value, -kl_clamp, kl_clamp)
    if STRAIGHT:
        slope = dk
    return value, slope


@triton.jit
def first_offset_at_least(key, cu_ptr, num_offsets, search_steps):
    """For each of ``key`` (int64), the first index ``i >= 1`` of ``cu_seqlens`` (``num_offsets`` entries) with
    ``cu_seqlens[i] >= key``, or ``num_offsets``: a binary search of ``search_steps >= log2(num_offsets)`` steps. With
    ``key = n + 1``: position ``n`` is in segment ``i - 1`` and ends it when ``cu_seqlens[i] == n + 1``."""
    lo = tl.zeros_like(key) + 1
    hi = tl.zeros_like(key) + num_offsets
    for _ in range(search_steps):
        open_ = lo < hi
        mid = (lo + hi) // 2
        value = tl.load(cu_ptr + mid, mask=open_, other=0).to(tl.int64)
        right = open_ & (value < key)
        hi = tl.where(open_ & ~right, mid, hi)
        lo = tl.where(right, mid + 1, lo)
    return lo


# --- the gradient -------------------------------------------------------------------------------------

@triton.jit
def loss_basis(g_logp, g_entropy, entropy, g_full_kl, full_kl, inv_temperature, ENTROPY_TERM: tl.constexpr,
               FULL_KL_TERM: tl.constexpr):
    """``(c_label, c_p, c_p_logp, c_p_logq, c_q)`` (fp32, divided by ``T``; ``c_q`` 0) of upstream gradients on
    ``logp``, ``entropy`` and ``full_kl``, computed in float64 (``kltriton.kernels.statistics.gradient_basis``)."""
    inv = inv_temperature.to(tl.float64)
    gl = g_logp.to(tl.float64)
    c_p = gl
    c_p_logp = 0.0
    c_p_logq = 0.0
    if ENTROPY_TERM:
        ge = g_entropy.to(tl.float64)
        c_p += tl.where(ge == 0, 0.0, ge * entropy.to(tl.float64))
        c_p_logp = ge
    if FULL_KL_TERM:
        gk = g_full_kl.to(tl.float64)
        c_p += tl.where(gk == 0, 0.0, gk * full_kl.to(tl.float64))
        c_p_logp -= gk
        c_p_logq = gk
    return ((gl * inv).to(tl.float32), (c_p * inv).to(tl.float32), (c_p_logp * inv).to(tl.float32),
            (c_p_logq * inv).to(tl.float32), 0.0)


@triton.jit
def upstream_basis(row, g_logp_ptr, g_entropy_ptr, g_full_kl_ptr, g_forward_kl_ptr, entropy_ptr, full_kl_ptr,
                   temperature_ptr, temperature_stride):
    """A row's gradient basis ``(c_label, c_p, c_p_logp, c_p_logq, c_q)`` (fp32, divided by ``T``) from the upstream
    gradients of its statistics (None: no gradient) and the entropy / full KL values their terms read, computed in
    float64 with the float64 ``1 / T`` (``kltriton.kernels.statistics.gradient_basis``, bit for bit; a zero gradient
    adds nothing even where its statistic is infinite)."""
    inv = 1.0 / tl.load(temperature_ptr + row * temperature_stride)
    gl = tl.zeros((), tl.float64)
    if g_logp_ptr is not None:
        gl = tl.load(g_logp_ptr + row).to(tl.float64)
    c_p = gl
    c_p_logp = tl.zeros((), tl.float64)
    c_p_logq = tl.zeros((), tl.float64)
    c_q = tl.zeros((), tl.float64)
    if g_entropy_ptr is not None:
        g = tl.load(g_entropy_ptr + row).to(tl.float64)
        c_p += tl.where(g == 0, 0.0, g * tl.load(entropy_ptr + row).to(tl.float64))
        c_p_logp += g
    if g_full_kl_ptr is not None:
        g = tl.load(g_full_kl_ptr + row).to(tl.float64)
        c_p += tl.where(g == 0, 0.0, g * tl.load(full_kl_ptr + row).to(tl.float64))
        c_p_logp -= g
        c_p_logq = g
    if g_forward_kl_ptr is not None:
        g = tl.load(g_forward_kl_ptr + row).to(tl.float64)
        c_p -= g
        c_q = g
    return ((gl * inv).to(tl.float32), (c_p * inv).to(tl.float32), (c_p_logp * inv).to(tl.float32),
            (c_p_logq * inv).to(tl.float32), (c_q * inv).to(tl.float32))


def upstream_terms(upstream) -> int:
    """The optional basis terms (``constants.BASIS_BITS``) of upstream gradients (``kltriton.kernels.stream.Upstream``)."""
    terms = 0
    if upstream.entropy is not None or upstream.full_kl is not None:
        terms |= constants.P_LOGP
    if upstream.full_kl is not None:
        terms |= constants.P_LOGQ
    if upstream.forward_kl is not None:
        terms |= constants.Q
    return terms


@triton.jit
def load_basis(basis_ptr, row, TERMS: tl.constexpr):
    """A row's gradient basis ``(c_label, c_p, c_p_logp, c_p_logq, c_q)`` from the ``[N, len(GRADIENT_BASIS)]``
    coefficients (``stacked_basis``: a row's terms adjacent, at constant offsets from one address); the terms
    ``TERMS`` does not hold are 0."""
    coefficients = basis_ptr + row.to(tl.int64) * NUM_TERMS
    c_p_logp = 0.0
    c_p_logq = 0.0
    c_q = 0.0
    if BASIS_P_LOGP & TERMS:
        c_p_logp = tl.load(coefficients + TERM_P_LOGP)
    if BASIS_P_LOGQ & TERMS:
        c_p_logq = tl.load(coefficients + TERM_P_LOGQ)
    if BASIS_Q & TERMS:
        c_q = tl.load(coefficients + TERM_Q)
    return tl.load(coefficients + TERM_LABEL), tl.load(coefficients + TERM_P), c_p_logp, c_p_logq, c_q


@triton.jit
def gradient_row_block(row, block, target_ptr, lse_ptr, grad_ptr, vocab, BLOCK_V: tl.constexpr):
    """Vocab block ``block`` of ``row``'s gradient (``[N, V]`` contiguous): ``(offs, in_vocab, grad_row, target, lse,
    live)``. ``live``: the row is scored and its ``lse`` finite; every other row (all ``-inf`` logits: ``-inf``; a
    NaN or ``+inf`` logit: NaN; ``|logits| / T`` beyond fp32: ``+-inf``) gets a zero gradient, on every backend."""
    offs = block * BLOCK_V + tl.arange(0, BLOCK_V)
    target = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    live = (target >= 0) & (lse > NEG_INF) & (lse < float("inf"))
    return offs, offs < vocab, grad_ptr + row.to(tl.int64) * vocab, target, lse, live


@triton.jit
def live_row_block(row, offs, in_vocab, temperature_ptr, temperature_stride, logits_ptr, logits_rows_per_outer,
                   logits_outer_stride, logits_inner_stride):
    """``(1 / T, x)``: the row's inverse temperature and its logits at ``offs`` (fp32, ``-inf`` outside the vocab)."""
    inv_temperature, _ = temperature_of(temperature_ptr, temperature_stride, row)
    x_row = logits_ptr + row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
    return inv_temperature, tl.load(x_row + offs, mask=in_vocab, other=NEG_INF).to(tl.float32)


@triton.jit
def grad_block(x, y, offs, target, lse, ref_lse, basis, inv_temperature, TERMS: tl.constexpr):
    """Gradient (fp32) w.r.t. the logits ``x`` at vocab positions ``offs`` of a row with a finite ``lse``:
    ``c_label * onehot - p * (c_p + c_p_logp * log p + c_p_logq * log q) - c_q * q`` with ``basis = (c_label, c_p,
    c_p_logp, c_p_logq, c_q)``; ``TERMS`` (``constants.P_LOGP`` / ``P_LOGQ`` / ``Q`` bits) says which optional terms
    are present (``y``, the reference logits, is read only for ``P_LOGQ`` and ``Q``)."""
    log_p = x * inv_temperature - lse
    p = tl.exp(log_p)
    c = basis[1]
    if BASIS_P_LOGP & TERMS:
        c = c + basis[2] * log_p
    if BASIS_P_LOGQ & TERMS:
        c = c + basis[3] * (y * inv_temperature - ref_lse)
    if (BASIS_P_LOGP | BASIS_P_LOGQ) & TERMS:
        # p == 0 (x = -inf, or x = finfo.min under a large lse): no mass, no gradient, even where
        # log p is -inf.
        c = tl.where(p == 0, 0.0, c)
    grad = tl.where(offs == target.to(tl.int32), basis[0], 0.0) - p * c
    if BASIS_Q & TERMS:
        grad -= basis[4] * tl.exp(y * inv_temperature - ref_lse)
    return grad


# --- stacked outputs and inputs (host side) ----------------------------------------------------------------------

def stacked_basis(basis):
    """``(coefficients, terms)``: a ``statistics.Basis`` as one contiguous ``[N, len(GRADIENT_BASIS)]`` fp32 tensor
    (absent terms 0) and the bits of its optional terms."""
    import torch

    terms = sum(bit for term, bit in constants.BASIS_BITS.items() if getattr(basis, term) is not None)
    zero = torch.zeros_like(basis.label, dtype=torch.float32)
    return torch.stack([zero if c is None else c.to(torch.float32) for c in basis], dim=1), terms


@triton.jit
def sequence_bounds(seq, n, seq_len, cu_ptr):
    """Sequence ``seq``'s positions ``[start, end)`` within ``[0, n)``: a packed segment of ``cu_seqlens``
    (``cu_ptr``), or the row of ``seq_len`` positions (``cu_ptr`` None)."""
    if cu_ptr is not None:
        start = tl.load(cu_ptr + seq).to(tl.int64)
        end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    else:
        start = (seq + tl.zeros((), tl.int64)) * seq_len
        end = start + seq_len
    start = tl.minimum(tl.maximum(start, 0), n)
    return start, tl.minimum(tl.maximum(end, start), n)
