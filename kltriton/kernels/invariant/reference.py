"""Reference backend of the ``invariant`` family (contract: ``kltriton.kernels.invariant``): PyTorch on a bounded
chunk of rows at a time, in ``accumulation_dtype`` (float64 for float64 logits). Each entry's ``exp`` is PyTorch's
elementwise kernel, the same whatever the entry's place in the chunk; the sums are int64."""
import math

import torch

from kltriton.kernels import accumulation_dtype, constants
from kltriton.kernels.invariant import FIXED_UNIT, sum_count
from kltriton.kernels.row_views import as_rows3d, num_rows
from kltriton.kernels.stream.reference import _chunks, _take_rows


def _read(rows3d, rows, floor, acc):
    """``[len(rows), V]`` entries of the rows in ``acc``, those below the floor ``-inf``."""
    x = _take_rows(rows3d, rows, acc)
    if floor is not None:
        x = torch.where(x < floor[rows].to(acc)[:, None], torch.full((), -math.inf, dtype=acc, device=x.device), x)
    return x


def maxima(logits, target, floor):
    n, vocab = num_rows(logits), logits.shape[-1]
    acc = accumulation_dtype(logits.dtype)
    out = torch.full((n,), -math.inf, dtype=acc, device=logits.device)
    rows3d = as_rows3d(logits)
    for start, stop in _chunks(n, vocab):
        rows = start + torch.nonzero(target[start:stop] >= 0).squeeze(1)
        if rows.numel():
            x = _read(rows3d, rows, floor, acc)
            bad = (torch.isnan(x) | (x == math.inf)).any(-1)
            out[rows] = torch.where(bad, torch.full((), math.inf, dtype=acc, device=x.device), x.amax(-1))
    return out


def sums(logits, target, temperature, row_max, floor, request):
    n, vocab = num_rows(logits), logits.shape[-1]
    acc = accumulation_dtype(logits.dtype)
    out = torch.zeros((sum_count(request), n), dtype=torch.int64, device=logits.device)
    rows3d = as_rows3d(logits)
    for start, stop in _chunks(n, vocab):
        chunk = slice(start, stop)
        rows = start + torch.nonzero((target[chunk] >= 0) & torch.isfinite(row_max[chunk])).squeeze(1)
        if rows.numel() == 0:
            continue
        t = temperature.to(acc)
        t = t[rows][:, None] if t.dim() else t
        z = (_read(rows3d, rows, floor, acc) - row_max[rows].to(acc)[:, None]) / t   # <= 0
        e = z.exp()                                                                  # in [0, 1]
        out[0, rows] = (e * FIXED_UNIT).long().sum(-1)
        if request & constants.ENTROPY:
            weighted = torch.where(e > 0, e * -z, torch.zeros((), dtype=acc, device=e.device))  # in [0, 1/e]
            out[1, rows] = (weighted * FIXED_UNIT).long().sum(-1)
    return out


def forward(logits, target, temperature, floor, request):
    row_max = maxima(logits, target, floor)
    return row_max, sums(logits, target, temperature, row_max, floor, request)
