"""Triton backend of the ``divergence`` family (contract: ``kltriton.kernels.divergence``).

The JSD pass: one program per row sums the row's mixture terms in vocab blocks (a per-lane accumulator reduced
once at the end, so a row's order depends on ``V`` only) from the whole rows' log-sum-exps. The gradient: a
(row, vocab block) grid as the ``stream`` backward. Both read the student and the teacher row once.

Where the two sides agree (``log p == log q``) ``m`` equals them and both terms are exactly 0 (``_ratios``; not
``log p - log m``, which rounds), so identical distributions have a JSD of exactly 0 (as ``csrc/row_mixture.h``).
"""
import torch
import triton
import triton.language as tl

from kltriton.kernels import accumulation_dtype
from kltriton.kernels import triton_rows as rows
from kltriton.kernels.divergence import composed
from kltriton.kernels.row_views import num_rows
from kltriton.kernels.stream import triton as stream

FORWARD_BLOCK = 2048  # vocab entries per loop iteration of the JSD pass


def _forward_block(vocab: int) -> int:
    return min(FORWARD_BLOCK, triton.next_power_of_2(max(vocab, 16)))


def launches(vocab: int, elem_bytes: int):
    """(kernel name, Launch, variant name, absent arguments) of every kernel of this module (``benchmarks/static.py``)."""
    block = _forward_block(vocab)
    backward = rows.backward_block(vocab)
    return [("_jsd_forward_kernel", rows.Launch(dict(BLOCK_V=block), rows.options(), block), "jsd", []),
            ("_jsd_backward_kernel", rows.Launch(dict(BLOCK_V=backward), rows.options(), backward,
                                               triton.cdiv(vocab, backward)), "jsd_bwd", [])]


@triton.jit
def _log_probs(x_row, y_row, offs, in_vocab, lse, ref_lse, inv_temperature):
    """``(log p, p, log q, q)`` fp32 at ``offs`` (``-inf`` / 0 outside the vocabulary)."""
    x = tl.load(x_row + offs, mask=in_vocab, other=rows.NEG_INF).to(tl.float32)
    y = tl.load(y_row + offs, mask=in_vocab, other=rows.NEG_INF).to(tl.float32)
    log_p = x * inv_temperature - lse
    log_q = y * inv_temperature - ref_lse
    return log_p, tl.exp(log_p), log_q, tl.exp(log_q)


@triton.jit
def _ratios(log_p, p, log_q, q, beta, one_minus_beta):
    """``(log(p / m), log(q / m))``: exactly 0 and 0 where ``log p == log q``; ``-inf`` where both are 0 (no term)."""
    log_m = tl.log(beta * q + one_minus_beta * p)
    agree = log_p == log_q
    return tl.where(agree, 0.0, log_p - log_m), tl.where(agree, 0.0, log_q - log_m)


@triton.jit
def _row_params(row, target_ptr, lse_ptr, ref_lse_ptr):
    """``(target, lse, ref_lse, live)``: ``live`` when the row is scored and both log-sum-exps are finite."""
    target = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    ref_lse = tl.load(ref_lse_ptr + row)
    finite = (lse > rows.NEG_INF) & (lse < float("inf")) & (ref_lse > rows.NEG_INF) & (ref_lse < float("inf"))
    return target, lse, ref_lse, (target >= 0) & finite


