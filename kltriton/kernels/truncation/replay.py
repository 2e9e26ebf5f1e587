"""Replay mode of the ``truncation`` family: the kept set is the engine's ``ids [N, K]`` (``-1`` padding), so a row's
statistics need only those ``K`` logits.

1. ``ops.truncation.replay_support``: the ids in a canonical form, each kept id once in increasing order, then the padding (a repeated
   id counts once);
2. ``ops.truncation.replay_columns`` (logits) or ``project`` (``LinearLogits``: only those ``K`` columns of the LM head are projected, a
   tile of rows at a time): the ``[N, K]`` logits at those ids (0 at padding). The logits gradient of ``columns`` is
   written by the backend's ``replay_scatter`` (the C++ backend: into the reused gradient buffer of its other
   backwards), zero outside the kept ids;
3. ``ops.truncation.replay_statistics``: ``logp``, ``lse`` and ``entropy`` of the row restricted to its kept ids, by the backend's
   ``replay_forward`` / ``replay_backward`` (contract: ``kltriton.kernels.truncation``).

Every bit of a row's values and gradients is independent of ``K`` (how wide the support is padded), of the order
and repetitions of its ids and of the other rows: the row's reductions are a maximum and fixed-point integer sums
(``constants.FIXED_POINT_BITS``), which are associative, and everything else is per entry.
"""
import torch

from kltriton.kernels.linear import scaled_and_capped
from kltriton._autograd import first_order


def shard_ids(ids: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Global ids ``[N, K]`` as the ids of a vocab shard ``[start, start + width)``, ``-1`` where it does not hold
    them."""
    local = ids - start
    return torch.where((ids >= 0) & (local >= 0) & (local < width), local, -1)


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
    @first_order("replay's LM-head columns")
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
                d_h[start:stop] = (d[:, :, None] * w_rows).sum(1)
            if want_w:
                d_w.index_add_(0, tile_ids.reshape(-1), (d[:, :, None] * h[:, None, :]).reshape(-1, h.shape[-1]))
            if want_b:
                d_b.index_add_(0, tile_ids.reshape(-1), d.reshape(-1))
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return cast(d_h, hidden), cast(d_w, weight), cast(d_b, bias), None, None, None, None


def _project_tile(hidden, weight, bias, ids, scale, softcap):
    """``(logits [t, K], d logits / d linear [t, K], weight rows [t, K, H] fp32)`` of one row tile. Each logit is
    its own dot product over ``H`` (a product and a sum over the last dim: the same order whatever ``K``)."""
    w_rows = weight[ids].float()                                                      # [t, K, H]
    linear = (w_rows * hidden.float()[:, None, :]).sum(-1)
    if bias is not None:
        linear = linear + bias[ids].float()
    y = scaled_and_capped(linear, scale, softcap)
    slope = torch.ones_like(y) if scale is None else torch.ones_like(y) * scale.float()
    if softcap is not None:  # d(c tanh(u / c)) / du = 1 - (y / c)^2
        slope = slope * (1 - (y / softcap).square())
    return y, slope, w_rows


def project(side, ids: torch.Tensor, tile_elements: int) -> torch.Tensor:
    """``[N, K]`` fp32 logits of a ``LinearLogits`` side (``kltriton.kernels.linear.Side``) at ``ids [N, K]``
    (``-1``: 0), differentiable w.r.t. its hidden states, weight and bias; ``tile_elements`` bounds
    ``tile_rows * K * H``."""
    hidden, weight, bias, scale, softcap = side
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    tile_rows = max(1, tile_elements // max(ids.shape[1] * hidden.shape[-1], 1))
    values = _Projection.apply(hidden2d, weight, bias, ids.clamp(min=0), scale, softcap, tile_rows)
    return torch.where(ids >= 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
