"""Reference backend of the ``truncation`` family: the floor by sorting each row (the oracle of the selection
kernels), the statistics by the reference ``stream`` kernel on the rows with the logits below the floor set to
``-inf``. Any float dtype; a bounded chunk of rows at a time (``O(chunk * V)`` memory)."""
import math

import torch

from kltriton.kernels import accumulation_dtype
from kltriton.kernels.rows import as_rows3d, num_rows
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
    (chunked by the callers)."""
    x = logits.to(accumulation_dtype(logits.dtype))
    return torch.where(x >= floor_rows[:, None].to(x.dtype), x, torch.full_like(x, -math.inf))


def forward(logits, target, temperature, top_k, top_p, min_p, given_floor, wanted):
    kept_floor = floor(logits, target, temperature, top_k, top_p, min_p) if given_floor is None else given_floor
    return kept_floor, _restricted(logits, target, temperature, kept_floor, wanted)


def _restricted(logits, target, temperature, floor, wanted):
    n, vocab = num_rows(logits), logits.shape[-1]
    rows3d = as_rows3d(logits)
    parts = []
    for start, stop in _chunks(n, vocab):
        rows = torch.arange(start, stop, device=logits.device)
        chunk = _masked(_take_rows(rows3d, rows, logits.dtype), floor[start:stop])
        temp = temperature if temperature.dim() == 0 else temperature[start:stop]
        parts.append(stream.forward(chunk, None, target[start:stop], temp, wanted))
    return type(parts[0])(*(torch.cat(values) for values in zip(*parts))) if parts else stream.forward(
        logits, None, target, temperature, wanted)


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
