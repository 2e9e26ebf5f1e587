"""Reference backend of the ``stream`` family: the test oracle (run it in float64) and the fallback.

Implements the contract of ``kltriton.kernels.stream`` with ordinary tensor ops, a bounded chunk of rows at a time so memory stays ``O(chunk * V)`` whatever ``N`` is.
It computes in float64 when given float64 logits, else in float32, and returns statistics
in that precision (float64 results from float64 logits: the oracle for the tests).
"""
import torch

from kltriton.kernels import OUT_OF_RANGE, accumulation_dtype, constants
from kltriton.kernels.layout import reference as layout
from kltriton.kernels.row_views import as_rows3d, num_rows
from kltriton.kernels.statistics import StreamStats, empty_stats, gradient_basis

CHUNK_ELEMENTS = 1 << 19  # rows per chunk = CHUNK_ELEMENTS // V (2 MiB of fp32, 4 MiB of fp64 per temporary)


def _chunks(n_rows: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, n_rows, step):
        yield start, min(start + step, n_rows)


def _take_rows(rows3d: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` (flat indices) of a ``[A, B, V]`` view as a ``[len(rows), V]`` tensor."""
    width = rows3d.shape[1]
    return rows3d[rows // width, rows % width].to(dtype)


def _row_temperature(temperature: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[len(rows), 1]`` temperature of each row (``temperature`` is 0-dim or ``[N]``)."""
    t = temperature.to(dtype)
    return t.reshape(1, 1) if t.dim() == 0 else t[rows][:, None]


def _log_softmax_rows(rows: torch.Tensor, temperature: torch.Tensor):
    """``(log_softmax(rows / T), logsumexp(rows / T))`` of ``[R, V]`` rows by torch's own ``log_softmax`` (so at
    least as exact as it) of ``(rows - max) / T``: the row max is subtracted before scaling, so the error follows
    ``|x - max| / T``, not ``|x| / T`` (logits of +-1e30 with ties give exactly ``-log(ties)``). A NaN or +inf
    logit gives a NaN row; an all ``-inf`` row gives ``lse = -inf`` and NaN log-probs."""
    m = rows.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # all -inf: -inf - -inf would be NaN
    shifted = (rows - m) / temperature
    return torch.log_softmax(shifted, dim=-1), (m / temperature + torch.logsumexp(shifted, dim=-1, keepdim=True)).squeeze(1)


def nonnegative(value: torch.Tensor) -> torch.Tensor:
    """A divergence's value, its rounding below 0 (nearly identical distributions) read as 0 (-0 as +0), NaN kept."""
    return torch.where(value <= 0, torch.zeros((), dtype=value.dtype, device=value.device), value)


def _p_times(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``p * values`` with ``0 * (-inf)`` read as 0 (entries where the policy has no mass); a NaN
    ``p`` stays NaN."""
    return torch.where(p == 0, torch.zeros((), dtype=p.dtype, device=p.device), p * values)


def _head_statistics(out, rows, x, label, temp, logp_all, row_lse):
    """A trainer head's metrics of rows ``rows`` (``x``: their ``[R, V]`` logits, ``label`` ``[R, 1]``) into ``out``:
    ``is_top1`` (torch.argmax's rule on the logits, exact), ``sum_logits`` (``sum(x) / T * LOGIT_SUM_SCALE``, summed
    in float64), ``log_sum_sq_probs`` and ``max_logit``. A row without a distribution
    (all ``-inf``: ``sum_logits`` and ``max_logit`` are ``-inf``; a NaN or ``+inf`` logit: NaN) has NaN for the
    others."""
    no_distribution = ~torch.isfinite(row_lse)
    bad = no_distribution & (row_lse != float("-inf"))
    nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    top1 = (x.argmax(-1, keepdim=True) == label).squeeze(1).to(x.dtype)
    out.is_top1[rows] = torch.where(no_distribution, nan, top1)
    total = (x.double().sum(-1) / temp.double().squeeze(1) * constants.LOGIT_SUM_SCALE).to(x.dtype)
    out.sum_logits[rows] = torch.where(bad, nan, total)
    out.log_sum_sq_probs[rows] = torch.logsumexp(2 * logp_all, -1).masked_fill(no_distribution, float("nan"))
    out.max_logit[rows] = torch.where(bad, nan, x.amax(-1))


def forward(logits, ref_logits, target, temperature, request) -> StreamStats:
    n, vocab = num_rows(logits), logits.shape[-1]
    device, acc = logits.device, accumulation_dtype(logits.dtype)
    out = empty_stats(n, request, lambda size: torch.zeros(size, dtype=acc, device=device))
    with_entropy, with_full_kl = bool(request & constants.ENTROPY), bool(request & constants.FULL_KL)
    with_forward_kl = bool(request & constants.FORWARD_KL)
    with_head = bool(request & constants.HEAD)
    rows3d = as_rows3d(logits)
    ref3d = as_rows3d(ref_logits) if ref_logits is not None else None
    for start, stop in _chunks(n, vocab):
        tgt = target[start:stop]
        keep = torch.nonzero(tgt >= 0).squeeze(1)
        if keep.numel() == 0:
            continue
        if keep.numel() == 1:
            # Batch invariance: torch splits a reduction with a single output between threads
            # (another summation order than a row of a larger batch gets); reduce the row twice.
            keep = keep.repeat(2)
        rows = start + keep
        label = tgt[keep][:, None]
        temp = _row_temperature(temperature, rows, acc)
        x = _take_rows(rows3d, rows, acc)
        logp_all, row_lse = _log_softmax_rows(x, temp)
        dead = row_lse == float("-inf")  # an all -inf row has no distribution: NaN like torch
        if with_head:
            _head_statistics(out, rows, x, label, temp, logp_all, row_lse)
        out.logp[rows] = logp_all.gather(1, label).squeeze(1).clamp(max=0)
        out.lse[rows] = row_lse
        p = logp_all.exp()
        if with_entropy:
            h = -_p_times(p, logp_all).sum(-1)
            out.entropy[rows] = h.masked_fill(dead, float("nan"))
        if ref3d is not None:
            logq_all, row_ref_lse = _log_softmax_rows(_take_rows(ref3d, rows, acc), temp)
            out.ref_logp[rows] = logq_all.gather(1, label).squeeze(1).clamp(max=0)
            out.ref_lse[rows] = row_ref_lse
            if with_full_kl or with_forward_kl:
                # The KL terms in float64: a finfo.min logit under the other side's mass has a log-prob beyond
                # fp32 (x / T) but a finite term, which the row's KL may hold (about 4.8e36).
                t64 = _row_temperature(temperature, rows, torch.float64)
                logp64 = _log_softmax_rows(_take_rows(rows3d, rows, torch.float64), t64)[0]
                logq64 = _log_softmax_rows(_take_rows(ref3d, rows, torch.float64), t64)[0]
            if with_full_kl:
                kl = nonnegative(_p_times(logp64.exp(), logp64 - logq64).sum(-1))
                out.full_kl[rows] = kl.to(acc).masked_fill(dead, float("nan"))
            if with_forward_kl:
                kl = nonnegative(_p_times(logq64.exp(), logq64 - logp64).sum(-1))
                out.forward_kl[rows] = kl.to(acc).masked_fill(dead, float("nan"))
    bad = target == OUT_OF_RANGE
    for name in ("logp", "entropy", "ref_logp", "full_kl", "forward_kl", "is_top1", "sum_logits", "log_sum_sq_probs",
                 "max_logit"):
        value = getattr(out, name)
        if value.numel():
            value.masked_fill_(bad, float("nan"))
    return out


def forward_labels(logits, ref_logits, labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, shift, flags,
                   temperature, request):
    """``forward`` at the ``layout`` family's target of the label side (the contract in ``kernels.stream``)."""
    target = layout.target(labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, logits.shape[-1], shift,
                           flags)
    return target, forward(logits, ref_logits, target, temperature, request)


def backward(logits, ref_logits, target, temperature, lse, ref_lse, basis) -> torch.Tensor:
    n, vocab = num_rows(logits), logits.shape[-1]
    acc = accumulation_dtype(logits.dtype)
    grad = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
    grad2d = grad.view(n, vocab)
    rows3d = as_rows3d(logits)
    ref3d = as_rows3d(ref_logits) if basis.reads_ref() else None
    for start, stop in _chunks(n, vocab):
        tgt = target[start:stop]
        keep = torch.nonzero((tgt >= 0) & torch.isfinite(lse[start:stop])).squeeze(1)
        if keep.numel() == 0:
            continue
        rows = start + keep
        coef = lambda c: c[rows].to(acc)[:, None]  # noqa: E731
        temp = _row_temperature(temperature, rows, acc)
        logp_all = _take_rows(rows3d, rows, acc) / temp - lse[rows].to(acc)[:, None]
        p = logp_all.exp()
        c = coef(basis.p).expand_as(logp_all)
        if basis.p_logp is not None:
            c = c + coef(basis.p_logp) * logp_all
        logq_all = None
        if ref3d is not None:
            logq_all = _take_rows(ref3d, rows, acc) / temp - ref_lse[rows].to(acc)[:, None]
        if basis.p_logq is not None:
            c = c + coef(basis.p_logq) * logq_all
        g = -_p_times(p, c)
        if basis.q is not None:
            g = g - coef(basis.q) * logq_all.exp()
        g.scatter_add_(1, tgt[keep][:, None], coef(basis.label))
        grad2d[rows] = g.to(grad.dtype)
    return grad


def backward_upstream(logits, ref_logits, target, temperature, lse, ref_lse, upstream, out=None) -> torch.Tensor:
    # the values the basis reads (the log-prob's and the forward KL's gradients read none: lse stands in)
    values = {"logp": lse, "lse": lse, "entropy": upstream.entropy_value, "full_kl": upstream.full_kl_value,
              "forward_kl": lse}
    stats = StreamStats(*(lse.new_empty(0) if values.get(name) is None else values[name] for name in StreamStats._fields))
    grads = {"logp": upstream.logp, "entropy": upstream.entropy, "full_kl": upstream.full_kl,
             "forward_kl": upstream.forward_kl}
    basis = gradient_basis(grads, stats, temperature)
    grad = backward(logits, ref_logits if basis.reads_ref() else None, target, temperature, lse,
                    ref_lse if basis.reads_ref() else None, basis)
    return grad if out is None else out.copy_(grad)
