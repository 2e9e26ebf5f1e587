"""Reference backend of the ``divergence`` family: the JSD pass and its gradient in chunked PyTorch (any float
dtype; float64 logits give the float64 oracle). See ``kltriton.kernels.divergence`` for the contract."""
import torch

from kltriton.kernels import OUT_OF_RANGE, accumulation_dtype
from kltriton.kernels.divergence import composed
from kltriton.kernels.row_views import as_rows3d, num_rows
from kltriton.kernels.stream import reference as stream

CHUNK_ELEMENTS = 1 << 19  # rows per chunk = CHUNK_ELEMENTS // V


def _rows(tensor, rows, dtype):
    """Rows ``rows`` (flat indices) of ``[..., V]`` as ``[len(rows), V]`` in ``dtype``."""
    rows3d = as_rows3d(tensor)
    return rows3d[rows // rows3d.shape[1], rows % rows3d.shape[1]].to(dtype)


def _log_probs(logits, ref_logits, rows, temperature, lse, ref_lse, dtype):
    """``(log p, log q)`` ``[R, V]`` of rows ``rows`` from the whole rows' log-sum-exps."""
    t = temperature.to(dtype)
    t = t.reshape(1, 1) if t.dim() == 0 else t[rows][:, None]
    log_p = _rows(logits, rows, dtype) / t - lse[rows].to(dtype)[:, None]
    log_q = _rows(ref_logits, rows, dtype) / t - ref_lse[rows].to(dtype)[:, None]
    return log_p, log_q


def ratios(log_p, log_q, beta):
    """``(log(p / m), log(q / m))`` elementwise, ``m = beta q + (1 - beta) p``, without ``log m``: from
    ``d = log q - log p`` the smaller side's ``log(m / side) = log1p(weight * expm1(-|d|))``, exactly 0 where the rows
    agree (the C++ and Triton kernels snap those entries to 0 instead); ``inf`` / NaN only on a side whose
    probability is 0."""
    d = log_q - log_p
    q_smaller = d <= 0
    weight = torch.where(q_smaller, beta, 1 - beta)
    smaller = torch.log1p(weight * torch.expm1(torch.where(q_smaller, d, -d)))
    return 0.0 - torch.where(q_smaller, smaller, smaller + d), 0.0 - torch.where(q_smaller, smaller - d, smaller)


def _times(prob, values):
    """``prob * values`` with ``0 * (-inf)`` read as 0 (no mass, no term)."""
    return torch.where(prob == 0, torch.zeros((), dtype=prob.dtype, device=prob.device), prob * values)


def _live_chunks(logits, ref_logits, target, temperature, lse, ref_lse, dtype):
    """``(rows, log p, log q)`` per chunk of the rows with a label and both distributions (finite log-sum-exps),
    ``CHUNK_ELEMENTS`` logits at a time."""
    n, vocab = num_rows(logits), logits.shape[-1]
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, n, step):
        stop = min(start + step, n)
        ok = (target[start:stop] >= 0) & torch.isfinite(lse[start:stop]) & torch.isfinite(ref_lse[start:stop])
        rows = start + torch.nonzero(ok).squeeze(1)
        if rows.numel():
            yield (rows, *_log_probs(logits, ref_logits, rows, temperature, lse, ref_lse, dtype))


def forward(logits, ref_logits, target, temperature, lse, ref_lse, beta):
    n = num_rows(logits)
    acc = accumulation_dtype(logits.dtype)
    bad = (target == OUT_OF_RANGE) | ((target >= 0) & ~(torch.isfinite(lse) & torch.isfinite(ref_lse)))
    jsd = torch.zeros(n, dtype=acc, device=logits.device).masked_fill_(bad, float("nan"))
    kl_student = jsd.clone()
    b = beta.to(acc)
    for rows, log_p, log_q in _live_chunks(logits, ref_logits, target, temperature, lse, ref_lse, acc):
        p_over_m, q_over_m = ratios(log_p, log_q, b)
        kl_p = _times(log_p.exp(), p_over_m).sum(-1)
        kl_q = _times(log_q.exp(), q_over_m).sum(-1)
        jsd[rows] = stream.nonnegative(b * kl_q + (1 - b) * kl_p)
        kl_student[rows] = kl_p
    return jsd, kl_student


def backward(logits, ref_logits, target, temperature, lse, ref_lse, beta, kl_student, coef):
    n, vocab = num_rows(logits), logits.shape[-1]
    acc = accumulation_dtype(logits.dtype)
    grad = torch.zeros((n, vocab), dtype=logits.dtype, device=logits.device)
    b = beta.to(acc)
    for rows, log_p, log_q in _live_chunks(logits, ref_logits, target, temperature, lse, ref_lse, acc):
        centred = ratios(log_p, log_q, b)[0] - kl_student[rows].to(acc)[:, None]
        grad[rows] = (coef[rows].to(acc)[:, None] * _times(log_p.exp(), centred)).to(grad.dtype)
    return grad.view(logits.shape)


loss_forward = composed.bind(stream, forward, backward)
