"""Triton backend of the ``loss`` family: the fused single-pass kernel ``_loss_forward_kernel``, and an
in-place scaling kernel that returns at once on the device when the upstream gradient is 1.

``_loss_forward_kernel``: one program per row (grid ``(N,)``). It reduces the row's statistics with the
shared vocab loop (``triton_rows.stream_chunk``: policy and reference row in the same loop, entropy always,
full KL for the ``full`` estimator), stores them, computes the row's loss derivative (``_row_g_logp``: the
formulas of ``terms.py`` differentiated per row, in float64 like the C++ kernel) and gradient basis, then
writes the row's gradient in vocab blocks with the shared element math (``triton_rows.grad_block``) while
the row is still in L1/L2: the logits are read from memory once for the forward and the backward together,
and the gradient written once. Launch settings depend on ``V`` and the dtype only (the stream forward's
tile, the stream backward's block), never on ``N``: a row's result is the same in every batch. Absent
optional tensors are passed as ``None`` (Triton specializes on them); the loss type and estimator are
compile-time strings; the hyperparameters and the per-row weights are data (a new clip value or
coefficient never recompiles).

Calls with no gradient request run ``composed.forward`` on the Triton stream kernels (the stream forward
alone, which splits long rows across programs and keeps a small batch busy; its statistics agree with the
fused kernel's to fp32 rounding).
"""
import torch
import triton
import triton.language as tl

from kltriton import estimators
from kltriton.kernels import constants, statistics
from kltriton.kernels import triton_rows as rows
from kltriton.kernels.layout import triton as layout
from kltriton.kernels.loss import LossTerms, composed, reference_logp, statistics_request
from kltriton.kernels.loss import terms as formulas
from kltriton.kernels.row_views import num_rows
from kltriton.kernels.stream import triton as stream

SCALE_BLOCK = 4096
HP_RATIO_LOW = tl.constexpr(formulas.SLOT["ratio_low"])
HP_RATIO_HIGH = tl.constexpr(formulas.SLOT["ratio_high"])
HP_DUAL_CLIP = tl.constexpr(formulas.SLOT["dual_clip"])
HP_KL_CLAMP = tl.constexpr(formulas.SLOT["kl_clamp"])
HP_LOG_RATIO_CLAMP = tl.constexpr(formulas.SLOT["log_ratio_clamp"])
HP_DELTA = tl.constexpr(formulas.SLOT["delta"])
HP_TAU_POS = tl.constexpr(formulas.SLOT["tau_pos"])
HP_TAU_NEG = tl.constexpr(formulas.SLOT["tau_neg"])
HP_CLIP_RATIO_C = tl.constexpr(formulas.SLOT["clip_ratio_c"])
HP_DRO_BETA = tl.constexpr(formulas.SLOT["dro_beta"])
HP_KL_RATIO = tl.constexpr(formulas.SLOT["kl_ratio"])
SKIP = tl.constexpr(constants.SKIP)
TERMS_BLOCK = 1024
(METRIC_PG_LOSS, METRIC_KL_LOSS, METRIC_ENTROPY_LOSS, METRIC_CLIPFRAC, METRIC_CLIPFRAC_LOWER, METRIC_PPO_KL,
 METRIC_KL_MEAN, METRIC_ENTROPY_MEAN, METRIC_RATIO_MAX, METRIC_RATIO_MIN) = (tl.constexpr(constants.LOSS_METRICS.index(
     name)) for name in ("pg_loss", "kl_loss", "entropy_loss", "clipfrac", "clipfrac_lower", "ppo_kl", "kl_mean",
                         "entropy_mean", "ratio_max", "ratio_min"))

# (variant, reference logits, loss type, estimator, entropy gradient) compiled by benchmarks/static.py:
# the lightest kernel, the usual GRPO one, the heaviest (full KL: the reference read in both passes),
# reference log-probs given per row with CISPO, SAPO's sigmoid gate, and DPPO's binary-KL trust region
# (float64 logs) with the full KL. tests/kernels/test_triton_compile.py compiles the other formulas too.
STATIC_VARIANTS = (("ppo", False, "ppo", "", False), ("ppo+ref+k3+ent", True, "ppo", "k3", True),
                   ("ppo+ref+full+ent", True, "ppo", "full", True), ("cispo+rlogp+k3+", False, "cispo", "k3+", False),
                   ("sapo+rlogp+k3", False, "sapo", "k3", False), ("dppo_kl+ref+full", True, "dppo_kl", "full", False))


