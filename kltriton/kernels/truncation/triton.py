"""Triton backend of the ``truncation`` family (row helpers: ``kltriton.kernels.triton_rows``).

Forward, one program per row (grid ``(N,)``): the floor by selection without sorting, then the statistics of
the row with the logits below the floor read as ``-inf`` (``triton_rows.stream_chunk`` with ``floor``):

1. a pass for the row max ``m`` (and NaN / ``+inf``); min-p's floor ``m + T log(min_p)`` follows;
2. top-k, then top-p: the largest fp32 ``v`` at least the floor so far whose weight over ``{x >= v}`` reaches
   the goal (a count of ``k``; ``top_p`` times the probability mass of the kept set), by a ``G + 1``-way
   bisection on the order-preserving 32-bit keys of the logits: each pass is a *census* of the row, the
   weights of ``{x >= t}`` at ``G`` thresholds ``t`` spread evenly over the keys of the bracket, which shrinks
   ``G + 1``-fold. Exact (the answer is a logit: the key where the weight crosses the goal), at most
   ``ceil(32 / log2(G + 1))`` passes per step, fewer when the bracket starts narrower;
3. the statistics pass.

Every pass reads the row; after the first, from L2 (a row is 64 KB in bf16 at ``V = 32000``). Backward: the
stream family's backward kernel with the floor (the logits below it read as ``-inf``: zero gradient there).
Launch settings depend on ``V`` and the dtype only (batch invariance). See ``kltriton.kernels.truncation`` for the
contract and ``python -m benchmarks static`` for what each variant compiles to.
"""
import torch
import triton
import triton.language as tl

from kltriton.kernels import constants, statistics
from kltriton.kernels import triton_rows as rows
from kltriton.kernels.row_views import num_rows
from kltriton.kernels.stream import triton as stream_triton
# Replay (``kltriton.kernels.truncation.replay``) is O(N K) work on the K gathered logits of each row: the reference's
# PyTorch code (a few launches on CUDA), and for the logits gradient a memset and a K-column scatter.
from kltriton.kernels.truncation.reference import (replay_backward, replay_columns, replay_forward,  # noqa: F401
                                                   replay_scatter, replay_support)

THRESHOLDS = 8         # census thresholds per pass (a power of two: a tensor dimension)
CENSUS_PER_THREAD = 4  # vocab entries per thread per selection-pass iteration


def _forward_launch(vocab: int, elem_bytes: int, request: int, given: bool) -> rows.Launch:
    """The stream forward's tile ``[SUBTILES, LANES, VEC]`` for the statistics (one program per row); the
    selection passes read ``BLOCK`` entries per iteration, 4 per thread (16-byte loads in fp32, 8-byte in 16-bit
    dtypes: 8 per thread would double the census' ``[G, BLOCK]`` sums, past the register file). The entries per
    iteration of the kernel's heaviest loop (the static report's): the statistics' with a given floor, else the
    census'."""
    tile = rows.forward_tile(vocab, elem_bytes, False)
    c = tile.constexprs
    block = min(CENSUS_PER_THREAD * 32 * rows.NUM_WARPS, triton.next_power_of_2(max(vocab, 16)))
    return rows.Launch(dict(WANT=request, SUBTILES=c["SUBTILES"], LANES=c["LANES"], VEC=c["VEC"], BLOCK=block,
                          G=THRESHOLDS), rows.options(), tile.elements_per_iteration if given else block)


