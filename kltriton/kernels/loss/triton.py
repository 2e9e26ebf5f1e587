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

Calls with no gradient wanted run ``composed.forward`` on the Triton stream kernels (the stream forward
alone, which splits long rows across programs and keeps a small batch busy; its statistics agree with the
fused kernel's to fp32 rounding).
"""
import torch
import triton
import triton.language as tl

from kltriton import estimators
from kltriton.kernels import constants, statistics
from kltriton.kernels import triton_rows as tr
from kltriton.kernels.loss import composed, terms, wanted
from kltriton.kernels.rows import num_rows
from kltriton.kernels.stream import triton as stream

SCALE_BLOCK = 4096
LOG_RATIO_CLAMP = tl.constexpr(constants.LOG_RATIO_CLAMP)
HP_RATIO_LOW = tl.constexpr(terms.SLOT["ratio_low"])
HP_RATIO_HIGH = tl.constexpr(terms.SLOT["ratio_high"])
HP_DUAL_CLIP = tl.constexpr(terms.SLOT["dual_clip"])
HP_KL_CLAMP = tl.constexpr(terms.SLOT["kl_clamp"])

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
def _row_g_logp(row, logp, ref_logp, old_logp_ptr, adv_ptr, w_pg_ptr, w_kl_ptr, hp_ptr, LOSS_TYPE: tl.constexpr,
                ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr):
    """``d loss / d logp`` (float64) of one row: the derivative of ``w_pg * pg + w_kl * kl`` (``terms.py``;
    C++ ``row_g_logp``). ``old_logp_ptr`` None: on-policy (old = logp)."""
    lp = logp.to(tl.float64)
    old = lp
    if old_logp_ptr is not None:
        old = tl.load(old_logp_ptr + row).to(tl.float64)
    adv = tl.load(adv_ptr + row).to(tl.float64)
    w_pg = tl.load(w_pg_ptr + row).to(tl.float64)
    d = (lp - old).to(tl.float32).to(tl.float64)  # the fp32 difference, as the other backends
    ratio = tl.exp(tr.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = tr.clamp(ratio, tl.load(hp_ptr + HP_RATIO_LOW), tl.load(hp_ptr + HP_RATIO_HIGH))
    if LOSS_TYPE == "ppo":
        pg1 = -adv * ratio
        pg2 = -adv * clipped
        g_ratio = tl.where(pg1 >= pg2, -adv, 0.0)
        # The dual clip holds the loss constant for a negative advantage.
        held = (adv < 0) & (tl.maximum(pg1, pg2) > -adv * tl.load(hp_ptr + HP_DUAL_CLIP))
        g_ratio = tl.where(held, 0.0, g_ratio)
        g_logp = w_pg * g_ratio * tl.where(tl.abs(d) <= LOG_RATIO_CLAMP, ratio, 0.0)
    else:  # cispo: -sg(clip(ratio)) * A * logp
        g_logp = -w_pg * clipped * adv
    if ESTIMATOR != "" and ESTIMATOR != "full":
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
        slope = tl.where(tl.abs(value) > tl.load(hp_ptr + HP_KL_CLAMP), 0.0, slope)
        if STRAIGHT:  # "k3+": the value of the estimator, the gradient of k2
            slope = dk
        g_logp += tl.load(w_kl_ptr + row).to(tl.float64) * slope
    return g_logp


@triton.jit
def _coefficients_kernel(logp_ptr, ref_logp_ptr, old_logp_ptr, adv_ptr, w_pg_ptr, w_kl_ptr, hp_ptr, out_ptr,
                         LOSS_TYPE: tl.constexpr, ESTIMATOR: tl.constexpr, STRAIGHT: tl.constexpr):
    """Grid ``(N,)``: ``_row_g_logp`` of each row (for the parity test of the three implementations)."""
    row = tl.program_id(0)
    g = _row_g_logp(row, tl.load(logp_ptr + row), tl.load(ref_logp_ptr + row), old_logp_ptr, adv_ptr, w_pg_ptr,
                    w_kl_ptr, hp_ptr, LOSS_TYPE, ESTIMATOR, STRAIGHT)
    tl.store(out_ptr + row, g.to(tl.float32))


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
    logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr,  # [N] fp32 statistics, None if absent
    forward_kl_ptr,             # None: the loss never asks for it
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
    TERMS: tl.constexpr = (tr.BASIS_P_LOGP if ENTROPY_GRAD or WITH_FULL_KL else 0) | (tr.BASIS_P_LOGQ if WITH_FULL_KL
                                                                                       else 0)
    row = tl.program_id(0)
    target = tl.load(target_ptr + row)
    if target >= 0:  # a skipped row is never read
        inv_temperature, c2 = tr.temperature_of(temperature_ptr, temperature_stride, row)
        x_row, y_row = tr.row_pointers(row, logits_ptr, logits_rows_per_outer, logits_outer_stride,
                                       logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride,
                                       ref_inner_stride)
        state = tr.stream_chunk(x_row, y_row, 0, vocab, c2, WANT, SUBTILES, LANES, VEC)
        # Loaded after the loop (once per row): Triton 3.6 keeps them across it on the stack otherwise.
        x_label, y_label = tr.label_logits(x_row, y_row, target, ref_ptr is not None)
        values = tr.finalize(state, x_label, y_label, inv_temperature, WANT)
        tr.store_stats(row, values, logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr)
        logp, lse, entropy, ref_logp, ref_lse, full_kl, _ = values
        # A row without a finite lse (all -inf logits; a NaN or +inf logit) gets a zero gradient.
        if (lse > tr.NEG_INF) & (lse < float("inf")):
            rlp = ref_logp
            if given_ref_logp_ptr is not None:
                rlp = tl.load(given_ref_logp_ptr + row)
            g_logp = _row_g_logp(row, logp, rlp, old_logp_ptr, adv_ptr, w_pg_ptr, w_kl_ptr, hp_ptr, LOSS_TYPE,
                                 ESTIMATOR, STRAIGHT).to(tl.float32)
            g_full_kl = 0.0
            if WITH_FULL_KL:
                g_full_kl = tl.load(w_kl_ptr + row)
            basis = tr.loss_basis(g_logp, tl.load(w_ent_ptr + row), entropy, g_full_kl, full_kl, inv_temperature,
                                  ENTROPY_GRAD, WITH_FULL_KL)
            grad_row = grad_ptr + row.to(tl.int64) * vocab
            last = (vocab - 1) // BLOCK_V * BLOCK_V
            # The row again, last block first: the most recently read bytes are the likeliest still in L2.
            for back in range(0, vocab, BLOCK_V):
                offs = (last - back) + tl.arange(0, BLOCK_V)
                in_vocab = offs < vocab
                x = tl.load(x_row + offs, mask=in_vocab, other=tr.NEG_INF).to(tl.float32)
                y = x
                if WITH_FULL_KL:
                    y = tl.load(y_row + offs, mask=in_vocab, other=tr.NEG_INF).to(tl.float32)
                grad = tr.grad_block(x, y, offs, target, lse, ref_lse, basis, inv_temperature, TERMS)
                tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)
        else:
            _zero_row(grad_ptr, row, vocab, BLOCK_V)
    else:
        tr.store_stats(row, tr.skipped_stats(target), logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr,
                       full_kl_ptr)
        _zero_row(grad_ptr, row, vocab, BLOCK_V)


def _launch(vocab: int, elem_bytes: int, has_ref: bool, loss_type: str, estimator: str, entropy_grad: bool):
    """The fused kernel's Launch: the stream forward's tile (never split: one program per row) and the
    stream backward's block, both from ``V`` and the dtype only; the loss type and estimator."""
    est = estimators.parse(estimator) if estimator else None
    tile = tr.forward_tile(vocab, elem_bytes, has_ref)
    constexprs = dict(WANT=wanted(has_ref, estimator), LOSS_TYPE=loss_type, ESTIMATOR=est.base if est else "",
                      STRAIGHT=bool(est and est.straight_through), ENTROPY_GRAD=bool(entropy_grad),
                      SUBTILES=tile.constexprs["SUBTILES"], LANES=tile.constexprs["LANES"],
                      VEC=tile.constexprs["VEC"], BLOCK_V=tr.backward_block(vocab))
    return tr.Launch(constexprs, tr.options(), tile.elements_per_iteration)


def launches(vocab: int, elem_bytes: int):
    """(kernel name, Launch, variant, absent arguments) of ``STATIC_VARIANTS`` (for ``benchmarks/static.py``)."""
    out = []
    for variant, has_ref, loss_type, estimator, entropy_grad in STATIC_VARIANTS:
        launch = _launch(vocab, elem_bytes, has_ref, loss_type, estimator, entropy_grad)
        want = launch.constexprs["WANT"]
        absent = [f"{s}_ptr" for s in statistics.NAMES if not statistics.present(want, s)]
        absent += [] if has_ref else ["ref_ptr"]
        absent += [] if estimator not in ("", "full") and not has_ref else ["given_ref_logp_ptr"]
        out.append(("_loss_forward_kernel", launch, variant, absent))
    return out


def forward(logits, ref_logits, target, temperature, inputs, hp, loss_type, estimator, entropy_grad, with_grad):
    _check_fused(loss_type)
    if not with_grad:
        return composed.forward(stream, logits, ref_logits, target, temperature, inputs, hp, loss_type, estimator,
                                entropy_grad, with_grad)
    n, vocab = num_rows(logits), logits.shape[-1]
    has_ref = ref_logits is not None
    stats = statistics.empty_stats(n, wanted(has_ref, estimator),
                                   lambda size: torch.empty(size, dtype=torch.float32, device=logits.device))
    grad = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    if n == 0:
        return stats, grad
    f32 = lambda t: None if t is None else t.detach().to(torch.float32).contiguous()  # noqa: E731
    given_ref = inputs.ref_logp if estimator not in ("", "full") and not has_ref else None
    launch = _launch(vocab, logits.element_size(), has_ref, loss_type, estimator, entropy_grad)
    _loss_forward_kernel[(n,)](
        *tr.view_args(logits.detach()), *tr.view_args(None if ref_logits is None else ref_logits.detach()),
        target, *(value if value.numel() else None for value in stats), grad, f32(inputs.old_logp),
        f32(inputs.advantages), f32(inputs.w_pg), f32(inputs.w_kl), f32(inputs.w_ent), f32(given_ref),
        hp.to(torch.float64).contiguous(), vocab, temperature, 1 if temperature.dim() else 0,
        **launch.constexprs, **launch.options)
    return stats, grad


def _check_fused(loss_type):
    if loss_type not in terms.FUSED:
        raise ValueError(f"no fused Triton kernel for loss_type {loss_type!r} (fused: {terms.FUSED})")


def coefficients(logp, ref_logp, inputs, hp, loss_type, estimator):
    """``d loss / d logp`` per row from ``_row_g_logp`` (for the parity test of the three implementations)."""
    _check_fused(loss_type)
    est = estimators.parse(estimator) if estimator else None
    f32 = lambda t: None if t is None else t.detach().to(torch.float32).contiguous()  # noqa: E731
    out = torch.empty_like(f32(logp))
    if out.numel():
        _coefficients_kernel[(out.numel(),)](
            f32(logp), f32(ref_logp), f32(inputs.old_logp), f32(inputs.advantages), f32(inputs.w_pg),
            f32(inputs.w_kl), hp.to(torch.float64).contiguous(), out, LOSS_TYPE=loss_type,
            ESTIMATOR=est.base if est else "", STRAIGHT=bool(est and est.straight_through))
    return out


def scale_(grad, upstream):
    numel = grad.numel()
    if numel:
        _scale_kernel[(triton.cdiv(numel, SCALE_BLOCK),)](grad, upstream.float(), numel, BLOCK=SCALE_BLOCK)