@triton.jit
def _scale_kernel(
    grad_ptr,      # [numel] contiguous, logits dtype, scaled in place
    upstream_ptr,  # [] the upstream gradient of the loss
    numel,
    BLOCK: tl.constexpr,
):
    upstream = tl.load(upstream_ptr).to(tl.float32)
    if upstream != 1.0:  # a unit upstream gradient reads and writes nothing
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < numel
        g = tl.load(grad_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(grad_ptr + offs, (g * upstream).to(grad_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _ratio(d, hp_ptr):
    """``(r, dr)``: the importance ratio ``exp(clamp(d, -c, c))`` (``c`` the ``log_ratio_clamp`` slot, ``inf``: no
    clamp) and ``d r / d logp`` (0 beyond the clamp), float64 (C++ ``Ratio``)."""
    clamp = tl.load(hp_ptr + HP_LOG_RATIO_CLAMP)
    ratio = tl.exp(rows.clamp(d, -clamp, clamp))
    return ratio, tl.where(tl.abs(d) <= clamp, ratio, 0.0)


@triton.jit
def _chain(g, d_ratio):
    """``g * d_ratio``; a zero ``g`` stays 0 where an unclamped ratio overflows to ``+inf``."""
    return tl.where(g == 0.0, 0.0, g * d_ratio)


@triton.jit
def _pg_slope(lp, old, d, adv, hp_ptr, LOSS_TYPE: tl.constexpr):
    """``d pg / d logp`` (float64) of one row before its weight ``w_pg`` (``terms.SLOPES``; C++ ``pg_slope``)."""
    ratio, d_ratio = _ratio(d, hp_ptr)
    low = tl.load(hp_ptr + HP_RATIO_LOW)
    high = tl.load(hp_ptr + HP_RATIO_HIGH)
    if LOSS_TYPE == "kl_only":  # no policy-gradient term
        slope = tl.zeros_like(adv)
    elif LOSS_TYPE == "ppo":  # max(-A min(r, delta), -A clip(r)), held by the dual clip for A < 0
        delta = tl.load(hp_ptr + HP_DELTA)
        pg1 = -adv * tl.minimum(ratio, delta)
        pg2 = -adv * rows.clamp(ratio, low, high)
        g_ratio = tl.where(pg1 >= pg2, tl.where(ratio <= delta, -adv, 0.0),
                           tl.where((ratio >= low) & (ratio <= high), -adv, 0.0))
        held = (adv < 0) & (tl.maximum(pg1, pg2) > -adv * tl.load(hp_ptr + HP_DUAL_CLIP))
        slope = _chain(tl.where(held, 0.0, g_ratio), d_ratio)
    elif LOSS_TYPE == "cispo":  # -sg(clip(ratio)) * A * logp
        slope = -rows.clamp(ratio, low, high) * adv
    elif LOSS_TYPE == "sapo":  # -A * 4 sigmoid(tau (r - 1)) / tau
        tau = tl.where(adv > 0, tl.load(hp_ptr + HP_TAU_POS), tl.load(hp_ptr + HP_TAU_NEG))
        sig = 1.0 / (1.0 + tl.exp(-tau * (ratio - 1.0)))
        slope = _chain(-adv * 4.0 * sig * (1.0 - sig), d_ratio)
    elif LOSS_TYPE == "clipped_ratio":  # -clip(r) * A, through the ratio inside the range
        slope = tl.where((ratio >= low) & (ratio <= high), _chain(-adv, d_ratio), 0.0)
    elif LOSS_TYPE == "gpg":  # -logp * A
        slope = -adv
    elif LOSS_TYPE == "dro":  # -(logp A - beta / 2 (logp - old)^2)
        slope = -adv + tl.load(hp_ptr + HP_DRO_BETA) * d
    elif LOSS_TYPE == "dppo_tv" or LOSS_TYPE == "dppo_kl":  # -A * sg(min(r, clip_ratio_c)) * logp in the region
        valid = _dppo_valid(lp, old, adv, hp_ptr, LOSS_TYPE)
        slope = tl.where(valid, -adv * tl.minimum(ratio, tl.load(hp_ptr + HP_CLIP_RATIO_C)), 0.0)
    else:
        tl.static_assert(False, "_pg_slope has no derivative for this loss type")
    return slope


@triton.jit
def _pg_terms(lp, old, d, adv, hp_ptr, LOSS_TYPE: tl.constexpr):
    """``(pg, ratio, clipped, clipped_lower, log_ratio)`` (float64; flags bool) of the rows (``terms.FORMULAS``; C++
    ``pg_terms``): the policy-gradient term before its weight, the ratio, verl's clip flags and the log-ratio whose
    negative ``ppo_kl`` averages."""
    clamp = tl.load(hp_ptr + HP_LOG_RATIO_CLAMP)
    log_ratio = rows.clamp(d, -clamp, clamp)
    ratio = tl.exp(log_ratio)
    clip = rows.clamp(ratio, tl.load(hp_ptr + HP_RATIO_LOW), tl.load(hp_ptr + HP_RATIO_HIGH))
    no = adv != adv  # False, NaN aside (a NaN advantage is NaN everywhere anyway)
    if LOSS_TYPE == "kl_only":  # no policy-gradient term
        pg, clipped, lower = tl.zeros_like(adv), no, no
    elif LOSS_TYPE == "ppo":
        pg1 = -adv * tl.minimum(ratio, tl.load(hp_ptr + HP_DELTA))
        pg2 = -adv * clip
        clip1 = tl.maximum(pg1, pg2)
        pg3 = -adv * tl.load(hp_ptr + HP_DUAL_CLIP)
        pg = tl.where(adv < 0, tl.minimum(clip1, pg3), clip1)
        clipped, lower = pg2 > pg1, (clip1 > pg3) & (adv < 0)
    elif LOSS_TYPE == "cispo":
        pg, clipped, lower = -clip * adv * lp, ratio != clip, no
    elif LOSS_TYPE == "clipped_ratio":
        pg, clipped, lower = -clip * adv, ratio != clip, no
    elif LOSS_TYPE == "sapo":
        tau = tl.where(adv > 0, tl.load(hp_ptr + HP_TAU_POS), tl.load(hp_ptr + HP_TAU_NEG))
        pg, clipped, lower = -(4.0 / tau) / (1.0 + tl.exp(-tau * (ratio - 1.0))) * adv, no, no
    elif LOSS_TYPE == "gpg":
        pg, clipped, lower = -lp * adv, no, no
    elif LOSS_TYPE == "dppo_tv" or LOSS_TYPE == "dppo_kl":
        valid = _dppo_valid(lp, old, adv, hp_ptr, LOSS_TYPE)
        cap = tl.load(hp_ptr + HP_CLIP_RATIO_C)
        pg = tl.where(valid, -adv * tl.minimum(ratio, cap) * lp, 0.0)
        clipped, lower = ~valid, (ratio > cap) & valid
    elif LOSS_TYPE == "dro":  # its log-ratio is not clamped
        pg, clipped, lower = -(lp * adv - 0.5 * tl.load(hp_ptr + HP_DRO_BETA) * d * d), no, no
        log_ratio = d
    else:
        tl.static_assert(False, "_pg_terms has no formula for this loss type")
    return pg, ratio, clipped, lower, log_ratio


@triton.jit
def _dppo_valid(lp, old, adv, hp_ptr, LOSS_TYPE: tl.constexpr):
    """DPPO's trust region (verl ``dppo_tv`` / ``dppo_kl``): the divergence of ``p = exp(lp)`` from ``exp(old)``
    within ``clip_high`` (``A > 0``) or ``clip_low`` (``A <= 0``)."""
    clip_low = 1.0 - tl.load(hp_ptr + HP_RATIO_LOW)
    clip_high = tl.load(hp_ptr + HP_RATIO_HIGH) - 1.0
    p = tl.exp(lp)
    p_old = tl.exp(old)
    if LOSS_TYPE == "dppo_tv":
        return tl.where(adv > 0, (p - p_old) <= clip_high, (p - p_old) >= -clip_low)
    div = p_old * (old - lp) + (1.0 - p_old) * tl.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    return tl.where(adv > 0, (div <= clip_high) | (p <= p_old), (div <= clip_low) | (p >= p_old))


@triton.jit
def _row_g_logp(row, logp, ref_logp, full_kl, old_logp_ptr, adv_ptr, w_pg_ptr, w_kl_ptr, hp_ptr,
                LOSS_TYPE: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr):
    """``(d loss / d logp, d loss / d full_kl)`` (float64) of one row: the derivative of ``w_pg * pg + w_kl * kl``
    (times the ratio with ``kl_ratio``: ``kl' r + kl dr``; ``terms.py``; C++ ``row_g_logp``). ``old_logp_ptr``
    None: on-policy (old = logp)."""
    lp = logp.to(tl.float64)
    old = lp
    if old_logp_ptr is not None:
        old = tl.load(old_logp_ptr + row).to(tl.float64)
    adv = tl.load(adv_ptr + row).to(tl.float64)
    d = (lp - old).to(tl.float32).to(tl.float64)  # the fp32 difference, as the other backends
    g_logp = tl.load(w_pg_ptr + row).to(tl.float64) * _pg_slope(lp, old, d, adv, hp_ptr, LOSS_TYPE)
    g_full_kl = g_logp * 0.0
    if ESTIMATOR != "":
        ratio, d_ratio = _ratio(d, hp_ptr)
        corrected = tl.load(hp_ptr + HP_KL_RATIO) != 0.0
        weight = tl.where(corrected, ratio, 1.0)
        w_kl = tl.load(w_kl_ptr + row).to(tl.float64)
        kl_clamp = tl.load(hp_ptr + HP_KL_CLAMP)
        if ESTIMATOR == "full":  # the full KL's own gradient goes through its statistic; 0 where clamped
            fkl = full_kl.to(tl.float64)
            g_full_kl = tl.where(tl.abs(fkl) > kl_clamp, 0.0, w_kl * weight)
            g_logp += tl.where(corrected, w_kl * rows.clamp(fkl, -kl_clamp, kl_clamp) * d_ratio, 0.0)
        else:
            value, slope = rows.kl_estimate(lp - ref_logp.to(tl.float64), kl_clamp, ESTIMATOR, STRAIGHT)
            g_logp += w_kl * (slope * weight + tl.where(corrected, value * d_ratio, 0.0))
    return g_logp, g_full_kl


@triton.jit
def _coefficients_kernel(logp_ptr, ref_logp_ptr, full_kl_ptr, old_logp_ptr, adv_ptr, w_pg_ptr, w_kl_ptr, hp_ptr,
                         out_ptr, n, LOSS_TYPE: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK),)``: ``_row_g_logp`` of ``BLOCK`` rows per program, elementwise (for the parity
    test of the three implementations)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.minimum(offs, n - 1)  # the helpers load unmasked: rows past N repeat the last one, never stored
    full_kl = tl.load(logp_ptr + row) * 0.0
    if full_kl_ptr is not None:
        full_kl = tl.load(full_kl_ptr + row)
    g, _ = _row_g_logp(row, tl.load(logp_ptr + row), tl.load(ref_logp_ptr + row), full_kl, old_logp_ptr, adv_ptr,
                       w_pg_ptr, w_kl_ptr, hp_ptr, LOSS_TYPE, ESTIMATOR, STRAIGHT)
    tl.store(out_ptr + offs, g.to(tl.float32), mask=offs < n)


@triton.jit
def _zero_row(grad_ptr, row, vocab, BLOCK_V: tl.constexpr):
    """A zero gradient row (a skipped row, or one without a finite lse)."""
    grad_row = grad_ptr + row.to(tl.int64) * vocab
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        tl.store(grad_row + offs, tl.zeros((BLOCK_V,), grad_ptr.dtype.element_ty), mask=offs < vocab)


@triton.jit
def _accumulate_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    target_ptr,                 # [N] int64
    lse_ptr,                    # [N] fp32
    c_label_ptr, c_p_ptr, c_p_logp_ptr,  # [N] fp32 basis (c_p_logp None: no such term)
    grad_ptr,                   # [N, V] contiguous, logits dtype, updated in place
    vocab,
    temperature_ptr, temperature_stride,
    TERMS: tl.constexpr,        # constants.P_LOGP when c_p_logp is given, else 0
    BLOCK_V: tl.constexpr,
):
    """Grid ``(N,)``: ``grad[row] +=`` the row's gradient on the basis; a row with nothing to add is not read."""
    row = tl.program_id(0)
    target = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    c_label = tl.load(c_label_ptr + row)
    c_p = tl.load(c_p_ptr + row)
    c_p_logp = c_p * 0.0
    if TERMS != 0:
        c_p_logp = tl.load(c_p_logp_ptr + row)
    live = (c_label != 0.0) | (c_p != 0.0) | (c_p_logp != 0.0)
    if (target >= 0) & (lse > rows.NEG_INF) & (lse < float("inf")) & live:
        inv_temperature, _ = rows.temperature_of(temperature_ptr, temperature_stride, row)
        x_row = logits_ptr + rows.row_offset(row, logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
        grad_row = grad_ptr + row.to(tl.int64) * vocab
        basis = (c_label, c_p, c_p_logp, c_p * 0.0)
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            in_vocab = offs < vocab
            x = tl.load(x_row + offs, mask=in_vocab, other=rows.NEG_INF).to(tl.float32)
            grad = rows.grad_block(x, x, offs, target, lse, lse, basis, inv_temperature, TERMS)
            before = tl.load(grad_row + offs, mask=in_vocab, other=0.0).to(tl.float32)
            tl.store(grad_row + offs, (before + grad).to(grad_ptr.dtype.element_ty), mask=in_vocab)


@triton.jit
def _loss_forward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same, or None
    target_ptr,                 # [N] int64: label, SKIP or OUT_OF_RANGE
    logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr,  # [N] fp32 statistics, None if absent
    forward_kl_ptr, is_top1_ptr, sum_logits_ptr, log_sum_sq_probs_ptr, max_logit_ptr,  # None: never asked for
    grad_ptr,                   # [N, V] contiguous output, logits dtype
    old_logp_ptr,               # [N] fp32, or None: on-policy
    adv_ptr, w_pg_ptr, w_kl_ptr, w_ent_ptr,  # [N] fp32 per-row inputs (kltriton.kernels.loss.LossInputs)
    given_ref_logp_ptr,         # [N] fp32 reference log-probs, or None (reference logits, or no KL)
    hp_ptr,                     # float64 hyperparameters (slots of constants.HYPERPARAMETERS)
    vocab,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1): data, no recompile
    WANT: tl.constexpr, LOSS_TYPE: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr, SUBTILES: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Grid ``(N,)``: the statistics, the loss coefficients and the gradient of one row."""
    WITH_FULL_KL: tl.constexpr = ESTIMATOR == "full"
    TERMS: tl.constexpr = (rows.BASIS_P_LOGP if ENTROPY_GRAD or WITH_FULL_KL else 0) | (rows.BASIS_P_LOGQ if WITH_FULL_KL
                                                                                       else 0)
    row, target, inv_temperature, log2e_over_t, x_row, y_row = rows.program_row(
        target_ptr, temperature_ptr, temperature_stride, logits_ptr, logits_rows_per_outer, logits_outer_stride,
        logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
    if target >= 0:  # a skipped row is never read
        state = rows.stream_chunk(x_row, y_row, 0, vocab, log2e_over_t, WANT, SUBTILES, LANES, VEC)
        # Loaded after the loop (once per row): Triton 3.6 keeps them across it on the stack otherwise.
        x_label, y_label = rows.label_logits(x_row, y_row, target, ref_ptr is not None)
        values = rows.finalize(state, x_label, y_label, inv_temperature, WANT)
        rows.store_stats(row, values, logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr)
        logp, lse, entropy = values[rows.STAT_LOGP], values[rows.STAT_LSE], values[rows.STAT_ENTROPY]
        ref_logp, ref_lse, full_kl = values[rows.STAT_REF_LOGP], values[rows.STAT_REF_LSE], values[rows.STAT_FULL_KL]
        # A row without a finite lse (all -inf logits; a NaN or +inf logit) gets a zero gradient.
        if (lse > rows.NEG_INF) & (lse < float("inf")):
            rlp = ref_logp
            if given_ref_logp_ptr is not None:
                rlp = tl.load(given_ref_logp_ptr + row)
            g_logp, g_full_kl = _row_g_logp(row, logp, rlp, full_kl, old_logp_ptr, adv_ptr, w_pg_ptr, w_kl_ptr, hp_ptr,
                                            LOSS_TYPE, ESTIMATOR, STRAIGHT)
            basis = rows.loss_basis(g_logp.to(tl.float32), tl.load(w_ent_ptr + row), entropy,
                                  g_full_kl.to(tl.float32), full_kl, inv_temperature, ENTROPY_GRAD, WITH_FULL_KL)
            grad_row = grad_ptr + row.to(tl.int64) * vocab
            last = (vocab - 1) // BLOCK_V * BLOCK_V
            # The row again, last block first: the most recently read bytes are the likeliest still in L2.
            for back in range(0, vocab, BLOCK_V):
                offs = (last - back) + tl.arange(0, BLOCK_V)
                in_vocab = offs < vocab
                x = tl.load(x_row + offs, mask=in_vocab, other=rows.NEG_INF).to(tl.float32)
                y = x
                if WITH_FULL_KL:
                    y = tl.load(y_row + offs, mask=in_vocab, other=rows.NEG_INF).to(tl.float32)
                grad = rows.grad_block(x, y, offs, target, lse, ref_lse, basis, inv_temperature, TERMS)
                tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)
        else:
            _zero_row(grad_ptr, row, vocab, BLOCK_V)
    else:
        rows.store_stats(row, rows.skipped_stats(target), logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr,
                       full_kl_ptr)
        _zero_row(grad_ptr, row, vocab, BLOCK_V)


@triton.jit
def _terms_kernel(
    logp_ptr, ref_logp_ptr, full_kl_ptr, entropy_ptr,  # [N] statistics (ref / full KL / entropy: None when absent)
    target_ptr, old_logp_ptr, adv_ptr, w_pg_ptr, w_kl_ptr, w_ent_ptr, w_agg_ptr,  # [N] (old: None on-policy)
    hp_ptr,                     # float64 hyperparameters
    loss_ptr, kl_ptr, ratio_ptr, metrics_ptr,  # outputs: [] the loss, [N], [N], [len(LOSS_METRICS)] fp32
    n,
    REF_GIVEN: tl.constexpr, LOSS_TYPE: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid ``(1,)``: the per-token terms of every row in row order (blocks of ``BLOCK``), their sums in float64 (the
    same order every call: deterministic), the loss and the metrics (``constants.LOSS_METRICS``)."""
    zero = tl.zeros((), tl.float64)
    loss, pg_loss, kl_loss, entropy_loss, count, clipped, lower = zero, zero, zero, zero, zero, zero, zero
    ppo_kl, kl_sum, entropy_sum = zero, zero, zero
    high = zero - float("inf")
    low = zero + float("inf")
    nan_ratio = zero
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        scored = inside & (tl.load(target_ptr + offs, mask=inside, other=SKIP) != SKIP)
        lp = tl.load(logp_ptr + offs, mask=scored, other=0.0).to(tl.float64)
        old = lp
        if old_logp_ptr is not None:
            old = tl.load(old_logp_ptr + offs, mask=scored, other=0.0).to(tl.float64)
        adv = tl.load(adv_ptr + offs, mask=scored, other=0.0).to(tl.float64)
        d = (lp - old).to(tl.float32).to(tl.float64)  # the fp32 difference, as the other backends
        pg, ratio, is_clipped, is_lower, log_ratio = _pg_terms(lp, old, d, adv, hp_ptr, LOSS_TYPE)
        kl = tl.zeros((BLOCK,), tl.float64)
        if ESTIMATOR == "full":
            clamp = tl.load(hp_ptr + HP_KL_CLAMP)
            kl = rows.clamp(tl.load(full_kl_ptr + offs, mask=scored, other=0.0).to(tl.float64), -clamp, clamp)
        elif ESTIMATOR != "":
            ref = tl.load(ref_logp_ptr + offs, mask=scored, other=0.0).to(tl.float64)
            kl, _ = rows.kl_estimate(lp - ref, tl.load(hp_ptr + HP_KL_CLAMP), ESTIMATOR, STRAIGHT)
        kl = tl.where(tl.load(hp_ptr + HP_KL_RATIO) != 0.0, kl * ratio, kl)  # TRL's bias-corrected KL
        entropy = tl.zeros((BLOCK,), tl.float64)
        if entropy_ptr is not None:
            entropy = tl.load(entropy_ptr + offs, mask=scored, other=0.0).to(tl.float64)
        w_pg = tl.load(w_pg_ptr + offs, mask=scored, other=0.0).to(tl.float64)
        w_agg = tl.load(w_agg_ptr + offs, mask=scored, other=0.0).to(tl.float64)
        pg_part = tl.where(scored, w_pg * pg, 0.0)
        kl = tl.where(scored, kl, 0.0)
        entropy = tl.where(scored, entropy, 0.0)
        ratio = tl.where(scored, ratio, 0.0)
        loss += tl.sum(pg_part + tl.load(w_kl_ptr + offs, mask=scored, other=0.0).to(tl.float64) * kl
                       + tl.load(w_ent_ptr + offs, mask=scored, other=0.0).to(tl.float64) * entropy, axis=0)
        pg_loss += tl.sum(pg_part, axis=0)
        kl_loss += tl.sum(w_agg * kl, axis=0)
        entropy_loss += tl.sum(w_agg * entropy, axis=0)
        count += tl.sum(scored.to(tl.float64), axis=0)
        clipped += tl.sum((scored & is_clipped).to(tl.float64), axis=0)
        lower += tl.sum((scored & is_lower).to(tl.float64), axis=0)
        ppo_kl -= tl.sum(tl.where(scored, log_ratio, 0.0), axis=0)
        kl_sum += tl.sum(kl, axis=0)
        entropy_sum += tl.sum(entropy, axis=0)
        nan_ratio += tl.sum((scored & (ratio != ratio)).to(tl.float64), axis=0)
        high = tl.maximum(high, tl.max(tl.where(scored, ratio, -float("inf")), axis=0))
        low = tl.minimum(low, tl.min(tl.where(scored, ratio, float("inf")), axis=0))
        tl.store(kl_ptr + offs, kl.to(tl.float32), mask=inside)
        tl.store(ratio_ptr + offs, ratio.to(tl.float32), mask=inside)
    denominator = tl.maximum(count, 1.0)
    high = tl.where(count == 0, 0.0, tl.where(nan_ratio > 0, float("nan"), high))
    low = tl.where(count == 0, 0.0, tl.where(nan_ratio > 0, float("nan"), low))
    tl.store(loss_ptr, loss.to(tl.float32))
    tl.store(metrics_ptr + METRIC_PG_LOSS, pg_loss.to(tl.float32))
    tl.store(metrics_ptr + METRIC_KL_LOSS, kl_loss.to(tl.float32))
    tl.store(metrics_ptr + METRIC_ENTROPY_LOSS, entropy_loss.to(tl.float32))
    tl.store(metrics_ptr + METRIC_CLIPFRAC, (clipped / denominator).to(tl.float32))
    tl.store(metrics_ptr + METRIC_CLIPFRAC_LOWER, (lower / denominator).to(tl.float32))
    tl.store(metrics_ptr + METRIC_PPO_KL, (ppo_kl / denominator).to(tl.float32))
    tl.store(metrics_ptr + METRIC_KL_MEAN, (kl_sum / denominator).to(tl.float32))
    tl.store(metrics_ptr + METRIC_ENTROPY_MEAN, (entropy_sum / denominator).to(tl.float32))
    tl.store(metrics_ptr + METRIC_RATIO_MAX, high.to(tl.float32))
    tl.store(metrics_ptr + METRIC_RATIO_MIN, low.to(tl.float32))


def _launch(vocab: int, elem_bytes: int, has_ref: bool, loss_type: str, estimator: str, entropy_grad: bool,
            with_entropy: bool = True):
    """The fused kernel's Launch: the stream forward's tile (never split: one program per row) and the
    stream backward's block, both from ``V`` and the dtype only; the loss type and estimator."""
    est = estimators.parse(estimator) if estimator else None
    tile = rows.forward_tile(vocab, elem_bytes, has_ref)
    constexprs = dict(WANT=statistics_request(has_ref, estimator, with_entropy), LOSS_TYPE=loss_type, ESTIMATOR=est.base if est else "",
                      STRAIGHT=bool(est and est.straight_through), ENTROPY_GRAD=bool(entropy_grad),
                      SUBTILES=tile.constexprs["SUBTILES"], LANES=tile.constexprs["LANES"],
                      VEC=tile.constexprs["VEC"], BLOCK_V=rows.backward_block(vocab))
    return rows.Launch(constexprs, rows.options(), tile.elements_per_iteration)


def launches(vocab: int, elem_bytes: int, variants=STATIC_VARIANTS):
    """(kernel name, Launch, variant, absent arguments) of ``variants`` and of the entropy mask's
    ``_accumulate_kernel`` (for ``benchmarks/static.py``)."""
    block = rows.backward_block(vocab)
    out = [("_accumulate_kernel", rows.Launch(dict(TERMS=terms_, BLOCK_V=block), rows.options(), block), name,
            [] if terms_ else ["c_p_logp_ptr"])
           for name, terms_ in (("accumulate", 0), ("accumulate+plogp", constants.P_LOGP))]
    for variant, has_ref, loss_type, estimator, entropy_grad in variants:
        launch = _launch(vocab, elem_bytes, has_ref, loss_type, estimator, entropy_grad)
        needs_grad = launch.constexprs["WANT"]
        absent = [f"{s}_ptr" for s in statistics.NAMES if not statistics.present(needs_grad, s)]
        absent += [] if has_ref else ["ref_ptr"]
        absent += [] if estimator not in ("", "full") and not has_ref else ["given_ref_logp_ptr"]
        out.append(("_loss_forward_kernel", launch, variant, absent))
    return out


def forward(logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator, entropy_grad, with_grad,
            with_entropy=True):
    _check_fused(loss_type)
    if not with_grad:
        return composed.forward(stream, logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator,
                                entropy_grad, with_grad, with_entropy)
    n, vocab = num_rows(logits), logits.shape[-1]
    has_ref = ref_logits is not None
    stats = statistics.empty_stats(n, statistics_request(has_ref, estimator, with_entropy),
                                   lambda size: torch.empty(size, dtype=torch.float32, device=logits.device))
    grad = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    if n == 0:
        return stats, grad
    f32 = lambda t: None if t is None else t.detach().to(torch.float32).contiguous()  # noqa: E731
    given_ref = inputs.ref_logp if estimator not in ("", "full") and not has_ref else None
    launch = _launch(vocab, logits.element_size(), has_ref, loss_type, estimator, entropy_grad, with_entropy)
    _loss_forward_kernel[(n,)](
        *rows.view_args(logits.detach()), *rows.view_args(None if ref_logits is None else ref_logits.detach()),
        target, *(value if value.numel() else None for value in stats), grad, f32(inputs.old_logp),
        f32(inputs.advantages), f32(inputs.w_pg), f32(inputs.w_kl), f32(inputs.w_ent), f32(given_ref),
        hyperparameters.to(torch.float64).contiguous(), vocab, temperature, 1 if temperature.dim() else 0,
        **launch.constexprs, **launch.options)
    return stats, grad


def forward_labels(logits, ref_logits, *args):
    return composed.forward_labels(layout.target_weights, forward, terms, logits, ref_logits, *args)


def terms(stats, target, inputs, hyperparameters, loss_type, estimator) -> LossTerms:
    _check_fused(loss_type)
    n, device = target.numel(), target.device
    est = estimators.parse(estimator) if estimator else None
    loss = torch.empty((), dtype=torch.float32, device=device)
    kl, ratio = torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device)
    metrics = torch.empty(len(constants.LOSS_METRICS), dtype=torch.float32, device=device)
    present = lambda t: t if t.numel() == n and n else None  # noqa: E731
    _terms_kernel[(1,)](
        stats.logp, reference_logp(stats, inputs), present(stats.full_kl), present(stats.entropy), target,
        inputs.old_logp, inputs.advantages, inputs.w_pg, inputs.w_kl, inputs.w_ent,
        inputs.w_pg if inputs.w_agg is None else inputs.w_agg, hyperparameters.to(torch.float64).contiguous(), loss,
        kl, ratio, metrics, n, REF_GIVEN=stats.ref_logp.shape != stats.logp.shape, LOSS_TYPE=loss_type,
        ESTIMATOR=est.base if est else "", STRAIGHT=bool(est and est.straight_through), BLOCK=TERMS_BLOCK)
    return LossTerms(loss, kl, ratio, metrics)


