"""Triton backend of the ``stream`` family: one program per row, streaming over the vocab in ``BLOCK_V`` chunks.

Forward keeps an online max ``m`` of the raw logits and sums of ``exp((x - m) / T)``,
so nothing of size ``[N, V]`` is written and a row is read once (policy and reference
rows in the same loop). Backward recomputes the probabilities from the saved fp32
log-sum-exp. See ``kltriton.kernels.stream`` for the contract. Absent optional tensors are
passed as ``None``: Triton specializes the kernel on them (a compile-time constant), so a
variant without a reference never carries its pointer or its code.
"""
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


def _block_v(vocab: int) -> int:
    # Large blocks amortise the per-iteration cost (and the interpreter's ~1 ms per
    # iteration on CPU); 4096 fp32 values per iteration keep registers in check on GPU.
    return min(4096, triton.next_power_of_2(max(vocab, 16)))


NUM_WARPS = 8  # 4096-wide blocks: 16 values per thread; not tuned on hardware yet


@triton.jit
def _row_offset(row, rows_per_outer, outer_stride, inner_stride):
    """Element offset of row ``row`` of an ``[A, B, V]`` view (``B = rows_per_outer``)."""
    row = row.to(tl.int64)
    return (row // rows_per_outer) * outer_stride + (row % rows_per_outer) * inner_stride


@triton.jit
def _clamp_nonpositive(logp):
    # tl.minimum drops NaN by default (GPU min.f32 returns the other operand); keep it.
    return tl.minimum(logp, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _online_update(x, m, s, inv_temperature):
    """Fold a block ``x`` of raw logits into a running (max, sum of exp((x - max) / T)).

    Returns the new max, its finite stand-in (0 while the row is all ``-inf``: ``-inf - -inf``
    would be NaN), the factor the old sums are rescaled by, ``z = (x - max) / T`` and ``exp(z)``.
    """
    m_new = tl.maximum(m, tl.max(x, axis=0))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.exp((m - m_safe) * inv_temperature)
    z = (x - m_safe) * inv_temperature
    e = tl.exp(z)
    return m_new, m_safe, alpha, z, e, s * alpha + tl.sum(e, axis=0)


@triton.jit
def _stream_forward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same, or None
    target_ptr,                 # [N] int64: label, SKIP or OUT_OF_RANGE
    logp_ptr, lse_ptr,          # [N] fp32 outputs
    entropy_ptr,                # [N] fp32 output, or None
    ref_logp_ptr, ref_lse_ptr,  # [N] fp32 outputs, or None (with ref_ptr)
    full_kl_ptr,                # [N] fp32 output, or None
    vocab,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1): data, no recompile
    BLOCK_V: tl.constexpr,
):
    HAS_REF: tl.constexpr = ref_ptr is not None
    WITH_ENTROPY: tl.constexpr = entropy_ptr is not None
    WITH_FULL_KL: tl.constexpr = full_kl_ptr is not None
    row = tl.program_id(0)
    inv_temperature = (1.0 / tl.load(temperature_ptr + row * temperature_stride)).to(tl.float32)
    target = tl.load(target_ptr + row)
    if target < 0:
        # Not scored: never read the row. SKIP -> 0.0, OUT_OF_RANGE -> NaN.
        skipped = tl.where(target == SKIP, 0.0, float("nan"))
        tl.store(logp_ptr + row, skipped)
        tl.store(lse_ptr + row, 0.0)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, skipped)
        if HAS_REF:
            tl.store(ref_logp_ptr + row, skipped)
            tl.store(ref_lse_ptr + row, 0.0)
        if WITH_FULL_KL:
            tl.store(full_kl_ptr + row, skipped)
    else:
        x_row = logits_ptr + _row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
        m_x = NEG_INF
        s_x = 0.0
        t_x = 0.0   # sum exp(z) * z, for the entropy
        m_y = NEG_INF
        s_y = 0.0
        u = 0.0     # sum exp(zx) * (zx - zy), for the full KL
        m_x_safe = 0.0
        m_y_safe = 0.0
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            in_vocab = offs < vocab
            x = tl.load(x_row + offs, mask=in_vocab, other=NEG_INF).to(tl.float32)
            s_x_old = s_x
            m_x_safe_old = m_x_safe
            m_x, m_x_safe, alpha_x, z_x, e_x, s_x = _online_update(x, m_x, s_x, inv_temperature)
            # Rescaling t_x / u to the new max: where alpha_x is 0 (an empty row so far, or a max
            # that grew by > ~100 / T, e.g. from finfo.min to finfo.max, where delta overflows to
            # +inf) the old sums vanish. The where is on the scalar, so 0 * inf never reaches
            # t_x / u. Per element, a term with e_x == 0 is 0 even where z_x is -inf (x = -inf,
            # or x - max overflowing for x = finfo.min under a max of finfo.max).
            if WITH_ENTROPY:
                delta = (m_x_safe - m_x_safe_old) * inv_temperature
                t_x = tl.where(alpha_x > 0, alpha_x * (t_x - delta * s_x_old), 0.0)
                t_x += tl.sum(tl.where(e_x == 0, 0.0, e_x * z_x), axis=0)
            if HAS_REF:
                y_row = ref_ptr + _row_offset(row, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
                y = tl.load(y_row + offs, mask=in_vocab, other=NEG_INF).to(tl.float32)
                m_y_safe_old = m_y_safe
                m_y, m_y_safe, alpha_y, z_y, e_y, s_y = _online_update(y, m_y, s_y, inv_temperature)
                if WITH_FULL_KL:
                    shift = ((m_x_safe - m_x_safe_old) - (m_y_safe - m_y_safe_old)) * inv_temperature
                    u = tl.where(alpha_x > 0, alpha_x * (u - shift * s_x_old), 0.0)
                    u += tl.sum(tl.where(e_x == 0, 0.0, e_x * (z_x - z_y)), axis=0)
        log_s_x = tl.log(s_x)
        x_label = tl.load(x_row + target).to(tl.float32)
        tl.store(logp_ptr + row, _clamp_nonpositive((x_label - m_x_safe) * inv_temperature - log_s_x))
        tl.store(lse_ptr + row, m_x_safe * inv_temperature + log_s_x)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, log_s_x - t_x / s_x)
        if HAS_REF:
            y_row = ref_ptr + _row_offset(row, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
            log_s_y = tl.log(s_y)
            y_label = tl.load(y_row + target).to(tl.float32)
            tl.store(ref_logp_ptr + row, _clamp_nonpositive((y_label - m_y_safe) * inv_temperature - log_s_y))
            tl.store(ref_lse_ptr + row, m_y_safe * inv_temperature + log_s_y)
            if WITH_FULL_KL:
                tl.store(full_kl_ptr + row, u / s_x - log_s_x + log_s_y)


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
    WITH_ENTROPY: tl.constexpr = g_entropy_ptr is not None
    WITH_FULL_KL: tl.constexpr = g_full_kl_ptr is not None
    row = tl.program_id(0)
    inv_temperature = (1.0 / tl.load(temperature_ptr + row * temperature_stride)).to(tl.float32)
    grad_row = grad_ptr + row.to(tl.int64) * vocab
    target = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    # Skipped rows and rows without a finite lse (all -inf logits: -inf; a NaN or +inf logit:
    # NaN; |logits| / T beyond fp32: +-inf) get a zero gradient, as on every backend.
    live = (target >= 0) & (lse > NEG_INF) & (lse < float("inf"))
    g_logp = tl.where(live, tl.load(g_logp_ptr + row), 0.0)
    x_row = logits_ptr + _row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
    if WITH_ENTROPY:
        entropy = tl.load(entropy_ptr + row)
        g_entropy = tl.where(live, tl.load(g_entropy_ptr + row), 0.0)
    if WITH_FULL_KL:
        ref_lse = tl.load(ref_lse_ptr + row)
        full_kl = tl.load(full_kl_ptr + row)
        g_full_kl = tl.where(live, tl.load(g_full_kl_ptr + row), 0.0)
    read_limit = tl.where(live, vocab, 0)  # dead rows read nothing
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab
        read = offs < read_limit
        x = tl.load(x_row + offs, mask=read, other=NEG_INF).to(tl.float32)
        log_p = x * inv_temperature - lse
        p = tl.exp(log_p)
        grad = g_logp * (tl.where(offs == target, 1.0, 0.0) - p)
        if WITH_ENTROPY:
            # p == 0 (x = -inf, or x = finfo.min under a large lse): no mass, no gradient, even
            # where log_p is -inf.
            grad -= g_entropy * tl.where(p == 0, 0.0, p * (log_p + entropy))
        if WITH_FULL_KL:
            y_row = ref_ptr + _row_offset(row, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
            y = tl.load(y_row + offs, mask=read, other=NEG_INF).to(tl.float32)
            log_q = y * inv_temperature - ref_lse
            grad += g_full_kl * tl.where(p == 0, 0.0, p * (log_p - log_q - full_kl))
        grad = tl.where(live, grad * inv_temperature, 0.0)
        tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)


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
    _stream_forward_kernel[(n,)](
        *_view_args(logits), *_view_args(ref_logits), target,
        stats.logp, stats.lse, when(with_entropy, stats.entropy),
        when(has_ref, stats.ref_logp), when(has_ref, stats.ref_lse), when(with_full_kl, stats.full_kl),
        vocab, temperature, 1 if temperature.dim() else 0,
        BLOCK_V=_block_v(vocab), num_warps=NUM_WARPS,
    )
    return stats


def backward(logits, ref_logits, target, temperature, lse, ref_lse, g_logp, g_entropy, entropy,
             g_full_kl, full_kl) -> torch.Tensor:
    n, vocab = num_rows(logits), logits.shape[-1]
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if n == 0:
        return grad
    with_full_kl = g_full_kl is not None
    _stream_backward_kernel[(n,)](
        *_view_args(logits), *_view_args(ref_logits if with_full_kl else None), grad, target,
        lse, g_logp, entropy if g_entropy is not None else None, g_entropy,
        ref_lse if with_full_kl else None, full_kl if with_full_kl else None, g_full_kl,
        vocab, temperature, 1 if temperature.dim() else 0,
        BLOCK_V=_block_v(vocab), num_warps=NUM_WARPS,
    )
    return grad