def launches(vocab: int, elem_bytes: int):
    """(kernel name, Launch, variant name, absent arguments) of every kernel ``forward`` / ``backward`` launch
    for this vocab and logits element size (for ``benchmarks/static.py``)."""
    out = []
    for given, ent in ((False, False), (False, True), (True, False), (True, True)):
        request = statistics.request(entropy=ent)
        name = "trunc-fwd" + ("+floor" if given else "") + ("+ent" if ent else "")
        absent = ([] if ent else ["entropy_ptr"]) + (["top_k_ptr", "top_p_ptr", "min_p_ptr"] if given else [])
        out.append(("_truncated_forward_kernel", _forward_launch(vocab, elem_bytes, request, given), name, absent))
    for logp_term in (False, True):  # the stream family's backward kernel with the floor
        launch = stream_triton.backward_launch(vocab)
        launch = launch._replace(constexprs=dict(launch.constexprs, TERMS=constants.P_LOGP if logp_term else 0))
        out.append(("_stream_backward_kernel", launch, "trunc-bwd" + ("+plogp" if logp_term else ""),
                    ["ref_ptr", "ref_lse_ptr", *stream_triton.UPSTREAM_POINTERS]))
    return out


@triton.jit
def _key(x):
    """int32 key of fp32 ``x`` ordered as the values (``a >= b`` iff ``key(a) >= key(b)``, NaN aside; -0 just
    below +0): the bits, with the magnitude bits of negative values flipped."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _value(key):
    """The fp32 value of a ``_key``."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _row_max(x_row, vocab, BLOCK: tl.constexpr):
    """The row max, NaN when the row has a NaN."""
    offs0 = tl.arange(0, BLOCK)
    acc = tl.full((BLOCK,), rows.NEG_INF, tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + offs0
        x = tl.load(x_row + offs, mask=offs < vocab, other=rows.NEG_INF).to(tl.float32)
        acc = tl.maximum(acc, x, propagate_nan=tl.PropagateNan.ALL)
    nan = acc != acc
    m = tl.max(tl.where(nan, rows.NEG_INF, acc), axis=0)
    return tl.where(tl.sum(nan.to(tl.int32), axis=0) > 0, float("nan"), m)


@triton.jit
def _census(x_row, vocab, lower, thresholds, m, log2e_over_t, MASS: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr):
    """``(weight [G], count [G], weight_total, count_total)`` in float64 of the logits ``>= thresholds[g]`` and
    of those ``>= lower``; a logit's weight is 1 (``MASS`` False: the counts) or ``2^((x - m) log2e_over_t)`` (its
    unnormalized probability); below ``lower`` nothing counts. Per-position fp32 sums ``[G, BLOCK]`` over the
    row, reduced once at the end."""
    offs0 = tl.arange(0, BLOCK)[None, :]
    # [G, BLOCK] against [1, BLOCK] loads, the vocab along the last (fastest) dimension: a thread compares its own
    # logits with every threshold, in the layout they were loaded in (no shared-memory exchange inside the loop)
    th = thresholds[:, None]
    acc = tl.zeros((G, BLOCK), tl.float32)
    acc_count = tl.zeros((G, BLOCK), tl.float32)
    acc_total = tl.zeros((1, BLOCK), tl.float32)
    acc_count_total = tl.zeros((1, BLOCK), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + offs0
        x = tl.load(x_row + offs, mask=offs < vocab, other=rows.NEG_INF).to(tl.float32)
        one = tl.where((offs < vocab) & (x >= lower), 1.0, 0.0)
        above = x >= th
        acc_count_total += one
        acc_count += tl.where(above, one, 0.0)
        if MASS:
            w = tl.where(x >= lower, tl.exp2((x - m) * log2e_over_t), 0.0)  # x = -inf: 0
            acc_total += w
            acc += tl.where(above, w, 0.0)
    count = tl.sum(acc_count.to(tl.float64), axis=1)
    count_total = tl.sum(acc_count_total.to(tl.float64))
    if MASS:
        return tl.sum(acc.to(tl.float64), axis=1), count, tl.sum(acc_total.to(tl.float64)), count_total
    return count, count, count_total, count_total


@triton.jit
def _max_between(x_row, vocab, lo, hi, BLOCK: tl.constexpr):
    """The largest logit in ``[lo, hi)``."""
    offs0 = tl.arange(0, BLOCK)
    acc = tl.full((BLOCK,), rows.NEG_INF, tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + offs0
        x = tl.load(x_row + offs, mask=offs < vocab, other=rows.NEG_INF).to(tl.float32)
        acc = tl.maximum(acc, tl.where((x >= lo) & (x < hi), x, rows.NEG_INF))
    return tl.max(acc, axis=0)


@triton.jit
def _largest_reaching(x_row, vocab, lower, m, log2e_over_t, count, fraction, MASS: tl.constexpr, BLOCK: tl.constexpr,
                      G: tl.constexpr):
    """The largest fp32 ``v >= lower`` whose weight (``_census``) over ``{x >= v}`` reaches the goal: ``count``
    (``MASS`` False), or ``fraction`` times the weight of ``{x >= lower}``; ``lower`` when nothing above it does.

    A bracket of keys ``[lo, hi)`` with ``weight(lo) >= goal > weight(hi)`` shrinks per census to the gap
    between two of its ``G`` thresholds: spread evenly in value while it spans more than two binades (the
    logits' density follows the values), else evenly over the keys. It ends at ``hi = lo + 1``, or, once a
    single logit lies in the bracket, with one pass for that logit (the answer)."""
    steps = tl.arange(0, G) + 1
    lo = _key(lower).to(tl.int64)
    hi = _key(m).to(tl.int64) + 1  # nothing is above the max
    count_lo = vocab.to(tl.float64)  # logits >= lo (at most): updated by the first census
    count_hi = tl.zeros((), tl.float64)
    reachable = True  # weight(lo) >= goal: with counts, unknown until the first census
    while (hi - lo > 1) & (count_lo - count_hi > 1):
        lo_value = _value(lo.to(tl.int32)).to(tl.float64)
        hi_value = _value(hi.to(tl.int32)).to(tl.float64)
        by_value = (lo_value > rows.NEG_INF) & (hi - lo > (1 << 24))
        lo_value = tl.where(by_value, lo_value, hi_value)  # keeps -inf out of the arithmetic (unused then)
        spread = (lo_value + (hi_value - lo_value) * steps.to(tl.float64) / (G + 1)).to(tl.float32)
        keys = tl.where(by_value, _key(spread).to(tl.int64), lo + (hi - lo) * steps.to(tl.int64) // (G + 1))
        keys = tl.minimum(tl.maximum(keys, lo + 1), hi - 1)
        weight, counts, total, count_total = _census(x_row, vocab, lower, _value(keys.to(tl.int32)), m, log2e_over_t, MASS,
                                                     BLOCK, G)
        goal = count
        if MASS:
            goal = fraction * total
        else:
            reachable = reachable & (count_total >= goal)
        count_lo = tl.minimum(count_lo, count_total)
        reached = weight >= goal
        lo_next = tl.max(tl.where(reached, keys, lo), axis=0)
        count_lo = tl.min(tl.where(reached, counts, count_lo), axis=0)
        count_hi = tl.max(tl.where(reached, count_hi, counts), axis=0)
        hi = tl.min(tl.where(reached, hi, keys), axis=0)
        lo = lo_next
    answer = _value(lo.to(tl.int32))
    if reachable & (hi - lo > 1):  # one logit left in [lo, hi): it is the answer
        answer = _max_between(x_row, vocab, answer, _value(hi.to(tl.int32)), BLOCK)
    return answer


@triton.jit
def _fp32_at_least(value):
    """The smallest fp32 ``>= value`` (float64): ``x >= it`` in fp32 iff ``x >= value``."""
    f = value.to(tl.float32)
    return tl.where(f.to(tl.float64) < value, _value(_key(f) + 1), f)


@triton.jit
def _row_floor(x_row, vocab, row, temperature, log2e_over_t, top_k_ptr, top_p_ptr, min_p_ptr, BLOCK: tl.constexpr,
               G: tl.constexpr):
    """The floor of a row from its knobs (``kltriton.kernels.truncation``): NaN for a NaN or ``+inf`` logit,
    ``-inf`` for an all ``-inf`` row or when nothing is cut."""
    m = _row_max(x_row, vocab, BLOCK)
    floor = tl.full((), rows.NEG_INF, tl.float32)
    if (m > rows.NEG_INF) & (m < float("inf")):  # NaN: False
        min_p = tl.load(min_p_ptr + row)
        if min_p > 0:
            floor = _fp32_at_least(m.to(tl.float64) + temperature * tl.log(min_p))
        k = tl.load(top_k_ptr + row)
        if (k > 0) & (k < vocab):
            floor = _largest_reaching(x_row, vocab, floor, m, log2e_over_t, k.to(tl.float64), 1.0, False, BLOCK, G)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1:
            floor = _largest_reaching(x_row, vocab, floor, m, log2e_over_t, 0.0, top_p, True, BLOCK, G)
    return tl.where((m != m) | (m == float("inf")), float("nan"), floor)


@triton.jit
def _truncated_forward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    target_ptr,                 # [N] int64: label, SKIP or OUT_OF_RANGE
    top_k_ptr, top_p_ptr, min_p_ptr,  # [N] int64 / float64 / float64 knobs, or None with a given floor
    floor_ptr,                  # [N] fp32: written from the knobs, or read (given) when they are None
    logp_ptr, lse_ptr, entropy_ptr,   # [N] fp32 statistics (entropy_ptr None if absent)
    vocab,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1): data, no recompile
    WANT: tl.constexpr, SUBTILES: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr,
    G: tl.constexpr,
):
    """Grid ``(N,)``: a row's floor (from the knobs, or given) and the statistics of its kept set."""
    row = tl.program_id(0)
    target = tl.load(target_ptr + row)
    if target >= 0:  # a skipped row is never read
        inv_temperature, log2e_over_t = rows.temperature_of(temperature_ptr, temperature_stride, row)
        x_row = logits_ptr + rows.row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
        x_label = tl.load(x_row + target).to(tl.float32)
        if top_k_ptr is None:
            floor = tl.load(floor_ptr + row)
        else:
            temperature = tl.load(temperature_ptr + row * temperature_stride)
            floor = _row_floor(x_row, vocab, row, temperature, log2e_over_t, top_k_ptr, top_p_ptr, min_p_ptr, BLOCK, G)
            tl.store(floor_ptr + row, floor)
        state = rows.stream_chunk(x_row, x_row, 0, vocab, log2e_over_t, WANT, SUBTILES, LANES, VEC, floor)
        values = rows.finalize(state, rows.below_floor_absent(x_label, floor), x_label, inv_temperature, WANT)
        rows.store_stats(row, values, logp_ptr, lse_ptr, entropy_ptr, None, None, None)
    else:
        if top_k_ptr is not None:
            tl.store(floor_ptr + row, rows.NEG_INF)
        rows.store_stats(row, rows.skipped_stats(target), logp_ptr, lse_ptr, entropy_ptr, None, None, None)


def forward(logits, target, temperature, top_k, top_p, min_p, floor, request):
    n, vocab = num_rows(logits), logits.shape[-1]
    stats = statistics.empty_stats(n, request, lambda size: torch.empty(size, dtype=torch.float32,
                                                                       device=logits.device))
    given = floor is not None
    out_floor = floor if given else torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out_floor, stats
    launch = _forward_launch(vocab, logits.element_size(), request, given)
    knobs = (None, None, None) if given else (top_k, top_p, min_p)
    _truncated_forward_kernel[(n,)](*rows.view_args(logits), target, *knobs, out_floor, stats.logp, stats.lse,
                                    stats.entropy if stats.entropy.numel() else None, vocab, temperature,
                                    1 if temperature.dim() else 0, **launch.constexprs, **launch.options)
    return out_floor, stats


def backward(logits, target, temperature, floor, lse, basis):
    """The stream family's backward kernel with the floor: the logits below it have no mass, no gradient."""
    return stream_triton.backward(logits, None, target, temperature, lse, None, basis, floor=floor)
