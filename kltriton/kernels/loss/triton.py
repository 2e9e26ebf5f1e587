"""Triton backend of the ``loss`` family: the fused single-pass kernel ``_loss_forward_kernel``, and an
in-place scaling kernel that returns at once on the device when the upstream gradient is 1.

``_loss_forward_kernel``: one program per row (grid ``(N,)``). It reduces the row's statistics with the
stream family's vocab loop (``_chunk``: policy and reference row in the same loop, entropy always,
full KL for the ``full`` estimator), stores them, computes the row's loss coefficients
(``_row_coefficients``: ``terms.coefficients`` / C++ ``row_coefficients`` per row, in float64 like the
C++ kernel), then writes the row's gradient in vocab blocks with the stream backward's element math
(``_grad_block``) while the row is still in L1/L2: the logits are read from memory once for the
forward and the backward together, and the gradient written once. Launch settings depend on ``V`` and
the dtype only (the stream forward's tile, the stream backward's block), never on ``N``: a row's
result is the same in every batch. Absent optional tensors are passed as ``None`` (Triton
specializes on them); the loss type and estimator are compile-time strings; ``bounds`` and the
per-row weights are data (a new clip value or coefficient never recompiles).

``with_grad=False`` runs ``composed.forward`` (the stream forward alone, with no gradient): there is
nothing to fuse, and the stream forward splits long rows across programs, which keeps a small batch
busy. The statistics agree with the fused kernel's to fp32 rounding (identical where the stream
forward does not split the row, ``V <= CHUNK_BLOCKS`` tiles).
"""
import torch
import triton
import triton.language as tl

from kltriton.kernels.loss import LossStats, composed, terms
from kltriton.kernels.rows import num_rows
from kltriton.kernels.stream import triton as ts
from kltriton.kernels.stream.triton import (NEG_INF, _chunk, _grad_block, _label_logits, _row_pointers,
                                            _store_skipped, _store_stats, _temperature)

SCALE_BLOCK = 4096
LOG_RATIO_CLAMP = tl.constexpr(terms.LOG_RATIO_CLAMP)