@triton.jit
def _live_row(row, beta_ptr, temperature_ptr, temperature_stride, logits_ptr, logits_rows_per_outer,
              logits_outer_stride, logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride,
              ref_inner_stride):
    """What both kernels read of a live row: ``(1 / T, beta (float64), x_row, y_row)``, the pointers to the
    student's and the teacher's logits."""
    inv_temperature, _ = rows.temperature_of(temperature_ptr, temperature_stride, row)
    x_row, y_row = rows.row_pointers(row, logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,
                                     ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
    return inv_temperature, tl.load(beta_ptr), x_row, y_row


@triton.jit
def _jsd_forward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same
    target_ptr,                 # [N] int64
    lse_ptr, ref_lse_ptr,       # [N] fp32 whole rows' log-sum-exps of x / T and y / T
    beta_ptr,                   # float64 []: data, no recompile
    jsd_ptr, kl_student_ptr,    # [N] fp32 outputs
    vocab,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1)
    BLOCK_V: tl.constexpr,
):
    """Grid ``(N,)``: ``JSD = beta KL(q || m) + (1 - beta) KL(p || m)`` and ``KL(p || m)`` of one row."""
    row = tl.program_id(0)
    target, lse, ref_lse, live = _row_params(row, target_ptr, lse_ptr, ref_lse_ptr)
    if live:
        inv_temperature, beta64, x_row, y_row = _live_row(
            row, beta_ptr, temperature_ptr, temperature_stride, logits_ptr, logits_rows_per_outer, logits_outer_stride,
            logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
        beta = beta64.to(tl.float32)
        one_minus_beta = (1.0 - beta64).to(tl.float32)
        kl_p = tl.zeros((BLOCK_V,), tl.float32)
        kl_q = tl.zeros((BLOCK_V,), tl.float32)
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            log_p, p, log_q, q = _log_probs(x_row, y_row, offs, offs < vocab, lse, ref_lse, inv_temperature)
            p_over_m, q_over_m = _ratios(log_p, p, log_q, q, beta, one_minus_beta)
            kl_p += tl.where(p > 0, p * p_over_m, 0.0)
            kl_q += tl.where(q > 0, q * q_over_m, 0.0)
        kl_student = tl.sum(kl_p, axis=0)
        tl.store(jsd_ptr + row, rows.nonnegative(beta * tl.sum(kl_q, axis=0) + one_minus_beta * kl_student))
        tl.store(kl_student_ptr + row, kl_student)
    else:
        skipped = tl.where(target == rows.SKIP, 0.0, float("nan"))
        tl.store(jsd_ptr + row, skipped)
        tl.store(kl_student_ptr + row, skipped)


@triton.jit
def _jsd_backward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same
    grad_ptr,                   # [N, V] contiguous output, logits dtype
    target_ptr,                 # [N] int64
    lse_ptr, ref_lse_ptr,       # [N] fp32
    beta_ptr,                   # float64 []
    kl_student_ptr, coef_ptr,   # [N] fp32: KL(p || m) of the whole row, g (1 - beta) / T
    vocab,
    temperature_ptr, temperature_stride,
    BLOCK_V: tl.constexpr,
):
    """Grid ``(N, cdiv(V, BLOCK_V))``: ``coef * p * (log p - log m - KL(p || m))`` on one vocab block."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = offs < vocab
    grad_row = grad_ptr + row.to(tl.int64) * vocab
    target, lse, ref_lse, live = _row_params(row, target_ptr, lse_ptr, ref_lse_ptr)
    if live:
        inv_temperature, beta64, x_row, y_row = _live_row(
            row, beta_ptr, temperature_ptr, temperature_stride, logits_ptr, logits_rows_per_outer, logits_outer_stride,
            logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
        log_p, p, log_q, q = _log_probs(x_row, y_row, offs, in_vocab, lse, ref_lse, inv_temperature)
        p_over_m, _ = _ratios(log_p, p, log_q, q, beta64.to(tl.float32), (1.0 - beta64).to(tl.float32))
        centred = p_over_m - tl.load(kl_student_ptr + row)
        grad = tl.load(coef_ptr + row) * tl.where(p > 0, p * centred, 0.0)
        tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)
    else:
        tl.store(grad_row + offs, tl.zeros((BLOCK_V,), grad_ptr.dtype.element_ty), mask=in_vocab)


def forward(logits, ref_logits, target, temperature, lse, ref_lse, beta):
    n, vocab = num_rows(logits), logits.shape[-1]
    acc = accumulation_dtype(logits.dtype)
    jsd = torch.empty(n, dtype=acc, device=logits.device)
    kl_student = torch.empty(n, dtype=acc, device=logits.device)
    if n:
        _jsd_forward_kernel[(n,)](
            *rows.view_args(logits), *rows.view_args(ref_logits), target, lse.float().contiguous(),
            ref_lse.float().contiguous(), beta.to(torch.float64), jsd, kl_student, vocab, temperature,
            1 if temperature.dim() else 0, BLOCK_V=_forward_block(vocab), **rows.options())
    return jsd, kl_student


def backward(logits, ref_logits, target, temperature, lse, ref_lse, beta, kl_student, coef):
    n, vocab = num_rows(logits), logits.shape[-1]
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if n:
        block = rows.backward_block(vocab)
        _jsd_backward_kernel[(n, triton.cdiv(vocab, block))](
            *rows.view_args(logits), *rows.view_args(ref_logits), grad, target, lse.float().contiguous(),
            ref_lse.float().contiguous(), beta.to(torch.float64), kl_student.float().contiguous(),
            coef.float().contiguous(), vocab, temperature, 1 if temperature.dim() else 0, BLOCK_V=block,
            **rows.options())
    return grad


loss_forward = composed.bind(stream, forward, backward)
