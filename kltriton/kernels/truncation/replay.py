"""Replay mode of the ``truncation`` family, every backend: the kept set is the engine's ``ids [N, K]`` (``-1``
padding), so a row's statistics need only those ``K`` logits: a ``K``-column gather (from ``LinearLogits``, only
those ``K`` columns of the LM head are projected, a tile of rows at a time), then the restricted log-softmax over
``K`` values in PyTorch. Autograd gives the gradient, on the kept columns only."""
import math
from typing import NamedTuple

import torch

from kltriton.kernels import OUT_OF_RANGE, SKIP, accumulation_dtype, statistics
from kltriton.kernels.linear import scaled_and_capped
from kltriton.kernels.rows import as_rows3d
from kltriton.kernels.statistics import StreamStats


class Support(NamedTuple):
    """The kept ids of each row, deduplicated: ``ids [N, K]`` (sorted; ``0`` where not ``valid``), ``valid [N, K]``."""
    ids: torch.Tensor
    valid: torch.Tensor


def support(ids: torch.Tensor) -> Support:
    """``Support`` of engine ids ``[N, K]`` (``-1`` padding; a repeated id counts once)."""
    ids = ids.sort(-1).values
    valid = ids >= 0
    valid[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    return Support(torch.where(valid, ids, torch.zeros_like(ids)), valid)


def gather(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` at ``ids [N, K]`` (in-range ids) as ``[N, K]`` in the accumulation dtype,
    differentiable; reads the logits in place (any strides on the leading dims)."""
    rows3d = as_rows3d(logits)
    a, b, _ = rows3d.shape
    return rows3d.gather(2, ids.view(a, b, -1)).reshape(ids.shape).to(accumulation_dtype(logits.dtype))


class _Projection(torch.autograd.Function):
    """``[N, K]`` fp32 logits ``head(hidden[n]) [ids[n, k]]`` of an LM head ``(weight, bias, scale, softcap)``
    over row tiles of ``tile_rows``: a tile holds ``weight[ids]`` as ``[tile_rows, K, H]``, never ``[N, K, H]``.
    The backward projects the tiles again."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, scale, softcap, tile_rows):
        out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, ids.shape[0], tile_rows):
            stop = min(start + tile_rows, ids.shape[0])
            out[start:stop] = _project_tile(hidden[start:stop], weight, bias, ids[start:stop], scale, softcap)[0]
        ctx.save_for_backward(hidden, weight, bias, ids, scale, softcap)
        ctx.tile_rows = tile_rows
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, ids, scale, softcap = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        d_h = torch.zeros_like(hidden, dtype=torch.float32) if want_h else None
        d_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        d_b = torch.zeros_like(bias, dtype=torch.float32) if want_b else None
        for start in range(0, ids.shape[0], ctx.tile_rows):
            stop = min(start + ctx.tile_rows, ids.shape[0])
            h, tile_ids = hidden[start:stop].float(), ids[start:stop]
            _, d_linear, w_rows = _project_tile(hidden[start:stop], weight, bias, tile_ids, scale, softcap)
            d = grad[start:stop].float() * d_linear                                  # [t, K]
            if want_h:
                d_h[start:stop] = torch.bmm(d[:, None, :], w_rows).squeeze(1)
            if want_w:
                d_w.index_add_(0, tile_ids.reshape(-1), (d[:, :, None] * h[:, None, :]).reshape(-1, h.shape[-1]))
            if want_b:
                d_b.index_add_(0, tile_ids.reshape(-1), d.reshape(-1))
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return cast(d_h, hidden), cast(d_w, weight), cast(d_b, bias), None, None, None, None


def _project_tile(hidden, weight, bias, ids, scale, softcap):
    """``(logits [t, K], d logits / d linear [t, K], weight rows [t, K, H] fp32)`` of one row tile."""
    w_rows = weight[ids].float()                                                      # [t, K, H]
    linear = torch.bmm(w_rows, hidden.float()[:, :, None]).squeeze(2)
    if bias is not None:
        linear = linear + bias[ids].float()
    y = scaled_and_capped(linear, scale, softcap)
    slope = torch.ones_like(y) if scale is None else torch.ones_like(y) * scale.float()
    if softcap is not None:  # d(c tanh(u / c)) / du = 1 - (y / c)^2
        slope = slope * (1 - (y / softcap).square())
    return y, slope, w_rows


def project(side, ids: torch.Tensor, tile_elements: int) -> torch.Tensor:
    """``[N, K]`` fp32 logits of a ``LinearLogits`` side (``kltriton.kernels.linear.Side``) at ``ids [N, K]``,
    differentiable w.r.t. its hidden states, weight and bias; ``tile_elements`` bounds ``tile_rows * K * H``."""
    hidden, weight, bias, scale, softcap = side
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    tile_rows = max(1, tile_elements // max(ids.shape[1] * hidden.shape[-1], 1))
    return _Projection.apply(hidden2d, weight, bias, ids, scale, softcap, tile_rows)


def statistics_of(values: torch.Tensor, valid: torch.Tensor, label_here: torch.Tensor, label_value: torch.Tensor,
                  target: torch.Tensor, temperature: torch.Tensor, wanted: int) -> StreamStats:
    """``StreamStats`` (``logp``, ``lse``, ``entropy`` when asked) of the distribution restricted to the kept
    logits ``values [N, K]`` (``valid`` marks them), at temperature ``temperature``; ``label_here [N]``: the label
    is kept (its logit ``label_value [N]``), else its log-prob is ``-inf``. 0 at ``SKIP`` rows, NaN at
    ``OUT_OF_RANGE``; differentiable w.r.t. ``values`` and ``label_value``."""
    t = temperature if temperature.dim() == 0 else temperature[:, None]
    z = torch.where(valid, values / t.to(values.dtype), torch.full_like(values, -math.inf))
    lse = torch.logsumexp(z, -1)
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    zl = label_value / (t.squeeze(-1) if t.dim() else t).to(values.dtype)
    logp = torch.where(label_here, (zl - finite_lse).clamp(max=0), torch.full_like(lse, -math.inf))
    skip, bad = target == SKIP, target == OUT_OF_RANGE
    nan, zero = torch.full_like(lse, math.nan), torch.zeros_like(lse)
    fix = lambda v: torch.where(skip, zero, torch.where(bad, nan, v))  # noqa: E731
    logp = torch.where(torch.isfinite(lse), logp, torch.full_like(lse, math.nan))
    out = {"logp": fix(logp), "lse": torch.where(skip | bad, zero, lse)}
    if wanted & statistics.constants.ENTROPY:
        p = torch.exp(z - finite_lse[:, None])
        h = finite_lse - torch.where(valid & (p > 0), p * z, torch.zeros_like(z)).sum(-1)
        out["entropy"] = fix(torch.where(torch.isfinite(lse), h, nan))
    return StreamStats(*(out.get(name, lse.new_empty(0)) for name in statistics.NAMES))


def label_in(sup: Support, target: torch.Tensor):
    """``(here [N], position [N])``: whether each row's label is among its kept ids, and its column there."""
    eq = sup.valid & (sup.ids == target[:, None])
    return eq.any(-1), eq.to(torch.int8).argmax(-1)