# (variant, reference logits, loss type, estimator, entropy gradient) compiled by benchmarks/static.py:
# the lightest kernel, the usual GRPO one, the heaviest (full KL: the reference read in both passes),
# and reference log-probs given per row with CISPO.
STATIC_VARIANTS = (("ppo", False, "ppo", "", False), ("ppo+ref+k3+ent", True, "ppo", "k3", True),
                   ("ppo+ref+full+ent", True, "ppo", "full", True), ("cispo+rlogp+k3+", False, "cispo", "k3+", False))


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
def _clamp(value, low, high):
    """``min(max(value, low), high)``, NaN kept (as ``torch.clamp``)."""
    return tl.minimum(tl.maximum(value, low, propagate_nan=tl.PropagateNan.ALL), high,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_coefficients(row, logp, ref_logp, old_logp_ptr, adv_ptr, w_pg_ptr, w_kl_ptr, w_ent_ptr, bounds_ptr,
                      LOSS_TYPE: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr):
    """``(d loss / d logp, d loss / d entropy, d loss / d full_kl)`` (fp32) of one row: the derivative of
    ``w_pg * pg + w_kl * kl + w_ent * entropy`` (``terms.coefficients``), in float64 as the C++ kernel's
    ``row_coefficients``. ``old_logp_ptr`` None: on-policy (old = logp)."""
    lp = logp.to(tl.float64)
    old = lp
    if old_logp_ptr is not None:
        old = tl.load(old_logp_ptr + row).to(tl.float64)
    adv = tl.load(adv_ptr + row).to(tl.float64)
    w_pg = tl.load(w_pg_ptr + row).to(tl.float64)
    d = (lp - old).to(tl.float32).to(tl.float64)  # the fp32 difference, as the other backends
    ratio = tl.exp(_clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = _clamp(ratio, tl.load(bounds_ptr), tl.load(bounds_ptr + 1))
    if LOSS_TYPE == "ppo":
        pg1 = -adv * ratio
        pg2 = -adv * clipped
        g_ratio = tl.where(pg1 >= pg2, -adv, 0.0)
        # The dual clip holds the loss constant for a negative advantage.
        held = (adv < 0) & (tl.maximum(pg1, pg2) > -adv * tl.load(bounds_ptr + 2))
        g_ratio = tl.where(held, 0.0, g_ratio)
        g_logp = w_pg * g_ratio * tl.where(tl.abs(d) <= LOG_RATIO_CLAMP, ratio, 0.0)
    else:  # cispo: -sg(clip(ratio)) * A * logp
        g_logp = -w_pg * clipped * adv
    w_kl = tl.load(w_kl_ptr + row)
    g_full_kl = 0.0
    if ESTIMATOR == "full":
        g_full_kl = w_kl
    elif ESTIMATOR != "":
        dk = lp - ref_logp.to(tl.float64)
        if ESTIMATOR == "k1":
            value = dk
            slope = 1.0
        elif ESTIMATOR == "abs":
            value = tl.abs(dk)
            slope = tl.where(dk > 0, 1.0, tl.where(dk < 0, -1.0, 0.0))
        elif ESTIMATOR == "k2":
            value = 0.5 * dk * dk
            slope = dk
        else:  # k3: exp(-dk) - 1 + dk (float64: exact enough for an fp32 result without expm1)
            slope = 1.0 - tl.exp(-dk)
            value = dk - slope
        slope = tl.where(tl.abs(value) > tl.load(bounds_ptr + 3), 0.0, slope)
        if STRAIGHT:  # "k3+": the value of the estimator, the gradient of k2
            slope = dk
        g_logp += w_kl.to(tl.float64) * slope
    return g_logp.to(tl.float32), tl.load(w_ent_ptr + row), g_full_kl


@triton.jit
def _zero_row(grad_ptr, row, vocab, BLOCK_V: tl.constexpr):
    """A zero gradient row (a skipped row, or one without a finite lse)."""
    grad_row = grad_ptr + row.to(tl.int64) * vocab
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        tl.store(grad_row + offs, tl.zeros((BLOCK_V,), grad_ptr.dtype.element_ty), mask=offs < vocab)


@triton.jit
def _loss_forward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same, or None
    target_ptr,                 # [N] int64: label, SKIP or OUT_OF_RANGE
    logp_ptr, entropy_ptr,      # [N] fp32 outputs
    ref_logp_ptr,               # [N] fp32 output, or None (with ref_ptr)
    full_kl_ptr,                # [N] fp32 output, or None (estimator "full")
    grad_ptr,                   # [N, V] contiguous output, logits dtype
    old_logp_ptr,               # [N] fp32, or None: on-policy
    adv_ptr, w_pg_ptr, w_kl_ptr, w_ent_ptr,  # [N] fp32 per-row weights (kltriton.kernels.loss.LossRows)
    given_ref_logp_ptr,         # [N] fp32 reference log-probs, or None (reference logits, or no KL)
    bounds_ptr,                 # float64 [4]: ratio low, ratio high, dual clip, KL clamp
    vocab,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1): data, no recompile
    LOSS_TYPE: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
    ROWS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Grid ``(N,)``: the statistics, the loss coefficients and the gradient of one row."""
    HAS_REF: tl.constexpr = ref_ptr is not None
    WITH_FULL_KL: tl.constexpr = full_kl_ptr is not None
    row = tl.program_id(0)
    target = tl.load(target_ptr + row)
    if target >= 0:  # a skipped row is never read
        inv_temperature, c2 = _temperature(temperature_ptr, temperature_stride, row)
        x_row, y_row = _row_pointers(row, logits_ptr, logits_rows_per_outer, logits_outer_stride,
                                     logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride,
                                     ref_inner_stride)
        x_label, y_label = _label_logits(x_row, y_row, target, HAS_REF)  # issued before the loop
        m, s, t, my, sy, u = _chunk(x_row, y_row, 0, vocab, c2, True, HAS_REF, WITH_FULL_KL, ROWS, LANES, VEC)
        logp, lse, entropy, ref_logp, ref_lse, full_kl = _store_stats(
            row, x_label, y_label, m, s, t, my, sy, u, inv_temperature, logp_ptr, None, entropy_ptr, ref_logp_ptr,
            None, full_kl_ptr)
        # A row without a finite lse (all -inf logits; a NaN or +inf logit) gets a zero gradient.
        if (lse > NEG_INF) & (lse < float("inf")):
            rlp = ref_logp
            if given_ref_logp_ptr is not None:
                rlp = tl.load(given_ref_logp_ptr + row)
            g_logp, g_entropy, g_full_kl = _row_coefficients(row, logp, rlp, old_logp_ptr, adv_ptr, w_pg_ptr,
                                                             w_kl_ptr, w_ent_ptr, bounds_ptr, LOSS_TYPE, ESTIMATOR,
                                                             STRAIGHT)
            grad_row = grad_ptr + row.to(tl.int64) * vocab
            last = (vocab - 1) // BLOCK_V * BLOCK_V
            # The row again, last block first: the most recently read bytes are the likeliest still in L2.
            for back in range(0, vocab, BLOCK_V):
                offs = (last - back) + tl.arange(0, BLOCK_V)
                in_vocab = offs < vocab
                x = tl.load(x_row + offs, mask=in_vocab, other=NEG_INF).to(tl.float32)
                y = x
                if WITH_FULL_KL:
                    y = tl.load(y_row + offs, mask=in_vocab, other=NEG_INF).to(tl.float32)
                grad = _grad_block(x, y, offs, target, lse, g_logp, entropy, g_entropy, ref_lse, full_kl, g_full_kl,
                                   inv_temperature, ENTROPY_GRAD, WITH_FULL_KL)
                tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)
        else:
            _zero_row(grad_ptr, row, vocab, BLOCK_V)
    else:
        _store_skipped(row, target, logp_ptr, None, entropy_ptr, ref_logp_ptr, None, full_kl_ptr)
        _zero_row(grad_ptr, row, vocab, BLOCK_V)


def _launch(vocab: int, elem_bytes: int, has_ref: bool, loss_type: str, estimator: str, entropy_grad: bool):
    """The fused kernel's Launch: the stream forward's tile (never split: one program per row) and the
    stream backward's block, both from ``V`` and the dtype only; the loss type and estimator."""
    base, straight = terms.split_estimator(estimator)
    tile = ts._forward_launch(vocab, elem_bytes, has_ref)
    constexprs = dict(LOSS_TYPE=loss_type, ESTIMATOR=base, STRAIGHT=straight, ENTROPY_GRAD=bool(entropy_grad),
                      ROWS=tile.constexprs["ROWS"], LANES=tile.constexprs["LANES"], VEC=tile.constexprs["VEC"],
                      BLOCK_V=ts._backward_launch(vocab).constexprs["BLOCK_V"])
    return ts.Launch(constexprs, ts._options(), tile.elements_per_iteration)


def launches(vocab: int, elem_bytes: int):
    """(kernel name, Launch, variant, absent arguments) of ``STATIC_VARIANTS`` (for ``benchmarks/static.py``)."""
    out = []
    for variant, has_ref, loss_type, estimator, entropy_grad in STATIC_VARIANTS:
        base = terms.split_estimator(estimator)[0]
        absent = ([] if has_ref else ["ref_ptr", "ref_logp_ptr"]) + ([] if base == "full" else ["full_kl_ptr"]) + \
                 ([] if base not in ("", "full") and not has_ref else ["given_ref_logp_ptr"])
        out.append(("_loss_forward_kernel", _launch(vocab, elem_bytes, has_ref, loss_type, estimator, entropy_grad),
                    variant, absent))
    return out


def forward(logits, ref_logits, target, temperature, rows, bounds, loss_type, estimator, entropy_grad, with_grad):
    if not with_grad:
        return composed.forward("triton", logits, ref_logits, target, temperature, rows, bounds, loss_type,
                                estimator, entropy_grad, with_grad)
    n, vocab = num_rows(logits), logits.shape[-1]
    base = terms.split_estimator(estimator)[0]
    has_ref, full = ref_logits is not None, base == "full"
    new = lambda wanted: torch.empty(n if wanted else 0, dtype=torch.float32, device=logits.device)  # noqa: E731
    stats = LossStats(new(True), new(True), new(has_ref), new(full))
    grad = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    if n == 0:
        return stats, grad
    f32 = lambda t: None if t is None else t.detach().to(torch.float32).contiguous()  # noqa: E731
    given_ref = rows.ref_logp if base not in ("", "full") and not has_ref else None
    launch = _launch(vocab, logits.element_size(), has_ref, loss_type, estimator, entropy_grad)
    _loss_forward_kernel[(n,)](
        *ts._view_args(logits.detach()), *ts._view_args(None if ref_logits is None else ref_logits.detach()),
        target, stats.logp, stats.entropy, stats.ref_logp if has_ref else None, stats.full_kl if full else None,
        grad, f32(rows.old_logp), f32(rows.advantages), f32(rows.w_pg), f32(rows.w_kl), f32(rows.w_ent),
        f32(given_ref), bounds.to(torch.float64).contiguous(), vocab, temperature, 1 if temperature.dim() else 0,
        **launch.constexprs, **launch.options)
    return stats, grad


def scale_(grad, upstream):
    numel = grad.numel()
    if numel:
        _scale_kernel[(triton.cdiv(numel, SCALE_BLOCK),)](grad, upstream.float(), numel, BLOCK=SCALE_BLOCK)