def _check_fused(loss_type):
    if loss_type not in formulas.FUSED:
        raise ValueError(f"no fused Triton kernel for loss_type {loss_type!r} (fused: {formulas.FUSED})")


def coefficients(logp, ref_logp, inputs, hyperparameters, loss_type, estimator, full_kl=None):
    """``d loss / d logp`` per row from ``_row_g_logp`` (for the parity test of the three implementations)."""
    _check_fused(loss_type)
    est = estimators.parse(estimator) if estimator else None
    f32 = lambda t: None if t is None else t.detach().to(torch.float32).contiguous()  # noqa: E731
    out = torch.empty_like(f32(logp))
    if out.numel():
        block = 256
        _coefficients_kernel[(triton.cdiv(out.numel(), block),)](
            f32(logp), f32(ref_logp), f32(full_kl), f32(inputs.old_logp), f32(inputs.advantages), f32(inputs.w_pg),
            f32(inputs.w_kl), hyperparameters.to(torch.float64).contiguous(), out, out.numel(), LOSS_TYPE=loss_type,
            ESTIMATOR=est.base if est else "", STRAIGHT=bool(est and est.straight_through), BLOCK=block)
    return out


def accumulate_(grad, logits, target, temperature, lse, basis):
    n, vocab = target.numel(), logits.shape[-1]
    if n == 0:
        return
    f32 = lambda t: None if t is None else t.detach().to(torch.float32).contiguous()  # noqa: E731
    _accumulate_kernel[(n,)](
        *rows.view_args(logits.detach()), target, f32(lse), f32(basis.label), f32(basis.p), f32(basis.p_logp), grad,
        vocab, temperature, 1 if temperature.dim() else 0, TERMS=constants.P_LOGP if basis.p_logp is not None else 0,
        BLOCK_V=rows.backward_block(vocab), **rows.options())


def scale_(grad, upstream):
    numel = grad.numel()
    if numel:
        _scale_kernel[(triton.cdiv(numel, SCALE_BLOCK),)](grad, upstream.float(), numel, BLOCK=SCALE_BLOCK)
