"""Reference backend of the ``truncation`` family: the floor by sorting each row (the oracle of the selection
kernels), the statistics by the reference ``stream`` kernel on the rows with the logits below the floor set to
``-inf``. Any float dtype; a bounded chunk of rows at a time (``O(chunk * V)`` memory)."""
import math

import torch

from kltriton.kernels import accumulation_dtype, constants
from kltriton.kernels.row_views import as_rows3d, num_rows
from kltriton.kernels.stream import reference as stream
from kltriton.kernels.stream.reference import _chunks, _take_rows


def _min_p_floor(m: torch.Tensor, t: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``m + T log(min_p)`` (``p_v >= min_p * max p`` iff ``x_v >= m + T log(min_p)``), in float64; ``-inf`` off."""
    log_min_p = torch.where(min_p > 0, min_p.clamp(min=1e-300).log(), torch.full_like(min_p, -math.inf))
    return torch.where(min_p > 0, m + t * log_min_p, torch.full_like(m, -math.inf))


def _fp32_at_least(value: torch.Tensor) -> torch.Tensor:
    """The smallest float32 ``>= value`` (float64), so that ``x >= floor`` in fp32 equals ``x >= value``."""
    f = value.float()
    up = torch.nextafter(f, torch.full_like(f, math.inf))
    return torch.where(f.double() < value, up, f)


def floor(logits, target, temperature, top_k, top_p, min_p) -> torch.Tensor:
    n, vocab = num_rows(logits), logits.shape[-1]
    out = torch.full((n,), -math.inf, dtype=torch.float32, device=logits.device)
    rows3d = as_rows3d(logits)
    for start, stop in _chunks(n, vocab):
        rows = start + torch.nonzero(target[start:stop] >= 0).squeeze(1)
        if rows.numel() == 0:
            continue
        x = _take_rows(rows3d, rows, torch.float64)                     # [R, V]
        t = (temperature.reshape(1) if temperature.dim() == 0 else temperature[rows]).double()
        m = x.amax(-1)
        lower = _min_p_floor(m, t, min_p[rows])
        k = top_k[rows]
        if bool((k > 0).any()):
            values = x.sort(-1, descending=True).values
            kth = values.gather(1, (k.clamp(min=1) - 1)[:, None]).squeeze(1)
            lower = torch.where(k > 0, torch.maximum(lower, kth), lower)
        p = top_p[rows]
        if bool((p < 1).any()):
            kept = x >= lower[:, None]
            e = torch.where(kept, ((x - m[:, None]) / t[:, None]).exp(), torch.zeros_like(x))
            e_sorted, order = e.sort(-1, descending=True)
            x_sorted = x.gather(1, order)
            above = e_sorted.cumsum(-1) - e_sorted                     # mass before each, in descending order
            total = e_sorted.sum(-1, keepdim=True)
            # vLLM keeps a token iff the kept mass strictly above it is < top_p (ties: the first of them decides)
            keep = (above < p[:, None] * total) & (e_sorted > 0)
            keep[:, 0] = True
            last = keep.long().sum(-1) - 1
            cut = x_sorted.gather(1, last[:, None]).squeeze(1)
            lower = torch.where(p < 1, torch.maximum(lower, cut), lower)
        bad = torch.isnan(m) | (m == math.inf)
        lower = torch.where(bad, torch.full_like(lower, math.nan), lower)
        out[rows] = torch.where(torch.isinf(lower) & (lower < 0), lower.float(), _fp32_at_least(lower))
    return out


def _masked(logits, floor_rows):
    """The rows of ``logits`` as ``[N, V]`` in the accumulation dtype with the entries below the floor ``-inf``
    (chunked by the callers); a NaN floor (a NaN or ``+inf`` logit) masks nothing, so the row's statistics are NaN
    as the ``stream`` family's."""
    x = logits.to(accumulation_dtype(logits.dtype))
    f = floor_rows[:, None].to(x.dtype)
    return torch.where((x >= f) | torch.isnan(f), x, torch.full_like(x, -math.inf))


def forward(logits, target, temperature, top_k, top_p, min_p, given_floor, request):
    kept_floor = floor(logits, target, temperature, top_k, top_p, min_p) if given_floor is None else given_floor
    return kept_floor, _restricted(logits, target, temperature, kept_floor, request)


def _restricted(logits, target, temperature, floor, request):
    n, vocab = num_rows(logits), logits.shape[-1]
    rows3d = as_rows3d(logits)
    parts = []
    for start, stop in _chunks(n, vocab):
        rows = torch.arange(start, stop, device=logits.device)
        chunk = _masked(_take_rows(rows3d, rows, logits.dtype), floor[start:stop])
        temp = temperature if temperature.dim() == 0 else temperature[start:stop]
        parts.append(stream.forward(chunk, None, target[start:stop], temp, request))
    return type(parts[0])(*(torch.cat(values) for values in zip(*parts))) if parts else stream.forward(
        logits, None, target, temperature, request)


def backward(logits, target, temperature, floor, lse, basis):
    n, vocab = num_rows(logits), logits.shape[-1]
    grad = torch.zeros((n, vocab), dtype=logits.dtype, device=logits.device)
    rows3d = as_rows3d(logits)
    for start, stop in _chunks(n, vocab):
        rows = torch.arange(start, stop, device=logits.device)
        chunk = _masked(_take_rows(rows3d, rows, logits.dtype), floor[start:stop])
        temp = temperature if temperature.dim() == 0 else temperature[start:stop]
        part = type(basis)(*(None if c is None else c[start:stop] for c in basis))
        grad[start:stop] = stream.backward(chunk, None, target[start:stop], temp, lse[start:stop], None, part)
    return grad.view(logits.shape)


# --- replay (kltriton.kernels.truncation.replay) -----------------------------------------------------------------

_UNIT = 2.0 ** constants.FIXED_POINT_BITS
_PAD = torch.iinfo(torch.int64).max  # sorts after every id


def replay_support(ids):
    key = torch.where(ids >= 0, ids, _PAD).sort(-1).values
    repeat = torch.zeros_like(key, dtype=torch.bool)
    repeat[:, 1:] = key[:, 1:] == key[:, :-1]
    key = torch.where(repeat, _PAD, key).sort(-1).values
    return torch.where(key == _PAD, -1, key)


def replay_columns(logits, ids):
    rows3d = as_rows3d(logits)
    a, b, _ = rows3d.shape
    values = rows3d.gather(2, ids.clamp(min=0).view(a, b, -1)).reshape(ids.shape).to(accumulation_dtype(logits.dtype))
    return values.masked_fill_(ids < 0, 0.0)


def _replay_shifted(values, ids, row_max, temperature):
    """``d = (x - max) / T`` (float64 ``[N, K]``, ``<= 0``) of the kept entries, ``-inf`` at padding."""
    t = temperature.double()
    t = t[:, None] if t.dim() else t
    d = (values.double() - row_max.double()[:, None]) / t
    return torch.where(ids >= 0, d, torch.full((), -math.inf, dtype=torch.float64, device=d.device))


def _settle(value, live, empty, no_mass, target, if_empty, if_no_mass, if_out_of_range):
    """``value`` on the live rows; on the others: nothing kept (an all ``-1`` support), no mass (every kept logit
    ``-inf``), a NaN or ``+inf`` logit kept (NaN), a ``SKIP`` (0) or ``OUT_OF_RANGE`` row."""
    full = lambda v: torch.full((), v, dtype=value.dtype, device=value.device)  # noqa: E731
    value = torch.where(live, value, torch.where(empty, full(if_empty),
                                                 torch.where(no_mass, full(if_no_mass), full(math.nan))))
    value = torch.where(target == constants.OUT_OF_RANGE, full(if_out_of_range), value)
    return torch.where(target == constants.SKIP, full(0.0), value)


def replay_forward(values, ids, target, temperature, request):
    kept = ids >= 0
    m = torch.where(kept, values, torch.full((), -math.inf, dtype=values.dtype, device=values.device)).amax(-1)
    live = (target >= 0) & torch.isfinite(m)
    empty, no_mass = ~kept.any(-1), torch.isneginf(m)
    m = torch.where(live, m, torch.zeros_like(m))
    d = _replay_shifted(values, ids, m, temperature)
    d = torch.where(live[:, None], d, torch.full_like(d, -math.inf))
    e = d.exp()                                                   # in [0, 1]; exactly 1 at the max
    mass = (e * _UNIT).long().sum(-1)                             # >= 2^bits on a live row, 0 elsewhere
    log_mass = (mass.double() / _UNIT).log()                      # >= 0 on a live row, -inf elsewhere
    here = kept & (ids == target[:, None])
    column = torch.where(here.any(-1), here.to(torch.int8).argmax(-1), -1)
    d_label = d.gather(1, column.clamp(min=0)[:, None]).squeeze(1)
    logp = torch.where(column >= 0, (d_label - log_mass).clamp(max=0), torch.full_like(log_mass, -math.inf))
    lse = m.double() / temperature.double() + log_mass
    rows = (live, empty, no_mass, target)
    entropy = values.new_empty(0)
    if request & constants.ENTROPY:
        weighted = torch.where(e > 0, e * d, torch.zeros_like(d))  # in [-1/e, 0]
        h = log_mass - (weighted * _UNIT).long().sum(-1).double() / mass.double()
        entropy = _settle(h, *rows, 0.0, math.nan, math.nan).to(values.dtype)
    return (_settle(logp, *rows, -math.inf, math.nan, math.nan).to(values.dtype),
            _settle(lse, *rows, -math.inf, -math.inf, 0.0).to(values.dtype), entropy, m, log_mass, column)


def replay_backward(values, ids, target, temperature, row_max, log_mass, basis):
    live = (target >= 0) & torch.isfinite(log_mass)
    logq = _replay_shifted(values, ids, torch.where(live, row_max, torch.zeros_like(row_max)),
                           temperature) - torch.where(live, log_mass, torch.zeros_like(log_mass))[:, None]
    p = logq.exp()
    c = basis.p.double()[:, None]
    if basis.p_logp is not None:
        c = c + basis.p_logp.double()[:, None] * logq
    grad = -torch.where(p > 0, p * c, torch.zeros_like(p))
    here = (ids >= 0) & (ids == target[:, None])
    grad = grad + torch.where(here, basis.label.double()[:, None], torch.zeros_like(grad))
    return torch.where(live[:, None] & (ids >= 0), grad, torch.zeros_like(grad)).to(values.dtype)


def replay_scatter(columns, ids, vocab, dtype):
    grad = torch.zeros((ids.shape[0], vocab), dtype=dtype, device=ids.device)
    written = torch.where(ids >= 0, columns, torch.zeros_like(columns)).to(dtype)
    return grad.scatter_add_(1, ids.clamp(min=0), written)  # padding adds an exact 0 (ids are distinct)
